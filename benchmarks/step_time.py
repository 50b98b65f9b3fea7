"""Optimizer step time: lowbit_tree's fused low-bit AdamW against torch, torchao and
bitsandbytes, all in one process on the same parameters and gradients.

Cases: (a) 2 x 2048x2048; (b) a GPT-like set of ~76 mixed tensors (~10M params:
embeddings, qkv, mlp, layer norms, biases); (c) many small tensors; (m) 2 x 512x512 (the Muon
rows with their whole Newton-Schulz on a CPU without bfloat16 matrix units, where case (a)'s
takes minutes a step); (g) 4 x 4096x4096 (67M params: a GPU's step long enough, about half a
millisecond at 16 bytes a param on an H100, for its share of the memory bandwidth to mean
something); (t) 2 x 16x64 (one shape, two of the Triton kernel's programs: the CPU rehearsal of
benchmarks/gpu_check.py, whose interpreter takes about 0.1 s a program).

Implementations (each skipped with a note when unavailable); params float32 unless
the name ends in -bf16 / -bf16sr / -bf16c (bfloat16 params; -bf16sr with stochastic rounding,
-bf16c with param_correction=True: an int8 correction per param, lowbit_tree.correction):
  torch-fused, torch-foreach        torch.optim.AdamW (fp32 states)
  torch-fused-bf16                  torch.optim.AdamW(fused=True) on bfloat16 params
  deepspeed-cpu-adam, ...-bf16      DeepSpeedCPUAdam (fp32 states; ZeRO-Offload's host step) on float32 /
                                    bfloat16 params (the bench extra; its C++ op is built or loaded
                                    before the first step: benchmarks/deepspeed_anchor.py)
  bridge-fp32/8bit/4bit/fp8         bridge.AdamW / AdamW8bit / AdamW4bit / AdamWFp8
  bridge-8bit-bf16, ...-bf16sr      the same classes on bfloat16 params
  bridge-8bit-bf16c, ...            the same with param_correction=True
  bridge-8bit-amsgrad, ...          AdamW*(amsgrad=True)
  bridge-lion-8bit, ...             bridge.Lion8bit / Lion4bit / Lion(state_format="fp8")
  bridge-sgd-8bit, ...              bridge.SGD8bit / SGD(state_format=...), momentum 0.9
  functional-8bit, ...              lowbit_tree.adamw as the functional guide's first example steps it:
                                    lt.UpdateStep(tx)(grads, state, params, donate=True), eager
  functional-8bit-pure              the same, pure: tx.update + apply_updates (new tensors every step)
  functional-lion-8bit, -sgd-8bit   lowbit_tree.lion / lowbit_tree.sgd(momentum=0.9)
  functional-4bit-block             lowbit_tree.adamw(state_format="4bit", rank1_normalization=False)
  bridge-4bit-block                 bridge.AdamW4bit(rank1_normalization=False)
                                    (every other 4-bit Adam row: 4-bit's default, rank-1 second moments)
  torchao-8bit/4bit/fp8             torchao.optim.AdamW8bit / AdamW4bit / AdamWFp8
  bnb-8bit                          bitsandbytes.optim.AdamW8bit
  flashoptim-bf16c                  flashoptim.FlashAdamW (bfloat16 params, 8-bit moments, 24-bit
                                    master weights; CUDA only: pip install flashoptim)
  bridge-ademamix-8bit, ...         bridge.AdEMAMix8bit / AdEMAMix4bit (8-bit slow EMA) / AdEMAMix (fp32)
  functional-ademamix-8bit          lowbit_tree.ademamix
  bnb-ademamix-8bit, -32bit         bitsandbytes.optim.AdEMAMix8bit / AdEMAMix32bit
  torch-muon                        torch.optim.Muon (fp32 momentum; 2-D params: case a only;
                                    the Muon rows run only when named with --impl)
  bridge-muon-fp32, -8bit, -4bit    bridge.Muon / Muon8bit / Muon4bit (each also as a ratio to
                                    bridge-muon-fp32 and torch-muon)
  functional-muon-8bit              lowbit_tree.muon

Reported: median ms/step, ratio to torch-fused, first-step time (includes any
compilation), optimizer state bytes per parameter, and peak extra memory during a
step. Peak memory method: CUDA: ``torch.cuda.max_memory_allocated`` minus the
allocation before the step; CPU: the process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``) minus RSS before the step (counts freshly touched
pages, so it can under-count memory the allocator reuses; "n/a" where
unsupported).

Usage: python benchmarks/step_time.py [--case a|b|c|all] [--steps N] [--device cpu|cuda]
       [--impl NAME ...] [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# The tree this script sits in, before any installed copy of the package (run as a script, its own
# folder is first on the path, not the repository's), and its sibling modules, however it was loaded.
sys.path[:0] = [os.path.dirname(HERE), HERE]

import deepspeed_anchor  # noqa: E402

import lowbit_tree as lt  # noqa: E402
from lowbit_tree import kernels  # noqa: E402

LOW = ("8bit", "4bit", "fp8")
IMPLS = (
    ["torch-fused", "torch-foreach", "torch-fused-bf16", "deepspeed-cpu-adam", "deepspeed-cpu-adam-bf16", "bridge-fp32", "bridge-8bit", "bridge-4bit", "bridge-fp8"]
    + [f"bridge-{f}-bf16" for f in LOW] + [f"bridge-{f}-bf16sr" for f in LOW]
    + [f"bridge-{f}-bf16c" for f in LOW] + [f"bridge-{f}-amsgrad" for f in LOW]
    + [f"bridge-lion-{f}" for f in LOW] + [f"bridge-sgd-{f}" for f in LOW]
    + ["functional-fp32"] + [f"functional-{f}" for f in LOW] + ["functional-8bit-pure"]
    + ["functional-lion-8bit", "functional-sgd-8bit", "functional-4bit-block", "bridge-4bit-block"]
    + ["torchao-8bit", "torchao-4bit", "torchao-fp8", "bnb-8bit"]
    + [f"bridge-ademamix-{f}" for f in ("8bit", "4bit", "fp32")] + ["functional-ademamix-8bit"]
    + ["bnb-ademamix-8bit", "bnb-ademamix-32bit"]
    + ["torch-muon", "bridge-muon-fp32", "bridge-muon-8bit", "bridge-muon-4bit", "functional-muon-8bit"]
)
MUON_HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, ns_steps=5)
DEFAULT_IMPLS = [i for i in IMPLS if "muon" not in i]
"""Without ``--impl``: every row but Muon's, whose Newton-Schulz (bfloat16 matmuls, as torch's)
takes minutes per 2048x2048 matrix on a CPU without bfloat16 matrix units; name them to run them."""
QUICK_IMPLS = ["torch-fused", "bridge-8bit", "bridge-8bit-bf16", "bridge-lion-8bit", "functional-8bit", "torchao-8bit",
               "bnb-8bit"]
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


# ----------------------------------------------------------------------------- cases


def case_shapes(case: str) -> list[tuple[int, ...]]:
    if case == "a":
        return [(2048, 2048), (2048, 2048)]
    if case == "b":  # GPT-like: vocab 8192, d 320, 6 layers, context 512
        d, layers, vocab, ctx = 320, 6, 8192, 512
        shapes = [(vocab, d), (ctx, d)]
        for _ in range(layers):
            shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
        return shapes + [(d,), (d,)]
    if case == "m":  # Muon-sized for a CPU without bf16 matrix units (case a's Newton-Schulz takes minutes there)
        return [(512, 512), (512, 512)]
    if case == "g":  # GPU-sized: a step moves about a gigabyte
        return [(4096, 4096)] * 4
    if case == "t":  # tiny, one shape (an anchor that compiles per shape compiles once)
        return [(16, 64), (16, 64)]
    if case == "c":  # many small tensors
        shapes = []
        for i in range(100):
            shapes += [(64, 64), (128,), (16, 16, 3, 3), (7, 33), (1,)]
        return shapes
    raise ValueError(case)


def make_params(shapes, device, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-2).to(device=device, dtype=dtype) for s in shapes]
    return params, grads


# ----------------------------------------------------------------------------- drivers


class FunctionalOptimizer:
    """The functional API as the functional guide's first example runs it (docs/guide/functional.md):
    ``params, state = step(grads, state, params, donate=True)`` with ``step = lt.UpdateStep(tx)``,
    eagerly; with ``pure``, ``updates, state = tx.update(grads, state, params)`` then ``params =
    apply_updates(params, updates)`` (new tensors every step, nothing given up)."""

    def __init__(self, params, tx, pure=False):
        self.values = [p.detach() for p in params]
        self.grads = [p.grad for p in params]
        self.tx, self.pure = tx, pure
        self.update_step = lt.UpdateStep(tx)
        self.state = tx.init(self.values)

    @torch.no_grad()
    def step(self):
        if self.pure:
            updates, self.state = self.tx.update(self.grads, self.state, self.values)
            self.values = lt.apply_updates(self.values, updates)
        else:
            self.values, self.state = self.update_step(self.grads, self.state, self.values, donate=True)

    def state_bytes(self):
        return sum(r.nbytes for r in lt.state_report(self.state)[:-1] if r.format not in ("int32", "int64"))


def param_dtype(impl: str) -> torch.dtype:
    return torch.bfloat16 if impl.endswith(("-bf16", "-bf16sr", "-bf16c")) else torch.float32


def make_optimizer(impl, params):
    """-> (optimizer, note) or (None, reason)."""
    lr, betas, eps, wd = HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"]
    parts = impl.split("-")
    fam = parts[0]
    if "muon" in parts and any(p.ndim != 2 for p in params):
        return None, "Muon takes 2-D params only (case a)"
    if impl == "torch-muon":
        return torch.optim.Muon(params, **MUON_HP), ""
    if fam == "deepspeed":
        if params[0].device.type != "cpu":
            return None, "DeepSpeedCPUAdam steps host params only"
        reason = deepspeed_anchor.missing_reason()
        if reason:
            return None, reason
        return deepspeed_anchor.make_optimizer(params, lr, betas, eps, wd), ""
    if fam == "torch":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, **{parts[1]: True}), ""
    if fam == "functional":
        rule = parts[1] if parts[1] in ("lion", "sgd", "ademamix", "muon") else "adamw"
        fmt = parts[2] if rule != "adamw" else parts[1]
        if rule == "lion":
            tx = lt.lion(1e-4, weight_decay=wd, state_format=fmt)
        elif rule == "sgd":
            tx = lt.sgd(1e-2, momentum=0.9, state_format=fmt)
        elif rule == "ademamix":
            tx = lt.ademamix(lr, *betas, 0.9999, 5.0, eps, wd, state_format=fmt)
        elif rule == "muon":
            tx = lt.muon(MUON_HP["lr"], MUON_HP["momentum"], MUON_HP["weight_decay"], ns_steps=MUON_HP["ns_steps"],
                         state_format=fmt)
        else:
            tx = lt.adamw(lr, *betas, eps, wd, state_format=fmt, rank1_normalization=False if impl.endswith("block") else None)
        pure = parts[-1] == "pure"
        return (FunctionalOptimizer(params, tx, pure=pure),
                f"backend {kernels.backend_for(params[0].device)}{', tx.update + apply_updates' if pure else ''}")
    if fam == "bridge":
        try:
            import bridge
        except Exception as e:  # noqa: BLE001
            return None, f"bridge not importable ({type(e).__name__})"
        if parts[1] == "lion":
            return bridge.Lion(params, lr=1e-4, weight_decay=wd, state_format=parts[2]), ""
        if parts[1] == "sgd":
            return bridge.SGD(params, lr=1e-2, momentum=0.9, state_format=parts[2]), ""
        if parts[1] == "muon":  # the named classes (Muon4bit: "nf4")
            cls = {"8bit": bridge.Muon8bit, "4bit": bridge.Muon4bit}.get(parts[2])
            return (cls(params, **MUON_HP) if cls else bridge.Muon(params, state_format=parts[2], **MUON_HP)), ""
        if parts[1] == "ademamix":  # the named classes (AdEMAMix4bit: its slow EMA in 8-bit)
            cls = {"8bit": bridge.AdEMAMix8bit, "4bit": bridge.AdEMAMix4bit}.get(parts[2], bridge.AdEMAMix)
            kw = {"state_format": parts[2]} if cls is bridge.AdEMAMix else {}
            return cls(params, lr=lr, betas=(*betas, 0.9999), eps=eps, weight_decay=wd, **kw), ""
        fmt, extra = parts[1], parts[2:]
        kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=wd, state_format=fmt,
                  amsgrad="amsgrad" in extra, bf16_stochastic_round="bf16sr" in extra)
        if "bf16c" in extra:
            kw["param_correction"] = True
        if "block" in extra:
            kw["rank1_normalization"] = False
        return bridge.AdamW(params, **kw), ""
    if fam == "torchao":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import torchao.optim as ao
        except Exception as e:  # noqa: BLE001
            return None, f"torchao not installed ({type(e).__name__})"
        cls = {"8bit": ao.AdamW8bit, "4bit": ao.AdamW4bit, "fp8": ao.AdamWFp8}[parts[1]]
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=wd), ""
    if fam == "bnb":
        try:
            import bitsandbytes as bnb
        except Exception as e:  # noqa: BLE001
            return None, f"bitsandbytes not installed ({type(e).__name__})"
        if parts[1] == "ademamix":
            cls = bnb.optim.AdEMAMix8bit if parts[2] == "8bit" else bnb.optim.AdEMAMix32bit
            return cls(params, lr=lr, betas=(*betas, 0.9999), eps=eps, weight_decay=wd), ""
        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps, weight_decay=wd), ""
    if fam == "flashoptim":  # FlashOptim's AdamW (arXiv 2602.23349): 8-bit moments, a 24-bit master weight
        if params[0].device.type != "cuda":
            return None, "FlashOptim runs on CUDA only"
        try:
            from flashoptim import FlashAdamW
        except Exception as e:  # noqa: BLE001
            return None, f"flashoptim not installed ({type(e).__name__})"
        return FlashAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, master_weight_bits=24), ""
    raise ValueError(impl)


def lt_native() -> bool:
    from lowbit_tree.kernels import native

    return native.available()


# ----------------------------------------------------------------------------- measurements


def _tensor_bytes(t) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt) -> int:
    if hasattr(opt, "state_bytes"):
        return opt.state_bytes()
    total = 0
    for st in getattr(opt, "state", {}).values():
        for v in (st.values() if isinstance(st, dict) else [st]):
            if isinstance(v, torch.Tensor):
                if v.ndim == 0:
                    continue  # step counters
                total += _tensor_bytes(v)
            else:  # QState / QTensor-like records
                for name in ("codes", "scale"):
                    total += _tensor_bytes(getattr(v, name, None))
                if hasattr(v, "nbytes") and not hasattr(v, "codes"):
                    total += int(v.nbytes)
    return total


def _rss_kb(field: str) -> int | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def setup(impl, shapes, device):
    """Params, grads and the optimizer of one implementation, after its first
    (timed: compilation) and one warm step."""
    params, grads = make_params(shapes, device, dtype=param_dtype(impl))
    for p, g in zip(params, grads):
        p.grad = g
    opt, note = make_optimizer(impl, params)
    if opt is None:
        return {"impl": impl, "skipped": note}
    sync(device)
    t0 = time.perf_counter()
    opt.step()
    sync(device)
    first = time.perf_counter() - t0
    if first < 1.0:
        opt.step()  # warm (slow implementations skip it: --quick stays short)
    return {"impl": impl, "note": note, "opt": opt, "params": params, "first_step_s": first, "times": []}


def timed_step(st, device, last: bool):
    """One timed step; on the last one also the peak extra memory."""
    before = None
    if last:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = _rss_kb("VmRSS") if _reset_peak_rss() else None
    sync(device)
    t0 = time.perf_counter()
    st["opt"].step()
    sync(device)
    st["times"].append(time.perf_counter() - t0)
    if last:
        st["peak"] = None
        if device.type == "cuda":
            st["peak"] = torch.cuda.max_memory_allocated() - before
        elif before is not None:
            hwm = _rss_kb("VmHWM")
            st["peak"] = None if hwm is None else max(0, hwm - before) * 1024


def result(st, shapes):
    if "skipped" in st:
        return st
    n = sum(math.prod(s) for s in shapes)
    return {
        "impl": st["impl"],
        "note": st["note"],
        "median_ms": statistics.median(st["times"]) * 1e3,
        "first_step_s": st["first_step_s"],
        "state_bytes_per_param": state_bytes(st["opt"]) / n,
        "peak_extra_bytes": st.get("peak"),
        "largest_param_bytes": max(math.prod(s) for s in shapes) * 4,
        "param_element_bytes": torch.empty((), dtype=param_dtype(st["impl"])).element_size(),
    }


def run_case(case, device, impls, steps, out):
    """Timed steps are interleaved: round r steps every implementation once, so a
    slow period of a shared machine hits all of them alike and the ratios hold."""
    shapes = case_shapes(case)
    n = sum(math.prod(s) for s in shapes)
    print(f"\ncase ({case}): {len(shapes)} tensors, {n / 1e6:.2f}M params, device {device}, "
          f"{torch.get_num_threads()} threads, {steps} timed steps (interleaved)")
    states = []
    interrupted = False
    try:
        for impl in impls:
            try:
                states.append(setup(impl, shapes, device))
            except Exception as e:  # noqa: BLE001 - one failing impl must not stop the table
                states.append({"impl": impl, "skipped": f"error: {type(e).__name__}: {str(e)[:120]}"})
        for i in range(steps):
            for st in states:
                if "skipped" in st:
                    continue
                try:
                    timed_step(st, device, last=i == steps - 1)
                except Exception as e:  # noqa: BLE001
                    states[states.index(st)] = {"impl": st["impl"],
                                                "skipped": f"error: {type(e).__name__}: {str(e)[:120]}"}
    except KeyboardInterrupt:  # SIGINT (gpu_check.py past a step's budget): the table of what was timed
        interrupted = True
        print("\ninterrupted: each row below is the median of the steps timed before it", flush=True)
        done = {st["impl"] for st in states}
        states = [st if "skipped" in st or st.get("times") else {"impl": st["impl"], "skipped": "interrupted"}
                  for st in states] + [{"impl": i, "skipped": "interrupted"} for i in impls if i not in done]
    rows = []
    for st in states:
        rows.append(result(st, shapes))
        print_row(rows[-1], rows)
    del states
    gc.collect()
    out.append({"case": case, "device": str(device), "params": n, "tensors": len(shapes), "results": rows,
                "interrupted": interrupted})


def print_row(r, rows):
    ref = next((x for x in rows if x["impl"] == "torch-fused" and "median_ms" in x), None)
    if len(rows) == 1:
        print(f"  {'impl':<25}{'ms/step':>10}{'x fused':>9}{'first s':>9}{'B/param':>9}{'peak MB':>9}  note")
    if "skipped" in r:
        print(f"  {r['impl']:<25}{'-':>10}{'':>9}{'':>9}{'':>9}{'':>9}  skipped: {r['skipped']}")
        return
    ratio = r["median_ms"] / ref["median_ms"] if ref else float("nan")
    r["ratio_to_fused"] = ratio
    if "muon" in r["impl"]:  # Muon's own references: its fp32-state step, ours and torch's
        for name in ("bridge-muon-fp32", "torch-muon"):
            base = next((x for x in rows if x["impl"] == name and "median_ms" in x), None)
            if base is not None and base is not r:
                key = "ratio_to_" + name.replace("-", "_")
                r[key] = r["median_ms"] / base["median_ms"]
                r["note"] = (r["note"] + f" {r[key]:.2f}x {name}").strip()
    peak = "n/a" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.1f}"
    print(f"  {r['impl']:<25}{r['median_ms']:>10.2f}{ratio:>9.2f}{r['first_step_s']:>9.2f}"
          f"{r['state_bytes_per_param']:>9.3f}{peak:>9}  {r['note']}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default=None, choices=["a", "b", "c", "m", "g", "t", "all"],
                    help="default: a with --quick, else all (a, b, c); m: 2 x 512x512, for the Muon rows on a CPU; "
                         "g: 4 x 4096x4096, for a GPU; t: 2 x 16x64, a rehearsal's")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 3 with --quick)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--impl", nargs="*", default=None, help=f"subset of {IMPLS}")
    ap.add_argument("--quick", action="store_true", help=f"case a, 3 steps, impls {QUICK_IMPLS} (< 60 s on 2 cores)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--muon-ns-steps", type=int, default=5,
                    help="Newton-Schulz iterations of the Muon rows (torch's default 5; 0 times everything "
                         "but the matrix products, which are the same bfloat16 ops in every Muon row)")
    args = ap.parse_args(argv)
    MUON_HP["ns_steps"] = args.muon_ns_steps
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; nothing to do")
        return 0
    cases = [args.case or ("a" if args.quick else "all")]
    if cases == ["all"]:
        cases = ["a", "b", "c"]
    steps = args.steps or (3 if args.quick else 10)
    impls = args.impl or (QUICK_IMPLS if args.quick else DEFAULT_IMPLS)
    if "torch-fused" not in impls:
        impls = ["torch-fused"] + impls  # the reference of every ratio
    print(f"torch {torch.__version__}, lowbit_tree {lt.__version__} from {os.path.dirname(lt.__file__)}, "
          f"native CPU kernels: {lt_native()}, LOWBIT_TREE_BACKEND={os.environ.get('LOWBIT_TREE_BACKEND', '')!r}")
    out = []
    for case in cases:
        run_case(case, device, impls, steps, out)
        if out[-1]["interrupted"]:
            break
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "lowbit_tree": lt.__file__, "threads": torch.get_num_threads(),
                       "backend_env": os.environ.get("LOWBIT_TREE_BACKEND", ""), "cases": out}, f, indent=2)
        print(f"\nwrote {args.json}")
    return 130 if out and out[-1]["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
