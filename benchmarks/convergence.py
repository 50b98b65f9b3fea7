"""Convergence: held-out loss of each low-bit AdamW relative to fp32 AdamW, over seeds.

The task is the demo's (``bridge/tools/demo.py``): a byte-level GPT on the Python standard
library's source. For each seed every variant starts from the same initial weights and
sees the same batches; the figure of merit is the final held-out loss relative to fp32
AdamW *of the same seed*, with the spread over seeds. Acceptance: within +1% for 8-bit and
4-bit (issue 17, with rank-1 second moments, 4-bit's default since), +2% for FP8 and
block-normalized 4-bit (issue 7); for 8-bit AdamW on bfloat16 params with an int8
correction, the mean over seeds within +0.2% of 8-bit AdamW on float32 params (issue 29).

Variants:
  fp32, 8bit, 4bit, fp8   bridge.AdamW / AdamW8bit / AdamW4bit / AdamWFp8 (4bit: its default, rank-1
                          normalized second moments)
  4bit-block              bridge.AdamW4bit(rank1_normalization=False): v normalized per block
                          (the 4-bit default before state-dict version 3)
  torchao-8bit            torchao.optim.AdamW8bit, when installed
  bnb-8bit                bitsandbytes.optim.AdamW8bit, when installed (CPU works in 0.50)
  ademamix-fp32, -8bit,   bridge.AdEMAMix / AdEMAMix8bit / AdEMAMix4bit, betas (0.9, 0.99, 0.999),
  -4bit, -4bit-slow8      alpha 5, t_alpha = t_beta3 = the run's steps (-slow8: the slow EMA
                          in 8-bit, the other states 4-bit); compared with
                          ademamix-fp32 of the same seed (the others with fp32 AdamW)
  muon-fp32, -8bit, -4bit bridge.Muon / Muon8bit / Muon4bit on the hidden matrices and AdamW on
                          the rest, one lr (adjust_lr_fn="match_rms_adamw"); compared with
                          muon-fp32 of the same seed (Muon4bit: rank-16 bfloat16 factors and an
                          "nf4" residual, the normal-float map on blocks of 32; "8bit" AdamW states)
  muon-4bit-rank8         Muon4bit with momentum_rank=8
  muon-4bit-adamw4        Muon4bit with the AdamW groups' states in 4-bit ("4bit")
  muon-4bit-rank0         Muon4bit with momentum_rank=0: the whole momentum in "nf4", i.e.
                          bridge.Muon(state_format="nf4") with 8-bit AdamW states
  muon-4bit-dynamic       bridge.Muon(state_format="4bit"): the dynamic map on blocks of 128
                          (the dynamic 4-bit map, for comparison with "nf4")
  8bit-bf16, -bf16sr,     AdamW8bit on bfloat16 params (the model converted with .to(torch.bfloat16),
  -bf16c                  the loss float32 from the logits): rounded to nearest at each step,
                          bf16_stochastic_round=True, param_correction=True (an int8 correction
                          per element); compared with 8bit on float32 params of the same seed
                          (and, in the summary's vs_fp32 fields, with fp32 AdamW)
  4bit-bf16c              AdamW4bit(param_correction=True); compared with 4bit
  8bit-bf16m, 8bit-amp    references that tell bfloat16 compute from the master weight's precision,
                          compared with 8bit (and the bfloat16 variants, in the summary's
                          vs_bf16m fields, with 8bit-bf16m). -bf16m: "O2" mixed precision,
                          float32 master params stepped by the 8bit optimizer itself, a bfloat16
                          copy of the model for forward and backward (its gradients, clipped, go
                          to the masters as float32; the masters come back rounded to nearest):
                          what -bf16c approximates with 16 significant bits instead of 24.
                          -amp: float32 params, forward under torch.autocast (bfloat16), the
                          8bit optimizer (how most bfloat16 training runs)

    python benchmarks/convergence.py                       # 2000 steps x 3 seeds (hours on CPU)
    python benchmarks/convergence.py --steps 300 --seeds 0,1 --out convergence_out
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch

from bridge.tools.demo import Batches, CharGPT, RunResult, eval_batches, load_corpus, make_optimizer, parse_setup, train

ALL_VARIANTS = ("fp32", "8bit", "4bit", "4bit-block", "fp8", "torchao-8bit", "bnb-8bit",
                "ademamix-fp32", "ademamix-8bit", "ademamix-4bit", "ademamix-4bit-slow8",
                "muon-fp32", "muon-8bit", "muon-4bit", "muon-4bit-rank8", "muon-4bit-adamw4", "muon-4bit-rank0",
                "muon-4bit-dynamic", "8bit-bf16", "8bit-bf16sr", "8bit-bf16c", "4bit-bf16c", "8bit-bf16m", "8bit-amp")
BF16_VARIANTS = ("8bit-bf16", "8bit-bf16sr", "8bit-bf16c", "4bit-bf16c")
MIXED_VARIANTS = {"8bit-bf16m": "8bit", "8bit-amp": "8bit"}  # bfloat16 compute, float32 masters -> their optimizer
TOLERANCE = {"8bit": 1.0, "4bit": 1.0, "4bit-block": 2.0, "fp8": 2.0,  # % over the reference's held-out loss
             "ademamix-8bit": 1.0, "ademamix-4bit": 2.0, "ademamix-4bit-slow8": 2.0, "muon-8bit": 1.0, "muon-4bit": 2.0,
             "muon-4bit-rank8": 2.0, "muon-4bit-adamw4": 2.0, "muon-4bit-rank0": 2.0, "muon-4bit-dynamic": 2.0}
MEAN_TOLERANCE = {"8bit-bf16c": 0.2}  # % over the reference, on the mean over seeds (issue 29: 8bit on float32 params)


def reference_of(variant: str) -> str:
    """The run a variant is compared with: for bfloat16 params, the same optimizer on float32
    params; fp32 AdEMAMix / Muon for theirs; else fp32 AdamW."""
    if variant in BF16_VARIANTS:
        return parse_setup(variant).format
    if variant in MIXED_VARIANTS:
        return MIXED_VARIANTS[variant]
    for family in ("ademamix", "muon"):
        if variant.startswith(family + "-"):
            return family + "-fp32"
    return "fp32"


def available(variant: str) -> bool:
    import importlib.util

    if variant == "torchao-8bit":
        return importlib.util.find_spec("torchao") is not None
    if variant == "bnb-8bit":
        return importlib.util.find_spec("bitsandbytes") is not None
    return True


class Autocast(torch.nn.Module):
    """``model`` with its forward under ``torch.autocast`` (bfloat16 on CPU): float32 params,
    bfloat16 matmuls; evaluation too."""

    def __init__(self, model: torch.nn.Module, dtype=torch.bfloat16):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, idx):
        with torch.autocast(idx.device.type, dtype=self.dtype):
            return self.model(idx)


class MasterParams:
    """An optimizer on float32 copies ("masters") of low-precision params: ``step`` hands the
    params' gradients to the masters as float32, steps ``inner(masters)`` and writes the
    masters back to the params rounded to nearest. The masters start from the params' values,
    as a correction starts at zero. ``param_groups`` are the inner optimizer's (the loop sets
    their lr); ``state_bytes`` adds the masters' 4 bytes per param."""

    def __init__(self, params, inner):
        self.params = [p for p in params]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.inner = inner(self.masters)
        self.param_groups = self.inner.param_groups

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params + self.masters:
            p.grad = None

    def state_report(self):
        return self.inner.state_report()

    def state_bytes(self) -> int:
        return self.inner.state_bytes() + sum(4 * m.numel() for m in self.masters)


def model_for(variant: str, init: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``init`` as ``variant`` trains it: bfloat16 for -bf16*, wrapped in autocast for -amp."""
    model = copy.deepcopy(init)
    if variant in BF16_VARIANTS:
        return model.to(parse_setup(variant).dtype)
    if variant == "8bit-bf16m":
        return model.to(torch.bfloat16)
    if variant == "8bit-amp":
        return Autocast(model)
    return model


def make(variant: str, params, args, model=None) -> tuple[torch.optim.Optimizer, str]:
    """(optimizer, the param-group key holding its learning rate: ``lr`` for every variant)."""
    betas, wd = (0.9, 0.99), args.weight_decay
    if variant in ("muon-4bit-rank8", "muon-4bit-adamw4", "muon-4bit-rank0", "muon-4bit-dynamic"):
        import bridge

        groups = bridge.muon_param_groups(model, exclude=("tok", "pos", "head"), betas=betas)
        common = dict(lr=args.lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw", min_quant_size=args.min_quant_size)
        if variant == "muon-4bit-dynamic":
            return bridge.Muon(groups, state_format="4bit", **common), "lr"
        if variant == "muon-4bit-adamw4":  # Muon4bit's momentum, 4-bit AdamW states on the rest
            groups = [g if g.get("use_muon", True) else {**g, "state_format": "4bit"} for g in groups]
            return bridge.Muon4bit(groups, **common), "lr"
        return bridge.Muon4bit(groups, momentum_rank=int(variant[len("muon-4bit-rank"):]), **common), "lr"
    if variant.startswith("muon-"):
        return make_optimizer(variant.split("-")[1], params, args.lr, wd, args.min_quant_size, "muon", model=model), "lr"
    if variant == "8bit-bf16m":
        return MasterParams(params, lambda masters: make("8bit", masters, args)[0]), "lr"
    if variant == "8bit-amp":
        return make("8bit", params, args)
    if variant in ("fp32", "8bit", "4bit", "fp8") + BF16_VARIANTS:
        setup = parse_setup(variant)
        return make_optimizer(setup.format, params, args.lr, wd, args.min_quant_size, **setup.options), "lr"
    if variant == "4bit-block":
        import bridge

        return bridge.AdamW4bit(params, lr=args.lr, betas=betas, weight_decay=wd, min_quant_size=args.min_quant_size,
                                rank1_normalization=False), "lr"
    if variant.startswith("ademamix-"):
        import bridge

        fmt = variant.split("-")[1]
        kw = {} if fmt == "fp32" else {"min_quant_size": args.min_quant_size}
        if variant.endswith("-slow8"):
            kw["slow_state_format"] = "8bit"
        return bridge.AdEMAMix(params, lr=args.lr, betas=(*betas, 0.999), alpha=5.0, t_alpha=args.steps,
                               t_beta3=args.steps, weight_decay=wd, state_format=fmt, **kw), "lr"
    if variant == "torchao-8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=args.lr, betas=betas, weight_decay=wd), "lr"
    if variant == "bnb-8bit":
        from bitsandbytes.optim import AdamW8bit

        return AdamW8bit(params, lr=args.lr, betas=betas, weight_decay=wd), "lr"
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(ALL_VARIANTS)}")


def summarize(results: dict[str, dict[int, RunResult]]) -> list[dict]:
    """Per variant: held-out loss mean/std over seeds, and relative to its fp32 reference
    (:func:`reference_of`) of the same seed."""
    rows = []
    for variant, by_seed in results.items():
        base = results.get(reference_of(variant), {})
        losses = [r.held_out_loss for r in by_seed.values()]
        rel = [100 * (r.held_out_loss / base[s].held_out_loss - 1) for s, r in by_seed.items() if s in base]
        tol, on_mean = TOLERANCE.get(variant, MEAN_TOLERANCE.get(variant)), variant in MEAN_TOLERANCE
        any_r = next(iter(by_seed.values()))
        fp32 = results.get("fp32", {})
        vs_fp32 = [100 * (r.held_out_loss / fp32[s].held_out_loss - 1) for s, r in by_seed.items() if s in fp32]
        o2 = results.get("8bit-bf16m", {}) if variant in BF16_VARIANTS or variant == "8bit-amp" else {}
        vs_bf16m = [100 * (r.held_out_loss / o2[s].held_out_loss - 1) for s, r in by_seed.items() if s in o2]
        rows.append(dict(
            variant=variant, seeds=sorted(by_seed), held_out_mean=statistics.mean(losses),
            held_out_std=statistics.stdev(losses) if len(losses) > 1 else 0.0,
            rel_mean=statistics.mean(rel) if rel else None, rel_min=min(rel) if rel else None,
            rel_max=max(rel) if rel else None, rel_sd=statistics.stdev(rel) if len(rel) > 1 else None, tolerance=tol, tolerance_on="mean" if on_mean else "max",
            within=None if tol is None or not rel else (statistics.mean(rel) if on_mean else max(rel)) <= tol,
            vs_fp32_mean=statistics.mean(vs_fp32) if vs_fp32 else None,
            vs_fp32_min=min(vs_fp32) if vs_fp32 else None, vs_fp32_max=max(vs_fp32) if vs_fp32 else None,
            vs_bf16m_mean=statistics.mean(vs_bf16m) if vs_bf16m else None,
            vs_bf16m_min=min(vs_bf16m) if vs_bf16m else None, vs_bf16m_max=max(vs_bf16m) if vs_bf16m else None,
            bytes_per_param=any_r.bytes_per_param, ms_per_step=statistics.mean(r.ms_per_step for r in by_seed.values()),
            state_formats=any_r.state_formats,
        ))
    return rows


def format_summary(rows: list[dict]) -> str:
    head = (f"{'variant':13s} {'held-out (mean +- sd)':>22s} {'vs reference':>20s} {'[min, max] over seeds':>22s} "
            f"{'target':>7s} {'ok':>4s} {'vs fp32 AdamW':>13s} {'B/param':>8s} {'ms/step':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ref = reference_of(r["variant"])
        rel = "-" if r["rel_mean"] is None or ref == r["variant"] else f"{r['rel_mean']:+.2f}% ({ref})"
        spread = "-" if r["rel_min"] is None else f"[{r['rel_min']:+.2f}%, {r['rel_max']:+.2f}%]"
        tol = "-" if r["tolerance"] is None else f"+{r['tolerance']:g}%" + (" m" if r["tolerance_on"] == "mean" else "")
        ok = "-" if r["within"] is None else ("yes" if r["within"] else "NO")
        vs_fp32 = "-" if r["vs_fp32_mean"] is None or ref == "fp32" else f"{r['vs_fp32_mean']:+.2f}%"
        lines.append(f"{r['variant']:13s} {r['held_out_mean']:14.4f} +- {r['held_out_std']:.4f} {rel:>20s} "
                     f"{spread:>22s} {tol:>7s} {ok:>4s} {vs_fp32:>13s} {r['bytes_per_param']:8.3f} {r['ms_per_step']:8.1f}")
    o2 = [f"{r['variant']} {r['vs_bf16m_mean']:+.2f}% [{r['vs_bf16m_min']:+.2f}%, {r['vs_bf16m_max']:+.2f}%]"
          for r in rows if r.get("vs_bf16m_mean") is not None]
    if o2:  # the same bfloat16 compute with float32 masters: what is left is the master weight's precision
        lines.append("vs 8bit-bf16m (mean [min, max] over seeds): " + "; ".join(o2))
    return "\n".join(lines + ["target: on the largest relative loss over seeds; 'm': on their mean"])


def plot(results, rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, by_seed in results.items():
        runs = list(by_seed.values())
        steps = runs[0].eval_steps
        mean = [statistics.mean(r.eval_curve[i] for r in runs) for i in range(len(steps))]
        a.plot(steps, mean, marker=".", lw=1, label=variant)
    a.set(xlabel="step", ylabel="held-out loss (mean over seeds)", title="held-out loss")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    rel_rows = [r for r in rows if r["rel_mean"] is not None and r["variant"] != reference_of(r["variant"])]
    xs = range(len(rel_rows))
    for x, r in zip(xs, rel_rows):
        b.errorbar([x], [r["rel_mean"]], yerr=[[r["rel_mean"] - r["rel_min"]], [r["rel_max"] - r["rel_mean"]]],
                   fmt="o", capsize=4)
        if r["tolerance"] is not None:
            b.hlines(r["tolerance"], x - 0.3, x + 0.3, colors="r", linestyles="--", lw=1)
    b.axhline(0, color="k", lw=0.8)
    b.set_xticks(list(xs), [r["variant"] for r in rel_rows], rotation=20, fontsize=8)
    b.set(ylabel="final held-out loss vs reference, % (mean, seed range)",
          title="relative to each variant's reference (red: target)")
    b.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS),
                    help="comma-separated; torchao/bitsandbytes ones are skipped when not installed")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--min-quant-size", type=int, default=1024)
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--evals", type=int, default=10, help="held-out evaluations per run")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    ap.add_argument("--out", default="convergence_out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ALL_VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(ALL_VARIANTS)}")
    skipped = [v for v in variants if not available(v)]
    variants = [v for v in variants if available(v)]
    if skipped:
        print(f"skipping (not installed): {', '.join(skipped)}")
    warnings.filterwarnings("ignore")
    train_data, held_data, info = load_corpus()
    held_out = eval_batches(held_data, args.seq_len, args.eval_windows)
    results: dict[str, dict[int, RunResult]] = {v: {} for v in variants}
    t_start = time.time()
    for seed in seeds:
        torch.manual_seed(seed)
        init = CharGPT(256, args.d_model, args.layers, args.heads, args.seq_len)
        batches = Batches(train_data, args.seq_len, args.batch, seed)
        for v in variants:
            model = model_for(v, init)
            factory = lambda params, v=v, model=model: make(v, params, args, model)[0]
            t0 = time.time()
            r = train(v, model, factory, batches, held_out, steps=args.steps, lr=args.lr,
                      warmup=max(1, args.steps // 20), eval_every=max(1, args.steps // args.evals))
            results[v][seed] = r
            print(f"seed {seed} {v:13s} held-out {r.held_out_loss:.4f} train {r.train_loss:.4f} "
                  f"({time.time() - t0:.0f} s, {r.ms_per_step:.0f} ms/step, {r.state_formats})", flush=True)
    rows = summarize(results)
    n = sum(p.numel() for p in init.parameters())
    title = (f"char-level GPT ({n:,} params, d{args.d_model} x {args.layers} layers) on Python stdlib source, "
             f"{args.steps} steps, seeds {args.seeds}, lr {args.lr}")
    print(title)
    print(format_summary(rows))
    os.makedirs(args.out, exist_ok=True)
    plot(results, rows, os.path.join(args.out, "convergence.png"), title)
    with open(os.path.join(args.out, "convergence.json"), "w") as f:
        json.dump({"config": vars(args), "torch": torch.__version__, "corpus": info, "params": n,
                   "wall_s": time.time() - t_start, "summary": rows,
                   "runs": {v: {s: {"held_out_loss": r.held_out_loss, "train_loss": r.train_loss,
                                    "eval_steps": r.eval_steps, "eval_curve": r.eval_curve}
                                for s, r in by_seed.items()} for v, by_seed in results.items()}}, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'convergence.png')} and {os.path.join(args.out, 'convergence.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
