"""SOAP's low-bit states: state bytes a param, and held-out loss against fp32 SOAP.

``--bytes``: state bytes a param of one matrix (2048 x 2048 and 2048 x 512 by default, built on
the meta device, nothing allocated) for fp32 AdamW, 8-bit AdamW and fp32 / 8-bit / 4-bit SOAP
(:func:`lowbit_tree.state_report`'s total over the matrix's elements).

Otherwise: the demo's byte-level GPT (``bridge/demo.py``: the Python standard library's source),
small enough for a CPU, trained with the functional core (``lowbit_tree.soap`` /
``lowbit_tree.adamw``, ``apply_updates``) from the same initial weights and batches per seed;
the figure of merit is each variant's final held-out loss relative to fp32 SOAP *of the same
seed* (mean and standard error over seeds).

Variants:
  adamw          lt.adamw, fp32 states, lr 1e-3 (its own tuned lr on this task is not searched)
  soap           lt.soap, fp32 moments and factors (the reference's representation size)
  soap8          state_format="8bit", precond_format="8bit"
  soap4          bridge.SOAP4bit's: exp_avg "nf4", exp_avg_sq "8bit", precond_format="4bit"
  soap4-v4       state_format="nf4": exp_avg_sq rank-1 4-bit too
  soap4-dyn      state_format="4bit": exp_avg on the dynamic 4-bit map
  soap4-m8       4-bit factors, 8-bit moments
  soap4-m8v4     4-bit factors, exp_avg "8bit", exp_avg_sq rank-1 4-bit
  soap4-nobj     soap4 without Bjorck steps

    python benchmarks/soap_quality.py --bytes
    python benchmarks/soap_quality.py --time     # ms a step, interleaved, medians of 3
    python benchmarks/soap_quality.py --steps 300 --seeds 0,1,2
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import lowbit_tree as lt

VARIANTS = {
    "adamw": None,
    "soap": dict(state_format="fp32", precond_format="fp32"),
    "soap8": dict(state_format="8bit", precond_format="8bit"),
    "soap4": dict(state_format={"exp_avg": "nf4", "exp_avg_sq": "8bit"}, precond_format="4bit"),
    "soap4-v4": dict(state_format="nf4", precond_format="4bit"),
    "soap4-dyn": dict(state_format="4bit", precond_format="4bit"),
    "soap4-m8": dict(state_format="8bit", precond_format="4bit"),
    "soap4-m8v4": dict(state_format={"exp_avg": "8bit", "exp_avg_sq": "4bit"}, precond_format="4bit"),
    "soap4-nobj": dict(state_format={"exp_avg": "nf4", "exp_avg_sq": "8bit"}, precond_format="4bit", bjorck_steps=0),
}


def make(variant: str, lr: float, weight_decay: float, frequency: int) -> lt.GradientTransformation:
    if variant == "adamw":
        return lt.adamw(lr, 0.9, 0.999, 1e-8, weight_decay, state_format="fp32")
    return lt.soap(lr, 0.95, 0.95, weight_decay=weight_decay, precondition_frequency=frequency,
                   **VARIANTS[variant])


def bytes_per_param(variant: str, shape: tuple) -> float:
    p = torch.empty(shape, device="meta")
    if variant == "adamw8":
        tx = lt.adamw(1e-3, state_format="8bit")
    elif variant == "adamw":
        tx = lt.adamw(1e-3, state_format="fp32")
    else:
        tx = make(variant, 1e-3, 0.0, 10)
    total = lt.state_report(tx.init([p]))[-1].nbytes
    return total / p.numel()


def step_times(shape: tuple, steps: int, rounds: int) -> dict:
    """Median seconds a step (over ``rounds`` interleaved rounds of ``steps`` steps, the first,
    building step excluded) of each optimizer on one matrix, preconditioner refreshes amortized
    (frequency 10)."""
    gen = torch.Generator().manual_seed(0)
    p = [torch.randn(shape, generator=gen)]
    grads = [[torch.randn(shape, generator=gen)] for _ in range(steps)]
    names = ("adamw", "adamw8", "soap", "soap8", "soap4")
    txs = {v: (lt.adamw(1e-3, state_format="8bit") if v == "adamw8" else make(v, 1e-3, 0.01, 10)) for v in names}
    states = {v: tx.update(grads[0], tx.init(p), p)[1] for v, tx in txs.items()}
    times = {v: [] for v in names}
    for _ in range(rounds):
        for v in names:
            t0 = time.perf_counter()
            for g in grads:
                _, states[v] = txs[v].update(g, states[v], p)
            times[v].append((time.perf_counter() - t0) / steps)
    return {v: statistics.median(t) for v, t in times.items()}


def run(variant: str, seed: int, args, data) -> float:
    from bridge.demo import Batches, CharGPT, eval_batches, evaluate, loss_fn

    train_data, held_out = data
    torch.manual_seed(seed)
    model = CharGPT(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq_len)
    params = list(model.parameters())
    lr = args.adamw_lr if variant == "adamw" else args.lr
    tx = make(variant, lr, args.weight_decay, args.frequency)
    state = tx.init([p.detach() for p in params])
    batches = Batches(train_data, args.seq_len, args.batch, seed)
    for step in range(args.steps):
        for p in params:
            p.grad = None
        loss_fn(model, batches(step)).backward()
        upd, state = tx.update([p.grad for p in params], state, [p.detach() for p in params])
        with torch.no_grad():
            for p, u in zip(params, upd):
                p.add_(u)
    windows = eval_batches(held_out, args.seq_len, args.eval_windows)
    return evaluate(model, windows, args.batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", action="store_true")
    ap.add_argument("--time", action="store_true", help="step time of each optimizer on one 1024 x 1024 matrix")
    ap.add_argument("--variants", default="adamw,soap,soap8,soap4")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--adamw-lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--frequency", type=int, default=10)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=256)
    args = ap.parse_args(argv)
    if args.bytes:
        shapes = [(2048, 2048), (2048, 512)]
        print(f"{'optimizer':<10}" + "".join(f"{f'{a}x{b}':>12}" for a, b in shapes))
        for v in ("adamw", "adamw8", "soap", "soap8", "soap4"):
            print(f"{v:<10}" + "".join(f"{bytes_per_param(v, s):>12.3f}" for s in shapes))
        return 0
    if args.time:
        t = step_times((1024, 1024), 20, 3)
        print(f"{'optimizer':<10} {'ms/step':>9} {'vs adamw':>9}  (1024 x 1024, {torch.get_num_threads()} threads)")
        for v, s in t.items():
            print(f"{v:<10} {1e3 * s:>9.2f} {s / t['adamw']:>9.1f}")
        return 0
    from bridge.demo import load_corpus

    torch.set_num_threads(1)
    train_data, held_out, _ = load_corpus()
    variants = [v for v in args.variants.split(",") if v]
    seeds = [int(s) for s in args.seeds.split(",")]
    losses = {v: [] for v in variants}
    for seed in seeds:
        for v in variants:
            t0 = time.perf_counter()
            losses[v].append(run(v, seed, args, (train_data, held_out)))
            print(f"seed {seed} {v:<11} held-out {losses[v][-1]:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    ref = losses.get("soap")
    print(f"\n{'variant':<11} {'held-out':>9} {'vs soap %':>10} {'s.e.':>6}")
    for v in variants:
        mean = statistics.fmean(losses[v])
        rel = [100 * (a / b - 1) for a, b in zip(losses[v], ref)] if ref else []
        se = statistics.stdev(rel) / math.sqrt(len(rel)) if len(rel) > 1 else float("nan")
        print(f"{v:<11} {mean:>9.4f} {statistics.fmean(rel) if rel else float('nan'):>+10.2f} {se:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
