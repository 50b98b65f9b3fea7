"""Writes docs/results.md: every figure the README and the docs quote, each table with the
command that measured it, the machine, the versions and the date.

It runs the batteries by calling the benchmark scripts themselves (``step_time.py``,
``memory_floor.py``, ``offload_bytes.py``, ``convergence.py``, ``digits_mlp.py``,
``second_moment_formats.py``, ``training_state_bytes.py``, ``step_in_backward.py``, the demo and
``lowbit-tree roundtrip``) in this one process, and ``soap_quality.py`` and ``triton_compile.py`` in
subprocesses, and builds the page's summary ("choose a format")
from their results. Its pictures (``charts.py``) are PNGs beside the page, named after it
(``docs/results-*.png``). Step times are medians of three runs
of ``step_time.py``, whose timed steps interleave every implementation; each ratio is printed
beside torch's fused AdamW's own ms/step in the same runs, since on a shared machine the ratio
moves with the machine's state.

    python benchmarks/report.py                         # full batteries, docs/results.md (~30 min, 2 cores;
                                                        # needs the parity and bench extras)
    python benchmarks/report.py --quick --out /tmp/r.md # CI smoke: the same code at tiny sizes (~1-2 min)
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # the benchmark scripts, imported as modules
sys.path.insert(0, ROOT)  # lowbit_tree and bridge of this checkout

import charts  # noqa: E402
import convergence  # noqa: E402
import deepspeed_anchor  # noqa: E402
import digits_mlp  # noqa: E402
import memory_floor  # noqa: E402
import offload_bytes  # noqa: E402
import requantize_drift  # noqa: E402
import second_moment_formats  # noqa: E402
import step_in_backward  # noqa: E402
import step_overhead  # noqa: E402
import soap_quality  # noqa: E402
import step_time  # noqa: E402
import training_state_bytes  # noqa: E402

RUNS = 3  # full step-time batteries: medians of this many runs of step_time.py

# (table heading, step_time.py arguments) of the full step-time batteries
# every row of step_time.py but the slowest comparators (torchao's 4-bit and FP8, bitsandbytes'
# AdEMAMix): each costs seconds a run on this machine and answers no question of choosing a format
CASE_A_IMPLS = [i for i in step_time.DEFAULT_IMPLS
                if i not in ("torchao-4bit", "torchao-fp8", "bnb-ademamix-8bit", "bnb-ademamix-32bit")]
STEP_BATTERIES = [
    ("Case (a): 2 x 2048x2048 float32 params, every rule, format and param dtype",
     ["--case", "a", "--steps", "10", "--impl", *CASE_A_IMPLS]),
    ("Case (b): a GPT-like set of 76 tensors (10.2M params)",
     ["--case", "b", "--steps", "10", "--impl", "torch-fused", "torch-foreach", "bridge-fp32", "bridge-8bit",
      "bridge-4bit", "bridge-fp8", "functional-8bit", "functional-8bit-pure", "bnb-8bit"]),
    ("Case (c): 500 small tensors",
     ["--case", "c", "--steps", "10", "--impl", "torch-fused", "torch-foreach", "bridge-fp32", "bridge-8bit",
      "functional-8bit", "functional-8bit-pure"]),
    ("Muon without its matrix products: case (a), `--muon-ns-steps 0`",
     ["--case", "a", "--steps", "5", "--muon-ns-steps", "0", "--impl", "torch-fused", "torch-muon", "bridge-muon-fp32",
      "bridge-muon-8bit", "bridge-muon-4bit", "functional-muon-8bit"]),
]
MUON_WHOLE = ("Muon, whole steps (Newton-Schulz included): case (m), 2 x 512x512",
              ["--case", "m", "--steps", "2", "--impl", "torch-fused", "torch-muon", "bridge-muon-fp32",
               "bridge-muon-8bit", "bridge-muon-4bit"])
QUICK_STEP = ("Case (a), quick", ["--quick"])
# host overhead per param (step_overhead.py): the native backend's table, and the compiled backend's
# (CUDA's default) at one size, its first step compiling from scratch
OVERHEAD_FULL = [["--variants", "native-8bit", "native-fp32", "--shapes", "small", "tiny", "--runs", "3", "--steps", "20"],
                 ["--variants", "compiled-8bit", "compiled-fp32", "--shapes", "tiny", "--sizes", "200", "--runs", "3",
                  "--steps", "10"]]
OVERHEAD_QUICK = [["--variants", "native-8bit", "native-fp32", "--shapes", "tiny", "--sizes", "50", "--runs", "1",
                   "--steps", "5"]]

CONV_VARIANTS = ["fp32", "8bit", "4bit", "fp8", "ademamix-fp32", "ademamix-8bit", "ademamix-4bit", "ademamix-4bit-slow8",
                 "muon-fp32", "muon-8bit", "muon-4bit", "muon-4bit-rank0", "4bit-bf16c"]
CONV_FULL = ["--steps", "400", "--seeds", "0,1,2", "--d-model", "64", "--layers", "2", "--eval-windows", "128",
             "--threads", "1", "--variants", ",".join(CONV_VARIANTS)]
CONV_QUICK = ["--steps", "20", "--seeds", "0", "--d-model", "32", "--layers", "1", "--seq-len", "32", "--batch", "8",
              "--eval-windows", "16", "--evals", "2", "--threads", "1",
              "--variants", "fp32,8bit,4bit,fp8,muon-fp32,muon-8bit,muon-4bit,4bit-bf16c"]
# bfloat16 params with 8-bit AdamW: 12 seeds, since the seed-to-seed spread of a difference (~0.4%)
# puts the standard error of a 3-seed mean (~0.25%) above the 0.2% asked of the correction
BF16_CONV_VARIANTS = ["8bit", "8bit-bf16", "8bit-bf16sr", "8bit-bf16c", "8bit-bf16m", "8bit-amp"]
BF16_CONV_FULL = ["--steps", "400", "--seeds", ",".join(str(s) for s in range(12)), "--d-model", "64", "--layers", "2",
                  "--eval-windows", "128", "--threads", "1", "--variants", ",".join(BF16_CONV_VARIANTS)]
BF16_CONV_QUICK = ["--steps", "20", "--seeds", "0,1", "--d-model", "32", "--layers", "1", "--seq-len", "32", "--batch", "8",
                   "--eval-windows", "16", "--evals", "2", "--threads", "1", "--variants", ",".join(BF16_CONV_VARIANTS)]
DIGITS_VARIANTS = ["fp32", "8bit", "4bit-rank1", "4bit-block", "fp8", "8bit-bf16", "8bit-bf16sr", "8bit-bf16c",
                   "4bit-bf16c"]
DIGITS_FULL = ["--seeds", "0,1,2,3,4,5,6,7,8,9", "--variants", ",".join(DIGITS_VARIANTS)]
DIGITS_QUICK = ["--steps", "30", "--seeds", "0", "--variants", "fp32,8bit,4bit-rank1,4bit-block,fp8,8bit-bf16c"]
TRAINING_STATE_FULL = ["--wider", "256,512"]
TRAINING_STATE_QUICK = ["--quick", "--wider", "48"]
IN_BACKWARD_FULL: list[str] = []
IN_BACKWARD_QUICK = ["--quick"]
DEMO_FULL = ["demo", "--no-progress"]
DEMO_QUICK = ["demo", "--tiny", "--no-progress"]
SECOND_MOMENT_QUICK = ["--steps", "20"]
FLOOR_FULL: list[str] = []  # case (a), every row of memory_floor.py, 10 rounds x 3 runs
FLOOR_QUICK = ["--quick"]
OFFLOAD_BYTES_FULL: list[str] = []  # d_model 512, 4 layers
OFFLOAD_BYTES_QUICK = ["--d-model", "128", "--ffn", "384", "--heads", "2", "--layers", "2"]
# SOAP (soap_quality.py): bytes, 12 paired seeds of the GPT (run as two processes of half the seeds
# each, one thread each), step time against HeavyBall's SOAP (compiled, as its users get it: minutes
# of compilation, so not in --quick)
SOAP_VARIANTS = ["adamw", "adamw8", "muon4", "soap", "soap8", "soap4", "heavyball"]
SOAP_BYTES_FULL = ["--bytes", "--variants", ",".join(SOAP_VARIANTS)]
SOAP_BYTES_QUICK = ["--bytes", "--variants", "adamw,adamw8,muon4,soap,soap8,soap4"]
SOAP_QUALITY_FULL = ["--steps", "200", "--seeds", ",".join(str(s) for s in range(12)), "--variants",
                     ",".join(SOAP_VARIANTS)]
SOAP_QUALITY_QUICK = ["--steps", "10", "--seeds", "0,1", "--d-model", "32", "--layers", "1", "--seq-len", "32",
                      "--batch", "8", "--eval-windows", "16", "--variants", "adamw,soap,soap8,soap4"]
SOAP_TIME_FULL = ["--time", "--variants", "adamw,adamw8,soap,soap8,soap4,heavyball"]
SOAP_TIME_QUICK = ["--time", "--size", "128", "--variants", "adamw,soap,soap4"]
SOAP_TARGETS = {"soap8": 0.5, "soap4": 1.0}  # % over fp32 SOAP's held-out loss (issue's acceptance)
# the Triton kernel's compile step (triton_compile.py): every variant, sm_80 and sm_90; --quick the first few
TRITON_FULL = ["--arch", "80,90", "--jobs", "2"]
TRITON_QUICK = ["--arch", "80,90", "--jobs", "2", "--limit", "3"]


# ----------------------------------------------------------------------------- plumbing


def log(msg: str) -> None:
    print(f"[report {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def isolated(threads: int):
    """Runs a battery with ``threads`` torch threads, its stdout captured, and torch's thread
    count and the warning filters restored after (the scripts set both)."""
    before = torch.get_num_threads()
    buf = io.StringIO()
    with warnings_restored(), contextlib.redirect_stdout(buf):
        torch.set_num_threads(threads)
        try:
            yield buf
        finally:
            torch.set_num_threads(before)


@contextlib.contextmanager
def warnings_restored():
    import warnings

    with warnings.catch_warnings():
        yield


def cmd(script: str, args: list[str]) -> str:
    return "`" + " ".join(["python", script, *args]) + "`"


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def pct(x) -> str:
    return "-" if x is None else f"{x:+.2f}%"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


ANCHORS = ("torchao", "bitsandbytes", "scikit-learn", "deepspeed", "heavyball")
"""What the full page compares with (the ``parity`` and ``bench`` extras): without one, its rows
and tables would be missing from the page, so the full run refuses to start."""


def missing_anchors() -> list[str]:
    """The :data:`ANCHORS` not installed."""
    return [d for d in ANCHORS if version(d) is None]


# ----------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def vector_isa(cpuinfo: str | None = None) -> str:
    """The widest vector instruction set the CPU reports, from the flags (x86) or Features (Arm)
    line of ``cpuinfo`` (default: /proc/cpuinfo's text): "AVX-512" (with "+BF16" when it has
    avx512_bf16), "AVX2", "AVX", "SSE only", "SVE", "NEON"; "unknown" when no such line is found."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return "unknown"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            break
    if not flags:
        return "unknown"
    if "avx512f" in flags:
        return "AVX-512" + ("+BF16" if "avx512_bf16" in flags else "")
    for flag, name in (("avx2", "AVX2"), ("avx", "AVX"), ("sse2", "SSE only"), ("sve", "SVE"), ("asimd", "NEON")):
        if flag in flags:
            return name
    return "unknown"


def memory_gib() -> str:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return "?"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        # the measured code: the library and the benchmarks (not the docs this page is part of)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "lowbit_tree", "bridge", "benchmarks"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + (" with uncommitted changes to lowbit_tree/, bridge/ or benchmarks/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def kernel_build_seconds() -> str:
    """The native kernel's first build, timed in a fresh process with an empty cache."""
    code = ("import time; from lowbit_tree.kernels import native; t = time.perf_counter(); ok = native.available(); "
            "print(ok, round(time.perf_counter() - t, 1), native.build_error() or '')")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "LOWBIT_TREE_CACHE": cache, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.split(maxsplit=2)
    if not out:
        return "could not be timed"
    if out[0] != "True":
        return f"not built: {' '.join(out[2:])}"
    return f"{out[1]} s (first use, empty cache; cached after)"


def environment(started: datetime.datetime, build: str, load: str, ds_build: str) -> list[list[str]]:
    gpu = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
           else "none: no GPU figures yet; the CUDA path is tested only where a GPU is present")
    optional = ", ".join(f"{d} {version(d)}" for d in ANCHORS if version(d))
    return [
        ["date", started.strftime("%Y-%m-%d %H:%M UTC")],
        ["machine", f"{platform.system()} {platform.machine()}, {cpu_model()} (vector ISA: {vector_isa()}),"
                    f" {os.cpu_count()} cores, {memory_gib()}"],
        ["torch threads", str(torch.get_num_threads())],
        ["load average (1 min) at start / end", load],
        ["GPU", gpu],
        ["Python", platform.python_version()],
        ["torch", torch.__version__],
        ["lowbit-tree", f"{version('lowbit-tree') or '?'}, commit {git_commit()}"],
        ["compared with", optional or f"nothing installed ({', '.join(ANCHORS)})"],
        ["native CPU kernel build", build],
        ["DeepSpeed cpu_adam op build", ds_build],
    ]


# ----------------------------------------------------------------------------- step time


def step_battery(args: list[str], runs: int, tmp: str) -> dict:
    """``runs`` runs of step_time.py; per implementation the median ms/step, the per-run ratios to
    torch's fused AdamW and that reference's ms/step in each run."""
    per_run = []
    for k in range(runs):
        path = os.path.join(tmp, f"step_{abs(hash(tuple(args)))}_{k}.json")
        with isolated(torch.get_num_threads()):
            step_time.main([*args, "--json", path])
        with open(path) as f:
            per_run.append(json.load(f)["cases"][0])
    rows = {}
    for case in per_run:
        fused = next(r["median_ms"] for r in case["results"] if r["impl"] == "torch-fused")
        for r in case["results"]:
            row = rows.setdefault(r["impl"], {"impl": r["impl"], "ms": [], "ratio": [], "fused_ms": [], "skipped": None,
                                              "extra": {}})
            if "skipped" in r:
                row["skipped"] = r["skipped"]
                continue
            row["ms"].append(r["median_ms"])
            row["ratio"].append(r["median_ms"] / fused)
            row["fused_ms"].append(fused)
            row["bytes"] = r["state_bytes_per_param"]
            row["first_s"] = r["first_step_s"]
            for key in ("ratio_to_bridge_muon_fp32", "ratio_to_torch_muon"):
                if key in r:
                    row["extra"].setdefault(key, []).append(r[key])
    return {"rows": rows, "params": per_run[0]["params"], "tensors": per_run[0]["tensors"]}


def correction_cost(b: dict) -> str:
    """Per format, the step time of bfloat16 params with the int8 correction over plain bfloat16
    params in each run (both times from the same run), or '' where the battery has neither."""
    parts = []
    for fmt in ("8bit", "4bit", "fp8"):
        c, plain = b["rows"].get(f"bridge-{fmt}-bf16c"), b["rows"].get(f"bridge-{fmt}-bf16")
        if not (c and plain and c["ms"] and plain["ms"]):
            continue
        per_run = [x / y for x, y in zip(c["ratio"], plain["ratio"])]
        parts.append(f"{fmt} {statistics.median(per_run):.2f}x (runs " + ", ".join(f"{x:.2f}" for x in per_run) + ")")
    if not parts:
        return ""
    return ("\n\nThe int8 correction's cost, bridge-*-bf16c over bridge-*-bf16 in the same run (median, and each run's"
            " ratio of their ratios to torch fused): " + "; ".join(parts) + ".")


def pure_form_ratio(b: dict) -> str:
    """The functional API's two forms against the bridge's step, where the battery has all three
    rows: the README's and the functional guide's first example is the pure form."""
    rows = b["rows"]
    if not all(k in rows and rows[k]["ratio"] for k in ("bridge-8bit", "functional-8bit", "functional-8bit-pure")):
        return ""

    def against_bridge(impl):  # per run, both against the same run's fused step
        return statistics.median(x / y for x, y in zip(rows[impl]["ratio"], rows["bridge-8bit"]["ratio"]))

    return (f"\n\nThe functional API against the bridge's step (`bridge-8bit`), per run, median: its pure form "
            f"(`tx.update` then `apply_updates`, `functional-8bit-pure`, the README's quickstart) "
            f"**{against_bridge('functional-8bit-pure'):.2f}x**; its donated form (`UpdateStep(tx)(..., "
            f"donate=True)`, `functional-8bit`) **{against_bridge('functional-8bit'):.2f}x**.")


def step_table(b: dict, muon: bool = False) -> str:
    head = ["implementation", "ms/step", "x torch fused AdamW", "runs (x fused)", "fused AdamW ms/step in those runs",
            "state B/param", "first step s"]
    if muon:
        head[3:3] = ["x ours fp32 Muon", "x torch.optim.Muon"]
    rows = []
    for r in b["rows"].values():
        if not r["ms"]:
            rows.append([r["impl"], "skipped: " + str(r["skipped"])] + [""] * (len(head) - 2))
            continue
        line = [r["impl"], f"{statistics.median(r['ms']):.1f}", f"**{statistics.median(r['ratio']):.2f}**",
                ", ".join(f"{x:.2f}" for x in r["ratio"]), ", ".join(f"{x:.1f}" for x in r["fused_ms"]),
                f"{r['bytes']:.3f}", f"{r['first_s']:.2f}"]
        if muon:
            line[3:3] = [f"{statistics.median(r['extra'][k]):.2f}" if k in r["extra"] else "-"
                         for k in ("ratio_to_bridge_muon_fp32", "ratio_to_torch_muon")]
        rows.append(line)
    return table(head, rows)


# ----------------------------------------------------------------------------- the other batteries


def run_demo(argv: list[str], tmp: str) -> dict:
    from bridge.tools.cli import main as cli

    out = os.path.join(tmp, "demo")
    with isolated(torch.get_num_threads()):
        rc = cli([*argv, "--out", out])
    if rc:
        raise RuntimeError(f"lowbit-tree {' '.join(argv)} exited {rc}")
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def demo_table(d: dict) -> str:
    base = next(r for r in d["runs"] if r["name"] == "fp32")
    rows = [[r["name"], f"{r['held_out_loss']:.4f}", pct(100 * (r["held_out_loss"] / base["held_out_loss"] - 1)),
             f"{r['state_bytes'] / 2**20:.3f}", f"{r['bytes_per_param']:.3f}", f"{r['ms_per_step']:.1f}",
             f"{r['opt_ms_per_step']:.1f}", r["state_formats"]] for r in d["runs"]]
    return table(["optimizer", "held-out loss", "vs fp32", "state MB", "state B/param", "ms/step (whole step)",
                  "optimizer ms/step", "state formats (share of params)"], rows)


def run_convergence(argv: list[str], tmp: str, name: str = "convergence") -> dict:
    out = os.path.join(tmp, name)
    with isolated(torch.get_num_threads()):
        convergence.main([*argv, "--out", out])
    with open(os.path.join(out, "convergence.json")) as f:
        return json.load(f)


def conv_table(c: dict) -> str:
    rows = []
    for r in c["summary"]:
        ref = convergence.reference_of(r["variant"])
        per_seed = ", ".join(
            pct(100 * (c["runs"][r["variant"]][str(s)]["held_out_loss"] / c["runs"][ref][str(s)]["held_out_loss"] - 1))
            for s in r["seeds"]) if ref in c["runs"] and r["variant"] != ref else "-"
        rows.append([r["variant"], "-" if r["variant"] == ref else ref, f"{r['held_out_mean']:.4f} +- {r['held_out_std']:.4f}",
                     "-" if r["variant"] == ref else pct(r["rel_mean"]), per_seed, f"{r['bytes_per_param']:.3f}",
                     r["state_formats"]])
    return table(["variant", "compared with", "held-out loss (mean +- sd)", "vs reference (mean)", "per seed",
                  "state B/param (this model)", "state formats"], rows)


def run_digits(argv: list[str]) -> dict | None:
    if version("scikit-learn") is None:
        return None
    with isolated(1):
        return digits_mlp.main(argv)


def digits_rel(losses: dict, variant: str) -> list[float]:
    return [100.0 * (a / b - 1.0) for a, b in zip(losses[variant], losses["fp32"])]


def digits_table(losses: dict) -> str:
    rows = []
    for v, ls in losses.items():
        rel = digits_rel(losses, v)
        rows.append([v, f"{statistics.mean(ls):.4f}", "-" if v == "fp32" else pct(statistics.mean(rel)),
                     "-" if v == "fp32" else f"[{min(rel):+.2f}%, {max(rel):+.2f}%]"])
    return table(["variant", "held-out loss (mean)", "vs fp32 (mean)", "[min, max] over seeds"], rows)


BF16_ROWS = {
    "8bit-bf16": "`AdamW8bit`, bfloat16 params rounded to nearest at each step",
    "8bit-bf16sr": "`AdamW8bit(bf16_stochastic_round=True)`",
    "8bit-bf16c": "`AdamW8bit(param_correction=True)`: an int8 correction per element",
    "8bit-bf16m": "`AdamW8bit` on float32 master params, a bfloat16 copy of the model for forward and backward",
    "8bit-amp": "`AdamW8bit`, float32 params, forward under `torch.autocast(bfloat16)`",
    "4bit-bf16c": "`AdamW4bit(param_correction=True)`",
}


def bf16_table(conv: dict, conv_bf16: dict, digits: dict | None) -> str:
    """Each bfloat16 variant against the same optimizer on float32 params (its reference), against
    float32 masters with the same bfloat16 compute (8bit-bf16m) and against fp32 AdamW, on the GPT
    (the 8-bit rows from ``conv_bf16``'s seeds, 4-bit from ``conv``'s) and on the MLP."""
    conv_rows = {r["variant"]: r for r in conv["summary"]}
    conv_rows.update({r["variant"]: r for r in conv_bf16["summary"]})
    rows = []
    for v, what in BF16_ROWS.items():
        c = conv_rows.get(v)
        gpt = ["not measured"] * 6
        if c is not None:
            o2 = "-" if c.get("vs_bf16m_mean") is None or v == "8bit-bf16m" else (
                f"{pct(c['vs_bf16m_mean'])} [{c['vs_bf16m_min']:+.2f}, {c['vs_bf16m_max']:+.2f}]")
            sem = c["rel_sd"] / len(c["seeds"]) ** 0.5 if c.get("rel_sd") is not None else None
            gpt = [str(len(c["seeds"])), f"{c['held_out_mean']:.4f}",
                   f"{pct(c['rel_mean'])}" + (f" (se {sem:.2f})" if sem is not None else "")
                   + f" [{c['rel_min']:+.2f}, {c['rel_max']:+.2f}] (vs {convergence.reference_of(v)})", o2,
                   pct(c["vs_fp32_mean"]) if c.get("vs_fp32_mean") is not None else "-",
                   "-" if c["tolerance"] is None else
                   f"+{c['tolerance']:g}% on the {c['tolerance_on']}: {'yes' if c['within'] else 'NO'}"]
        mlp = ["not measured"] * 2
        if digits and v in digits:
            twin = digits_mlp.relative(digits, v, digits_mlp.float32_twin(v))
            mlp = [f"{pct(statistics.mean(twin))} [{min(twin):+.2f}, {max(twin):+.2f}] "
                   f"(vs {digits_mlp.float32_twin(v)})", pct(statistics.mean(digits_rel(digits, v)))]
        rows.append([v, what, *gpt, *mlp])
    return table(["variant", "optimizer", "GPT seeds", "GPT held-out loss (mean)",
                  "GPT vs float32 params (mean (its standard error) [min, max], %)",
                  "GPT vs 8bit-bf16m (mean [min, max], %)", "GPT vs fp32 AdamW", "GPT target",
                  "MLP vs float32 params", "MLP vs fp32 AdamW"], rows)


def demo_setup_legend() -> str:
    from bridge.tools.demo import SETUP_LEGEND

    return "Setups: " + SETUP_LEGEND.replace("\n", " ") + "."


def captured(fn, argv) -> str:
    with isolated(torch.get_num_threads()) as buf:
        fn(argv)
    return buf.getvalue().rstrip()


# ----------------------------------------------------------------------------- offloaded training


def figure(out: str, name: str) -> str:
    """The path of the page's picture ``name``: a PNG beside the page, named after it."""
    stem = os.path.splitext(os.path.abspath(out))[0]
    return f"{stem}-{name}.png"


def deepspeed_build(quick: bool) -> str:
    """The environment table's line on DeepSpeed's cpu_adam op: its first build timed in a fresh
    process (the full page), or why not."""
    reason = deepspeed_anchor.missing_reason()
    if reason:
        return reason
    if quick:
        return "not timed from scratch (--quick)"
    log("timing DeepSpeed's cpu_adam op's first build (minutes)")
    return f"{deepspeed_anchor.fresh_build_seconds():.0f} s (first use, empty extensions folder; cached after)"


def offload_step_section(floor: dict, floor_args: list[str], picture: str) -> str:
    return (
        "## Offloaded training: the host step against DeepSpeed and the memory floor\n\n"
        f"{cmd('benchmarks/memory_floor.py', floor_args)}: the step an offloaded run takes on the host."
        " DeepSpeed's `DeepSpeedCPUAdam` (ZeRO-Offload's step: fp32 states, AdamW mode), torch's fused AdamW and"
        " our classes (step_time.py's rows: `bridge-8bit` is `AdamW8bit`, `-bf16c` bfloat16 params with"
        " `param_correction=True`, `lion`/`sgd` `Lion8bit`/`SGD8bit`), all on the same params and gradients,"
        " stepped in the same interleaved rounds as a memory-bandwidth probe (a STREAM triad over float32 arrays"
        " larger than the caches, by torch's threads). `bytes moved/param`: what the step must read and write"
        " (param and state read and written, gradient read; states with their codes, block scales and rank-1"
        " maxima; the int8 correction), counted once per read and once per write as STREAM counts; `GB/s` those"
        " bytes over the step's time; `share of probe` that over the probe's GB/s in the same run (1.0:"
        " memory-bound); `floor ns/param` the bytes at the probe's GB/s. Ratios to DeepSpeedCPUAdam are to its"
        " row on params of the same dtype, taken within each run; every figure the median of the runs. "
        + memory_floor.describe(floor) + "\n\n" + memory_floor.format_table(floor)
        + f"\n\n![ns/param per implementation, the floor of its format marked]({picture})")


def host_bytes_section(result: dict, ob_args: list[str]) -> str:
    c = result["config"]
    return (
        "## Offloaded training: host bytes per param\n\n"
        f"{cmd('benchmarks/offload_bytes.py', ob_args)}: what an offloaded run keeps in host memory (params,"
        f" gradients, optimizer states) for a Llama-shaped stack of {c['layers']} decoder layers (d_model"
        f" {c['d_model']}, SwiGLU {c['ffn']}, {c['heads']} query heads over {c['heads'] // 2} key-value heads,"
        f" RMSNorm weights; no embeddings), {result['params']:,} params, trained 3 iterations on one"
        f" {c['tokens']}-token sequence, one thread. Counted: `bridge.report.training_bytes` (params + gradients +"
        " states). Tracked: the bytes of every tensor alive, between steps (params and states) and at the peak"
        " (with the gradients, the batch's activations and the step's temporaries). Peak RSS growth: the"
        " process's peak resident memory over its RSS before the model was built, each setup in a fresh"
        " process (it adds allocator slack and torch's own buffers: a few MB that weigh more on a small"
        " model). fp32 `torch.optim.AdamW` is torch's default (for-loop) implementation. Bytes per param:\n\n"
        + offload_bytes.format_table(result["rows"]))


def convergence_picture(conv: dict, out: str, name: str) -> str:
    path = figure(out, name)
    charts.convergence_chart(conv, convergence.reference_of, {**convergence.TOLERANCE, **convergence.MEAN_TOLERANCE},
                             path)
    return f"![held-out loss of each variant relative to its reference, per evaluation]({os.path.basename(path)})"


# ----------------------------------------------------------------------------- SOAP


def script(name: str, argv: list[str], out_json: str, procs_argv: list[list[str]] | None = None) -> dict:
    """Runs ``benchmarks/name`` with ``argv`` (or, in parallel, with each of ``procs_argv``) in
    subprocesses writing JSON; returns the JSON (of each process, in order, as a list when parallel)."""
    path = os.path.join(HERE, name)
    runs = procs_argv or [argv]
    procs = []
    for i, a in enumerate(runs):
        procs.append(subprocess.Popen([sys.executable, path, *a, "--json", f"{out_json}.{i}"], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for i, pr in enumerate(procs):
        text, _ = pr.communicate()
        if pr.returncode != 0:
            raise RuntimeError(f"{name} {' '.join(runs[i])} failed (exit {pr.returncode}):\n{text[-4000:]}")
        with open(f"{out_json}.{i}") as f:
            outs.append(json.load(f))
    return outs if procs_argv else outs[0]


def soap_runs(quality_args: list[str], tmp: str) -> dict:
    """soap_quality.py's GPT runs, the seeds split over two processes, merged in seed order."""
    i = quality_args.index("--seeds")
    seeds = quality_args[i + 1].split(",")
    halves = [h for h in (seeds[: (len(seeds) + 1) // 2], seeds[(len(seeds) + 1) // 2:]) if h]
    parts = script("soap_quality.py", quality_args, os.path.join(tmp, "soap_q.json"),
                   [quality_args[:i + 1] + [",".join(h)] + quality_args[i + 2:] for h in halves])
    out = dict(parts[0])
    for key in ("seeds",):
        out[key] = [x for p in parts for x in p[key]]
    for key in ("losses", "curves"):
        out[key] = {v: [x for p in parts for x in p[key][v]] for v in out["variants"]}
    return out


def soap_section(nbytes: dict, quality: dict, times: dict, args: tuple, out: str, picture: str) -> str:
    bytes_args, quality_args, time_args = args
    names = soap_quality.NAMES
    n_gpt = quality["params"]
    rows = []
    for v in nbytes["variants"]:
        b = nbytes["bytes"][v]
        rows.append([names[v], f"{b['2048x2048']:.2f}", f"{b['2048x512']:.2f}",
                     f"{quality['bytes_gpt'][v]:.2f}" if v in quality["bytes_gpt"] else "-"])
    cfg = quality["config"]
    text = [
        f"## SOAP\n\nState bytes a param: {cmd('benchmarks/soap_quality.py', bytes_args)} for the two matrices"
        " (HeavyBall's counted from its states after one step; ours from the state report, on the meta device), and"
        " the GPT's below (the states after its last step over all its params; its small tensors, under"
        " `min_quant_size`, stay float32 in every low-bit optimizer). Muon4bit: rank-16 factors and an `nf4` residual"
        " for the matrices, 8-bit AdamW states for the rest.\n\n"
        + table(["optimizer", "2048 x 2048", "2048 x 512", f"the GPT ({n_gpt:,} params)"], rows)]
    ref = quality["losses"]["soap"]
    rows = []
    for v in quality["variants"]:
        rel = soap_quality.relative(quality["losses"][v], ref)
        mean, se = soap_quality.mean_se(rel)
        target = SOAP_TARGETS.get(v)
        rows.append([names[v], f"{statistics.fmean(quality['losses'][v]):.4f}",
                     "(reference)" if v == "soap" else f"{mean:+.2f}%", "" if v == "soap" else f"{se:.2f}",
                     "" if v == "soap" else f"[{min(rel):+.2f}, {max(rel):+.2f}]",
                     f"<= +{target}%" if target else ""])
    text.append(
        f"Held-out loss: {cmd('benchmarks/soap_quality.py', quality_args)} (two processes of half the seeds each, one"
        f" thread each): the demo's byte-level GPT at d_model {cfg['d_model']}, layers {cfg['layers']}, sequence"
        f" {cfg['seq_len']}, batch {cfg['batch']}, {cfg['steps']} steps, {len(quality['seeds'])} seeds; per seed"
        " every optimizer starts from the same weights and sees the same batches, and its final held-out loss is"
        " taken relative to fp32 SOAP's of the same seed (mean, standard error and range over the seeds). SOAP and"
        f" Muon at lr {cfg['lr']}, AdamW at {cfg['adamw_lr']} (none tuned), weight decay {cfg['weight_decay']},"
        f" SOAP's preconditioner refreshed every {cfg['frequency']} steps; HeavyBall's SOAP at our SOAP's"
        " settings, eager.\n\n"
        + table(["optimizer", "held-out loss", "vs fp32 SOAP", "s.e.", "range", "target"], rows)
        + f"\n\n![training loss, and final held-out loss against fp32 SOAP per seed]({picture})")
    rows = []
    t = times["time"]
    for v in times["variants"]:
        rows.append([names[v], f"{1e3 * t[v]['step_s']:.2f}", f"{t[v]['step_s'] / t['adamw']['step_s']:.1f}x",
                     f"{t[v]['first_s']:.1f}"])
    text.append(
        f"Step time: {cmd('benchmarks/soap_quality.py', time_args)}: one {times['size']} x {times['size']} float32"
        " matrix,"
        f" {times['threads']} threads, the functional step (ours) and `opt.step()` (HeavyBall's, compiled with its"
        " default `torch.compile` mode, as its users run it); 3 interleaved rounds of 20 steps (two preconditioner"
        " refreshes each, so their cost is amortized over the frequency), medians; `first 20 steps`: the building"
        " step and, for HeavyBall, its compilation.\n\n"
        + table(["optimizer", "ms/step", "vs AdamW (fp32)", "first 20 steps s"], rows))
    del out
    return "\n\n".join(text)


# ----------------------------------------------------------------------------- the Triton kernels


def triton_section(result: dict | None, targs: list[str]) -> str:
    head = "## Triton kernels compiled for sm_80 and sm_90\n\n"
    if result is None:
        return head + "Skipped: triton is not installed (`pip install -e \".[triton]\"`)."
    by_name: dict = {}
    for r in result["results"]:
        by_name.setdefault(r["name"], {})[str(r["arch"])] = r
    rows = []
    for name, arches in by_name.items():
        a80, a90 = arches.get("80", {}), arches.get("90", {})
        cells = []
        for key in ("regs", "spills", "shared", "widest_load", "loads_128"):
            cells.append(f"{a80.get(key, '-')} / {a90.get(key, '-')}")
        any_r = a80 or a90
        rows.append([name, *cells, any_r.get("fma_count", "-"), f"{any_r['bytes']:.2f}" if "bytes" in any_r else "-"])
    cold = [r for r in result["results"] if not r.get("cached")]
    n = len(result["results"])
    how = ("all compiled in this run" if len(cold) == n else
           f"{len(cold)} compiled in this run, {n - len(cold)} from the cache of earlier runs (keyed by the kernel"
           " source's sha256)")
    return head + (
        f"{cmd('benchmarks/triton_compile.py', targs)} with triton {result['triton']} and its bundled `ptxas`, no"
        f" GPU: {len(by_name)} variants of `lowbit_tree/kernels/triton_step.py`'s one kernel (every declared rule and"
        " variant x every state format with float32 params written in place, and per rule with 8-bit states:"
        " bfloat16 params with stochastic rounding, with the int8 correction, and the float32 update; each"
        " `aligned`, every address a multiple of 16 bytes and rows of whole 32-element vectors, and `offset`, any"
        " view), each for"
        f" sm_80 and sm_90: {len(result['results'])} compiles ({how}), {result['wall_s']:.0f} s wall with"
        f" {result['jobs']} processes{_load_note(result)}; {result['failed']} failed the PTX scan (banned: `div.full`,"
        " `div.approx`, `sqrt.approx`, `rsqrt.approx`, `ex2.approx`, `lg2.approx`, `.ftz`; `fma` only where the"
        " source writes `tl.fma`; the aligned 8-bit AdamW with float32 params without 4 128-bit loads or with a"
        " spill). Formats that differ only by their value table (`8bit`, `8bit_bnb`, `fp8`) share a variant."
        " Registers, spills (local memory bytes) and shared memory from `cuobjdump --dump-resource-usage`, sm_80 /"
        " sm_90; `widest load`: the widest global load of data in the PTX in bits (`ld.global.v4.b32`: 128),"
        " `128-bit loads`: how many (a thread's: the aligned 8-bit AdamW's 4 are its float32 params and"
        " gradients, two each); `fma`: the `fma.rn.f32` in the PTX; `bytes/param`: what the step reads and writes"
        " per param"
        " element (gradient, param, states' codes and scales), the floor of a GPU step at its memory bandwidth."
        " Not run on a GPU here: docs/guide/gpu.md says what has run where.\n\n"
        + table(["variant", "registers", "spills", "shared", "widest load", "128-bit loads", "fma", "bytes/param"],
                rows))


def _load_note(result: dict) -> str:
    """The machine's load average at the compile run's start and end, where it was recorded."""
    load = result.get("load")
    cores = result.get("cores", "?")
    return f" (load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, on {cores} cores)" if load else ""


# ----------------------------------------------------------------------------- the summary


# (class, what it is for, case (a) implementation, convergence variant, digits variant)
FORMAT_ROWS = [
    ("`torch.optim.AdamW(fused=True)`", "the reference: fp32 states", "torch-fused", "fp32", "fp32"),
    ("`AdamW8bit`", "the default choice: 8-bit moments, closest to fp32", "bridge-8bit", "8bit", "8bit"),
    ("`AdamW4bit`", "least memory for Adam: 4-bit moments, rank-1 normalized second moment", "bridge-4bit", "4bit",
     "4bit-rank1"),
    ("`AdamW4bit(rank1_normalization=False)`", "4-bit with per-block second moments (faster, worse on the MLP)",
     "bridge-4bit-block", None, "4bit-block"),
    ("`AdamWFp8`", "e4m3 moments: the fastest quantized step", "bridge-fp8", "fp8", "fp8"),
    ("`Lion8bit`", "Lion: one state", "bridge-lion-8bit", None, None),
    ("`SGD8bit`", "SGD with momentum", "bridge-sgd-8bit", None, None),
    ("`AdEMAMix8bit`", "AdEMAMix (three states); compared with fp32 AdEMAMix", "bridge-ademamix-8bit", "ademamix-8bit",
     None),
    ("`AdEMAMix4bit`", "AdEMAMix, 4-bit but its slow EMA in 8-bit", "bridge-ademamix-4bit", "ademamix-4bit-slow8", None),
]
MUON_ROWS = [
    ("`Muon8bit`", "Muon's momentum in 8 bits (hidden matrices; AdamW groups 8-bit)", "bridge-muon-8bit", "muon-8bit"),
    ("`Muon4bit`", "rank-16 bfloat16 factors + `nf4` residual; AdamW groups 8-bit", "bridge-muon-4bit", "muon-4bit"),
    ("`Muon(state_format=\"nf4\")`", "the normal-float 4-bit map alone (no factors)", None, "muon-4bit-rank0"),
]


def summary(steps: dict, muon: dict | None, conv: dict | None, digits: dict | None, runs: int) -> str:
    conv_rows = {r["variant"]: r for r in conv["summary"]} if conv else {}

    def quality(variant):
        r = conv_rows.get(variant)
        if r is None:
            return "not measured"
        if variant == convergence.reference_of(variant):
            return "reference"
        return f"{pct(r['rel_mean'])} [{r['rel_min']:+.2f}, {r['rel_max']:+.2f}]"

    def speed(b, impl, key=None):
        r = b["rows"].get(impl) if b else None
        if r is None or not r["ms"]:
            return "not measured", "-"
        vals = r["extra"].get(key, []) if key else r["ratio"]
        ratio = f"{statistics.median(vals):.2f}x" if vals else "-"
        return ratio, f"{r['bytes']:.3f}"

    rows = []
    for name, what, impl, conv_v, dig_v in FORMAT_ROWS:
        ratio, nbytes = speed(steps, impl)
        dig = "not measured"
        if digits and dig_v in digits:
            rel = digits_rel(digits, dig_v)
            dig = "reference" if dig_v == "fp32" else f"{pct(statistics.mean(rel))} [{min(rel):+.2f}, {max(rel):+.2f}]"
        rows.append([name, nbytes, quality(conv_v) if conv_v else "not measured", dig, ratio, what])
    fused = steps["rows"]["torch-fused"]["fused_ms"] if steps else []
    text = table(["optimizer", "state B/param (2048x2048)", "GPT held-out loss vs fp32 (mean [min, max], %)",
                  "MLP held-out loss vs fp32", "step x torch fused AdamW (case a)", "for"], rows)
    text += (f"\n\nStep-time ratios are medians of {runs} run(s) in which torch's fused AdamW took "
             + ", ".join(f"{x:.1f}" for x in fused) + " ms/step.")
    if muon is not None:
        mrows = []
        for name, what, impl, conv_v in MUON_ROWS:
            ratio_ns, nbytes = speed(muon, impl, "ratio_to_torch_muon") if impl else ("not measured", "-")
            mrows.append([name, nbytes, quality(conv_v), ratio_ns, what])
        torch_muon = muon["rows"].get("torch-muon", {}).get("ms") or []
        text += "\n\n" + table(["optimizer", "state B/param (2048x2048)", "GPT held-out loss vs fp32 Muon (%)",
                                "step without Newton-Schulz x torch.optim.Muon", "for"], mrows)
        text += ("\n\ntorch.optim.Muon's step without its matrix products took "
                 + ", ".join(f"{x:.1f}" for x in torch_muon) + " ms in those runs; whole steps are in \"Muon, whole steps\".")
    return text


# ----------------------------------------------------------------------------- the page


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: every battery at tiny sizes, one run each")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    args = ap.parse_args(argv)
    missing = missing_anchors()
    if missing and not args.quick:
        ap.error(f"{', '.join(missing)} not installed: the page compares with them. Install them with "
                 '`pip install -e ".[parity,bench]"` (--quick, the CI smoke, runs without them)')
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # the pictures go beside the page
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    runs = 1 if args.quick else RUNS
    report = ["python benchmarks/report.py" + (" --quick" if args.quick else "")]
    sections: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        log("timing the native kernel's first build")
        build = kernel_build_seconds()
        ds_build = deepspeed_build(args.quick)

        batteries = [QUICK_STEP] if args.quick else STEP_BATTERIES
        results = {}
        for title, sargs in batteries:
            log(f"step time: {title} ({runs} run(s))")
            results[title] = step_battery(sargs, runs, tmp)
        main_steps = results[batteries[0][0]]
        muon_steps = None if args.quick else results[STEP_BATTERIES[3][0]]
        whole = None
        if not args.quick:
            log(f"step time: {MUON_WHOLE[0]} (1 run)")
            whole = step_battery(MUON_WHOLE[1], 1, tmp)

        floor_args = FLOOR_QUICK if args.quick else FLOOR_FULL
        log(f"the host step against DeepSpeed and the memory floor ({' '.join(floor_args)})")
        with isolated(torch.get_num_threads()):
            floor = memory_floor.main(floor_args)
        charts.step_floor_chart(floor, figure(args.out, "offload-step"))
        log("offloaded training: host bytes per param")
        ob_args = OFFLOAD_BYTES_QUICK if args.quick else OFFLOAD_BYTES_FULL
        with isolated(1):
            host_bytes = offload_bytes.main(ob_args)

        log("host overhead per param")
        overhead_args = OVERHEAD_QUICK if args.quick else OVERHEAD_FULL
        overhead = []
        for oargs in overhead_args:
            with isolated(1):
                captured(step_overhead.main, oargs + ["--json", os.path.join(tmp, "overhead.json")])
            with open(os.path.join(tmp, "overhead.json")) as f:
                overhead.append(json.load(f))
            os.environ.pop("LOWBIT_TREE_BACKEND", None)  # step_overhead sets it per variant

        log("the demo")
        demo = run_demo(DEMO_QUICK if args.quick else DEMO_FULL, tmp)
        log("convergence (byte-level GPT)")
        conv_args = CONV_QUICK if args.quick else CONV_FULL
        conv = run_convergence(conv_args, tmp)
        log("convergence (byte-level GPT), bfloat16 params")
        bf16_args = BF16_CONV_QUICK if args.quick else BF16_CONV_FULL
        conv_bf16 = run_convergence(bf16_args, tmp, "convergence_bf16")
        log("convergence (digits MLP)")
        dig_args = DIGITS_QUICK if args.quick else DIGITS_FULL
        digits = run_digits(dig_args)
        log("training-state bytes")
        ts_args = TRAINING_STATE_QUICK if args.quick else TRAINING_STATE_FULL
        with isolated(1):
            training_state = training_state_bytes.main(ts_args)
        wide_state = [r for r in training_state if r["table"] == "wider"]
        training_state = [r for r in training_state if r["table"] == "demo"]
        log("the step in backward")
        ib_args = IN_BACKWARD_QUICK if args.quick else IN_BACKWARD_FULL
        in_backward = captured(step_in_backward.main, ib_args)
        log("second-moment robustness, requantization drift and round trips")
        sm_args = SECOND_MOMENT_QUICK if args.quick else []
        sm = captured(second_moment_formats.main, sm_args)
        drift_args = ["--quick"] if args.quick else []
        drift = captured(requantize_drift.main, drift_args)
        from bridge.tools.cli import main as cli

        rt = captured(cli, ["roundtrip"])
        log("SOAP: bytes, held-out loss over the seeds, step time against HeavyBall's")
        soap_args = ((SOAP_BYTES_QUICK, SOAP_QUALITY_QUICK, SOAP_TIME_QUICK) if args.quick else
                     (SOAP_BYTES_FULL, SOAP_QUALITY_FULL, SOAP_TIME_FULL))
        soap_bytes = script("soap_quality.py", soap_args[0], os.path.join(tmp, "soap_b.json"))
        soap_quality_runs = soap_runs(soap_args[1], tmp)
        soap_times = script("soap_quality.py", soap_args[2], os.path.join(tmp, "soap_t.json"))
        soap_picture = figure(args.out, "soap")
        charts.soap_chart(soap_quality_runs, soap_quality.NAMES, soap_picture)
        targs = TRITON_QUICK if args.quick else TRITON_FULL
        if version("triton") is None:
            triton_result = None
        else:
            log("the Triton kernels' compile step (sm_80, sm_90)")
            triton_result = script("triton_compile.py", targs, os.path.join(tmp, "triton.json"))

    elapsed = time.perf_counter() - t0
    load = f"{load_start:.1f} / {os.getloadavg()[0]:.1f} (other processes share the cores)"
    if floor["deepspeed_build"] is not None and ds_build.startswith("not timed"):
        b = floor["deepspeed_build"]
        how = "loaded from an earlier build" if b["cached"] else "built"
        ds_build += f"; in this run {how} in {b['seconds']:.1f} s"
    env = environment(started, build, load, ds_build)
    head = [
        "# Results",
        "",
        "<!-- Generated by benchmarks/report.py: rerun it, do not edit this page. -->",
        "",
        f"Generated by `{report[0]}` in {elapsed / 60:.1f} minutes"
        + (" (the CI smoke settings: tiny sizes, one run; not for quoting)." if args.quick else
           " (battery sizes chosen for about 20 minutes on a quiet 2-core machine; a busy one takes longer).")
        + " Every figure in the README and the docs comes from this page; each table names the command that"
        " measured it (run from the repository root). History lives in git, not here.",
        "",
        table(["", ""], env),
        "",
        "How to read the step times: a ratio is an implementation's ms/step over torch's fused fp32 AdamW"
        " (`torch.optim.AdamW(fused=True)` on float32 params) in the same run of `step_time.py`, whose timed steps"
        " interleave every implementation (round r steps each once), so a slow period of the machine hits all of"
        " them alike. The ratio still moves with the machine's state (this is a shared 2-core machine), so every"
        " ratio stands beside the fused step's own ms/step in the runs it comes from. `state B/param`: optimizer"
        " state bytes per parameter (codes, scales, factors; not the step counters).",
    ]
    sections.append("## Choose a format\n\nFrom the tables below: memory and step time on case (a) (two"
                    " 2048x2048 params), quality from the byte-level GPT and the MLP on digits.\n\n"
                    + summary(main_steps, muon_steps, conv, digits, runs))
    for title, sargs in batteries:
        n = results[title]
        sections.append(f"## Step time: {title}\n\n{n['tensors']} tensors, {n['params'] / 1e6:.2f}M params. "
                        f"{runs} run(s) of {cmd('benchmarks/step_time.py', sargs)}; medians over the runs.\n\n"
                        + step_table(n, muon="muon" in title.lower()) + correction_cost(n) + pure_form_ratio(n))
    if whole is not None:
        sections.append(f"## Step time: {MUON_WHOLE[0]}\n\nOne run of {cmd('benchmarks/step_time.py', MUON_WHOLE[1])}"
                        " (a whole step takes seconds on a CPU without bfloat16 matrix units; Newton-Schulz is the"
                        " same bfloat16 matrix products in every Muon row).\n\n" + step_table(whole, muon=True))
    sections.append(offload_step_section(floor, floor_args, os.path.basename(figure(args.out, "offload-step"))))
    sections.append(host_bytes_section(host_bytes, ob_args))
    rows = [[r["shapes"], r["variant"], r["params"], f"{r['ours_ms']:.2f}", f"{r['torch_fused_ms']:.2f}",
             f"{r['overhead_us_per_param']:.1f}", f"{r['first_step_s']:.1f}",
             f"{r['compiler_warmup_s']:.1f}" if r["variant"].startswith("compiled") else "-", r["graphs"]]
            for part in overhead for r in part]
    sections.append(
        "## Host overhead per param\n\n" + " and ".join(cmd("benchmarks/step_overhead.py", a) for a in overhead_args)
        + ": many small params, every one with a gradient, one thread; `AdamW8bit` (every param quantized,"
        " `min_quant_size=1`) and `AdamW` with float32 states, against `torch.optim.AdamW(fused=True)` on the same"
        " params, interleaved; overhead = (ours - torch fused) / params, the median of the runs. `small`: 64x64 ..."
        " 256x32 (about 10k elements a param: the 8-bit kernel's arithmetic counts); `tiny`: 8x8 .. 32x4 (almost"
        " only host work). `first step`: our first step in seconds (the compiled backend's compilations, from"
        " scratch: no disk cache); `compiler warm-up`: inductor's one-time work in a new cache folder (its C++"
        " prelude), done before the first step and timed apart; `graphs`: the graphs dynamo made.\n\n"
        + table(["shapes", "variant", "params", "ours ms", "torch fused ms", "overhead us/param", "first step s",
                 "compiler warm-up s", "graphs"], rows))
    cfg = demo["config"]
    sections.append(
        f"## The demo\n\n{cmd('-m bridge', DEMO_QUICK if args.quick else DEMO_FULL)} (the README's first command"
        f" runs it as `lowbit-tree demo`): byte-level GPT, d_model {cfg['d_model']}, {cfg['layers']} layers,"
        f" {demo['runs'][0]['params']:,} params, {cfg['steps']} steps per optimizer, seed {cfg['seed']},"
        f" `min_quant_size={cfg['min_quant_size']}`; {demo['corpus']['bytes']:,} bytes of Python"
        f" {demo['corpus']['python']}'s standard-library source, last 10% held out. One seed: the held-out column"
        " moves by about a percent from seed to seed (see the next table).\n\n" + demo_table(demo))
    n_ts = training_state[0]["elements"]
    sections.append(
        f"## Training state: bytes per param\n\n{cmd('benchmarks/training_state_bytes.py', ts_args)}: the demo's model"
        f" ({n_ts:,} params), AdamW with the demo's settings, 3 iterations on a batch of one 8-byte window."
        " Counted: `opt.training_bytes()`, params + gradients + optimizer states (with steps in backward the"
        " largest gradient, each being freed after its step). Measured: the bytes of every tensor alive, followed"
        " from allocation to release through torch's dispatcher; between steps (params and states) and at the peak"
        " (adding the gradients alive together, the small batch's activations and the step's temporaries). "
        + demo_setup_legend() + "\n\n"
        + training_state_bytes.format_table(training_state)
        + "\n\nWhere the optimizer states' bytes go: the records' codes; their scales and maxima (block scales,"
        " rank-1 row and column maxima, float32: design.md, \"Scales are float32\"); the states kept unquantized"
        " (float32: the params with one dimension, biases and norms, and those under `min_quant_size`); the int8"
        " param corrections.\n\n"
        + training_state_bytes.format_parts_table(training_state)
        + "\n\nThe bfloat16-param setups on wider models of the same depth (the same command's second table),"
        " where biases and norms are a smaller share of the params:\n\n"
        + training_state_bytes.format_wider_table(wide_state))
    sections.append(
        f"## The step in backward\n\n{cmd('benchmarks/step_in_backward.py', ib_args)}: `bridge.step_in_backward`"
        " against `backward()` then `opt.step()`, one thread. Host cost: each param's step in backward is one call"
        " through its own plan; `extra per param` is what that costs over `opt.step()`'s one call for the group."
        " Memory: the gradients alive at once, and the process's peak RSS growth during an iteration.\n\n"
        + in_backward)
    sections.append(
        f"## Convergence: byte-level GPT\n\n{cmd('benchmarks/convergence.py', conv_args)}: the demo's model at"
        f" {conv['params']:,} params; per seed every variant starts from the same weights and sees the same"
        " batches. Final held-out loss relative to the fp32 run of the same rule and seed (fp32 AdamW, fp32"
        " AdEMAMix, fp32 Muon). The AdamW groups of the Muon variants (embeddings, head, norms, biases) take the"
        f" class's formats. Run time {conv['wall_s'] / 60:.1f} min.\n\n" + conv_table(conv)
        + "\n\n" + convergence_picture(conv, args.out, "convergence"))
    if digits is None:
        sections.append("## Convergence: MLP on digits\n\nSkipped: scikit-learn is not installed"
                        " (`pip install -e \".[bench]\"`).")
    else:
        sections.append(f"## Convergence: MLP on digits\n\n{cmd('benchmarks/digits_mlp.py', dig_args)}: MLP"
                        " 64-256-256-10 on scikit-learn's digits; the 256x10 head keeps fp32 states.\n\n"
                        + digits_table(digits))
    sections.append(
        f"## bfloat16 params\n\n{cmd('benchmarks/convergence.py', bf16_args)}: the 8-bit rows' GPT runs (run time"
        f" {conv_bf16['wall_s'] / 60:.1f} min); the 4-bit row's and the MLP's are the runs of the tables above. The"
        " model converted with `.to(torch.bfloat16)` (inputs and activations in bfloat16, the loss float32 from the"
        " logits); 8bit-bf16m and 8bit-amp compute in bfloat16 too but keep float32 params. Each variant against the"
        " same optimizer on float32 params of the same seed, against 8bit-bf16m (same compute, float32 masters: what"
        " is left is the master weight's precision) and against fp32 AdamW. The GPT's target: with the int8"
        " correction, the mean over seeds within 0.2% of float32 params. A difference between two variants moves by"
        " about 0.4% from seed to seed, so a mean over 3 seeds has a standard error of about 0.25%: hence 12 seeds.\n\n"
        + bf16_table(conv, conv_bf16, digits) + "\n\n" + convergence_picture(conv_bf16, args.out, "convergence-bf16"))
    sections.append(f"## Second-moment robustness\n\n{cmd('benchmarks/second_moment_formats.py', sm_args)}:"
                    " Adam on rows whose gradients span 1e-8..1 inside a block, half the rows absent (zero"
                    " gradient) at each step; the largest weight step against fp32 Adam's largest.\n\n```\n"
                    + sm + "\n```")
    sections.append(f"## Requantization drift\n\n{cmd('benchmarks/requantize_drift.py', drift_args)}: a state"
                    " requantized at every step, as every step does (design.md, \"Scales are float32\"): a uniform"
                    " decay keeps its codes (1.0000: none), and the steady first moment of a constant gradient at each"
                    " block's largest element.\n\n```\n" + drift + "\n```")
    sections.append(soap_section(soap_bytes, soap_quality_runs, soap_times, soap_args, args.out,
                                 os.path.basename(soap_picture)))
    sections.append(triton_section(triton_result, targs))
    sections.append(f"## Round-trip error of each format\n\n`lowbit-tree roundtrip`: a heavy-tailed 256x1024 tensor"
                    " through each format's default block size.\n\n```\n" + rt + "\n```")
    text = "\n".join(head) + "\n\n" + "\n\n".join(sections) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    log(f"wrote {args.out} in {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
