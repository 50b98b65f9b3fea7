"""Bytes Muon moves per step under FSDP2: gathering the Newton-Schulz input in storage form
(bridge.Muon) against gathering the same rows as float32.

A stack of linear layers (no biases) is sharded with ``fully_shard`` on 2 and 3 gloo ranks and
stepped with ``bridge.Muon`` in each momentum format; ``Muon.communication()`` counts the bytes
each rank sent for the Newton-Schulz of each matrix (summed over ranks here):

- gather: the input rows to the matrix's owner, as stored (8-bit codes + block scales, ...);
- gather as float32: what the same rows cost as float32 (Moonlight / DistMuon-style gathers);
- scatter: the owner's bfloat16 result rows back (Newton-Schulz returns bfloat16 in torch too).

``nf4+rank8`` is the low-rank momentum (Muon4bit has rank 16): its gather carries the 8-bit
input residual, the new buffer's 4-bit residual and the factor rows the owner lacks, its scatter
the result and the refreshed factors' rows.

    python benchmarks/muon_comm.py [--dims 256,1024] [--layers 2] [--worlds 2,3]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

FORMATS = ("fp32", "bf16", "8bit", "4bit", "fp8", "nf4", "nf4+rank8")


def model_for(dims: list[int], layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        for a, b in zip(dims, dims[1:] + dims[:1]):
            mods.append(nn.Linear(a, b, bias=False))
    return nn.Sequential(*mods)


def worker(rank: int, world: int, store: str, dims: list[int], layers: int, out: str) -> None:
    from bridge.distributed import run_and_exit

    def body():
        import bridge
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        rows = []
        for fmt in FORMATS:
            model = model_for(dims, layers)
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
            base, _, k = fmt.partition("+rank")
            opt = bridge.Muon(model.parameters(), lr=0.02, state_format=base, momentum_rank=int(k or 0))
            for p in model.parameters():
                p.grad = torch.distributed.tensor.DTensor.from_local(
                    torch.randn(p.to_local().shape), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            opt.step()
            c = opt.communication()
            t = torch.tensor([c["gather"], c["gather_float32"], c["scatter"]], dtype=torch.int64)
            dist.all_reduce(t)
            rows.append((fmt, *t.tolist()))
        if rank == 0:
            with open(out, "w") as f:
                for r in rows:
                    f.write(" ".join(map(str, r)) + "\n")

    run_and_exit(body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="256,1024", help="a cycle of layer widths (default: 256 -> 1024 -> 256)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--worlds", default="2,3")
    args = ap.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]
    n = sum(p.numel() for p in model_for(dims, args.layers).parameters())
    print(f"{args.layers} x {dims} linear layers: {n / 1e6:.1f}M params in matrices of "
          f"{sorted({tuple(p.shape) for p in model_for(dims, args.layers).parameters()})}; bytes per step, all ranks")
    for world in [int(w) for w in args.worlds.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows")
            mp.start_processes(worker, args=(world, os.path.join(tmp, "store"), dims, args.layers, out), nprocs=world,
                               join=True, start_method="spawn")
            rows = [line.split() for line in open(out)]
        print(f"\n{world} ranks    {'gather':>12} {'as float32':>12} {'ratio':>7} {'scatter':>12} "
              f"{'total':>12} {'vs float32 both ways':>21}")
        for fmt, g, g32, s in rows:
            g, g32, s = int(g), int(g32), int(s)
            both32 = g32 + 2 * s  # float32 rows in, float32 rows back
            print(f"  {fmt:<10} {g:>12,} {g32:>12,} {g / g32:>7.3f} {s:>12,} {g + s:>12,} {(g + s) / both32:>21.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
