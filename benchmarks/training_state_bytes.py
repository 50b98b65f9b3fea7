"""Training-state bytes per param (params + gradients + optimizer states) of the demo's model,
counted and measured, for each setup of ``lowbit-tree demo`` (``bridge/tools/demo.py``: a format,
then ``-bf16c`` for bfloat16 params with ``param_correction=True`` and ``-bw`` for steps in
backward).

Counted: ``opt.training_bytes()`` (:func:`bridge.report.training_bytes`) after the last step:
params, gradients (all of them; with steps in backward the largest, each being freed after its
step) and every optimizer state.

Measured: the bytes of every tensor storage alive, followed from allocation to release by a
``TorchDispatchMode`` that sees every op's outputs (backward ops and the optimizer's included)
and a weak reference to each new storage. The model is built in its dtype inside it, then
trained for 3 iterations (forward, backward, step; no gradient clipping) on a batch of one
window of ``--window`` bytes, so the activations are small beside the training state:
  between steps   alive after the last step: params + optimizer states (+ anything the
                  optimizer keeps, such as its plans' step counters)
  peak            the most alive at once: params + states + the gradients alive together +
                  the small batch's activations and their gradients + the step's temporaries
                  (the native kernel works in tiles)
Tensors made outside torch's dispatcher (numpy arrays of the kernel's job tables) are not seen.

Where the optimizer-state bytes go: the records' codes, their other parts (block scales, rank-1
maxima), the states kept unquantized (params under ``min_quant_size`` or with one dimension:
biases and norms) and the param corrections. ``--wider``: the bfloat16-param setups' totals on
wider models of the same depth, where biases and norms are a smaller share.

    python benchmarks/training_state_bytes.py            # the demo's model (~1 min)
    python benchmarks/training_state_bytes.py --wider 256,512
    python benchmarks/training_state_bytes.py --quick    # the --tiny demo's model
"""
from __future__ import annotations

import argparse
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lowbit_tree import records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bridge  # noqa: E402
from bridge.qstate import QState  # noqa: E402
from bridge.tools.demo import MEMORY_SETUPS, SETUP_LEGEND, TINY, CharGPT, loss_fn, make_optimizer, parse_setup  # noqa: E402

LR, WEIGHT_DECAY, MIN_QUANT_SIZE = 3e-3, 0.01, 1024  # the demo's


class LiveTensorBytes(TorchDispatchMode):
    """While active: the bytes of the tensor storages made since it started that are still
    alive (``live``), and the most at once (``peak``)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._follow(t)
        return out

    def _follow(self, t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):  # a QState: its parts
            for name in t.__tensor_flatten__()[0]:
                self._follow(getattr(t, name))
            return
        if t.device.type != "cpu":  # meta tensors (the optimizer binds its states on them) hold no memory
            return
        storage = t.untyped_storage()
        key, n = storage._cdata, storage.nbytes()
        if key in self._alive:  # a view, or an in-place op's result
            return
        self._alive[key] = weakref.ref(storage, lambda _, key=key, n=n: self._release(key, n))
        self.live += n
        self.peak = max(self.peak, self.live)

    def _release(self, key: int, n: int) -> None:
        self._alive.pop(key, None)
        self.live -= n


PARTS = ("codes", "scales and maxima", "unquantized states", "correction")


def state_parts(opt) -> dict:
    """The optimizer states' bytes by what holds them (one process: the whole model's)."""
    out = dict.fromkeys(PARTS, 0)
    for st in opt.state.values():
        for name, v in st.items():
            if name == "step":
                continue
            if isinstance(v, QState):
                for part, t in records.parts_of(v.record).items():
                    out["codes" if part == "codes" else "scales and maxima"] += t.numel() * t.element_size()
            else:
                out["correction" if name == "param_correction" else "unquantized states"] += v.numel() * v.element_size()
    return out


def unquantized_elements(opt) -> int:
    """Param elements whose states are all unquantized (every state a plain tensor)."""
    return sum(p.numel() for p, st in opt.state.items()
               if not any(isinstance(v, QState) for k, v in st.items() if k != "step"))


def measure(name: str, d_model: int, layers: int, heads: int, seq_len: int, window: int) -> dict:
    """One setup: counted (``opt.training_bytes()``) and measured bytes, and the param count."""
    setup = parse_setup(name)
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (1, window + 1))
    tracker = LiveTensorBytes()
    default = torch.get_default_dtype()
    with tracker:
        torch.set_default_dtype(setup.dtype)  # built in its dtype: no float32 copy on the way
        try:
            model = CharGPT(256, d_model, layers, heads, seq_len)
        finally:
            torch.set_default_dtype(default)
        opt = make_optimizer(setup.format, model.parameters(), LR, WEIGHT_DECAY, MIN_QUANT_SIZE, **setup.options)
        handle = bridge.step_in_backward(model, opt) if setup.in_backward else None
        for _ in range(3):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        counted = opt.training_bytes()  # while the hooks are on: the gradients they leave alive
        between = tracker.live
    if handle is not None:
        handle.remove()
    return {"name": name, **counted._asdict(), "between_steps": between, "peak": tracker.peak,
            "parts": state_parts(opt), "unquantized_elements": unquantized_elements(opt), "d_model": d_model}


def format_table(rows: list[dict]) -> str:
    head = ["setup", "params", "grads", "states", "total (counted)", "between steps (measured)", "peak (measured)"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        n = r["elements"]
        cells = (r["params"], r["grads"], r["states"], r["params"] + r["grads"] + r["states"], r["between_steps"],
                 r["peak"])
        lines.append(f"| {r['name']} | " + " | ".join(f"{b / n:.3f}" for b in cells) + " |")
    return "\n".join(lines)


def format_parts_table(rows: list[dict]) -> str:
    """Where each setup's optimizer-state bytes go, in bytes per param."""
    head = ["setup", *PARTS, "states"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r["parts"][k] for k in PARTS] + [r["states"]]
        lines.append(f"| {r['name']} | " + " | ".join(f"{b / r['elements']:.3f}" for b in cells) + " |")
    return "\n".join(lines)


def wider(d_models: list[int], setups: list[str], layers: int, heads: int, seq_len: int, window: int) -> list[dict]:
    """``measure`` of each setup on models of each width (the same depth)."""
    return [measure(s, d, layers, heads, seq_len, window) for d in d_models for s in setups]


def format_wider_table(rows: list[dict]) -> str:
    """Per width: params, the share of them with unquantized states, each setup's counted total
    (params + gradients + states) in bytes per param."""
    setups = list(dict.fromkeys(r["name"] for r in rows))
    head = ["d_model", "params", "params with unquantized states", *setups]
    lines = ["| " + " | ".join(head) + " |", "|---:|" + "---:|" * (len(head) - 1)]
    for d in dict.fromkeys(r["d_model"] for r in rows):
        at = {r["name"]: r for r in rows if r["d_model"] == d}
        first = at[setups[0]]
        n = first["elements"]
        totals = [at[s]["params"] + at[s]["grads"] + at[s]["states"] for s in setups]
        lines.append(f"| {d} | {n:,} | {100 * first['unquantized_elements'] / n:.2f}% | "
                     + " | ".join(f"{t / n:.3f}" for t in totals) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    """Prints the tables (bytes per param); returns one dict of bytes per setup and model, its
    ``"table"`` ``"demo"`` (the demo's model) or ``"wider"`` (``--wider``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default=",".join(MEMORY_SETUPS), help="comma-separated demo setups")
    ap.add_argument("--d-model", type=int, default=128)  # the demo's model
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--window", type=int, default=8, help="bytes in the batch's one window")
    ap.add_argument("--quick", action="store_true", help="the --tiny demo's model")
    ap.add_argument("--wider", default="", help="comma-separated widths (d_model) for a second table")
    ap.add_argument("--wider-setups", default="8bit-bf16c,4bit-bf16c", help="the setups of that table")
    args = ap.parse_args(argv)
    if args.quick:
        for k in ("d_model", "layers", "heads", "seq_len"):
            setattr(args, k, TINY[k])
    torch.set_num_threads(1)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    for s in setups:
        parse_setup(s)
    rows = [{**measure(s, args.d_model, args.layers, args.heads, args.seq_len, args.window), "table": "demo"}
            for s in setups]
    print(f"the demo's byte-level GPT, {rows[0]['elements']:,} params (d_model {args.d_model}, {args.layers} layers), "
          f"AdamW, a batch of one {args.window}-byte window; bytes per param\n")
    print(format_table(rows))
    print("\n" + SETUP_LEGEND.replace("\n", " "))
    print("\nwhere the optimizer states' bytes go, bytes per param\n")
    print(format_parts_table(rows))
    if args.wider:
        widths = [args.d_model] + [int(w) for w in args.wider.split(",") if w.strip()]
        print(f"\nwider {args.layers}-layer models, counted params + gradients + states, bytes per param\n")
        wide = [{**r, "table": "wider"} for r in wider(widths, [s.strip() for s in args.wider_setups.split(",")],
                                                       args.layers, args.heads, args.seq_len, args.window)]
        print(format_wider_table(wide))
        rows += wide
    return rows


if __name__ == "__main__":
    main()
