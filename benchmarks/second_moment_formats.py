"""Which second-moment storage is safe? Measures the hazard that decided the defaults.

Adam's step is m / (sqrt(v) + eps). If a stored v dequantizes to 0 while m does
not, the next small-gradient step moves the weight by about m / eps. This runs
Adam (lr 1e-3, betas 0.9/0.999, eps 1e-8) on one parameter row with
heavy-tailed gradients (magnitudes spanning 1e-8..1 inside a block) where some
steps have exact-zero gradients (an embedding row absent from a batch), storing
m in the signed format and v in each candidate, and reports the largest single
weight step relative to the largest step fp32 Adam takes on the same sequence,
and how many stored v values flushed to zero.

Run: python benchmarks/second_moment_formats.py
"""
from __future__ import annotations

import argparse

import torch

import lowbit_tree as lt

CANDIDATES = [
    # (label, first-moment format, second-moment format, stores v or sqrt(v))
    ("8bit: bnb unsigned map on v (compat)", "dynamic8", "dynamic8_unsigned"),
    ("8bit: zero-free map on sqrt(v) (default)", "dynamic8", "dynamic8_sqrt"),
    ("fp8: e4m3 on v (torchao-like)", "e4m3", "e4m3"),
    ("fp8: zero-free e4m3 on sqrt(v) (default)", "e4m3", "e4m3_sqrt"),
    ("4bit: dynamic4 signed map on v", "dynamic4", "dynamic4"),
    ("4bit: zero-free linear on v (default)", "dynamic4", "linear4_unsigned"),
]


def gradients(steps: int, width: int, rows: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        mag = torch.pow(10.0, -8 * torch.rand(rows, width, generator=gen))
        g = mag * torch.randn(rows, width, generator=gen).sign()
        present = torch.rand(rows, 1, generator=gen) < 0.5  # rows absent from the batch
        out.append(torch.where(present, g, torch.zeros_like(g)))
    return out


def run(grads, fmt_m, fmt_v, block_size):
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    m = torch.zeros_like(grads[0])
    v = torch.zeros_like(grads[0])
    max_step = torch.zeros_like(grads[0])
    flushed = 0
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if fmt_m is not None:
            m = lt.quantize(m, fmt_m, block_size).dequantize()
            vq = lt.quantize(v, fmt_v, block_size).dequantize()
            flushed += int(((vq == 0) & (v > 0)).sum())
            v = vq
        step = lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        max_step = torch.maximum(max_step, step.abs())
    return max_step, flushed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    grads = gradients(args.steps, args.width, args.rows, args.seed)
    ref, _ = run(grads, None, None, args.block_size)
    print(f"fp32 Adam: largest step {ref.max().item():.3e} (lr 1e-3)")
    print(f"{'second-moment storage':45s} {'max step / fp32 max':>20s} {'v flushed to 0':>15s}")
    for label, fm, fv in CANDIDATES:
        worst, flushed = run(grads, fm, fv, args.block_size)
        print(f"{label:45s} {worst.max().item() / ref.max().item():20.3g} {flushed:15d}")


if __name__ == "__main__":
    main()
