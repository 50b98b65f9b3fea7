"""Train a small transformer with FSDP2 and an 8-bit AdamW, checkpoint it with DCP, resume.

Runs on CPU with gloo (or on GPUs with NCCL):

    torchrun --nproc_per_node 2 examples/fsdp_train.py --steps 10 --ckpt /tmp/lowbit_ckpt

With ``--tp N`` the mesh is 2-D, ``(world / N, N)``: each block's MLP is tensor parallel
(``ColwiseParallel`` then ``RowwiseParallel``) over the second dim, FSDP2 shards over the
first. Trained on a 2x2 mesh, the checkpoint resumes on 1x2 (exactly: the same column cuts)
and on 4x1 (the row-parallel weights' states were saved on blocks of 128 columns and are
requantized on blocks of 256, with a warning; ``bridge.dcp.load_optimizer``):

    torchrun --nproc_per_node 4 examples/fsdp_train.py --tp 2 --steps 6 --ckpt /tmp/lowbit_tp
    torchrun --nproc_per_node 2 examples/fsdp_train.py --tp 2 --steps 3 --ckpt /tmp/lowbit_tp
    torchrun --nproc_per_node 4 examples/fsdp_train.py --tp 1 --steps 3 --ckpt /tmp/lowbit_tp

Every rank keeps the optimizer states (codes and block scales) of its own shard of each
weight only; ``exp_avg.full_tensor()`` gathers a whole state. ``dcp.save`` writes one
row-sharded ``exp_avg.codes`` / ``exp_avg.scale`` pair per state, which loads at any
world size (try ``--nproc_per_node 1`` or ``3`` on the second run with the same --ckpt).

Checkpoints are switched atomically: step N is written to ``CKPT/step-N.tmp``, renamed to
``CKPT/step-N`` (``step-N.K`` if step N was saved before) once every rank has written it, and
only then does ``CKPT/latest`` (a one-line pointer file, replaced with ``os.replace``) name it. A run killed in the middle of a save leaves
a ``.tmp`` directory that nothing reads; the next run resumes from the previous checkpoint.

The process ends with ``os._exit`` after ``destroy_process_group()`` (pytorch issue 190489:
gloo's worker thread can abort an exiting interpreter; see design.md).
"""
from __future__ import annotations

import argparse
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from bridge import AdamW8bit
from bridge.dcp import load_optimizer
from bridge.distributed import run_and_exit


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        h = self.ln1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab: int = 97, d: int = 64, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


LATEST = "latest"


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (the one ``root/latest`` names), or None."""
    pointer = os.path.join(root, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{pointer} names {name!r}, which is not a complete DCP checkpoint under {root}")
    return path


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _checkpoint_dirs(root: str) -> list[tuple[int, int, str]]:
    """(step, rerun, name) of the complete checkpoints under ``root``, oldest first: ``step-N``
    and, when step N was saved again, ``step-N.K``."""
    out = []
    for name in os.listdir(root):
        head, _, rerun = name.partition(".")
        if head.startswith("step-") and head[5:].isdigit() and (rerun == "" or rerun.isdigit()):
            out.append((int(head[5:]), int(rerun or 0), name))
    return sorted(out)


def save_checkpoint(state: dict, root: str, step: int, writer=dcp.FileSystemWriter, keep: int = 2) -> str:
    """``dcp.save(state)`` to ``root/step-{step}.tmp``; once every rank has written, rank 0 renames
    it to a new name (``step-{step}``, or ``step-{step}.K`` if that step was saved before, so the
    checkpoint ``latest`` names is never touched), replaces ``root/latest`` atomically, and deletes
    all but the newest ``keep`` complete checkpoints. Collective: every rank calls it."""
    rank = dist.get_rank()
    tmp = os.path.join(root, f"step-{step}.tmp")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
    dist.barrier()
    dcp.save(state, storage_writer=writer(tmp))
    dist.barrier()  # every rank's shards and rank 0's .metadata are on disk
    name = f"step-{step}"
    if rank == 0:
        reruns = [k for s, k, _ in _checkpoint_dirs(root) if s == step]
        if reruns:
            name = f"step-{step}.{max(reruns) + 1}"
        os.rename(tmp, os.path.join(root, name))
        _write_atomically(os.path.join(root, LATEST), name + "\n")
        for _, _, old in _checkpoint_dirs(root)[:-keep]:
            if old != name:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    names = [name]
    dist.broadcast_object_list(names, src=0)  # the name rank 0 chose
    return os.path.join(root, names[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ckpt", default=None,
                    help="checkpoint root: resumed from its latest complete checkpoint if any, a new one written at the end")
    ap.add_argument("--offload", action="store_true", help="CPUOffloadPolicy (params and states on the CPU)")
    ap.add_argument("--tp", type=int, default=0,
                    help="tensor-parallel degree: a (world / tp, tp) mesh, the MLPs tensor parallel (0: FSDP2 only)")
    args = ap.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if args.tp:
        if world % args.tp:
            raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
        mesh2 = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        mesh = mesh2["dp"]
    else:
        mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # same initial weights on every rank
    model = LM().to(device)
    if args.tp:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for blk in model.blocks:
            parallelize_module(blk.mlp, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # pin_memory=True (the default) needs an accelerator
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=use_cuda)} if args.offload else {}
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    # min_quant_size: this toy model's weights are small; real models keep the default 4096
    opt = AdamW8bit(model.parameters(), lr=3e-3, min_quant_size=1024)

    start = 0
    resume = latest_checkpoint(args.ckpt) if args.ckpt else None
    if resume:
        state = {"model": get_model_state_dict(model), "step": 0}
        dcp.load(state, checkpoint_id=resume)
        set_model_state_dict(model, state["model"])
        # = dcp.load + set_optimizer_state_dict when the block sizes agree; states saved on other
        # blocks (another TP degree) are requantized, with a warning
        load_optimizer(model, opt, resume, key="optim")
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from {resume} at step {start} (world size {world})")

    for step in range(start, start + args.steps):
        g = torch.Generator().manual_seed(step)
        dp, dp_rank = (world // args.tp, rank // args.tp) if args.tp else (world, rank)  # TP ranks share a batch
        tokens = torch.randint(0, 97, (8 * dp, 32), generator=g).chunk(dp)[dp_rank].to(device)
        loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}")

    name, weight = ("blocks.0.mlp.2.weight", model.blocks[0].mlp[2].weight) if args.tp else ("head.weight", model.head.weight)
    exp_avg = opt.state[weight]["exp_avg"]
    full = exp_avg.full_tensor()  # all-gathers codes and scales: a QState of the full shape
    report = opt.format_state_report()  # a collective under FSDP2: every rank calls it
    if rank == 0:
        local = exp_avg.to_local()
        print(f"{name} {tuple(weight.placements)} exp_avg: local {type(local).__name__} {tuple(local.shape)} "
              f"blocks of {local.block_size}, full {tuple(full.shape)} {full.format}, "
              f"|mean| {full.dequantize().abs().mean():.3e}")
        print("\n".join(report.splitlines()[-2:]))  # the whole model's state total, then the training state
    if args.ckpt:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                 "step": start + args.steps}
        path = save_checkpoint(state, args.ckpt, start + args.steps)
        if rank == 0:
            print(f"saved {path}")


if __name__ == "__main__":
    # destroy_process_group, flushed output, os._exit with main's status: gloo can abort a
    # process during interpreter shutdown (pytorch issue 190489)
    run_and_exit(main)
