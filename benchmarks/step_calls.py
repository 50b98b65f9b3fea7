"""Python calls and module transitions of one step on an initialized optimizer.

The host work of a step is the Python the bridge and the core run around the one kernel call;
how often it hops between modules says how straight the step goes down the layers
(design.md: optimizer -> plan -> core -> kernel plan -> kernel). With ``sys.setprofile`` this
records every call into a module of ``bridge`` or ``lowbit_tree`` during one ``step()`` (after
two steps: every cache made) and reports

    calls        the calls into our modules (comprehensions and generators included)
    modules      how many of our modules they enter
    transitions  how often the module changes from one of those calls to the next (the
                 walk's hops: a -> b -> a counts two)
    cross calls  the calls whose caller's module is another (or torch's)

    python benchmarks/step_calls.py                      # AdamW8bit, 3 params of 64x64, one group
    python benchmarks/step_calls.py --optimizer Muon8bit --show
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import bridge  # noqa: E402

OURS = ("bridge", "lowbit_tree")


def is_ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def record_step(optimizer: str = "AdamW8bit", params: int = 3, shape: tuple = (64, 64)) -> list:
    """``[(caller module, callee module, function)]`` of every call into our modules during one
    ``step()`` of ``bridge.<optimizer>`` (``min_quant_size=1``: every state quantized) over
    ``params`` seeded params of ``shape`` with gradients, after two steps."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(shape)) for _ in range(params)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = getattr(bridge, optimizer)(ps, lr=1e-3, min_quant_size=1)
    opt.step()
    opt.step()
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            callee = frame.f_globals.get("__name__", "")
            if is_ours(callee):
                caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
                calls.append((caller, callee, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return calls


def summary(calls: list) -> dict:
    modules = [callee for _, callee, _ in calls]
    return {
        "calls": len(calls),
        "modules": len(set(modules)),
        "transitions": sum(a != b for a, b in zip(modules, modules[1:])),
        "cross_calls": sum(caller != callee for caller, callee, _ in calls),
        "walk": [m for i, m in enumerate(modules) if i == 0 or m != modules[i - 1]],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizer", default="AdamW8bit", help="a class of bridge (default AdamW8bit)")
    ap.add_argument("--params", type=int, default=3)
    ap.add_argument("--show", action="store_true", help="list every call")
    args = ap.parse_args(argv)
    calls = record_step(args.optimizer, args.params)
    if args.show:
        for caller, callee, fn in calls:
            print(f"  {caller:>28} -> {callee}.{fn}")
    print(json.dumps({"optimizer": args.optimizer, **summary(calls)}, indent=1))


if __name__ == "__main__":
    main()
