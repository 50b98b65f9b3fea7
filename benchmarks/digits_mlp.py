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

bfloat16 params (the model converted with ``.to(torch.bfloat16)``, inputs cast to bfloat16, the
loss computed in float32 from the logits), each also compared with the same format on float32
params of the same seed:
  8bit-bf16                    AdamW8bit, params rounded to nearest at each step
  8bit-bf16sr                  AdamW8bit(bf16_stochastic_round=True)
  8bit-bf16c                   AdamW8bit(param_correction=True): an int8 correction per element
  4bit-bf16c                   AdamW4bit(param_correction=True) (its float32-param run: 4bit-rank1)

Needs scikit-learn for the data (``pip install -e ".[bench]"``).

    python benchmarks/digits_mlp.py                      # 300 steps x 5 seeds, a few minutes
    python benchmarks/digits_mlp.py --seeds 0,1,2,3,4,5,6,7,8,9 --variants 8bit,8bit-bf16,8bit-bf16sr,8bit-bf16c
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bridge.tools.demo import BF16_OPTIONS  # the bfloat16 options: "bf16", "bf16sr", "bf16c"

VARIANTS = ("fp32", "8bit", "fp8", "4bit-block", "4bit-rank1", "4bit-block64",
            "8bit-bf16", "8bit-bf16sr", "8bit-bf16c", "4bit-bf16c")


def split_variant(variant: str) -> tuple[str, dict]:
    """``"8bit-bf16c"`` -> (``"8bit"``, the optimizer's bfloat16 option); float32 params: (variant, {})."""
    base, _, suffix = variant.rpartition("-")
    if base and suffix in BF16_OPTIONS:
        return base, BF16_OPTIONS[suffix]
    return variant, {}


def is_bf16(variant: str) -> bool:
    return split_variant(variant)[0] != variant


def float32_twin(variant: str) -> str:
    """The same optimizer on float32 params: what a bfloat16-param variant is compared with."""
    base = split_variant(variant)[0]
    return "4bit-rank1" if base == "4bit" else base


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

    variant, bf16_option = split_variant(variant)
    kw = dict(lr=lr, weight_decay=weight_decay, **bf16_option)
    if variant == "4bit":
        return bridge.AdamW4bit(params, **kw)
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
    dtype = torch.bfloat16 if is_bf16(variant) else torch.float32
    model = make_model(seed).to(dtype)
    opt = make_optimizer(variant, list(model.parameters()), lr, weight_decay)
    gen = torch.Generator().manual_seed(10_000 + seed)

    def loss_fn(x, y):  # float32 cross-entropy from the logits, whatever the params' dtype
        return torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)

    for _ in range(steps):
        idx = torch.randint(len(ytr), (batch,), generator=gen)
        loss = loss_fn(xtr[idx], ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(loss_fn(xte, yte))


def relative(losses: dict[str, list[float]], variant: str, reference: str) -> list[float]:
    """Per seed, % of ``variant``'s held-out loss over ``reference``'s."""
    return [100.0 * (a / b - 1.0) for a, b in zip(losses[variant], losses[reference])]


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
    for v in variants:
        if split_variant(v)[0] not in VARIANTS + ("4bit",):
            ap.error(f"unknown variant {v!r}; one of {', '.join(VARIANTS)}")
    # the references first: fp32 AdamW, and each bfloat16 variant's float32 twin
    wanted = ["fp32"] + [float32_twin(v) for v in variants if is_bf16(v)] + variants
    variants = list(dict.fromkeys(wanted))
    data = load_data()
    print(f"digits MLP 64-256-256-10, {args.steps} steps, batch {args.batch}, lr {args.lr}, "
          f"weight decay {args.weight_decay}, seeds {seeds}")
    losses = {v: [run(v, s, data, args.steps, args.batch, args.lr, args.weight_decay) for s in seeds] for v in variants}
    print(f"{'variant':<14} {'held-out (mean +- sd)':>22} {'vs fp32 (mean)':>15} {'seed range':>20}"
          f"  {'vs float32 params':>18} {'seed range':>20}")
    for v in variants:
        rel = relative(losses, v, "fp32")
        line = (f"{v:<14} {statistics.mean(losses[v]):>13.4f} +- {statistics.pstdev(losses[v]):.4f} "
                f"{statistics.mean(rel):>+14.2f}% {_spread(rel):>20}")
        if is_bf16(v):
            twin = relative(losses, v, float32_twin(v))
            line += f"  {statistics.mean(twin):>+17.2f}% {_spread(twin):>20}  (vs {float32_twin(v)})"
        print(line)
    return losses


def _spread(rel: list[float]) -> str:
    return f"[{min(rel):+.2f}%, {max(rel):+.2f}%]"


if __name__ == "__main__":
    main()
