"""Host overhead per param of a step: many small params, ours against torch's fused AdamW.

Params cycle through five shapes; every param has a gradient. For each size (50, 200, 500
params) and each of our variants (``AdamW8bit`` and ``AdamW`` with float32 states, each on
the native and the compiled backend), one process times our step and torch's fused AdamW on
the same params, interleaved, median of ``--steps`` steps, and reports

    host overhead = (our step - torch fused's step) / params   (us a param)

as the median of ``--runs`` runs. ``--shapes small`` (64x64 .. 256x32, ~10k elements a param)
includes the kernels' own arithmetic; ``--shapes tiny`` (8x8 .. 32x4) leaves almost nothing
but the host's work. The compiled backend's first step (its compilations) and the number of
graphs dynamo made are reported too (compiled from scratch: inductor's disk cache is off). One thread (``torch.set_num_threads(1)``).

    python benchmarks/step_overhead.py                       # the full table (~5 min on 2 cores)
    python benchmarks/step_overhead.py --sizes 50 --runs 1   # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import bridge  # noqa: E402

SHAPES = {
    "small": [(64, 64), (128, 64), (64, 192), (96, 96), (256, 32)],
    "tiny": [(8, 8), (16, 8), (8, 24), (12, 12), (32, 4)],
}
VARIANTS = {  # name -> (class, backend)
    "native-8bit": ("AdamW8bit", "native"),
    "native-fp32": ("AdamW", "native"),
    "compiled-8bit": ("AdamW8bit", "compiled"),
    "compiled-fp32": ("AdamW", "compiled"),
}


def _params(n: int, shapes: list, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(shapes[i % len(shapes)], generator=g)) for i in range(n)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def _median_ms(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(variant: str, n: int, shapes: str, steps: int, runs: int) -> dict:
    """Our step and torch fused's, interleaved; the first step's seconds and dynamo's graphs."""
    cls, backend = VARIANTS[variant]
    os.environ["LOWBIT_TREE_BACKEND"] = backend
    import torch._dynamo
    from torch._dynamo.utils import counters

    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False  # first steps compile from scratch, not from the disk cache
    torch._dynamo.reset()
    counters.clear()
    ours_params = _params(n, SHAPES[shapes], 0)
    theirs_params = _params(n, SHAPES[shapes], 0)
    kw = {} if cls == "AdamW" else {"min_quant_size": 1}
    ours = getattr(bridge, cls)(ours_params, lr=1e-3, **kw)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-3, fused=True)
    t = time.perf_counter()
    ours.step()
    first = time.perf_counter() - t
    graphs = counters["stats"]["unique_graphs"]
    theirs.step()
    ours.step()  # warm
    rows = []
    for _ in range(runs):
        a = _median_ms(ours.step, steps)
        b = _median_ms(theirs.step, steps)
        rows.append((a, b, (a - b) * 1e3 / n))
    a, b, o = (statistics.median(r[k] for r in rows) for k in range(3))
    return {"variant": variant, "params": n, "shapes": shapes, "ours_ms": a, "torch_fused_ms": b,
            "overhead_us_per_param": o, "first_step_s": first, "graphs": graphs,
            "new_graphs_after_warmup": counters["stats"]["unique_graphs"] - graphs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 500])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--shapes", nargs="+", default=["small", "tiny"], choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=20, help="timed steps a run (median)")
    ap.add_argument("--runs", type=int, default=3, help="runs (median)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print("| shapes | variant | params | ours ms | torch fused ms | overhead us/param | first step s | graphs |")
    print("|---|---|---|---|---|---|---|---|")
    for shapes in args.shapes:
        for variant in args.variants:
            for n in args.sizes:
                r = measure(variant, n, shapes, args.steps, args.runs)
                rows.append(r)
                print(f"| {shapes} | {variant} | {n} | {r['ours_ms']:.2f} | {r['torch_fused_ms']:.2f} | "
                      f"{r['overhead_us_per_param']:.1f} | {r['first_step_s']:.2f} | {r['graphs']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
