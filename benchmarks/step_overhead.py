"""Host overhead per param of a step: many small params, ours against torch's fused AdamW.

Params cycle through five shapes; every param has a gradient. For each size (50, 200, 500
params) and each of our variants (``AdamW8bit`` and ``AdamW`` with float32 states, each on
the native and the compiled backend), one process times our step and torch's fused AdamW on
the same params, interleaved, median of ``--steps`` steps, and reports

    host overhead = (our step - torch fused's step) / params   (us a param)

as the median of ``--runs`` runs. ``--shapes small`` (64x64 .. 256x32, ~10k elements a param)
includes the kernels' own arithmetic; ``--shapes tiny`` (8x8 .. 32x4) leaves almost nothing
but the host's work. The compiled backend's first step (its compilations) and the number of
graphs dynamo made are reported too: compiled from scratch (inductor's and AOT autograd's disk
caches off, a new inductor cache folder), after inductor's one-time work in that folder (building
its C++ prelude, reported apart as the compiler's warm-up). One thread (``torch.set_num_threads(1)``).

    python benchmarks/step_overhead.py                       # the full table (~5 min on 2 cores)
    python benchmarks/step_overhead.py --sizes 50 --runs 1   # a quick look
    python benchmarks/step_overhead.py --device cuda --shapes llama7b/4 --variants compiled-8bit compiled-fp32
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import bridge  # noqa: E402

SHAPES = {
    "small": [(64, 64), (128, 64), (64, 192), (96, 96), (256, 32)],
    "tiny": [(8, 8), (16, 8), (8, 24), (12, 12), (32, 4)],
}


def llama7b_shapes(scale: int) -> list:
    """Llama-7B's 291 param shapes with every dimension divided by ``scale``: per layer q, k,
    v, o (d x d), gate and up (f x d), down (d x f), two norms (d); the embedding, the head
    and the final norm."""
    d, f, vocab = 4096 // scale, 11008 // scale, 32000 // scale
    layer = [(d, d)] * 4 + [(f, d), (f, d), (d, f), (d,), (d,)]
    return [(vocab, d)] + layer * 32 + [(d,), (vocab, d)]
VARIANTS = {  # name -> (class, backend)
    "native-8bit": ("AdamW8bit", "native"),
    "native-fp32": ("AdamW", "native"),
    "compiled-8bit": ("AdamW8bit", "compiled"),
    "compiled-fp32": ("AdamW", "compiled"),
    "triton-8bit": ("AdamW8bit", "triton"),  # CUDA (on CPU only under TRITON_INTERPRET=1)
    "triton-fp32": ("AdamW", "triton"),
}
CPU_VARIANTS = [v for v in VARIANTS if not v.startswith("triton")]


def _params(n: int, shapes: list, seed: int, device: str = "cpu") -> list:
    g = torch.Generator(device=device).manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(shapes[i % len(shapes)], generator=g, device=device)) for i in range(n)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, device=device)
    return ps


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_ms(step, steps: int, device: str = "cpu") -> float:
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(variant: str, n: int, shapes: str, steps: int, runs: int, device: str = "cpu") -> dict:
    """Our step and torch fused's, interleaved; the first step's seconds and dynamo's graphs."""
    cls, backend = VARIANTS[variant]
    os.environ["LOWBIT_TREE_BACKEND"] = backend
    import torch._dynamo
    from torch._dynamo.utils import counters

    import torch._functorch.config
    import torch._inductor.config

    # first steps compile from scratch: no disk cache (inductor's graphs, AOT autograd's artifacts,
    # which would otherwise serve a graph compiled by an earlier process)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="step_overhead_inductor_")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="step_overhead_triton_")  # the triton kernel's too
    warmup = 0.0
    if backend == "compiled":  # inductor's one-time work in a new cache (its C++ prelude): timed apart
        t = time.perf_counter()
        torch.compile(lambda x: x * 2 + 1, dynamic=True)(torch.ones(3, device=device))
        _sync(device)
        warmup = time.perf_counter() - t
    torch._dynamo.reset()
    counters.clear()
    shape_set = SHAPES[shapes] if shapes in SHAPES else llama7b_shapes(int(shapes.split("/")[1]))
    ours_params = _params(n, shape_set, 0, device)
    theirs_params = _params(n, shape_set, 0, device)
    kw = {} if cls == "AdamW" else {"min_quant_size": 1}
    ours = getattr(bridge, cls)(ours_params, lr=1e-3, **kw)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-3, fused=True)
    _sync(device)
    t = time.perf_counter()
    ours.step()
    _sync(device)
    first = time.perf_counter() - t
    graphs = counters["stats"]["unique_graphs"]
    theirs.step()
    ours.step()  # warm
    rows = []
    for _ in range(runs):
        a = _median_ms(ours.step, steps, device)
        b = _median_ms(theirs.step, steps, device)
        rows.append((a, b, (a - b) * 1e3 / n))
    a, b, o = (statistics.median(r[k] for r in rows) for k in range(3))
    return {"variant": variant, "params": n, "shapes": shapes, "ours_ms": a, "torch_fused_ms": b,
            "overhead_us_per_param": o, "first_step_s": first, "compiler_warmup_s": warmup, "graphs": graphs,
            "new_graphs_after_warmup": counters["stats"]["unique_graphs"] - graphs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 500])
    ap.add_argument("--variants", nargs="+", default=CPU_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--shapes", nargs="+", default=["small", "tiny"],
                    help="small, tiny, or llama7b/K: Llama-7B's 291 shapes divided by K (--sizes ignored)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20, help="timed steps a run (median)")
    ap.add_argument("--runs", type=int, default=3, help="runs (median)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print("| shapes | variant | params | ours ms | torch fused ms | overhead us/param | first step s | compiler warm-up s | graphs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shapes in args.shapes:
        if shapes not in SHAPES and not shapes.startswith("llama7b/"):
            ap.error(f"unknown shape set {shapes!r}")
        sizes = args.sizes if shapes in SHAPES else [len(llama7b_shapes(1))]
        for variant in args.variants:
            for n in sizes:
                r = measure(variant, n, shapes, args.steps, args.runs, args.device)
                rows.append(r)
                print(f"| {shapes} | {variant} | {n} | {r['ours_ms']:.2f} | {r['torch_fused_ms']:.2f} | "
                      f"{r['overhead_us_per_param']:.1f} | {r['first_step_s']:.2f} | {r['compiler_warmup_s']:.2f} | {r['graphs']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
