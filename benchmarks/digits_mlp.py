"""A second model kind for comparing state formats: an MLP (64-256-256-10) on scikit-learn's
digits, trained with each AdamW variant from the same initial weights and batches per seed.

The figure of merit is the final held-out cross-entropy relative to fp32 AdamW *of the same
seed*, with the spread over seeds, as in ``convergence.py`` (a byte-level GPT). The issue that
chose the 4-bit default (rank-1 normalized or block-normalized second moments) measured this
task first: 300 steps, lr 1e-3, weight decay 1e-2.

Variants (bridge classes; ``min_quant_size`` the default 4096, so the 256x10 head keeps fp32
states in every variant):
  fp32, 8bit, fp8              bridge.AdamW / AdamW8bit / AdamWFp8
  4bit-block                   bridge.AdamW4bit(rank1_normalization=False): v per block of 128
  4bit-rank1                   bridge.AdamW4bit(rank1_normalization=True)
  4bit-block64                 block-normalized, blocks of 64

Needs scikit-learn for the data (``pip install -e ".[bench]"``).

    python benchmarks/digits_mlp.py                      # 300 steps x 5 seeds, about a minute
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

VARIANTS = ("fp32", "8bit", "fp8", "4bit-block", "4bit-rank1", "4bit-block64")


def load_data(split_seed: int = 1234):
    """(x_train, y_train, x_test, y_test): pixels scaled to [0, 1], a fixed 80/20 split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("digits_mlp.py needs scikit-learn for its data: pip install scikit-learn")
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    n_test = len(y) // 5
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def make_optimizer(variant: str, params, lr: float, weight_decay: float):
    import bridge

    kw = dict(lr=lr, weight_decay=weight_decay)
    if variant == "fp32":
        return bridge.AdamW(params, state_format="fp32", **kw)
    if variant == "8bit":
        return bridge.AdamW8bit(params, **kw)
    if variant == "fp8":
        return bridge.AdamWFp8(params, **kw)
    if variant == "4bit-block":
        return bridge.AdamW4bit(params, rank1_normalization=False, **kw)
    if variant == "4bit-rank1":
        return bridge.AdamW4bit(params, rank1_normalization=True, **kw)
    if variant == "4bit-block64":
        return bridge.AdamW4bit(params, rank1_normalization=False, block_size=64, **kw)
    raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")


def run(variant: str, seed: int, data, steps: int, batch: int, lr: float, weight_decay: float) -> float:
    """Final held-out loss of one run."""
    xtr, ytr, xte, yte = data
    model = make_model(seed)
    opt = make_optimizer(variant, list(model.parameters()), lr, weight_decay)
    gen = torch.Generator().manual_seed(10_000 + seed)
    loss_fn = torch.nn.functional.cross_entropy
    for _ in range(steps):
        idx = torch.randint(len(ytr), (batch,), generator=gen)
        loss = loss_fn(model(xtr[idx]), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(loss_fn(model(xte), yte))


def main(argv=None) -> dict[str, list[float]]:
    """Prints the table; returns the final held-out losses, ``{variant: [one per seed]}``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-2)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    if "fp32" not in variants:
        variants = ["fp32"] + variants
    data = load_data()
    print(f"digits MLP 64-256-256-10, {args.steps} steps, batch {args.batch}, lr {args.lr}, "
          f"weight decay {args.weight_decay}, seeds {seeds}")
    losses = {v: [run(v, s, data, args.steps, args.batch, args.lr, args.weight_decay) for s in seeds] for v in variants}
    ref = losses["fp32"]
    print(f"fp32 held-out loss: {statistics.mean(ref):.4f} +- {statistics.pstdev(ref):.4f}")
    print(f"{'variant':<14} {'vs fp32 (mean)':>15} {'seed range':>22}  per seed")
    for v in variants:
        rel = [100.0 * (a / b - 1.0) for a, b in zip(losses[v], ref)]
        print(f"{v:<14} {statistics.mean(rel):>+14.2f}% [{min(rel):+.2f}%, {max(rel):+.2f}%]".ljust(54)
              + "  " + " ".join(f"{r:+.2f}" for r in rel))
    return losses


if __name__ == "__main__":
    main()
