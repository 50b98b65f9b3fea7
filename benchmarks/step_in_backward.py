"""Steps in backward (``bridge.step_in_backward``) against ``backward()`` then ``opt.step()``:
the host cost of stepping one param at a time, and the memory the gradients take at peak.

Host cost (one process, one thread): a stack of bias-free square linear layers with tanh,
200 params of 64x64 (where the per-call cost shows) and 16 of 512x512 (where the kernels' work
hides it), AdamW in fp32, 8-bit and 4-bit.
  step only        the steps on the same gradients: ``opt.step()`` against the loop the hooks
                   run (each param's ``step_param``, through its own cached plan)
  backward + step  a whole iteration: ``loss.backward(); opt.step()`` against the same with the
                   hooks on (the steps inside backward, the gradients freed there)
Each mode has its own model copy and optimizer (switching one optimizer between the whole
group's plan and the per-param plans rebuilds them); timed calls alternate between the modes.
Reported: median ms per step over ``--reps`` calls, the median of 3 such rounds, and the ratio.

Memory (a fresh subprocess per measurement, median of 3): an MLP of four linear layers
(1024x2048, 2048x2048, 2048x2048, 2048x1024: 12.6M params, float32), AdamW8bit, batch 32.
After 2 warm-up iterations (states created), one iteration (forward, backward, step) is
measured:
  live grads peak  the largest sum of gradient bytes held at once, read in a post-accumulate-
                   grad hook on every param (run before step_in_backward's) and at opt.step()
  peak RSS growth  the process's peak RSS during the iteration (``VmHWM``, reset through
                   ``/proc/self/clear_refs``) minus its RSS before it: gradients, activations
                   and the step's temporaries (pages freshly touched; large tensors are mmap'd
                   by the allocator and given back when freed)

Usage: python benchmarks/step_in_backward.py [--reps N] [--quick]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bridge  # noqa: E402

FORMATS = {"fp32": bridge.AdamW, "8bit": bridge.AdamW8bit, "4bit": bridge.AdamW4bit}


# ----------------------------------------------------------------------------
# host cost
# ----------------------------------------------------------------------------
class Stack(nn.Module):
    def __init__(self, n=200, d=64):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def host_cost(fmt: str, n: int, d: int, reps: int) -> dict:
    torch.manual_seed(0)
    base = Stack(n, d)
    x = torch.randn(8, d)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opt_a = FORMATS[fmt](a.parameters(), lr=1e-4, min_quant_size=1)
    opt_b = FORMATS[fmt](b.parameters(), lr=1e-4, min_quant_size=1)
    pa, pb = list(a.parameters()), list(b.parameters())
    for p, q in zip(pa, pb):
        p.grad = torch.randn_like(p) * 1e-3
        q.grad = p.grad.clone()

    def per_param():
        for p in pb:
            opt_b.step_param(p)

    out = {}
    rounds = {"opt.step()": [], "per param": []}
    for _ in range(3):
        for _ in range(3):  # warm-up: plans built, buffers recycled
            opt_a.step()
            per_param()
        ta, tb = [], []
        for _ in range(reps):
            ta.append(_timed(opt_a.step))
            tb.append(_timed(per_param))
        rounds["opt.step()"].append(statistics.median(ta))
        rounds["per param"].append(statistics.median(tb))
    out["step only"] = {k: statistics.median(v) for k, v in rounds.items()}

    for p in pa + pb:
        p.grad = None
    handle = bridge.step_in_backward(b, opt_b)

    def iteration_a():
        a(x).backward()
        opt_a.step()
        opt_a.zero_grad()

    def iteration_b():
        b(x).backward()
        opt_b.step()

    rounds = {"opt.step()": [], "per param": []}
    for _ in range(3):
        for _ in range(3):
            iteration_a()
            iteration_b()
        ta, tb = [], []
        for _ in range(reps):
            ta.append(_timed(iteration_a))
            tb.append(_timed(iteration_b))
        rounds["opt.step()"].append(statistics.median(ta))
        rounds["per param"].append(statistics.median(tb))
    handle.remove()
    out["backward + step"] = {k: statistics.median(v) for k, v in rounds.items()}
    return out


# ----------------------------------------------------------------------------
# memory, in a child process
# ----------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory_child(mode: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                          nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 1024))
    params = list(model.parameters())
    opt = bridge.AdamW8bit(params, lr=1e-4)
    peak = [0]

    def live_grad_bytes(_p=None):
        peak[0] = max(peak[0], sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None))

    for p in params:
        p.register_post_accumulate_grad_hook(live_grad_bytes)
    if mode == "in backward":
        bridge.step_in_backward(model, opt)
    x = torch.randn(32, 1024)

    def iteration():
        model(x).square().mean().backward()
        live_grad_bytes()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        iteration()
    peak[0] = 0
    before = _status_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    iteration()
    growth = (_status_kb("VmHWM") - before) * 1024 if reset else None
    return {"live_grads": peak[0], "rss_growth": growth, "grad_bytes": sum(p.numel() * 4 for p in params)}


def memory(mode: str) -> dict:
    runs = []
    for _ in range(3):
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode], capture_output=True,
                              text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072"))
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    growth = [r["rss_growth"] for r in runs if r["rss_growth"] is not None]
    return {"live_grads": statistics.median(r["live_grads"] for r in runs),
            "rss_growth": statistics.median(growth) if growth else None, "grad_bytes": runs[0]["grad_bytes"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="timed calls per mode and round")
    ap.add_argument("--quick", action="store_true", help="5 calls per round, 8-bit only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(memory_child(args.child)))
        return
    reps = 5 if args.quick else args.reps
    formats = ["8bit"] if args.quick else list(FORMATS)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 thread\n")
    print("Host cost: AdamW (ms per step; median of 3 rounds of medians)\n")
    print("| params | state format | what is timed | opt.step() | per param (in backward) | ratio | "
          "extra per param (us) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for n, d in ((200, 64), (16, 512)):
        for fmt in formats:
            for what, t in host_cost(fmt, n, d, reps).items():
                a, b = t["opt.step()"] * 1e3, t["per param"] * 1e3
                print(f"| {n} x {d}x{d} | {fmt} | {what} | {a:.2f} | {b:.2f} | {b / a:.2f} | {(b - a) / n * 1e3:.0f} |")
    print("\nMemory: MLP of 12.6M float32 params, AdamW8bit, one iteration after warm-up (median of 3 processes)\n")
    print("| mode | live gradients at peak (MB) | peak RSS growth (MB) |")
    print("|---|---:|---:|")
    res = {mode: memory(mode) for mode in ("backward, then opt.step()", "in backward")}
    for mode, r in res.items():
        growth = "n/a" if r["rss_growth"] is None else f"{r['rss_growth'] / 2**20:.1f}"
        print(f"| {mode} | {r['live_grads'] / 2**20:.1f} | {growth} |")
    a, b = res["backward, then opt.step()"], res["in backward"]
    print(f"\nall gradients: {a['grad_bytes'] / 2**20:.1f} MB; ratio in backward / after: live gradients "
          f"{b['live_grads'] / a['live_grads']:.2f}"
          + ("" if a["rss_growth"] is None else f", peak RSS growth {b['rss_growth'] / a['rss_growth']:.2f}"))


if __name__ == "__main__":
    main()
