"""Where 4-bit Muon momentum loses loss, and what a low-rank split would buy: a simulation.

fp32 ``bridge.Muon`` on the convergence benchmark's task (``benchmarks/convergence.py``: the
demo's byte-level GPT, Muon on the hidden matrices, fp32 AdamW on the rest, one lr with
``adjust_lr_fn="match_rms_adamw"``), whose momentum buffer is replaced after every step by what
a storage scheme would give back. The Newton-Schulz input is not quantized (the kernel's
``Muon(state_format="nf4")`` also quantizes it; on the benchmark that changed the loss by less than
the seeds' spread). Muon4bit keeps such a split (``momentum_rank``; design.md,
"Update rules"). Schemes:

  fp32        nothing replaced (the reference)
  nf4         nearest code of the normal-float map on blocks of 32 along rows (what
              Muon(state_format="nf4")'s kernel stores, rounded here in Python: the same bits on the
              tests' inputs, not on every value of a run)
  grid        the normal-float map on rank-1 scales, min(row absmax, column absmax)
  lrK-nf4     the top-K factor ``P R^T`` of the buffer (one power iteration a step,
              warm-started from last step's row space) kept in float32, the residual
              ``b - P R^T`` in nf4 (the structure of 4-bit-Muon-GRASP, ICLR 2026, and
              MuonQ, arXiv 2605.11396)
  lrK-grid    the same with the residual on rank-1 scales

    python benchmarks/muon_momentum_probe.py --variant lr8-nf4 --seed 0
    python benchmarks/muon_momentum_probe.py --variant nf4 --seed 0 --d-model 128

Prints one JSON line: the final held-out loss (compare with ``--variant fp32`` of the same
seed and width).
"""
from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

import bridge
from bridge.tools.demo import Batches, CharGPT, eval_batches, load_corpus, train
from lowbit_tree.formats import normal_map

_CODES = normal_map().float()
_MIDPOINTS = (_CODES[1:] + _CODES[:-1]) / 2


def nearest_normal(y: torch.Tensor) -> torch.Tensor:
    """Each value of ``y`` (in [-1, 1]) as its nearest normal-float code value."""
    return _CODES[torch.bucketize(y.clamp(-1, 1), _MIDPOINTS)]


def round_blocks(e: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``e`` stored on the normal-float map in row-aligned absmax blocks, dequantized."""
    m, n = e.shape
    x = torch.nn.functional.pad(e, (0, (-n) % block)).view(m, -1, block)
    s = x.abs().amax(-1, keepdim=True)
    y = torch.where(s > 0, x / s.clamp_min(1e-30), torch.zeros_like(x))
    return (nearest_normal(y) * s).view(m, -1)[:, :n]


def round_grid(e: torch.Tensor) -> torch.Tensor:
    """``e`` stored on the normal-float map with rank-1 scales min(row, column absmax)."""
    s = torch.minimum(e.abs().amax(1, keepdim=True), e.abs().amax(0, keepdim=True))
    y = torch.where(s > 0, e / s.clamp_min(1e-30), torch.zeros_like(e))
    return nearest_normal(y) * s


class StoredMomentum:
    """Replaces a momentum buffer, in place, with what ``variant`` would store."""

    def __init__(self, variant: str):
        base = variant.split("-")[-1]
        if base not in ("nf4", "grid") or (variant.startswith("lr") and not variant[2:variant.index("-")].isdigit()):
            raise ValueError(f"unknown variant {variant!r}: fp32, nf4, grid, lrK-nf4 or lrK-grid")
        self.rank = int(variant[2:variant.index("-")]) if variant.startswith("lr") else 0
        self.residual = round_grid if base == "grid" else round_blocks
        self.row_space: dict[int, torch.Tensor] = {}

    def __call__(self, key: int, b: torch.Tensor) -> None:
        if self.rank == 0:
            b.copy_(self.residual(b))
            return
        q = self.row_space.get(key)
        if q is None:
            g = torch.Generator().manual_seed(0)
            q = torch.linalg.qr(torch.randn(b.shape[1], self.rank, generator=g))[0]
        p = torch.linalg.qr(b @ q)[0]  # (m, K) orthonormal column space
        r = b.T @ p  # (n, K): b ~ p r^T
        low = p @ r.T
        self.row_space[key] = torch.linalg.qr(r)[0]
        b.copy_(low + self.residual(b - low))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    store = None if args.variant == "fp32" else StoredMomentum(args.variant)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    train_data, held_data, _ = load_corpus()
    held_out = eval_batches(held_data, 64, 256)
    torch.manual_seed(args.seed)  # the convergence benchmark's init and batches for this seed
    model = CharGPT(256, args.d_model, 2, 4, 64)
    batches = Batches(train_data, 64, 16, args.seed)

    def factory(params):
        groups = bridge.muon_param_groups(model, exclude=("tok", "pos", "head"), betas=(0.9, 0.99))
        opt = bridge.Muon(groups, lr=args.lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw", state_format="fp32")
        if store is None:
            return opt
        step = opt.step

        def step_then_store(closure=None):
            loss = step(closure)
            for group in opt.param_groups:
                if group.get("use_muon", True):
                    for p in group["params"]:
                        state = opt.state.get(p)
                        if state and "momentum_buffer" in state:
                            store(id(p), state["momentum_buffer"])
            return loss

        opt.step = step_then_store
        return opt

    t0 = time.time()
    r = train(args.variant, model, factory, batches, held_out, steps=args.steps, lr=args.lr,
              warmup=max(1, args.steps // 20), eval_every=max(1, args.steps // 10))
    print(json.dumps(dict(variant=args.variant, seed=args.seed, d_model=args.d_model, steps=args.steps,
                          held_out=r.held_out_loss, seconds=round(time.time() - t0))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
