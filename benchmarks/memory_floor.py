"""The host step against its memory floor: DeepSpeed's fp32 CPU Adam (ZeRO-Offload's step),
torch's fused AdamW and our low-bit classes, stepped in the same interleaved rounds as a
memory-bandwidth probe, with the bytes each step has to move.

The probe is a STREAM triad, ``a = b + s * c`` over float32 arrays larger than the caches, run
by torch's threads as the steps are. A step's floor is the bytes it must read and write per
param (:data:`TRAFFIC`, one definition per implementation) at the probe's GB/s; its achieved
GB/s is those bytes over its measured time, and the share of the probe says how close to the
floor it runs (1.0: memory-bound at the probe's rate).

Every round steps the triad once and each implementation once, so a slow period of a shared
machine hits all of them alike; a run is ``--steps`` rounds and its figure for each row the
median of its rounds; ``--runs`` runs (default 3) give the medians reported. Ratios are taken
within a run, then their median. DeepSpeed's C++ op is built (first use: minutes) or loaded
before the first round and that time is reported apart (``deepspeed_anchor``); without deepspeed
its rows say so (``skipped: deepspeed not installed ...``).

    python benchmarks/memory_floor.py                    # case (a): 2 x 2048x2048, 10 rounds x 3 runs
    python benchmarks/memory_floor.py --quick            # 3 rounds x 1 run
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_anchor  # noqa: E402
import step_time  # noqa: E402

from lowbit_tree.formats import STATE_FORMATS, get_format  # noqa: E402

# ----------------------------------------------------------------------------- bytes moved

StateBytes = Callable[[int, int], int]
"""Bytes one optimizer state holds for a (rows, cols) param."""


def fp32_state(rows: int, cols: int) -> int:
    return 4 * rows * cols


def blockwise(format_name: str) -> StateBytes:
    """Codes (``bits`` each, packed within a row) and one float32 scale per block of each row:
    the layout of lowbit_tree's block-wise records, block sizes from ``lowbit_tree.formats``."""
    f = get_format(format_name)
    return lambda rows, cols: rows * (math.ceil(cols * f.bits / 8) + 4 * math.ceil(cols / f.default_block_size))


def rank1(format_name: str) -> StateBytes:
    """Codes and float32 row and column maxima: 4-bit Adam's rank-1 normalized second moment."""
    f = get_format(format_name)
    return lambda rows, cols: rows * math.ceil(cols * f.bits / 8) + 4 * (rows + cols)


class StepTraffic(NamedTuple):
    """What one step reads and writes per param, as a count: the param (``param_bytes`` per
    element, read and written), its gradient (read), each state in ``states`` (read and
    written) and an int8 correction when ``correction`` (read and written). Bytes are counted
    once per read and once per write, as STREAM counts its triad."""

    param_bytes: int
    states: tuple[StateBytes, ...]
    correction: bool = False

    def bytes_moved(self, shapes) -> int:
        total = 0
        for shape in shapes:
            if len(shape) != 2:
                raise ValueError(f"shapes: the floor is counted for 2-D params, got {tuple(shape)}")
            rows, cols = shape
            n = rows * cols
            total += 3 * self.param_bytes * n + 2 * sum(s(rows, cols) for s in self.states)
            total += 2 * n if self.correction else 0
        return total


def _adam(fmt: str) -> tuple[StateBytes, StateBytes]:
    first, second = STATE_FORMATS[fmt]
    return blockwise(first), (rank1(second) if fmt == "4bit" else blockwise(second))


FP32_ADAM = (fp32_state, fp32_state)
TRAFFIC: dict[str, StepTraffic] = {
    "deepspeed-cpu-adam": StepTraffic(4, FP32_ADAM),
    "torch-fused": StepTraffic(4, FP32_ADAM),
    "bridge-8bit": StepTraffic(4, _adam("8bit")),
    "bridge-4bit": StepTraffic(4, _adam("4bit")),
    "bridge-fp8": StepTraffic(4, _adam("fp8")),
    "bridge-lion-8bit": StepTraffic(4, (blockwise(STATE_FORMATS["8bit"][0]),)),
    "bridge-sgd-8bit": StepTraffic(4, (blockwise(STATE_FORMATS["8bit"][0]),)),
    "deepspeed-cpu-adam-bf16": StepTraffic(2, FP32_ADAM),
    "bridge-8bit-bf16c": StepTraffic(2, _adam("8bit"), correction=True),
}
"""Per implementation (``step_time.py``'s names), what its step moves. The gradient has the
param's dtype. fp32 Adam: 4 + 4 read, 4 written for the param and its gradient, 2 x (4 + 4) for
the moments: 28 bytes a param; 8-bit Adam about 16, 4-bit about 14; bfloat16 params halve the
param and gradient bytes and the correction adds 2."""
IMPLS = list(TRAFFIC)
REFERENCES = {torch.float32: "deepspeed-cpu-adam", torch.bfloat16: "deepspeed-cpu-adam-bf16"}
"""The DeepSpeedCPUAdam row each row is compared with: the one on params of its dtype."""
SHAPES = [(2048, 2048), (2048, 2048)]  # step_time.py's case (a)

# ----------------------------------------------------------------------------- the probe


def largest_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports for cpu0 (sysfs), or None."""
    folder = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    try:
        for index in (d for d in os.listdir(folder) if d.startswith("index")):
            with open(os.path.join(folder, index, "size")) as f:
                text = f.read().strip()
            unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    except (OSError, ValueError):
        return None
    return max(sizes, default=None)


class Triad:
    """STREAM's triad ``a = b + s * c`` over three float32 arrays of ``mib`` MiB each, by torch's
    threads. ``bytes_moved``: 12 bytes an element (``b`` and ``c`` read, ``a`` written)."""

    def __init__(self, mib: int):
        if mib < 1:
            raise ValueError(f"triad array size must be >= 1 MiB, got {mib}")
        n = mib * 2**20 // 4
        gen = torch.Generator().manual_seed(0)
        self.a, self.b, self.c = torch.empty(n), torch.rand(n, generator=gen), torch.rand(n, generator=gen)
        self.bytes_moved = 12 * n
        self.a.copy_(self.b)  # every page touched before the first timed round

    def step(self) -> None:
        torch.add(self.b, self.c, alpha=3.0, out=self.a)

    def timed(self) -> float:
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0


def probe_gbs(mib: int = 64, repeats: int = 5) -> float:
    """The triad alone: median GB/s over ``repeats`` (for callers outside the rounds)."""
    triad = Triad(mib)
    return triad.bytes_moved / statistics.median(triad.timed() for _ in range(repeats)) / 1e9


def default_triad_mib() -> int:
    """Each array at least twice the largest cache and 64 MiB, at most 256 MiB (a VM may report
    its host's whole last-level cache; the three arrays together still exceed it)."""
    cache = largest_cache_bytes() or 0
    return int(min(256, max(64, 2 * cache // 2**20)))


# ----------------------------------------------------------------------------- the rounds


def run(impls: list[str], shapes, steps: int, runs: int, triad_mib: int) -> dict:
    """Builds DeepSpeed's op (when a row needs it), sets every implementation up, then ``runs``
    runs of ``steps`` interleaved rounds (triad, then each implementation). Returns the rows
    (:func:`summarize`), the probe's GB/s per run and the op's build."""
    unknown = [i for i in impls if i not in TRAFFIC]
    if unknown:
        raise ValueError(f"impls: no byte count for {unknown}; choose from {IMPLS}")
    device = torch.device("cpu")
    build = None
    if any(i.startswith("deepspeed") for i in impls) and deepspeed_anchor.missing_reason() is None:
        build = deepspeed_anchor.build_op()._asdict()
    states = [step_time.setup(impl, shapes, device) for impl in impls]
    timed = [st for st in states if "skipped" not in st]
    triad = Triad(triad_mib)
    triad.step()
    probe, per_run = [], []
    for _ in range(runs):
        triad_times = []
        for st in timed:
            st["times"] = []
        for _ in range(steps):
            triad_times.append(triad.timed())
            for st in timed:
                step_time.timed_step(st, device, last=False)
        probe.append(triad.bytes_moved / statistics.median(triad_times) / 1e9)
        per_run.append({st["impl"]: statistics.median(st["times"]) for st in timed})
    skipped = {st["impl"]: st["skipped"] for st in states if "skipped" in st}
    n = sum(math.prod(s) for s in shapes)
    return {"shapes": [list(s) for s in shapes], "params": n, "steps": steps, "runs": runs, "threads":
            torch.get_num_threads(), "triad_mib": triad_mib, "largest_cache_bytes": largest_cache_bytes(),
            "probe_gbs": probe, "deepspeed": deepspeed_anchor.version(), "deepspeed_build": build,
            "rows": summarize(impls, shapes, per_run, probe, skipped)}


def _ratios(per_run: list[dict], impl: str, ref: str) -> list[float] | None:
    if any(ref not in r or impl not in r for r in per_run):
        return None
    return [r[impl] / r[ref] for r in per_run]


def summarize(impls, shapes, per_run: list[dict], probe: list[float], skipped: dict) -> list[dict]:
    """Per implementation: median ms and ns/param over the runs, the medians of its per-run
    ratios to DeepSpeedCPUAdam (same param dtype) and torch fused, bytes moved per param, GB/s,
    its share of the probe, and the floor (bytes at the probe's GB/s) in ns/param."""
    n = sum(math.prod(s) for s in shapes)
    rows = []
    for impl in impls:
        moved = TRAFFIC[impl].bytes_moved(shapes)
        row = {"impl": impl, "bytes_per_param": moved / n,
               "floor_ns_per_param": moved / n / statistics.median(probe)}
        if impl in skipped:
            rows.append({**row, "skipped": skipped[impl]})
            continue
        secs = [r[impl] for r in per_run]
        ref = REFERENCES[step_time.param_dtype(impl)]
        vs_ds, vs_fused = _ratios(per_run, impl, ref), _ratios(per_run, impl, "torch-fused")
        shares = [moved / s / 1e9 / p for s, p in zip(secs, probe)]
        rows.append({**row, "ms": statistics.median(secs) * 1e3, "ns_per_param": statistics.median(secs) * 1e9 / n,
                     "ms_runs": [s * 1e3 for s in secs], "reference": ref,
                     "x_deepspeed": statistics.median(vs_ds) if vs_ds else None, "x_deepspeed_runs": vs_ds,
                     "x_torch_fused": statistics.median(vs_fused) if vs_fused else None,
                     "gbs": moved / statistics.median(secs) / 1e9, "share_of_probe": statistics.median(shares)})
    return rows


def format_table(result: dict) -> str:
    """The rows as a Markdown table (the results page's and the script's)."""
    head = ["implementation", "param dtype", "ms/step", "ns/param (s/step per billion params)", "x DeepSpeedCPUAdam (same param dtype)",
            "x torch fused AdamW", "bytes moved/param", "GB/s", "share of probe", "floor ns/param"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]

    def x(v):
        return "-" if v is None else f"{v:.2f}"

    for r in result["rows"]:
        dtype = "bfloat16" if step_time.param_dtype(r["impl"]) == torch.bfloat16 else "float32"
        if "skipped" in r:
            cells = [r["impl"], dtype, f"skipped: {r['skipped']}", "", "", "", f"{r['bytes_per_param']:.2f}", "", "",
                     f"{r['floor_ns_per_param']:.3f}"]
        else:
            cells = [r["impl"], dtype, f"{r['ms']:.2f}", f"{r['ns_per_param']:.3f}", x(r["x_deepspeed"]),
                     x(r["x_torch_fused"]), f"{r['bytes_per_param']:.2f}", f"{r['gbs']:.1f}",
                     f"{r['share_of_probe']:.2f}", f"{r['floor_ns_per_param']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(result: dict) -> str:
    """The run's setting in one paragraph: shapes, rounds, the probe and DeepSpeed's build."""
    cache = result["largest_cache_bytes"]
    build = result["deepspeed_build"]
    if build is None:
        ds = deepspeed_anchor.missing_reason() or "not needed by these rows"
    else:
        ds = (f"deepspeed {result['deepspeed']}; its cpu_adam op " + ("loaded from an earlier build" if build["cached"]
              else "built") + f" in {build['seconds']:.1f} s before the first round")
    return (f"{len(result['shapes'])} params of shape {' + '.join('x'.join(map(str, s)) for s in result['shapes'])}"
            f" ({result['params'] / 1e6:.2f}M), {result['threads']} torch threads, {result['runs']} run(s) of"
            f" {result['steps']} interleaved rounds. Probe: triad over 3 float32 arrays of {result['triad_mib']} MiB"
            f" (largest cache reported: {'unknown' if cache is None else f'{cache / 2**20:.0f} MiB'}),"
            f" {' / '.join(f'{g:.1f}' for g in result['probe_gbs'])} GB/s in the runs. {ds}.")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", nargs="*", default=None, help=f"subset of {IMPLS}")
    ap.add_argument("--shape", default=None, help="ROWSxCOLS of each of the two params (default 2048x2048)")
    ap.add_argument("--steps", type=int, default=None, help="rounds per run (default 10; 3 with --quick)")
    ap.add_argument("--runs", type=int, default=None, help="runs (default 3; 1 with --quick)")
    ap.add_argument("--triad-mib", type=int, default=None, help="MiB of each triad array (default: from the caches)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    shapes = SHAPES
    if args.shape:
        rows, cols = (int(v) for v in args.shape.lower().split("x"))
        shapes = [(rows, cols), (rows, cols)]
    impls = args.impl or IMPLS
    result = run(impls, shapes, args.steps or (3 if args.quick else 10), args.runs or (1 if args.quick else 3),
                 args.triad_mib or default_triad_mib())
    print(describe(result) + "\n\n" + format_table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
