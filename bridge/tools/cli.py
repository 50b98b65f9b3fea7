"""The ``lowbit-tree`` command line (also ``python -m bridge``)."""
from __future__ import annotations

import argparse
import sys

import torch


def roundtrip_report(args) -> int:
    """Quantize random heavy-tailed tensors in every format and print the error."""
    import lowbit_tree as lt

    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.rows, args.cols, generator=gen) * torch.exp(-8 * torch.rand(args.rows, args.cols, generator=gen))
    print(f"round trip of a {args.rows}x{args.cols} tensor, |x| spanning {x.abs().min():.1e}..{x.abs().max():.1e}")
    print(f"{'format':20s} {'block':>6s} {'bytes/elem':>10s} {'max err/absmax':>15s} {'mean err/absmax':>16s}")
    for name, fmt in sorted(lt.FORMATS.items()):
        xx = x if fmt.signed else x.abs()
        q = lt.quantize(xx, name)
        d = q.dequantize()
        rows, r = lt.row_layout(q.shape)
        block_of = torch.arange(r) // q.block_size
        ref = xx.sqrt() if fmt.sqrt else xx
        got = d.sqrt() if fmt.sqrt else d
        absmax = (q.scale * fmt.scale_divisor)[:, block_of]
        err = (got - ref).abs() / absmax
        print(f"{name:20s} {q.block_size:6d} {q.nbytes / xx.numel():10.3f} {err.max().item():15.4f} {err.mean().item():16.5f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lowbit-tree", description="low-bit optimizer states for PyTorch")
    sub = ap.add_subparsers(dest="command", required=True)
    rt = sub.add_parser("roundtrip", help="quantization round-trip error of every format")
    rt.add_argument("--rows", type=int, default=256)
    rt.add_argument("--cols", type=int, default=1024)
    rt.add_argument("--seed", type=int, default=0)
    rt.set_defaults(func=roundtrip_report)

    demo = sub.add_parser(
        "demo", help="train a small char-level transformer with fp32, 8-bit, 4-bit and FP8 AdamW and compare",
        description="Train a byte-level GPT on Python's own standard-library source with fp32 AdamW and "
                    "lowbit-tree's 8-bit, 4-bit and FP8 AdamW (same init, same data order); print a table and "
                    "write loss_curves.png and results.json to --out.",
    )
    from .demo import add_arguments

    add_arguments(demo)
    demo.set_defaults(func=_run_demo)

    ins = sub.add_parser("inspect", help="what precision each state of a saved optimizer state is stored in",
                         description="PATH: a torch.save'd optimizer state dict, a DCP checkpoint directory, or a "
                                     "torch.save'd lowbit_tree core state. Loaded with weights_only=True.")
    ins.add_argument("path")
    ins.set_defaults(func=_run_inspect)
    args = ap.parse_args(argv)
    return args.func(args)


def _run_demo(args) -> int:
    from .demo import run

    return run(args)


def _run_inspect(args) -> int:
    from .inspect_state import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
