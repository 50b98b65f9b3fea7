"""Worker functions for the multi-process FSDP2 / DCP tests (tests/test_fsdp.py).

Each ``*_worker(rank, world, *args)`` runs in one of ``world`` spawned processes with a
gloo process group already initialised (see :func:`launch`). They are plain module-level
functions so that ``torch.multiprocessing`` (start method ``spawn``) can pickle them.
Results that the test compares across runs are written by rank 0 with ``torch.save``.
"""
from __future__ import annotations

import copy
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

PG_TIMEOUT_S = 60


# ----------------------------------------------------------------------------
# launching
# ----------------------------------------------------------------------------
def _entry(rank, fn, world, store_file, args):
    """One rank: run ``fn``, then leave with ``os._exit`` (never through interpreter shutdown,
    pytorch issue 190489; :func:`bridge.distributed.run_and_exit`): 0 after success, 1 after
    printing the traceback of a failure (the launcher then fails the test)."""
    from bridge.distributed import run_and_exit

    def body():
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        fn(rank, world, *args)
        dist.barrier()

    run_and_exit(body)


def launch(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes; raise if any fails.

    A rank that raises exits with status 1 after printing its traceback; a rank killed by a
    signal fails the launch too (``ProcessExitedException`` names the signal). Nothing is
    retried. The children inherit ``os.environ`` (e.g. ``TORCHINDUCTOR_CACHE_DIR``). The
    rendezvous is a fresh FileStore, not a TCP port: no race with other jobs for a "free" port."""
    with tempfile.TemporaryDirectory(prefix="lowbit_fsdp_") as tmp:
        store_file = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(fn, world, store_file, args), nprocs=world, join=True, start_method="spawn")


def run_example(nproc: int, ckpt: str, *args, timeout: int = 180) -> tuple[str, str]:
    """``examples/fsdp_train.py --ckpt ckpt *args`` under ``torchrun --standalone`` with ``nproc``
    CPU ranks; asserts exit status 0 (printing both streams otherwise), returns (stdout, stderr).
    ``timeout`` (s) is per launch: a test makes up to three, within pytest's 600 s per test."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "examples", "fsdp_train.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
           "--ckpt", ckpt, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, done.stderr


def _mark(rank: int, phase: str, fmt: str) -> None:
    """A line on stderr at the start of each phase and format: when a rank dies (a crash
    that is not explained yet), its captured stderr says where."""
    import sys

    print(f"[rank {rank}] {phase} {fmt}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# a tiny transformer whose weights shard unevenly and, on 3 ranks, emptily
# ----------------------------------------------------------------------------
VOCAB, D, HIDDEN, SEQ, BATCH = 13, 12, 21, 6, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)        # (36, 12): even shards
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN)       # (21, 12): 11+10, 7+7+7
        self.fc2 = nn.Linear(HIDDEN, D)       # (12, 21): odd rows (4-bit packing)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, D // 2).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, nblocks: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)       # (13, 12): 7+6, 5+5+3
        self.blocks = nn.ModuleList([Block() for _ in range(nblocks)])
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.router = nn.Linear(D, 2, bias=False)  # (2, 12): 1+1+0 on 3 ranks (an empty shard)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        x = self.ln(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return loss + 0.1 * self.router(x).pow(2).mean()


def make_model(seed: int = 0, dtype=torch.float32) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(dtype)


def shard(model: TinyLM, world: int, offload: bool = False, hsdp: bool = False) -> TinyLM:
    """FSDP2 over ``world`` ranks; ``hsdp``: HSDP, replicated over 2 groups of ``world // 2``
    shards (placements ``(Replicate(), Shard(0))``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if hsdp:
        kw = {"mesh": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))}
    else:
        kw = {"mesh": init_device_mesh("cpu", (world,))}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # pin_memory needs an accelerator
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    return model


def batch(step: int, rank: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


OPTIMIZERS = {
    "8bit": "AdamW8bit",
    "4bit": "AdamW4bit",  # its default: rank-1 normalized second moments, maxima all-reduced across shards
    "4bitblock": "AdamW4bit",  # rank1_normalization=False: second moments per block
    "fp8": "AdamWFp8",
    "ademamix8bit": "AdEMAMix8bit",  # three states, the third a signed slow EMA
    "muon8bit": "Muon",  # Muon on the 2-D params (distributed Newton-Schulz), AdamW on the rest
    "muon4bit": "Muon",
    "muonfp32": "Muon",
    "muon4bitlr": "Muon4bit",  # its defaults: nf4 residual + rank-16 factors, refreshed on the owner ranks
    "mixed": "AdamW",  # MIXED_FORMATS: each state in its own format
    "8bitc": "AdamW8bit",  # param_correction: bfloat16 params (the callers' models) with an int8 correction
    "4bitc": "AdamW4bit",
    "rmsprop8bit": "RMSprop8bit",  # momentum and centered: three states, the second moment first
    "rmsprop4bit": "RMSprop4bit",
    "adagrad8bit": "Adagrad8bit",  # one unsigned state; lr_decay and an initial accumulator value
    "adagradfp8": "AdagradFp8",
    # the rest of torch.optim's elementwise family (test_fsdp / test_tp's extended tests)
    "adamax8bit": "Adamax8bit",  # the infinity norm (unsigned) first, then exp_avg; L2 decay
    "adamax4bit": "Adamax4bit",
    "adamaxfp8": "AdamaxFp8",
    "adadelta8bit": "Adadelta8bit",  # two unsigned states
    "adadelta4bit": "Adadelta4bit",
    "adadeltafp8": "AdadeltaFp8",
    "radam8bit": "RAdam8bit",  # decoupled decay: steps 1-5 the bias-corrected m, then rectified
    "radam4bit": "RAdam4bit",
    "radamfp8": "RAdamFp8",
    "nadam8bit": "NAdam8bit",  # decoupled decay; the per-param scalar mu_product beside step
    "nadam4bit": "NAdam4bit",
    "nadamfp8": "NAdamFp8",
}
RULE_OPTIONS = {"rmsprop": dict(momentum=0.9, centered=True), "adagrad": dict(lr_decay=0.01, initial_accumulator_value=0.1),
                "radam": dict(decoupled_weight_decay=True), "nadam": dict(decoupled_weight_decay=True)}
FAMILY_FORMATS = ("adamax8bit", "adamax4bit", "adamaxfp8", "adadelta8bit", "adadelta4bit", "adadeltafp8",
                  "radam8bit", "radam4bit", "radamfp8", "nadam8bit", "nadam4bit", "nadamfp8")
"""The family's formats the extended FSDP2 and TP tests run (family_worker, test_tp)."""
MIXED_FORMATS = {"exp_avg": "8bit", "exp_avg_sq": "4bit"}  # an 8-bit first moment beside a rank-1 4-bit second


def make_opt(params, fmt: str, **kw):
    import bridge

    cls = getattr(bridge, OPTIMIZERS[fmt])
    kw.setdefault("block_size", 8)      # rows of 12 and 21: blocks 8+4 and 8+8+5
    kw.setdefault("min_quant_size", 1)  # quantize every 2-D state of the tiny model
    if fmt == "4bitblock":
        kw["rank1_normalization"] = False
    if fmt == "mixed":
        kw.setdefault("state_format", MIXED_FORMATS)
    if fmt in ("8bitc", "4bitc"):
        kw["param_correction"] = True
    if fmt.startswith("muon"):  # every matrix (embedding and head too: more shapes) Muon, the rest AdamW
        ps = list(params)
        if ps and isinstance(ps[0], dict):  # param groups: each a Muon group if all its params are matrices
            groups = [dict(g, use_muon=all(p.ndim == 2 for p in g["params"])) for g in ps]
        else:
            groups = [{"params": [p for p in ps if p.ndim == 2]},
                      {"params": [p for p in ps if p.ndim != 2], "use_muon": False}]
        if fmt == "muon4bitlr":
            return cls(groups, lr=1e-2, weight_decay=0.1, **kw)
        return cls(groups, lr=1e-2, weight_decay=0.1, state_format=fmt[4:], **kw)
    for rule, options in RULE_OPTIONS.items():
        if fmt.startswith(rule):
            kw = {**options, **kw}
    return cls(params, lr=1e-2, weight_decay=0.1, **kw)


def global_grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    """A fixed full gradient per param name, independent of the mesh."""
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(7919 * step + i)
        out[name] = torch.randn(tuple(p.shape), generator=g)
    return out


# ----------------------------------------------------------------------------
# gathering states
# ----------------------------------------------------------------------------
def full_states(opt) -> list[dict[str, torch.Tensor]]:
    """Per param (in order), each state gathered to full: QStates as
    {name::codes (uint8 view), name::scale, name::deq}, plain tensors as themselves."""
    from bridge import QState
    from bridge.distributed import is_dtensor
    from bridge.param_states import SCALARS

    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = {}
            for name, v in opt.state[p].items():
                assert torch.is_tensor(v), (name, type(v))  # every state a tensor, of every kind
                if name not in SCALARS and is_dtensor(p):  # placed like its param (step, mu_product: CPU scalars)
                    assert is_dtensor(v) and tuple(v.placements) == tuple(p.placements), (name, v)
                full = v.full_tensor() if is_dtensor(v) else v  # all-gather of each record's parts
                if isinstance(full, QState):
                    assert tuple(full.shape) == tuple(p.shape), (name, full.shape, p.shape)
                    for part, t in full.parts.items():
                        st[f"{name}::{part}"] = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).clone()
                    st[f"{name}::deq"] = full.dequantize()
                    st[f"{name}::format"] = full.label
                else:
                    st[name] = full.detach().clone()
            out.append(st)
    return out


def assert_states_equal(a, b, exact=True, what=""):
    assert len(a) == len(b), (len(a), len(b))
    for i, (sa, sb) in enumerate(zip(a, b)):
        assert sorted(sa) == sorted(sb), (what, i, sorted(sa), sorted(sb))
        for k in sa:
            x, y = sa[k], sb[k]
            if isinstance(x, str):
                assert x == y, (what, i, k, x, y)
            elif exact:
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (what, i, k, x, y)
            else:
                torch.testing.assert_close(x, y, msg=f"{what} param {i} {k}")


def local_rows(t: torch.Tensor, p) -> torch.Tensor:
    """Rows of a full tensor ``t`` that this rank holds of param ``p``."""
    from bridge.distributed import local_row_range

    a, b = local_row_range(p)
    return t[a:b]


def set_global_grads(model: nn.Module, step: int) -> None:
    from bridge.distributed import is_dtensor, wrap_like

    for name, p in model.named_parameters():
        g = global_grads_for(name, p, step)
        p.grad = wrap_like(local_rows(g, p).clone(), p) if is_dtensor(p) else g.to(p.dtype)


def global_grads_for(name: str, p, step: int) -> torch.Tensor:
    seed = 7919 * step + sum(ord(c) * (i + 1) for i, c in enumerate(name))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(p.shape), generator=g).to(p.dtype)


# ----------------------------------------------------------------------------
# 1, 3, 7, 8, 10: parity with an unsharded model, CPU offload, bf16, missing ops
# ----------------------------------------------------------------------------
def _parity_run(rank, world, fmt, offload, steps=6):
    model = make_model()
    ref = copy.deepcopy(model)
    shard(model, world, offload=offload)
    opt, ref_opt = make_opt(model.parameters(), fmt), make_opt(ref.parameters(), fmt)
    for step in range(steps):
        tokens = batch(step, rank)
        loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(tokens)
        ref_loss.backward()
        for p in ref.parameters():  # what FSDP's reduce-scatter computes, unsharded
            dist.all_reduce(p.grad)
            p.grad /= world
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0, msg=f"{fmt} step {step} loss")
    for p, rp in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), rtol=0, atol=0)
        assert p.device.type == "cpu"
        for v in opt.state[p].values():
            assert v.device == p.device, (v.device, p.device)
    assert_states_equal(full_states(opt), full_states(ref_opt), exact=True, what=f"{fmt} offload={offload}")
    return model, opt


def _check_quantized_like_global(opt, min_quant_size):
    """No state that the global rule quantizes is fp32 on any rank (uneven and empty shards too)."""
    from lowbit_tree.moments import should_quantize

    from bridge import QState
    from bridge.distributed import to_local
    from bridge.param_states import SCALARS
    n = 0
    for group in opt.param_groups:
        for p in group["params"]:
            for name, v in opt.state[p].items():
                if name in SCALARS:
                    continue
                expect = should_quantize(tuple(p.shape), min_quant_size)
                assert isinstance(to_local(v), QState) == expect, (name, tuple(p.shape), to_local(v).shape, type(to_local(v)))
                n += expect
    assert n > 0


def parity_worker(rank, world):
    for fmt in ("8bit", "4bitblock", "4bit", "fp8", "ademamix8bit", "muon8bit", "muon4bit", "muonfp32", "muon4bitlr"):
        _, opt = _parity_run(rank, world, fmt, offload=False)
        if fmt != "muonfp32":
            _check_quantized_like_global(opt, 1)
    _parity_run(rank, world, "8bit", offload=True, steps=3)


def bf16_worker(rank, world):
    """bf16 params + stochastic rounding under FSDP2, fed identical global grads."""
    model = make_model(dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    shard(model, world)
    opt = make_opt(model.parameters(), "8bit", bf16_stochastic_round=True)
    ref_opt = make_opt(ref.parameters(), "8bit", bf16_stochastic_round=True)
    before = [p.detach().clone() for p in ref.parameters()]
    for step in range(3):
        set_global_grads(model, step)
        set_global_grads(ref, step)
        opt.step()
        ref_opt.step()
    for p, rp, p0 in zip(model.parameters(), ref.parameters(), before):
        assert p.dtype == torch.bfloat16 and p.to_local().dtype == torch.bfloat16
        full = p.full_tensor()
        assert torch.isfinite(full.float()).all() and not torch.equal(full, p0)
        # rounding bits are drawn per local element: rank 0's rows match the unsharded run
        # exactly; other ranks' rows may round the other way (one bf16 step per step taken)
        if rank == 0:
            assert torch.equal(p.to_local(), local_rows(rp.detach(), p))
        torch.testing.assert_close(full.float(), rp.detach().float(), rtol=2 ** -5, atol=1e-3)
    for st, rst in zip(full_states(opt), full_states(ref_opt)):
        for k in st:  # states depend on gradients only: exact
            assert isinstance(st[k], str) or torch.equal(st[k], rst[k]), k


def errors_worker(rank, world):
    """Failures raise on every rank (no rank left waiting in a collective)."""
    model = shard(make_model(), world)
    opt = make_opt(model.parameters(), "4bit")
    set_global_grads(model, 0)
    opt.step()
    d = opt.state[model.head.weight]["exp_avg"]
    try:
        torch.sin(d)
    except NotImplementedError as e:
        assert "QState" in str(e)
    else:
        raise AssertionError("torch.sin on a DTensor(QState) did not raise")
    dist.barrier()  # every rank got here: nobody hangs


def report_worker(rank, world):
    """format_state_report under FSDP2: per-rank lines equal each rank's own state_bytes(), and
    the whole-model total equals the unsharded optimizer's bytes (row-aligned blocks: the
    shards' codes and scales add up exactly), gathered from every rank; so do the training
    state's bytes (params + gradients + states of the whole model)."""
    import re

    model = make_model()
    ref = copy.deepcopy(model)
    shard(model, world)
    for fmt in FORMATS:
        _mark(rank, "report_worker", fmt)
        opt, ref_opt = make_opt(model.parameters(), fmt), make_opt(ref.parameters(), fmt)
        set_global_grads(model, 0)
        set_global_grads(ref, 0)
        opt.step()
        ref_opt.step()
        text = opt.format_state_report()
        mine = torch.tensor([opt.state_bytes()])
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        per_rank = {int(m[1]): (int(m[2]), int(m[3]))
                    for m in re.finditer(r"^rank (\d+): (\d+) bytes for (\d+) param elements", text, re.M)}
        assert sorted(per_rank) == list(range(world)), text
        assert [per_rank[r][0] for r in range(world)] == [int(t) for t in every], (text, every)
        total = re.search(rf"^total \({world} ranks, whole model\): (\d+) bytes for (\d+) param elements", text, re.M)
        assert total, text
        n_global = sum(p.numel() for p in ref.parameters())
        assert (int(total[1]), int(total[2])) == (ref_opt.state_bytes(), n_global), (text, ref_opt.state_bytes(), n_global)
        assert sum(n for _, n in per_rank.values()) == n_global
        ref_text = ref_opt.format_state_report()
        assert re.search(rf"^total {ref_opt.state_bytes()} bytes", ref_text, re.M), ref_text
        # the training state (params + gradients + states) of the whole model: the unsharded one's
        assert opt.training_bytes() == ref_opt.training_bytes()
        assert text.splitlines()[-1] == ref_text.splitlines()[-1], (text, ref_text)


def _exact_run(rank, world, fmt, steps, hsdp=False, dtype=torch.float32):
    """``fmt``'s optimizer under FSDP2 (or HSDP) and unsharded in this process, both fed the same
    global gradients for ``steps`` steps: params and every gathered state must be equal bit for
    bit. Returns the sharded optimizer."""
    _mark(rank, "exact", fmt)
    model = make_model(dtype=dtype)
    ref = copy.deepcopy(model)
    shard(model, world, hsdp=hsdp)
    opt, ref_opt = make_opt(model.parameters(), fmt), make_opt(ref.parameters(), fmt)
    for step in range(steps):
        set_global_grads(model, step)
        set_global_grads(ref, step)
        opt.step()
        ref_opt.step()
    for p, rp in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), rtol=0, atol=0, msg=f"{fmt} at {world} ranks")
    assert_states_equal(full_states(opt), full_states(ref_opt), exact=True, what=f"{fmt} at {world} ranks")
    return opt


def muon_exact_worker(rank, world, steps=4):
    """Muon (8-bit, 4-bit, fp32 momentum; AdamW on the 1-D params) under FSDP2 fed the same
    global gradients as an unsharded optimizer in this process: params and every gathered state
    bit for bit equal at any world size (uneven shards; an empty one at 3 ranks). Returns the
    bytes this rank sent for Newton-Schulz per step, and the same rows as float32, per format."""
    sent = {fmt: _exact_run(rank, world, fmt, steps).communication()
            for fmt in ("muon8bit", "muon4bit", "muonfp32", "muon4bitlr")}
    # what moved in the last step, summed over ranks: the Newton-Schulz inputs as stored
    total = {f: torch.tensor([c["gather"], c["gather_float32"], c["scatter"]]) for f, c in sent.items()}
    for t in total.values():
        dist.all_reduce(t)
    if world > 1:
        g32 = total["muonfp32"][1].item()
        assert total["muonfp32"][0].item() * 2 == g32  # fp32 buffers: the bfloat16 input, half of float32
        assert total["muon8bit"][0].item() < 0.45 * g32  # 1 byte + a 4-byte scale per block of 8 (up to 8 values)
        assert total["muon4bit"][0].item() < total["muon8bit"][0].item()
        # low rank: two 4-bit residuals (the input, the new buffer) and the factors (on this tiny
        # model's 12-wide matrices, rank-8 factors outweigh the matrix: benchmarks/muon_comm.py
        # measures realistic shapes)
        assert total["muon4bit"][0].item() < total["muon4bitlr"][0].item()
        assert all(t[2].item() == total["muonfp32"][2].item() > 0 for f, t in total.items() if f != "muon4bitlr")
        assert total["muon4bitlr"][2].item() > total["muonfp32"][2].item()  # bfloat16 back, and the new factors
    return sent


def rank1_exact_worker(rank, world, steps=4):
    """AdamW4bit(rank1_normalization=True), and AdamW with ``MIXED_FORMATS`` (8-bit ``exp_avg``,
    rank-1 4-bit ``exp_avg_sq``), under FSDP2 fed the unsharded run's gradients: params and
    gathered states (block records, rank-1 codes, row and column maxima) bit for bit equal at any
    world size. Returns the bytes AdamW4bit's rank sent for the maxima per step."""
    from bridge.distributed import to_local

    mixed = _exact_run(rank, world, "mixed", steps)
    kinds = {(name, to_local(v).label) for p, st in mixed.state.items() if p.ndim == 2 for name, v in st.items()
             if name != "step"}
    assert kinds == {("exp_avg", "dynamic8"), ("exp_avg_sq", "rank1_linear4_unsigned")}, kinds
    opt = _exact_run(rank, world, "4bit", steps)
    assert any(getattr(to_local(v), "kind_name", None) == "rank1" for st in opt.state.values() for v in st.values())
    reducers = [r for r in opt.param_states.reducers() if r is not None]
    return sum(r.sent for r in reducers) // steps


def correction_exact_worker(rank, world, steps=3):
    """bfloat16 params with ``param_correction=True`` (AdamW8bit, AdamW4bit) under FSDP2 fed the
    unsharded run's gradients: params, int8 corrections (gathered, placed like their params)
    and every other state bit for bit equal at any world size."""
    for fmt in ("8bitc", "4bitc"):
        states = full_states(_exact_run(rank, world, fmt, steps, dtype=torch.bfloat16))
        assert all(st["param_correction"].dtype == torch.int8 for st in states)
        assert any(st["param_correction"].abs().sum() > 0 for st in states)


def rules_exact_worker(rank, world, steps=4):
    """RMSprop8bit / RMSprop4bit (momentum, centered) and Adagrad8bit / AdagradFp8 (lr_decay, an
    initial accumulator value) under FSDP2 fed the unsharded run's global gradients: params and
    every gathered state bit for bit the unsharded optimizer's."""
    for fmt in ("rmsprop8bit", "rmsprop4bit", "adagrad8bit", "adagradfp8"):
        opt = _exact_run(rank, world, fmt, steps)
        _check_quantized_like_global(opt, 1)


def family_worker(rank, world, workdir, steps=3):
    """Each of :data:`FAMILY_FORMATS` under FSDP2: fed the unsharded run's global gradients, params
    and every gathered state bit for bit the unsharded optimizer's; then dcp.save after training
    steps, dcp.load into a fresh model and optimizer: the same states bit for bit and the same
    losses as the run that went on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    for fmt in FAMILY_FORMATS:
        _check_quantized_like_global(_exact_run(rank, world, fmt, steps), 1)
        _mark(rank, "family dcp", fmt)
        path = os.path.join(workdir, f"family_{fmt}_{world}")
        model = shard(make_model(), world)
        opt = make_opt(model.parameters(), fmt)
        for step in range(steps):
            global_batch_step(model, opt, step, rank, world)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        saved = full_states(opt)
        losses = [global_batch_step(model, opt, step, rank, world) for step in range(steps, steps + 2)]
        m2, o2 = _fresh(world, fmt)
        _dcp_load(m2, o2, path)
        assert_states_equal(full_states(o2), saved, what=f"{fmt} dcp round trip at {world} ranks")
        assert [global_batch_step(m2, o2, step, rank, world) for step in range(steps, steps + 2)] == losses


def parity_all_worker(rank, world):
    parity_worker(rank, world)
    report_worker(rank, world)
    bf16_worker(rank, world)
    errors_worker(rank, world)


# ----------------------------------------------------------------------------
# 2, 3: mesh invariance; 4, 5, 6, 9: checkpoints
# ----------------------------------------------------------------------------
FORMATS = ("8bit", "4bitblock", "4bit", "fp8", "ademamix8bit", "muon8bit", "muon4bitlr", "rmsprop8bit", "adagrad8bit")  # names of OPTIMIZERS: AdamW in three
# formats and with rank-1 4-bit second moments, AdEMAMix, Muon8bit and Muon4bit (low-rank momentum)
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks
MESH_MIN_QUANT = 100  # (13, 12) = 156 elements: quantized, though a 7-row shard has 84


def global_batch_step(model, opt, step, rank, world) -> float:
    """One step on this rank's slice of a fixed global batch; returns the global mean loss."""
    g = torch.Generator().manual_seed(555 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    n = GLOBAL_BATCH // world
    loss = model(tokens[rank * n:(rank + 1) * n])
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach().clone()
    if dist.is_initialized() and world > 1:
        dist.all_reduce(loss)
        loss /= world
    return loss.item()


def full_params(model):
    from bridge.distributed import is_dtensor

    return [p.full_tensor() if is_dtensor(p) else p.detach().clone() for p in model.parameters()]


def mesh_invariance_part(rank, world, workdir):
    out = {}
    for fmt in FORMATS:
        _mark(rank, "mesh_invariance_part", fmt)
        model = shard(make_model(), world)
        opt = make_opt(model.parameters(), fmt, min_quant_size=MESH_MIN_QUANT)
        for step in range(3):
            set_global_grads(model, step)
            opt.step()
        _check_quantized_like_global(opt, MESH_MIN_QUANT)
        out[fmt] = {"states": full_states(opt), "params": full_params(model)}
    if rank == 0:
        torch.save(out, os.path.join(workdir, f"mesh_{world}.pt"))


def _fresh(world, fmt, seed=1):
    model = shard(make_model(seed=seed), world)  # other weights than the saved run: loading must overwrite them
    return model, make_opt(model.parameters(), fmt)


def _dcp_load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def checkpoint_save_part(rank, world, workdir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict,
    )

    full_cpu = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {}
    for fmt in FORMATS:
        _mark(rank, "checkpoint_save_part", fmt)
        path = os.path.join(workdir, f"ckpt_{fmt}")
        model = shard(make_model(), world)
        opt = make_opt(model.parameters(), fmt)
        for step in range(4):
            global_batch_step(model, opt, step, rank, world)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        saved = full_states(opt)
        full_osd = copy.deepcopy(get_optimizer_state_dict(model, opt, options=full_cpu))  # rank 0 only
        full_msd = copy.deepcopy(get_model_state_dict(model, options=full_cpu))
        # on every rank. Copies: as with torch.optim, 0-d states ('step') are the live tensors
        # (on a CPU-only box, cpu_offload does not copy them either)
        full_all = copy.deepcopy(get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)))
        full_msd_all = copy.deepcopy(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
        assert (len(full_osd) > 0) == (rank == 0)
        if rank == 0:
            for st in full_osd["state"].values():
                for v in st.values():
                    for t in (v.values() if isinstance(v, dict) else [v]):  # quantized: {"codes", "scale"}
                        assert not isinstance(t, torch.distributed.tensor.DTensor) and t.device.type == "cpu"
        losses = [global_batch_step(model, opt, step, rank, world) for step in range(4, 7)]
        after = full_states(opt)
        out[fmt] = {"saved": saved, "losses": losses, "after": after, "full_osd": full_osd, "full_msd": full_msd}

        # 4. DCP round trip at the same world size: exact states, identical continuation
        m2, o2 = _fresh(world, fmt)
        _dcp_load(m2, o2, path)
        assert_states_equal(full_states(o2), saved, what=f"{fmt} dcp round trip")
        assert [global_batch_step(m2, o2, step, rank, world) for step in range(4, 7)] == losses
        assert_states_equal(full_states(o2), after, what=f"{fmt} dcp continued")

        # 6, 9. set_optimizer_state_dict(full_state_dict=True), with and without broadcast_from_rank0
        for bcast in (False, True):
            m3, o3 = _fresh(world, fmt)
            if bcast:
                osd, msd = (copy.deepcopy(full_osd), copy.deepcopy(full_msd)) if rank == 0 else ({}, {})
                opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            else:
                osd = copy.deepcopy(full_all)
                msd = copy.deepcopy(full_msd_all)
                opts = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(m3, o3, osd, options=opts)
            assert_states_equal(full_states(o3), saved, what=f"{fmt} full sd bcast={bcast}")
            set_model_state_dict(m3, msd, options=opts)
            assert [global_batch_step(m3, o3, step, rank, world) for step in range(4, 7)] == losses
    if rank == 0:
        torch.save(out, os.path.join(workdir, "saved.pt"))


def checkpoint_load_part(rank, world, workdir):
    """5. Reshard: load the 2-rank checkpoint at this world size."""
    ref = torch.load(os.path.join(workdir, "saved.pt"), weights_only=False)
    for fmt in FORMATS:
        _mark(rank, "checkpoint_load_part", fmt)
        model, opt = _fresh(world, fmt)
        _dcp_load(model, opt, os.path.join(workdir, f"ckpt_{fmt}"))
        assert_states_equal(full_states(opt), ref[fmt]["saved"], what=f"{fmt} resharded 2->{world}")
        losses = [global_batch_step(model, opt, step, rank, world) for step in range(4, 7)]
        # another world size sums gradients in another order: close, not bit-equal
        torch.testing.assert_close(losses, ref[fmt]["losses"], rtol=1e-5, atol=1e-6)


def checkpoint_worker(rank, world, mode, workdir):
    mesh_invariance_part(rank, world, workdir)
    if mode == "save":
        checkpoint_save_part(rank, world, workdir)
    elif mode == "load":
        checkpoint_load_part(rank, world, workdir)


def mesh_worker(rank, world, workdir):
    mesh_invariance_part(rank, world, workdir)


def dcp_cycles_worker(rank, world, workdir, cycles=3):
    """The flow that used to abort a rank 1 launch in 7 (benchmarks/launch_soak.py --worker
    dcp_cycles_worker): per format, 4 FSDP2 steps, ``dcp.save``, a gather of every state,
    a DCP load into a fresh model and another gather, ``cycles`` times. Each gather of a
    quantized state is two all-gathers (codes, scales); with both in flight at once gloo
    corrupted the heap (design.md, "One collective in flight")."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    for k in range(cycles):
        for fmt in FORMATS:
            _mark(rank, f"dcp_cycles {k}", fmt)
            path = os.path.join(workdir, f"ckpt_{fmt}_{k}")
            model = shard(make_model(), world)
            opt = make_opt(model.parameters(), fmt)
            for step in range(4):
                global_batch_step(model, opt, step, rank, world)
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=path)
            saved = full_states(opt)
            m2, o2 = _fresh(world, fmt)
            _dcp_load(m2, o2, path)
            assert_states_equal(full_states(o2), saved, what=f"{fmt} dcp cycle {k}")


# ----------------------------------------------------------------------------
# single process (no process group): the full state dict of a sharded run
# ----------------------------------------------------------------------------
def by_index(full_osd: dict, model: nn.Module) -> dict:
    """A get_optimizer_state_dict(full_state_dict=True) dict (FQN keys) in torch.optim's
    param-index layout, for a plain optimizer over ``model.parameters()``."""
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in full_osd["param_groups"]]
    return {"state": {index[n]: st for n, st in full_osd["state"].items()}, "param_groups": groups}


# ----------------------------------------------------------------------------
# a rank killed in the middle of dcp.save (tests/test_reliability.py)
# ----------------------------------------------------------------------------
def _example_module():
    """examples/fsdp_train.py as a module: its save_checkpoint / latest_checkpoint are under test."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "fsdp_train.py")
    spec = importlib.util.spec_from_file_location("fsdp_train_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _killing_writer(marker: str):
    """A FileSystemWriter whose rank 1 writes its shard files, then dies by SIGKILL (no cleanup,
    no exception: what an OOM kill or a lost node does) before the save completes."""
    import signal

    import torch.distributed.checkpoint as dcp

    class KillingWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            if dist.get_rank() == 1:
                fut.wait()
                with open(marker, "w") as f:
                    f.write("killed\n")
                os.kill(os.getpid(), signal.SIGKILL)
            return fut

    return KillingWriter


def _ckpt_state(model, opt, step):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": step}


def kill_during_save_worker(rank, world, root, phase):
    """phase "save": 3 steps, checkpoint step 3 (example's atomic save), 3 more steps (their
    losses and final states kept as the reference), then a save of step 6 during which rank 1
    is SIGKILLed. phase "resume": a fresh model loads the latest complete checkpoint: states
    equal the step-3 ones bit for bit and the next 3 steps repeat the reference losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    ex = _example_module()
    ref_path = os.path.join(os.path.dirname(root), "reference.pt")
    if phase == "save":
        model = shard(make_model(), world)
        opt = make_opt(model.parameters(), "8bit")
        for step in range(3):
            global_batch_step(model, opt, step, rank, world)
        saved = ex.save_checkpoint(_ckpt_state(model, opt, 3), root, 3)
        assert saved == os.path.join(root, "step-3")
        states = full_states(opt)
        losses = [global_batch_step(model, opt, step, rank, world) for step in range(3, 6)]
        after = full_states(opt)  # a collective: on every rank
        if rank == 0:
            torch.save({"states": states, "losses": losses, "after": after}, ref_path)
        dist.barrier()
        ex.save_checkpoint(_ckpt_state(model, opt, 6), root, 6, writer=_killing_writer(os.path.join(os.path.dirname(root), "killed")))
        raise AssertionError("the save with a killed rank returned")
    ref = torch.load(ref_path, weights_only=False)
    path = ex.latest_checkpoint(root)
    assert path == os.path.join(root, "step-3"), path
    model, opt = _fresh(world, "8bit")
    state = _ckpt_state(model, opt, 0)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    assert state["step"] == 3
    assert_states_equal(full_states(opt), ref["states"], what="resumed from step-3")
    assert [global_batch_step(model, opt, step, rank, world) for step in range(3, 6)] == ref["losses"]
    assert_states_equal(full_states(opt), ref["after"], what="continued after resume")


def full_gather_worker(rank, world, path, fmt, steps=3):
    """A torchtune-style full checkpoint: ``fmt``'s optimizer under FSDP2 for ``steps`` steps on
    the global gradients, then every state walked in ``opt.state`` and gathered with
    ``DTensor.full_tensor()`` (records included), saved with ``torch.save`` on rank 0 beside the
    gathered params and the param groups."""
    from bridge.distributed import is_dtensor

    model = shard(make_model(), world)
    opt = make_opt(model.parameters(), fmt)
    for step in range(steps):
        set_global_grads(model, step)
        opt.step()
    state = {}
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):  # the optimizer's order
        state[i] = {}
        for name, v in opt.state[p].items():
            assert torch.is_tensor(v), (fmt, name, type(v))
            state[i][name] = v.full_tensor() if is_dtensor(v) else v
    full_params = [p.full_tensor().detach() for p in model.parameters()]
    if rank == 0:
        torch.save({"state": state, "param_groups": opt.state_dict()["param_groups"], "params": full_params}, path)


def hsdp_exact_worker(rank, world, steps=3):
    """HSDP (2 replicas of ``world // 2`` shards): every state a DTensor placed like its param,
    params and gathered states of every record kind bit for bit the unsharded run's."""
    for fmt in ("8bit", "4bit", "fp8", "muon4bitlr"):
        _exact_run(rank, world, fmt, steps, hsdp=True)


# ----------------------------------------------------------------------------
# the step in backward (bridge.step_in_backward)
# ----------------------------------------------------------------------------
def _in_backward_opts():
    """name -> (params -> optimizer, param dtype): every optimizer family."""
    import bridge

    kw = dict(lr=1e-2, block_size=8, min_quant_size=1)
    return {
        "AdamW8bit": (lambda ps: bridge.AdamW8bit(ps, weight_decay=0.1, **kw), torch.float32),
        "AdamW4bit": (lambda ps: bridge.AdamW4bit(ps, weight_decay=0.1, **kw), torch.float32),  # rank-1: all-reduces
        "AdamW": (lambda ps: bridge.AdamW(ps, weight_decay=0.1, **kw), torch.float32),
        "Lion8bit": (lambda ps: bridge.Lion8bit(ps, **kw), torch.float32),
        "SGD8bit": (lambda ps: bridge.SGD8bit(ps, momentum=0.9, **kw), torch.float32),
        "AdEMAMix8bit": (lambda ps: bridge.AdEMAMix8bit(ps, **kw), torch.float32),
        "Muon8bit": (lambda ps: make_opt(ps, "muon8bit"), torch.float32),  # Newton-Schulz on an owner rank
        "AdamW8bit-bf16-sr": (lambda ps: bridge.AdamW8bit(ps, bf16_stochastic_round=True, **kw), torch.bfloat16),
    }


def _in_backward_pair(world, name):
    make, dtype = _in_backward_opts()[name]
    model = make_model(dtype=dtype)
    ref = copy.deepcopy(model)
    shard(model, world)
    shard(ref, world)
    return model, ref, make(model.parameters()), make(ref.parameters())


def _grad_probe(params):
    """A hook on every sharded param, registered before step_in_backward's (so it runs first):
    records how many params hold a gradient then, and checks the gradient is the param's shard."""
    seen = []

    def probe(p):
        assert p.grad is not None and p.grad.to_local().shape == p.to_local().shape
        seen.append(sum(q.grad is not None for q in params))

    return seen, [p.register_post_accumulate_grad_hook(probe) for p in params]


def _assert_same_sharded(model, ref, opt, ref_opt, what):
    for p, rp in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.to_local(), rp.to_local()), what
    assert_states_equal(full_states(opt), full_states(ref_opt), exact=True, what=what)


def steps_in_backward_match(model, ref, opt, ref_opt, steps: int, rank: int, name: str) -> None:
    """``steps`` steps of ``model``, whose optimizer steps in backward (every gradient freed by
    then), against ``ref`` stepped after its backward: the same loss at every step."""
    params = list(model.parameters())
    for step in range(steps):
        tokens = batch(step, rank)
        loss = model(tokens)
        loss.backward()
        assert all(p.grad is None for p in params), name
        opt.step()
        ref_loss = ref(tokens)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(loss, ref_loss), (name, step, loss, ref_loss)


def step_in_backward_worker(rank, world, steps=3):
    """bridge.step_in_backward on an FSDP2 model against opt.step() on a sharded deep copy fed the
    same batches (each rank its own): losses, params and every gathered state bit for bit, for
    every optimizer family; FSDP2 calls each sharded param's hook once per backward, after the
    unit's reduce-scatter, with only that param holding a gradient. Then FSDP2's accumulation:
    a first micro-batch under set_requires_gradient_sync(False) calls no hook, the second
    reduces and steps once, as opt.step() after both."""
    import bridge

    for name in _in_backward_opts():
        _mark(rank, "step_in_backward", name)
        model, ref, opt, ref_opt = _in_backward_pair(world, name)
        params = list(model.parameters())
        seen, probes = _grad_probe(params)
        handle = bridge.step_in_backward(model, opt)
        steps_in_backward_match(model, ref, opt, ref_opt, steps, rank, name)
        assert set(seen) == {1} and len(seen) == steps * len(params), (name, seen)
        _assert_same_sharded(model, ref, opt, ref_opt, name)
        handle.remove()
        for h in probes:
            h.remove()

    _mark(rank, "step_in_backward", "accumulation")
    model, ref, opt, ref_opt = _in_backward_pair(world, "AdamW4bit")
    params = list(model.parameters())
    seen, probes = _grad_probe(params)
    with bridge.step_in_backward(model, opt):
        for step in range(2):
            for m in (model, ref):
                m.set_requires_gradient_sync(False)
                m(batch(step, rank)).backward()
                m.set_requires_gradient_sync(True)
            assert not seen and all(p.grad is None for p in params)
            for m in (model, ref):
                m(batch(10 + step, rank)).backward()
            assert len(seen) == len(params) and all(p.grad is None for p in params)
            seen.clear()
            opt.step()
            ref_opt.step()
            ref_opt.zero_grad()
    _assert_same_sharded(model, ref, opt, ref_opt, "accumulation")
    assert all(float(opt.state[p]["step"]) == 2 for p in params)


# ----------------------------------------------------------------------------
# SOAP: each param stepped whole on its owner rank
# ----------------------------------------------------------------------------
def _soap_states(opt, p) -> dict:
    """``opt.state[p]`` as plain whole tensors: a DTensor state's ``full_tensor()``, a QState's
    parts under ``name::part`` and its value under ``name::value``."""
    from torch.distributed.tensor import DTensor

    from bridge import QState

    out = {}
    for name, v in opt.state[p].items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, QState):
            out[f"{name}::value"] = v.dequantize()
            for part, t in v.parts.items():
                out[f"{name}::{part}"] = t.clone()
        else:
            out[name] = v.clone()
    return out


def soap_exact_worker(rank, world, steps=7):
    """SOAP (fp32), SOAP8bit and SOAP4bit under FSDP2 (uneven shards; an empty one at 3 ranks), fed the
    same global gradients as an unsharded optimizer in this process, refreshing the eigenbases
    every 2 steps: every param, and ``full_tensor()`` of every state of each param on every rank,
    bit for bit the unsharded run's (each state but the 0-d scalars a DTensor on the param's mesh:
    the moments placed like the param, the factors ``Shard(0)``). Returns the bytes this rank sent
    in the last step, per class."""
    from torch.distributed.tensor import DTensor, Shard
    import bridge

    sent = {}
    for cls in (bridge.SOAP, bridge.SOAP8bit, bridge.SOAP4bit):
        _mark(rank, "soap", cls.__name__)
        model = make_model()
        ref = copy.deepcopy(model)
        shard(model, world)
        kw = dict(lr=1e-2, precondition_frequency=2, min_quant_size=64)
        opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
        for step in range(steps):
            set_global_grads(model, step)
            set_global_grads(ref, step)
            opt.step()
            ref_opt.step()
        for i, (p, rp) in enumerate(zip(model.parameters(), ref.parameters())):
            what = f"{cls.__name__} param {i} at {world} ranks"
            assert torch.equal(p.full_tensor(), rp.detach()), what
            got, want = _soap_states(opt, p), _soap_states(ref_opt, rp)
            assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (what, k)
            for name, v in opt.state[p].items():
                if name in ("step", "soap_step", "precond_failures"):
                    assert not isinstance(v, DTensor), (what, name)
                    continue
                assert isinstance(v, DTensor) and v.device_mesh == p.device_mesh, (what, name)
                want_pl = p.placements if name.startswith("exp_avg") else (Shard(0),)
                assert tuple(v.placements) == tuple(want_pl), (what, name, v.placements)
        assert int(ref_opt.state[next(ref.parameters())]["soap_step"]) == steps
        if cls is not bridge.SOAP:  # the test reaches quantized bases
            assert any(isinstance(v, bridge.QState) for st in ref_opt.state.values() for n, v in st.items()
                       if n.startswith("eigenbasis"))
        sent[cls.__name__] = opt.communication()
        # state_report: each rank its own blocks; over ranks the unsharded total, plus each other
        # rank's copy of the 0-d scalars
        mine = torch.tensor([opt.state_report()[-1].nbytes])
        dist.all_reduce(mine)
        ref_rows = ref_opt.state_report()
        scalar_bytes = sum(r.nbytes for r in ref_rows
                           if r.path.rsplit("/", 1)[-1] in ("step", "soap_step", "precond_failures"))
        assert mine.item() == ref_rows[-1].nbytes + (world - 1) * scalar_bytes, (mine, ref_rows[-1])
        # float32 rows padded to the largest shard's: each non-owner's param and gradient rows
        # to the owner, the owner's update rows to each other rank
        padded = sum(4 * -(-p.shape[0] // world) * (p.numel() // p.shape[0]) * (world - 1) for p in ref.parameters())
        total = torch.tensor([sent[cls.__name__]["gather"], sent[cls.__name__]["scatter"]])
        dist.all_reduce(total)
        assert total.tolist() == [2 * padded, padded], (total, padded)
        states = torch.tensor([sent[cls.__name__]["state_gather"], sent[cls.__name__]["state_scatter"]])
        dist.all_reduce(states)
        assert states.min() > 0, states
    _soap_refusals(world)
    _soap_host_group(world)
    return sent


def _soap_host_group(world, steps=3):
    """The mesh's group reported as carrying cuda alone (an NCCL-only group, simulated by patching
    :func:`bridge.collectives.device_types`), params offloaded to the host: SOAP's step raises
    ``group_for``'s error naming its gather and the fix; with a gloo group over the same ranks
    passed to ``bridge.set_host_group``, its gathers and scatters run on that group, and the
    params are bit for bit those of one process."""
    import bridge
    from bridge import collectives as C

    real, real_gather, real_scatter = C.device_types, dist.gather, dist.scatter
    host = dist.new_group(list(range(world)), backend="gloo")
    groups = []

    def recording(fn):
        def call(*args, group=None, **kw):
            groups.append(group)
            return fn(*args, group=group, **kw)
        return call

    C.device_types = lambda g: real(g) if g is host else {"cuda"}
    try:
        model = shard(make_model(), world, offload=True)
        opt = bridge.SOAP(model.parameters(), **SOAP_KW)
        set_global_grads(model, 0)
        try:
            opt.step()
        except RuntimeError as e:
            msg = str(e)
        else:
            raise AssertionError("SOAP: an offloaded step over an NCCL-only group did not raise")
        assert msg.startswith("SOAP's gather of a param's and its gradient's blocks to the owner: a collective of "
                              "cpu tensors"), msg
        for fix in ("init_process_group(backend='cpu:gloo,cuda:nccl')", "bridge.set_host_group(...)",
                    "carries only ['cuda']"):
            assert fix in msg, (fix, msg)
        C.set_host_group(host)
        dist.gather, dist.scatter = recording(real_gather), recording(real_scatter)
        try:
            ref = make_model()
            model = shard(copy.deepcopy(ref), world, offload=True)
            opt, ref_opt = bridge.SOAP(model.parameters(), **SOAP_KW), bridge.SOAP(ref.parameters(), **SOAP_KW)
            for step in range(steps):
                set_global_grads(model, step)
                set_global_grads(ref, step)
                opt.step()
                ref_opt.step()
        finally:
            dist.gather, dist.scatter = real_gather, real_scatter
            C.set_host_group()
        n = len(list(ref.parameters()))
        # per param and step: a gather each of its block, its gradient's and (most of) its states' parts, one scatter
        assert len(groups) > 3 * steps * n and all(g is host for g in groups), (len(groups), groups[:3])
        for p, rp in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.full_tensor(), rp.detach())
    finally:
        C.device_types = real


def _soap_refusals(world):
    """Any Shard / Replicate placement on a 1-D mesh is taken, with skip_nonfinite too
    (tests/test_soap_tp.py steps them); a 2-D mesh over some of the processes is refused by name."""
    import bridge
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for placement in (Replicate(), Shard(1), Shard(0)):
        bridge.SOAP([torch.nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, [placement]))], skip_nonfinite=True)
    if world == 3:  # a (1, 2) mesh over ranks 0 and 1 of 3
        from torch.distributed.device_mesh import DeviceMesh

        sub = DeviceMesh("cpu", [[0, 1]])
        if dist.get_rank() < 2:
            p = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 4), sub, [Shard(0), Shard(1)]))
            try:
                bridge.SOAP([p])
            except ValueError as e:
                assert "a 2-D mesh must span every process" in str(e) and "SOAP" in str(e), e
            else:
                raise AssertionError("a 2-D mesh over 2 of 3 processes was not refused")


SOAP_KW = dict(lr=1e-2, precondition_frequency=2, min_quant_size=64)


def _soap_pair(cls, world, steps):
    """An unsharded SOAP run of ``steps`` steps in this process, and an FSDP2 copy of its model
    with a fresh optimizer (params as the reference's after those steps)."""
    ref = make_model()
    ref_opt = cls(ref.parameters(), **SOAP_KW)
    for step in range(steps):
        set_global_grads(ref, step)
        ref_opt.step()
    model = shard(copy.deepcopy(ref), world)
    return ref, ref_opt, model, cls(model.parameters(), **SOAP_KW)


def _assert_soap_states_equal(opt, model, ref_opt, ref, what):
    """Every param, and ``full_tensor()`` of every state on every rank, bit for bit the reference's."""
    for i, (p, rp) in enumerate(zip(model.parameters(), ref.parameters())):
        assert torch.equal(p.full_tensor(), rp.detach()), (what, i)
        got, want = _soap_states(opt, p), _soap_states(ref_opt, rp)
        assert sorted(got) == sorted(want), (what, i, sorted(got), sorted(want))
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (what, i, k)


def soap_dcp_save_worker(rank, world, workdir, steps=4, helpers=False):
    """SOAP and SOAP8bit under FSDP2, ``steps`` steps, then ``dcp.save`` of ``opt.state_dict()``
    (every state a DTensor but the 0-d scalars: each rank saves its blocks); ``helpers``: of
    torch's ``get_optimizer_state_dict`` (keys by param name, as torchtitan saves)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    import bridge

    for cls in (bridge.SOAP, bridge.SOAP8bit):
        model = shard(make_model(), world)
        opt = cls(model.parameters(), **SOAP_KW)
        for step in range(steps):
            set_global_grads(model, step)
            opt.step()
        sd = get_optimizer_state_dict(model, opt) if helpers else opt.state_dict()
        dcp.save({"optim": sd}, checkpoint_id=os.path.join(workdir, cls.__name__))


def soap_dcp_load_worker(rank, world, workdir, steps=4, more=3, helpers=False):
    """The checkpoint of :func:`soap_dcp_save_worker` loaded at ``world`` ranks (blocks and owners
    change): ``full_tensor()`` of every state bit for bit the unsharded run's after ``steps``
    steps, and the same again after ``more`` steps (an eigenbasis refresh among them);
    ``helpers``: through torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    import bridge

    for cls in (bridge.SOAP, bridge.SOAP8bit):
        ref, ref_opt, model, opt = _soap_pair(cls, world, steps)
        sd = get_optimizer_state_dict(model, opt) if helpers else opt.state_dict()
        dcp.load({"optim": sd}, checkpoint_id=os.path.join(workdir, cls.__name__))
        if helpers:
            set_optimizer_state_dict(model, opt, sd)
        else:
            opt.load_state_dict(sd)
        step_on_after_load(opt, ref_opt, range(steps, steps + more),
                           lambda step: (set_global_grads(model, step), set_global_grads(ref, step)),
                           lambda what: _assert_soap_states_equal(opt, model, ref_opt, ref, what),
                           f"{cls.__name__} loaded at {world} ranks")


def step_on_after_load(opt, ref_opt, steps, set_grads, check, what: str) -> None:
    """After a checkpoint's load: ``check(what)`` (the loaded state is the reference's), then each
    of ``steps`` on both optimizers, their gradients set by ``set_grads(step)``, and ``check``
    again (the continuation is the reference's too)."""
    check(what)
    for step in steps:
        set_grads(step)
        opt.step()
        ref_opt.step()
    check(what + ", continued")


def soap_full_tensor_worker(rank, world, steps=5):
    """SOAP and SOAP4bit, ``steps`` steps (eigenbasis refreshes every 2): under FSDP2, and with
    params placed on a 1-D mesh the ways that choose each placement of a moment (a 1-D one, float32,
    and a quantized matrix whose shards hold whole blocks, like the param; a quantized matrix whose
    column shards cut its blocks, by rows): every state a DTensor placed so, its
    ``full_tensor()`` (a record's parts and value) bit for bit the one-process state's, also after
    loading the one-process state dict (whole tensors, cut to each rank's blocks), and the state
    gathers and scatters counted by ``communication()``."""
    import bridge
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    whole = {"vec": (torch.randn(70, generator=g), Shard(0)), "cut": (torch.randn(9, 40, generator=g), Shard(1)),
             "aligned": (torch.randn(4, 512, generator=g), Shard(1))}
    for cls in (bridge.SOAP, bridge.SOAP4bit):
        _mark(rank, "soap full_tensor", cls.__name__)
        ref, ref_opt, model, opt = _soap_pair(cls, world, 0)
        rps = [torch.nn.Parameter(t.clone()) for t, _ in whole.values()]
        ps = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [pl])) for t, pl in whole.values()]
        ropt2, opt2 = cls(rps, **SOAP_KW), cls(ps, **SOAP_KW)
        for step in range(steps):
            set_global_grads(model, step)
            set_global_grads(ref, step)
            for p, rp in zip(ps, rps):
                grad = torch.randn(rp.shape, generator=torch.Generator().manual_seed(100 + step))
                rp.grad = grad
                p.grad = distribute_tensor(grad, mesh, p.placements, src_data_rank=None)
            opt.step()
            ref_opt.step()
            opt2.step()
            ropt2.step()
        _assert_soap_states_equal(opt, model, ref_opt, ref, f"{cls.__name__} FSDP2")
        # a one-process state dict (whole tensors) loads into the sharded optimizer: each rank takes its blocks
        opt3 = cls(ps, **SOAP_KW)
        opt3.load_state_dict(ropt2.state_dict())
        for o in (opt2, opt3):
            for p, rp in zip(ps, rps):
                got, want = _soap_states(o, p), _soap_states(ropt2, rp)
                assert sorted(got) == sorted(want), (sorted(got), sorted(want))
                for k in want:
                    what = (cls.__name__, tuple(p.shape), k)
                    assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), what
        quantized = cls is bridge.SOAP4bit
        for (name, (_, pl)), p in zip(whole.items(), ps):
            st = opt2.state[p]
            moment = {"vec": Shard(0), "cut": Shard(0) if quantized else Shard(1),
                      "aligned": Shard(1)}[name]
            for k in ("exp_avg", "exp_avg_sq"):
                assert isinstance(st[k], DTensor) and tuple(st[k].placements) == (moment,), (name, k, st[k].placements)
                assert isinstance(st[k].to_local(), bridge.QState) == (quantized and name != "vec"), (name, k)
            for k, v in st.items():
                if k.startswith(("eigenbasis", "coupling", "eigenvalues")):
                    assert tuple(v.placements) == (Shard(0),), (name, k, v.placements)
        assert any(isinstance(v.to_local(), bridge.QState) for k, v in opt.state[next(model.parameters())].items()
                   if k.startswith("eigenbasis")) == quantized
        sent = torch.tensor([opt.communication()[k] for k in ("state_gather", "state_scatter")])
        dist.all_reduce(sent)
        assert sent.min() > 0, sent
