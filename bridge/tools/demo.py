"""``lowbit-tree demo``: one small character-level transformer trained with fp32 AdamW and
with our 8-bit, 4-bit and FP8 AdamW, on text that ships with Python itself; then the bytes
per param each setup trains with (params + gradients + optimizer states), bfloat16 params
with an int8 correction and steps in backward included.

Every run starts from the same initial weights and sees the same batches in the same
order; only the optimizer differs. The text is the source of a fixed list of standard
library modules read from the running interpreter (nothing is downloaded), as bytes
(vocabulary 256); the last 10% is held out.

The pieces (``load_corpus``, ``CharGPT``, ``Batches``, ``train``) are reused by
``benchmarks/convergence.py``.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import sysconfig
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# Fixed, present in every CPython 3.10+; order matters (it is the text's order).
CORPUS_FILES = (
    "argparse.py", "textwrap.py", "functools.py", "dataclasses.py", "enum.py",
    "collections/__init__.py", "pathlib.py", "shutil.py", "tempfile.py", "random.py",
    "statistics.py", "fractions.py", "heapq.py", "contextlib.py", "string.py",
)

FORMATS = ("fp32", "8bit", "4bit", "fp8")

# bfloat16 params (the model converted with .to(torch.bfloat16), the loss float32 from the
# logits) and what keeps their small updates: nothing (round to nearest), stochastic rounding,
# or an int8 correction per element (a 24-bit master weight in 3 bytes)
BF16_OPTIONS = {"bf16": {}, "bf16sr": {"bf16_stochastic_round": True}, "bf16c": {"param_correction": True}}

# the training-state table's rows
MEMORY_SETUPS = ("fp32", "8bit", "4bit", "fp8", "8bit-bf16c", "4bit-bf16c", "8bit-bf16c-bw", "4bit-bf16c-bw")
SETUP_LEGEND = ("bf16c: bfloat16 params with param_correction=True (an int8 correction per element); -bw: steps in "
                "backward\n(bridge.step_in_backward), each gradient freed after its step, so at most the largest "
                "is alive")


class Setup(NamedTuple):
    """What a demo name such as ``"8bit-bf16c-bw"`` asks for."""

    format: str  # the optimizer's state format, one of FORMATS
    options: dict  # the optimizer's bfloat16 option (BF16_OPTIONS)
    dtype: torch.dtype  # of the params
    in_backward: bool  # steps in backward (bridge.step_in_backward)


def parse_setup(name: str) -> Setup:
    """``<format>[-bf16|-bf16sr|-bf16c][-bw]``: ``"8bit"`` is 8-bit AdamW on float32 params,
    ``"8bit-bf16c"`` the same on bfloat16 params with ``param_correction=True``, and a ``-bw``
    suffix runs the steps in backward."""
    rest, in_backward = (name[:-3], True) if name.endswith("-bw") else (name, False)
    fmt, _, dtype = rest.partition("-")
    if fmt not in FORMATS or (dtype and dtype not in BF16_OPTIONS):
        raise ValueError(f"unknown setup {name!r}: a format ({', '.join(FORMATS)}), then optionally "
                         f"-{' / -'.join(BF16_OPTIONS)} (bfloat16 params) and -bw (steps in backward)")
    return Setup(fmt, BF16_OPTIONS.get(dtype, {}), torch.bfloat16 if dtype else torch.float32, in_backward)


def load_corpus(files=CORPUS_FILES, held_out_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, held-out bytes, info) as uint8 tensors, from the installed standard library."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, used = [], []
    for name in files:
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                chunks.append(f.read())
            used.append(name)
    if not chunks:
        raise FileNotFoundError(f"none of the corpus files were found under {root}")
    data = torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8)
    cut = int(len(data) * (1 - held_out_fraction))
    info = {"stdlib": root, "files": used, "python": sys.version.split()[0], "bytes": len(data),
            "train_bytes": cut, "held_out_bytes": len(data) - cut}
    return data[:cut], data[cut:], info


# ----------------------------------------------------------------------------
# model: a compact pre-norm GPT
# ----------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    """Byte-level GPT: token + learned position embeddings, pre-norm blocks, untied head."""

    def __init__(self, vocab: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, seq_len: int = 128):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------
# data order
# ----------------------------------------------------------------------------
class Batches:
    """Deterministic windows of ``seq_len + 1`` bytes: step ``i``'s batch depends only on (seed, i)."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch: int, seed: int):
        self.data, self.seq_len, self.batch, self.seed = data, seq_len, batch, seed

    def __call__(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch,), generator=gen)
        return torch.stack([self.data[s: s + self.seq_len + 1] for s in starts.tolist()]).long()


def eval_batches(data: torch.Tensor, seq_len: int, n_windows: int) -> torch.Tensor:
    """Evenly spaced held-out windows, the same for every run."""
    starts = torch.linspace(0, len(data) - seq_len - 2, n_windows).long()
    return torch.stack([data[s: s + seq_len + 1] for s in starts.tolist()]).long()


# ----------------------------------------------------------------------------
# optimizers
# ----------------------------------------------------------------------------
OPTIMIZERS = ("adamw", "ademamix", "muon")


def make_optimizer(fmt: str, params, lr: float, weight_decay: float, min_quant_size: int, optimizer: str = "adamw",
                   steps: int = 0, model: nn.Module | None = None, **options):
    """fp32 bridge.AdamW or our 8-bit / 4-bit / FP8 AdamW (same hyperparameters); with
    ``optimizer="ademamix"``, bridge.AdEMAMix in that format (betas (0.9, 0.99, 0.999),
    alpha 5, alpha and b3 warmed up over the run's ``steps``); with ``optimizer="muon"``,
    bridge.Muon on ``model``'s hidden matrices and AdamW (betas (0.9, 0.99)) on the embeddings,
    head, norms and biases, both with this ``lr`` and decay (``adjust_lr_fn="match_rms_adamw"``,
    Moonshot's rule for sharing AdamW's), momentum in that format (``"8bit"``, ``"4bit"``: the
    named classes Muon8bit, Muon4bit, whose 4-bit is ``"nf4"``). ``options`` go to the class
    as they are (``param_correction=True``, ``bf16_stochastic_round=True``)."""
    import bridge

    if optimizer == "muon":
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
        if model is None:
            raise ValueError("make_optimizer(optimizer='muon') needs model= (to tell hidden matrices by name)")
        groups = bridge.muon_param_groups(model, exclude=("tok", "pos", "head"), betas=(0.9, 0.99))
        kw = {} if fmt == "fp32" else {"min_quant_size": min_quant_size}
        cls = {"8bit": bridge.Muon8bit, "4bit": bridge.Muon4bit}.get(fmt)  # the named classes' formats
        if cls is None:
            cls, kw = bridge.Muon, {**kw, "state_format": fmt}
        return cls(groups, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw", **kw, **options)
    if optimizer == "ademamix":
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
        kw = {} if fmt == "fp32" else {"min_quant_size": min_quant_size}
        warm = steps or None
        return bridge.AdEMAMix(params, lr=lr, betas=(0.9, 0.99, 0.999), alpha=5.0, t_alpha=warm, t_beta3=warm,
                               weight_decay=weight_decay, state_format=fmt, **kw, **options)
    if optimizer != "adamw":
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")

    cls = {"fp32": bridge.AdamW, "8bit": bridge.AdamW8bit, "4bit": bridge.AdamW4bit, "fp8": bridge.AdamWFp8}.get(fmt)
    if cls is None:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    kw = {} if fmt == "fp32" else {"min_quant_size": min_quant_size}
    return cls(params, lr=lr, betas=(0.9, 0.99), weight_decay=weight_decay, **kw, **options)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def state_formats(opt) -> str:
    """``dynamic8+dynamic8_sqrt on 92% of params; fp32 on the rest`` from ``opt.state_report()``."""
    if not hasattr(opt, "state_report"):
        return type(opt).__module__.split(".")[0]
    rows = opt.state_report()
    numel: dict[int, int] = {}
    fmts: dict[int, list[str]] = {}
    for r in rows:
        numel[r.index] = math.prod(r.shape)
        fmts.setdefault(r.index, []).append(r.format)
    total = sum(numel.values()) or 1
    by_kind: dict[str, int] = {}
    for i, fs in fmts.items():
        key = "+".join(dict.fromkeys(fs))
        by_kind[key] = by_kind.get(key, 0) + numel[i]
    parts = sorted(by_kind.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {100 * n / total:.0f}%" for k, n in parts)


# ----------------------------------------------------------------------------
# one training run
# ----------------------------------------------------------------------------
@dataclass
class RunResult:
    name: str
    steps: int
    train_loss: float  # mean over the last 10% of steps
    held_out_loss: float
    state_bytes: int
    params: int
    ms_per_step: float
    opt_ms_per_step: float
    state_formats: str
    curve_steps: list = field(default_factory=list)
    train_curve: list = field(default_factory=list)
    eval_steps: list = field(default_factory=list)
    eval_curve: list = field(default_factory=list)

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / max(1, self.params)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _mean_across_ranks(x: float) -> float:
    dist = _dist()
    if dist is None:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _sum_across_ranks(x: int) -> int:
    dist = _dist()
    if dist is None:
        return x
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [loss_fn(model, windows[i: i + batch]).item() for i in range(0, len(windows), batch)]
    model.train()
    return sum(losses) / len(losses)


def train(
    name: str,
    model: nn.Module,
    opt_factory: Callable,
    batches: Batches,
    held_out: torch.Tensor,
    *,
    steps: int,
    lr: float,
    warmup: int,
    eval_every: int,
    lr_key: str = "lr",
    grad_clip: float = 1.0,
    progress=None,
    rank: int = 0,
    world: int = 1,
    in_backward: bool = False,
) -> RunResult:
    """Train ``model`` in place for ``steps`` steps; ``opt_factory(params)`` builds the optimizer.

    Under FSDP each rank takes its ``rank::world`` share of every batch; losses are averaged
    and state bytes summed over ranks. ``in_backward``: the steps run in backward
    (:func:`bridge.step_in_backward`), without gradient clipping (it needs every gradient at once).
    """
    # before any forward: FSDP2 params are sharded DTensors here, whose numel() is the global one
    n_params = sum(p.numel() for p in model.parameters())
    opt = opt_factory(model.parameters())
    if in_backward:
        import bridge

        handle = bridge.step_in_backward(model, opt)
        grad_clip = 0.0
    train_curve, curve_steps, eval_steps, eval_curve = [], [], [], []
    step_times, opt_times = [], []
    timing_from = min(5, steps // 4)
    for step in range(steps):
        for g in opt.param_groups:
            if isinstance(g[lr_key], torch.Tensor):  # torchao keeps lr as a tensor and wants it kept so
                g[lr_key].fill_(lr_at(step, steps, lr, warmup))
            else:
                g[lr_key] = lr_at(step, steps, lr, warmup)
        batch = batches(step)[rank::world]
        t0 = time.perf_counter()
        loss = loss_fn(model, batch)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if step >= timing_from:
            step_times.append(t2 - t0)
            opt_times.append(t2 - t1)
        value = _mean_across_ranks(loss.item())
        if not math.isfinite(value):
            raise FloatingPointError(f"{name}: loss became {value} at step {step}")
        train_curve.append(value)
        curve_steps.append(step)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            eval_steps.append(step + 1)
            eval_curve.append(_mean_across_ranks(evaluate(model, held_out[rank::world], batches.batch)))
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(f"{name} loss {value:.3f}", refresh=False)
    if in_backward:
        handle.remove()
    tail = train_curve[-max(1, steps // 10):]
    state_bytes = opt.state_bytes() if hasattr(opt, "state_bytes") else _fallback_state_bytes(opt)
    return RunResult(
        name=name, steps=steps, train_loss=sum(tail) / len(tail), held_out_loss=eval_curve[-1],
        state_bytes=_sum_across_ranks(state_bytes), params=n_params,
        ms_per_step=1e3 * _mean_across_ranks(sum(step_times) / max(1, len(step_times))),
        opt_ms_per_step=1e3 * _mean_across_ranks(sum(opt_times) / max(1, len(opt_times))),
        state_formats=state_formats(opt), curve_steps=curve_steps, train_curve=train_curve,
        eval_steps=eval_steps, eval_curve=eval_curve,
    )


def _fallback_state_bytes(opt) -> int:
    """Bytes of every tensor in ``opt.state`` (for torchao / bitsandbytes optimizers)."""
    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                if hasattr(v, "__tensor_flatten__"):
                    names, _ = v.__tensor_flatten__()
                    total += sum(getattr(v, n).numel() * getattr(v, n).element_size() for n in names)
                else:
                    total += v.numel() * v.element_size()
    return total


# ----------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------
TINY = dict(steps=30, d_model=32, layers=1, heads=2, seq_len=32, batch=8, eval_windows=16)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=300, help="training steps per format (default 300)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma-separated setups: a format ({','.join(FORMATS)}), then optionally -bf16, -bf16sr or "
                         "-bf16c (bfloat16 params: round to nearest, stochastic rounding, an int8 correction) and "
                         "-bw (steps in backward), e.g. 8bit-bf16c-bw")
    ap.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                    help="adamw (default), ademamix (bridge.AdEMAMix, alpha and b3 warmed up over the run) or "
                         "muon (bridge.Muon on hidden matrices, AdamW on the rest)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--min-quant-size", type=int, default=1024,
                    help="quantize states of params with >= this many elements (default 1024: every matrix here)")
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows of seq-len+1 bytes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="demo_out")
    ap.add_argument("--tiny", action="store_true", help="CI settings: a 1-layer model, 30 steps (~10 s)")
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (run under torchrun; gloo on CPU)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")


def _setup_fsdp(device: str):
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise SystemExit("--fsdp needs torchrun, e.g. torchrun --nproc_per_node 2 -m bridge demo --fsdp")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = f"cuda:{torch.cuda.current_device()}"
    return dist.get_rank(), dist.get_world_size(), device


def _shard(model: CharGPT, world: int, device: str) -> CharGPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # our loss reads the logits out of place; the hook warning about a view output does not apply
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(torch.device(device).type, (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def format_table(results: list[RunResult]) -> str:
    base = next((r for r in results if r.name == "fp32"), None)
    width = max([10] + [len(r.name) for r in results])
    head = (f"{'optimizer':{width}s} {'train loss':>10s} {'held-out':>9s} {'vs fp32':>8s} {'state MB':>9s} "
            f"{'state B/param':>13s} {'ms/step':>8s} {'opt ms':>7s}  state formats (share of params)")
    lines = [head, "-" * len(head)]
    for r in results:
        rel = f"{100 * (r.held_out_loss / base.held_out_loss - 1):+.2f}%" if base else "-"
        lines.append(
            f"{r.name:{width}s} {r.train_loss:10.4f} {r.held_out_loss:9.4f} {rel:>8s} {r.state_bytes / 2**20:9.3f} "
            f"{r.bytes_per_param:13.3f} {r.ms_per_step:8.1f} {r.opt_ms_per_step:7.1f}  {r.state_formats}"
        )
    return "\n".join(lines)


def training_state(name: str, init: nn.Module, batch: torch.Tensor, args) -> dict:
    """Setup ``name``'s training state on a copy of ``init`` after one step on ``batch``: the
    counts of ``bridge.report.training_bytes`` (params, gradients, states, param elements)."""
    setup = parse_setup(name)
    model = copy.deepcopy(init).to(device=batch.device, dtype=setup.dtype)
    opt = make_optimizer(setup.format, model.parameters(), args.lr, args.weight_decay, args.min_quant_size,
                         args.optimizer, args.steps, model, **setup.options)
    handle = None
    if setup.in_backward:
        import bridge

        handle = bridge.step_in_backward(model, opt)
    loss_fn(model, batch).backward()
    opt.step()
    counted = opt.training_bytes()
    if handle is not None:
        handle.remove()
    return {"name": name, **counted._asdict()}


def format_training_states(rows: list[dict]) -> str:
    head = f"{'setup':14s} {'params':>7s} {'grads':>7s} {'states':>7s} {'total':>7s}"
    lines = ["training state of this model, bytes per param (counted: params + gradients + optimizer states)", head,
             "-" * len(head)]
    for r in rows:
        n = max(r["elements"], 1)
        parts = (r["params"], r["grads"], r["states"], r["params"] + r["grads"] + r["states"])
        lines.append(f"{r['name']:14s} " + " ".join(f"{b / n:7.3f}" for b in parts))
    return "\n".join(lines + [SETUP_LEGEND])


def plot(results: list[RunResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        k = max(1, r.steps // 50)  # running mean over ~2% of the run
        smooth = [sum(r.train_curve[max(0, i - k + 1): i + 1]) / len(r.train_curve[max(0, i - k + 1): i + 1])
                  for i in range(len(r.train_curve))]
        a.plot(r.curve_steps, smooth, label=r.name, lw=1)
        b.plot(r.eval_steps, r.eval_curve, label=r.name, marker=".", lw=1)
    a.set(xlabel="step", ylabel="train loss (running mean)", title="train")
    b.set(xlabel="step", ylabel="held-out loss", title="held-out")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    """The demo; under ``--fsdp`` the process ends here with ``os._exit``
    (:func:`bridge.distributed.run_and_exit`, pytorch issue 190489)."""
    if args.fsdp:
        from ..distributed import run_and_exit

        run_and_exit(lambda: _run(args))
    return _run(args)


def _run(args) -> int:
    if args.tiny:
        for k, v in TINY.items():
            if getattr(args, k) == add_defaults()[k]:
                setattr(args, k, v)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        try:
            parse_setup(f)
        except ValueError as e:
            print(f"lowbit-tree demo: {e}", file=sys.stderr)
            return 2
    rank, world, device = 0, 1, args.device
    if args.fsdp:
        rank, world, device = _setup_fsdp(device)
        if args.batch % world or args.eval_windows % world:
            print(f"lowbit-tree demo: --batch and --eval-windows must divide by the world size {world}", file=sys.stderr)
            return 2
    main = rank == 0
    torch.manual_seed(args.seed)
    train_data, held_data, info = load_corpus()
    batches = Batches(train_data, args.seq_len, args.batch, args.seed)
    held_out = eval_batches(held_data, args.seq_len, args.eval_windows).to(device)
    init = CharGPT(256, args.d_model, args.layers, args.heads, args.seq_len)
    warmup = max(1, args.steps // 10)
    eval_every = max(1, args.steps // 10)
    if main:
        n = sum(p.numel() for p in init.parameters())
        print(f"char-level GPT, {n:,} params (d_model {args.d_model}, {args.layers} layers, seq {args.seq_len}, "
              f"batch {args.batch}) on {info['bytes']:,} bytes of Python {info['python']} stdlib source, "
              f"{args.steps} steps x {len(formats)} optimizers on {device}" + (f", FSDP2 x {world}" if world > 1 else ""))
    bar = None
    if main and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps * len(formats), unit="step", dynamic_ncols=True, file=sys.stderr)
    results = []
    for name in formats:
        setup = parse_setup(name)
        model = copy.deepcopy(init).to(device=device, dtype=setup.dtype)
        if args.fsdp:
            model = _shard(model, world, device)
        factory = lambda params, setup=setup, model=model: make_optimizer(
            setup.format, params, args.lr, args.weight_decay, args.min_quant_size, args.optimizer, args.steps, model,
            **setup.options)
        results.append(train(
            name, model, factory, _OnDevice(batches, device), held_out, steps=args.steps, lr=args.lr, warmup=warmup,
            eval_every=eval_every, progress=bar, rank=rank, world=world, in_backward=setup.in_backward,
        ))
    if bar is not None:
        bar.close()
    if main:
        print(format_table(results))
        # counted on one process's whole model, also under --fsdp (a count, not a measurement)
        memory = [training_state(name, init, batches(0).to(device), args) for name in MEMORY_SETUPS]
        print()
        print(format_training_states(memory))
        os.makedirs(args.out, exist_ok=True)
        title = (f"char-level GPT ({results[0].params:,} params) on Python stdlib source, {args.steps} steps, "
                 f"seed {args.seed}")
        plot(results, os.path.join(args.out, "loss_curves.png"), title)
        record = {
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "world_size": world,
            "torch": torch.__version__,
            "corpus": info,
            "runs": [dict(asdict(r), bytes_per_param=r.bytes_per_param) for r in results],
            "training_state": memory,
        }
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {os.path.join(args.out, 'loss_curves.png')} and {os.path.join(args.out, 'results.json')}")
    if args.fsdp:
        import torch.distributed as dist

        dist.barrier()  # rank 0's files are written before any rank leaves
    return 0


class _OnDevice:
    def __init__(self, batches: Batches, device):
        self.batches, self.device, self.batch = batches, device, batches.batch

    def __call__(self, step: int) -> torch.Tensor:
        return self.batches(step).to(self.device)


def add_defaults() -> dict:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return {k: ap.get_default(k) for k in TINY}
