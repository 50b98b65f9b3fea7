"""How a state's encoding behaves when it is requantized every step, per format.

Two measurements on seeded normal data, 128x1024, blocks of 128 (rank-1: the whole matrix):

- ``decay``: ``x = b * deq(q(x))`` for ``--steps`` steps with ``b = 0.999`` (a moment under
  zero gradients), ``x`` the data's magnitudes (the signed maps' negative side is the next
  measurement's). With exact block maxima every value keeps its code and the state ends at
  ``b ** steps`` of its first encoding; printed is the largest element's ratio to that (1.0: no
  drift; above: the maxima stagnate or grow).
- ``steady``: ``m = q(0.9 * deq(m) + 0.1 * g)`` with a constant ``g`` (a first moment): the
  block-maximum element's ``m / g`` at the end, for blocks whose largest gradient is positive
  and for those where it is negative (the signed dynamic maps hold 1.0 but not -1.0), and the
  mean relative error of all elements.

Usage: python benchmarks/requantize_drift.py [--steps 1000] [--quick]
``--quick``: 50 steps on 16x1024 (the CI smoke). A battery of ``benchmarks/report.py``.
"""
from __future__ import annotations

import argparse

import torch

import lowbit_tree as lt
from lowbit_tree.rank1 import rank1_dequantize, rank1_quantize

SIGNED = ("dynamic8", "dynamic4", "normal4", "e4m3")
UNSIGNED = ("dynamic8_sqrt", "dynamic8_unsigned", "e4m3_sqrt", "linear4_unsigned")
BLOCK = 128


def decay(roundtrip, x: torch.Tensor, steps: int, b: float = 0.999) -> float:
    first = roundtrip(x)
    for _ in range(steps):
        x = b * roundtrip(x)
    return (x.abs().max() / (first.abs().max() * b**steps)).item()


def steady(fmt: str, g: torch.Tensor, steps: int) -> tuple[float, float, float]:
    m = torch.zeros_like(g)
    for _ in range(steps):
        m = lt.dequantize(lt.quantize(0.9 * m + 0.1 * g, fmt, BLOCK))
    rows = g.shape[0]
    gb, mb = g.reshape(rows, -1, BLOCK), m.reshape(rows, -1, BLOCK)
    at = gb.abs().argmax(-1, keepdim=True)
    gmax, mmax = gb.gather(-1, at).squeeze(-1), mb.gather(-1, at).squeeze(-1)
    ratio, neg = mmax / gmax, gmax < 0
    return ratio[~neg].mean().item(), ratio[neg].mean().item(), ((m - g).abs().mean() / g.abs().mean()).item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="50 steps on 16x1024")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 50
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(16 if args.quick else 128, 1024, generator=gen)
    v = g.square()
    print(f"decay: largest element after {args.steps} steps of x = 0.999 * deq(q(x)), over 0.999**steps "
          "times its first encoding")
    for fmt in SIGNED + UNSIGNED:
        x = g.abs() if fmt in SIGNED else v
        print(f"  {fmt:<18} {decay(lambda t: lt.dequantize(lt.quantize(t, fmt, BLOCK)), x, args.steps):.4f}")
    print(f"  {'rank1':<18} {decay(lambda t: rank1_dequantize(rank1_quantize(t)), v, args.steps):.4f}")
    print(f"steady: m = q(0.9 m + 0.1 g), constant g, {args.steps} steps: block-maximum m/g (positive max, "
          "negative max), mean |m - g| / mean |g|")
    for fmt in SIGNED:
        pos, neg, err = steady(fmt, g, args.steps)
        print(f"  {fmt:<18} {pos:.4f} {neg:.4f} {err:.4f}")


if __name__ == "__main__":
    main()
