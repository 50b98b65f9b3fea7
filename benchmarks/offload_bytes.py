"""Offloaded training: host bytes per param of a Llama-shaped layer stack, counted and measured,
for the setups an offloaded run would choose between: fp32 ``torch.optim.AdamW`` (what
ZeRO-Offload and FSDP2's ``CPUOffloadPolicy`` keep on the host), ``AdamW8bit``, and
``AdamW8bit`` / ``AdamW4bit`` with ``param_correction=True`` on bfloat16 params.

The stack: ``--layers`` decoder layers, each RMSNorm, attention (q, o: d x d; k, v: d x d/2, two
query heads per key-value head), RMSNorm, SwiGLU MLP (gate, up: f x d; down: d x f), and a final
RMSNorm; no embeddings. Trained 3 iterations (forward, backward, step) on a batch of one
``--tokens``-token sequence, so the activations are small beside the training state.

Counted: ``bridge.report.training_bytes`` (params + gradients + optimizer states; it reads a torch
optimizer's states as well as ours). Measured, each setup in a fresh process: the bytes of every
tensor alive (``training_state_bytes.LiveTensorBytes``) between steps (params and states) and at
the peak (adding the gradients, the batch's activations and the step's temporaries), and the
process's peak RSS growth over its RSS before the model was built (``VmHWM``; counts allocator
slack and what torch allocates outside its tensors).

    python benchmarks/offload_bytes.py                 # d 512, 4 layers: 12.6M params (~40 s, 2 cores)
    python benchmarks/offload_bytes.py --d-model 128 --ffn 384 --heads 2 --layers 2   # seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import step_time  # noqa: E402
from training_state_bytes import LiveTensorBytes  # noqa: E402

SETUPS = {
    "fp32 torch.optim.AdamW": "torch-fp32",
    "AdamW8bit": "8bit",
    "AdamW8bit + param_correction (bf16 params)": "8bit-bf16c",
    "AdamW4bit + param_correction (bf16 params)": "4bit-bf16c",
}
"""Table label -> setup: ``torch-fp32`` or a ``bridge.tools.demo`` setup name (format, ``-bf16c``)."""
LR, WEIGHT_DECAY = 1e-3, 0.01


class DecoderLayer(nn.Module):
    """A Llama decoder layer's weights and computation (no rotary embedding: it has no weights)."""

    def __init__(self, d: int, ffn: int, heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, heads // 2, d // heads
        kv = self.kv_heads * self.head_dim
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d, bias=False), nn.Linear(d, kv, bias=False), nn.Linear(d, kv, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        k, v = (z.repeat_interleave(self.heads // self.kv_heads, dim=1) for z in (k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class LlamaStack(nn.Module):
    def __init__(self, d: int, ffn: int, heads: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(d, ffn, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def make_optimizer(setup: str, params):
    if setup == "torch-fp32":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    from bridge.tools.demo import make_optimizer as bridge_optimizer, parse_setup

    s = parse_setup(setup)
    return bridge_optimizer(s.format, params, LR, WEIGHT_DECAY, min_quant_size=4096, **s.options)


def param_dtype(setup: str) -> torch.dtype:
    return torch.bfloat16 if setup.endswith("-bf16c") else torch.float32


def measure(setup: str, d: int, ffn: int, heads: int, layers: int, tokens: int) -> dict:
    """One setup in this process: counted and measured bytes (call it in a fresh process: the
    peak RSS is the process's)."""
    from bridge.report import training_bytes
    from lowbit_tree.kernels import native

    torch.set_num_threads(1)
    native.available()  # the kernel library mapped before the baseline
    gen = torch.Generator().manual_seed(0)
    dtype = param_dtype(setup)
    batch = torch.randn(1, tokens, d, generator=gen).to(dtype)
    gc.collect()
    rss_reset = step_time._reset_peak_rss()
    before = step_time._rss_kb("VmRSS")
    tracker = LiveTensorBytes()
    default = torch.get_default_dtype()
    with tracker:
        torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy on the way
        try:
            torch.manual_seed(0)
            model = LlamaStack(d, ffn, heads, layers)
        finally:
            torch.set_default_dtype(default)
        opt = make_optimizer(setup, model.parameters())
        for _ in range(3):
            model(batch).float().pow(2).mean().backward()
            opt.step()
            counted = training_bytes(opt)
            opt.zero_grad(set_to_none=True)
        between = tracker.live
    hwm = step_time._rss_kb("VmHWM")
    peak_rss = None if not rss_reset or hwm is None or before is None else max(0, hwm - before) * 1024
    return {"setup": setup, **counted._asdict(), "between_steps": between, "tracked_peak": tracker.peak,
            "peak_rss": peak_rss}


def measure_in_subprocess(setup: str, argv: list[str], timeout_s: float = 300.0) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--one", setup], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"offload_bytes.py --one {setup} exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    head = ["setup", "params", "grads", "optimizer states", "total (counted)", "x fp32 AdamW total",
            "between steps (tracked)", "peak (tracked)", "peak RSS growth (measured)"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    base = next((r for r in rows if r["setup"] == "torch-fp32"), None)
    for r in rows:
        n = r["elements"]
        total = r["params"] + r["grads"] + r["states"]
        ratio = "-" if base is None else f"{total / (base['params'] + base['grads'] + base['states']):.2f}"
        rss = "n/a" if r["peak_rss"] is None else f"{r['peak_rss'] / n:.2f}"
        cells = [f"{r['params'] / n:.3f}", f"{r['grads'] / n:.3f}", f"{r['states'] / n:.3f}", f"**{total / n:.3f}**",
                 ratio, f"{r['between_steps'] / n:.3f}", f"{r['tracked_peak'] / n:.3f}", rss]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Prints the table; returns ``{"config", "params", "rows"}`` (bytes, not per param)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1536, help="the SwiGLU MLP's hidden size")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16, help="tokens in the batch's one sequence")
    ap.add_argument("--setups", default=",".join(SETUPS.values()))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one setup, JSON on stdout
    args = ap.parse_args(argv)
    if args.heads % 2 or args.d_model % args.heads:
        ap.error(f"--heads must be even and divide --d-model, got {args.heads} and {args.d_model}")
    dims = (args.d_model, args.ffn, args.heads, args.layers, args.tokens)
    if args.one:
        print(json.dumps(measure(args.one, *dims)))
        return {}
    labels = {v: k for k, v in SETUPS.items()}
    child = ["--d-model", str(args.d_model), "--ffn", str(args.ffn), "--heads", str(args.heads), "--layers",
             str(args.layers), "--tokens", str(args.tokens)]
    rows = []
    for setup in (s.strip() for s in args.setups.split(",") if s.strip()):
        if setup not in labels:
            ap.error(f"unknown setup {setup!r}; choose from {', '.join(labels)}")
        rows.append({**measure_in_subprocess(setup, child), "label": labels[setup]})
    config = dict(zip(("d_model", "ffn", "heads", "layers", "tokens"), dims))
    print(f"Llama-shaped stack {config}, {rows[0]['elements']:,} params; bytes per param\n")
    print(format_table(rows))
    return {"config": config, "params": rows[0]["elements"], "rows": rows}


if __name__ == "__main__":
    main()
