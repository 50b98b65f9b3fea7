"""The torch bug behind the old FSDP2-test aborts, reproduced with torch alone (no lowbit code).

Two ranks on gloo, each iteration two small all-gathers. ``--mode inflight`` issues the second
functional all-gather (``torch.ops._c10d_functional.all_gather_into_tensor``, what
``DTensor.full_tensor()`` uses) before waiting for the first; ``--mode waited`` waits for each
before issuing the next; ``--mode c10d`` keeps two ``dist.all_gather_into_tensor(async_op=True)``
in flight. On torch 2.13.0+cpu (2 cores): ``inflight`` kills a rank in every launch
("malloc(): unaligned tcache chunk detected", or SIGSEGV) inside gloo's
``AsyncAllgatherCoalescedWork``; ``waited`` and ``c10d`` survive. ``bridge/qstate.py`` therefore
gathers a quantized state's codes and scales one after the other (design.md, "One collective in
flight"). Run it on a new torch to see whether the workaround is still needed:

    python benchmarks/gloo_inflight_allgather.py --mode inflight --launches 3
    python benchmarks/gloo_inflight_allgather.py --mode waited --launches 3

Prints one line per launch and exits 1 if any rank died.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store: str, iters: int, mode: str) -> None:
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    group = dist.group.WORLD.group_name
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    for i in range(iters):
        n = 1 + (i * 7) % 37  # small, varying sizes, like a tiny model's codes and scales
        a = torch.full((n, 12), rank, dtype=torch.uint8)
        b = torch.full((n, 1), float(rank), dtype=torch.float32)
        if mode == "inflight":
            ga, gb = gather(a, world, group), gather(b, world, group)
            ga, gb = wait(ga), wait(gb)
        elif mode == "waited":
            ga = wait(gather(a, world, group))
            gb = wait(gather(b, world, group))
        else:
            ga, gb = a.new_empty((n * world, 12)), b.new_empty((n * world, 1))
            w1 = dist.all_gather_into_tensor(ga, a, async_op=True)
            w2 = dist.all_gather_into_tensor(gb, b, async_op=True)
            w1.wait()
            w2.wait()
        expect = torch.arange(world).repeat_interleave(n)
        if not (torch.equal(ga[:, 0].long(), expect) and torch.equal(gb[:, 0].long(), expect)):
            raise AssertionError(f"iteration {i}: wrong all-gather result")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pytorch issue 190489: never through interpreter shutdown with gloo threads alive


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("inflight", "waited", "c10d"), default="inflight")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args(argv)
    died = 0
    for i in range(args.launches):
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="gloo_inflight_") as tmp:
            try:
                mp.start_processes(_rank, args=(2, os.path.join(tmp, "store"), args.iters, args.mode), nprocs=2,
                                   join=True, start_method="spawn")
                outcome = "ok"
            except mp.ProcessExitedException as e:
                died += 1
                outcome = f"rank {e.error_index} died ({e.signal_name or f'status {e.exit_code}'})"
        print(f"{args.mode} launch {i + 1}/{args.launches}: {outcome} ({time.perf_counter() - t:.1f} s)", flush=True)
    print(f"{args.mode}: {args.launches - died} of {args.launches} launches ok, {args.iters} iterations each "
          f"(torch {torch.__version__})")
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main())
