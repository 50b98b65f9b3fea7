"""SOAP's low-bit states: state bytes a param, and held-out loss against fp32 SOAP.

``--bytes``: state bytes a param of one matrix (2048 x 2048 and 2048 x 512 by default, built on
the meta device, nothing allocated) for fp32 AdamW, 8-bit AdamW and fp32 / 8-bit / 4-bit SOAP
(:func:`lowbit_tree.state_report`'s total over the matrix's elements).

Otherwise: the demo's byte-level GPT (``bridge/tools/demo.py``: the Python standard library's source),
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
  adamw8         lt.adamw, state_format="8bit" (bridge.AdamW8bit's states), lr 1e-3
  muon4          bridge.Muon4bit on the hidden matrices (muon_param_groups; AdamW8bit's states on the
                 rest, betas (0.9, 0.999)), adjust_lr_fn="match_rms_adamw", SOAP's lr
  heavyball      HeavyBall's SOAP (the bench extra): SOAP's lr, betas, shampoo beta, frequency and
                 weight decay, merge_dims=False, use_precond_schedule=False, its other defaults;
                 eager (``heavyball.utils.compile_mode = None``: the same math, without minutes of
                 compilation per process)

    python benchmarks/soap_quality.py --bytes
    python benchmarks/soap_quality.py --time     # ms a step, interleaved, medians of 3
    python benchmarks/soap_quality.py --steps 300 --seeds 0,1,2
    python benchmarks/soap_quality.py --time --variants adamw,adamw8,soap,soap8,soap4,heavyball

``--json FILE`` writes what was measured (bytes, times or losses) for ``benchmarks/report.py``.
"""
from __future__ import annotations

import argparse
import json
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
TORCH_OPTIMIZERS = ("muon4", "heavyball")
"""Variants run as torch.optim optimizers (the others through the functional core)."""
NAMES = {"adamw": "AdamW (fp32)", "adamw8": "AdamW8bit", "muon4": "Muon4bit", "soap": "SOAP (fp32)",
         "soap8": "SOAP8bit", "soap4": "SOAP4bit", "heavyball": "HeavyBall SOAP 3.2.1"}


def heavyball_soap(params, lr: float, weight_decay: float, frequency: int, compiled: bool = False):
    """HeavyBall's SOAP at this script's SOAP settings (``compiled``: its default torch.compile of
    the step, else eager)."""
    import heavyball
    import heavyball.utils

    if not compiled:
        heavyball.utils.compile_mode = None
        heavyball.utils.compile_mode_recommended_to_none = None
    return heavyball.SOAP(params, lr=lr, betas=(0.95, 0.95), shampoo_beta=0.95, eps=1e-8, weight_decay=weight_decay,
                          precondition_frequency=frequency, max_precond_dim=10000, merge_dims=False,
                          precondition_1d=False, use_precond_schedule=False, warmup_steps=0)


def torch_optimizer(variant: str, model: torch.nn.Module, lr: float, weight_decay: float, frequency: int):
    if variant == "muon4":
        import bridge

        groups = bridge.muon_param_groups(model, exclude=("tok", "pos", "head"), betas=(0.9, 0.999))
        return bridge.Muon4bit(groups, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    return heavyball_soap(model.parameters(), lr, weight_decay, frequency)


def make(variant: str, lr: float, weight_decay: float, frequency: int) -> lt.GradientTransformation:
    if variant in ("adamw", "adamw8"):
        return lt.adamw(lr, 0.9, 0.999, 1e-8, weight_decay, state_format="fp32" if variant == "adamw" else "8bit")
    return lt.soap(lr, 0.95, 0.95, weight_decay=weight_decay, precondition_frequency=frequency,
                   **VARIANTS[variant])


def tensor_bytes(tree) -> int:
    """Bytes of every tensor with more than one element in a nest of dicts, lists and tuples (a
    torch.optim state; its 0-d step counters left out: a few bytes a tensor, which
    :func:`lowbit_tree.state_report`'s total counts for ours)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size() if tree.numel() > 1 else 0
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def state_bytes(variant: str, state) -> int:
    """Optimizer state bytes: a functional state's report total, a torch.optim optimizer's states."""
    if variant == "muon4":
        return state.state_bytes()
    if variant == "heavyball":
        return tensor_bytes(list(state.state.values()))
    return lt.state_report(state)[-1].nbytes


def bytes_per_param(variant: str, shape: tuple) -> float:
    """State bytes a param of one ``shape`` matrix: built on the meta device (nothing allocated),
    except HeavyBall's (one eager step on real tensors: its states are made by its step)."""
    if variant == "heavyball":
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        opt = heavyball_soap([p], 1e-3, 0.0, 10)
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
        return state_bytes(variant, opt) / p.numel()
    p = torch.empty(shape, device="meta")
    if variant == "muon4":  # Muon4bit's momentum: rank-16 factors and an nf4 residual
        tx = lt.muon(1e-3, state_format="nf4", momentum_rank=16)
    else:
        tx = make(variant, 1e-3, 0.0, 10)
    return lt.state_report(tx.init([p]))[-1].nbytes / p.numel()


def step_times(shape: tuple, steps: int, rounds: int, names: list[str]) -> dict:
    """``{variant: (median seconds a step, seconds of its first steps)}`` on one matrix: ``rounds``
    interleaved rounds of ``steps`` steps each (preconditioner refreshes amortized: frequency 10,
    so ``steps`` a multiple of 10), after the first ``steps`` steps (the building step, and
    HeavyBall's compilation, timed apart). HeavyBall runs as its users get it: compiled."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(steps)]
    steppers, first = {}, {}
    for v in names:
        t0 = time.perf_counter()
        if v == "heavyball":
            hp = torch.nn.Parameter(p0.clone())
            opt = heavyball_soap([hp], 1e-3, 0.01, 10, compiled=True)

            def step(g, hp=hp, opt=opt):
                hp.grad = g
                opt.step()
        else:
            tx, p = make(v, 1e-3, 0.01, 10), [p0.clone()]
            box = [tx.init(p)]

            def step(g, tx=tx, p=p, box=box):
                _, box[0] = tx.update([g], box[0], p)
        for g in grads:
            step(g)
        first[v] = time.perf_counter() - t0
        steppers[v] = step
    times = {v: [] for v in names}
    for _ in range(rounds):
        for v in names:
            t0 = time.perf_counter()
            for g in grads:
                steppers[v](g)
            times[v].append((time.perf_counter() - t0) / steps)
    return {v: (statistics.median(t), first[v]) for v, t in times.items()}


def run(variant: str, seed: int, args, data) -> tuple[float, float, list[float]]:
    """(final held-out loss, optimizer state bytes a param at the end, the training loss of each
    step) of one GPT run."""
    from bridge.tools.demo import Batches, CharGPT, eval_batches, evaluate, loss_fn

    train_data, held_out = data
    torch.manual_seed(seed)
    model = CharGPT(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq_len)
    params = list(model.parameters())
    lr = args.adamw_lr if variant in ("adamw", "adamw8") else args.lr
    batches = Batches(train_data, args.seq_len, args.batch, seed)
    curve = []
    if variant in TORCH_OPTIMIZERS:
        opt = torch_optimizer(variant, model, lr, args.weight_decay, args.frequency)
        for step in range(args.steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batches(step))
            loss.backward()
            curve.append(loss.item())
            opt.step()
        state = opt
    else:
        tx = make(variant, lr, args.weight_decay, args.frequency)
        state = tx.init([p.detach() for p in params])
        for step in range(args.steps):
            for p in params:
                p.grad = None
            loss = loss_fn(model, batches(step))
            loss.backward()
            curve.append(loss.item())
            upd, state = tx.update([p.grad for p in params], state, [p.detach() for p in params])
            with torch.no_grad():
                for p, u in zip(params, upd):
                    p.add_(u)
    windows = eval_batches(held_out, args.seq_len, args.eval_windows)
    n = sum(p.numel() for p in params)
    return evaluate(model, windows, args.batch), state_bytes(variant, state) / n, curve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", action="store_true", help="state bytes a param of a 2048 x 2048 and a 2048 x 512 matrix")
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
    ap.add_argument("--size", type=int, default=1024, help="--time's matrix side")
    ap.add_argument("--json", default="", help="also write the measurements to this file")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS and v not in ("adamw8", "muon4", "heavyball")]
    if unknown:
        ap.error(f"unknown variants {unknown}; the docstring lists them")
    out: dict = {"variants": variants}
    if args.bytes:
        shapes = [(2048, 2048), (2048, 512)]
        out["bytes"] = {v: {f"{a}x{b}": bytes_per_param(v, (a, b)) for a, b in shapes} for v in variants}
        print(f"{'optimizer':<10}" + "".join(f"{f'{a}x{b}':>12}" for a, b in shapes))
        for v in variants:
            print(f"{v:<10}" + "".join(f"{b:>12.3f}" for b in out["bytes"][v].values()))
    elif args.time:
        t = step_times((args.size, args.size), 20, 3, variants)
        out["time"] = {v: dict(step_s=s, first_s=f) for v, (s, f) in t.items()}
        out["threads"] = torch.get_num_threads()
        out["size"] = args.size
        ref = variants[0]
        print(f"{'optimizer':<10} {'ms/step':>9} {'vs ' + ref:>11} {'first 20 s':>11}  ({args.size} x {args.size}, "
              f"{torch.get_num_threads()} threads)")
        for v, (s, f) in t.items():
            print(f"{v:<10} {1e3 * s:>9.2f} {s / t[ref][0]:>11.1f} {f:>11.1f}")
    else:
        from bridge.tools.demo import load_corpus

        torch.set_num_threads(1)
        train_data, held_out, _ = load_corpus()
        seeds = [int(s) for s in args.seeds.split(",")]
        losses: dict = {v: [] for v in variants}
        curves: dict = {v: [] for v in variants}
        nbytes: dict = {}
        for seed in seeds:
            for v in variants:
                t0 = time.perf_counter()
                loss, nbytes[v], curve = run(v, seed, args, (train_data, held_out))
                losses[v].append(loss)
                curves[v].append(curve)
                print(f"seed {seed} {v:<11} held-out {loss:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        from bridge.tools.demo import CharGPT

        gpt = CharGPT(d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq_len)
        out.update(seeds=seeds, losses=losses, bytes_gpt=nbytes, curves=curves,
                   params=sum(p.numel() for p in gpt.parameters()), config=dict(
            steps=args.steps, lr=args.lr, adamw_lr=args.adamw_lr, weight_decay=args.weight_decay,
            frequency=args.frequency, d_model=args.d_model, layers=args.layers, seq_len=args.seq_len,
            batch=args.batch))
        ref = losses.get("soap")
        print(f"\n{'variant':<11} {'held-out':>9} {'vs soap %':>10} {'s.e.':>6} {'B/param':>8}")
        for v in variants:
            rel = relative(losses[v], ref) if ref else []
            mean, se = mean_se(rel) if rel else (float("nan"), float("nan"))
            print(f"{v:<11} {statistics.fmean(losses[v]):>9.4f} {mean:>+10.2f} {se:>6.2f} {nbytes[v]:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def relative(losses: list, ref: list) -> list:
    """Per seed, percent over the reference run of the same seed."""
    return [100 * (a / b - 1) for a, b in zip(losses, ref)]


def mean_se(xs: list) -> tuple[float, float]:
    """Mean and standard error of the mean (nan with one value)."""
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return statistics.fmean(xs), se


if __name__ == "__main__":
    raise SystemExit(main())
