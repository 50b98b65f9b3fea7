"""Worker functions for tests/test_offload.py: FSDP2 with ``CPUOffloadPolicy`` against the same
FSDP2 run without it, DCP across world sizes with offload, and the threads a rank's step uses.

The model, sharding, gradients and state gathering are ``fsdp_workers``' (a tiny transformer whose
weights shard unevenly); this module adds the optimizer families that module does not build
(Lion8bit, SGD8bit) and the offload scenarios. The workers run under ``fsdp_workers.launch``
(spawned gloo ranks), except :func:`threads_worker`, which runs under ``torchrun`` (``python
tests/offload_workers.py threads``) so that the thread count comes from the environment torchrun
gives each rank.
"""
from __future__ import annotations

import copy
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fsdp_workers, under torchrun too

import fsdp_workers as W  # noqa: E402

# every optimizer family, by the names of fsdp_workers.OPTIMIZERS plus two of ours
FAMILIES = (
    "8bit",          # AdamW8bit
    "4bit",          # AdamW4bit: rank-1 4-bit second moments (its default), maxima all-reduced
    "fp8",           # AdamWFp8
    "lion8bit",      # Lion8bit
    "sgd8bit",       # SGD8bit with momentum
    "ademamix8bit",  # AdEMAMix8bit
    "muon8bit",      # Muon, 8-bit momentum: Newton-Schulz on owner ranks
    "muon4bitlr",    # Muon4bit: low-rank momentum, factors refreshed on owner ranks
    "mixed",         # AdamW(state_format={"exp_avg": "8bit", "exp_avg_sq": "4bit"})
    "8bitc",         # AdamW8bit(param_correction=True), bfloat16 params
    "4bitc",         # AdamW4bit(param_correction=True), bfloat16 params
    "8bit-bf16compute",  # AdamW8bit on float32 params, FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16)
)
CORRECTED = ("8bitc", "4bitc")  # families whose params are bfloat16


def make_opt(params, fmt: str):
    """``fmt``'s optimizer over ``params`` (tiny-model settings: blocks of 8, every 2-D state quantized)."""
    import bridge

    kw = dict(block_size=8, min_quant_size=1)
    if fmt == "lion8bit":
        return bridge.Lion8bit(params, lr=1e-3, weight_decay=0.1, **kw)
    if fmt == "sgd8bit":
        return bridge.SGD8bit(params, lr=1e-2, momentum=0.9, weight_decay=0.1, **kw)
    return W.make_opt(params, "8bit" if fmt == "8bit-bf16compute" else fmt)


def shard(model: nn.Module, world: int, offload: bool, fmt: str) -> nn.Module:
    """``fsdp_workers.shard``; for ``"8bit-bf16compute"`` with FSDP2's mixed precision (float32
    params and gradient shards on the host, bfloat16 all-gathers and compute, float32 reduction)."""
    if fmt != "8bit-bf16compute":
        return W.shard(model, world, offload=offload)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw = {"mesh": init_device_mesh("cpu", (world,)),
          "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for blk in model.blocks:
        fully_shard(blk, **kw)
    return fully_shard(model, **kw)


def param_dtype(fmt: str) -> torch.dtype:
    return torch.bfloat16 if fmt in CORRECTED else torch.float32


def assert_offloaded(model: nn.Module, opt, offload: bool) -> None:
    """Every FSDP2 param is (or is not) under ``CPUOffloadPolicy``; sharded params and every
    state live on the host either way (a CPU-only machine)."""
    from torch.distributed.fsdp import FSDPModule

    from bridge.distributed import to_local

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(units) == 1 + len(model.blocks), units
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is not None:
            assert all(fp.offload_to_cpu == offload for fp in group.fsdp_params), (offload, unit)
    for p in model.parameters():
        assert p.to_local().device.type == "cpu"
        for v in opt.state[p].values():
            assert to_local(v).device.type == "cpu", (type(v), v.device)


def assert_same(model, ref, opt, ref_opt, what: str) -> None:
    """Params (gathered) and every gathered state (codes, scales, maxima, factors, corrections)
    bit for bit."""
    for p, rp in zip(model.parameters(), ref.parameters()):
        a, b = p.full_tensor(), rp.full_tensor()
        assert a.dtype == b.dtype and torch.equal(a, b), what
    W.assert_states_equal(W.full_states(opt), W.full_states(ref_opt), exact=True, what=what)


def _pair(world: int, fmt: str):
    """An offloaded FSDP2 model and a non-offloaded one with the same weights, each with ``fmt``'s optimizer."""
    model = W.make_model(dtype=param_dtype(fmt))
    ref = copy.deepcopy(model)
    shard(model, world, True, fmt)
    shard(ref, world, False, fmt)
    return model, ref, make_opt(model.parameters(), fmt), make_opt(ref.parameters(), fmt)


def offload_parity_run(rank: int, world: int, fmt: str, steps: int = 4) -> None:
    """``fmt`` on an offloaded FSDP2 model against the same model without offload, on the same
    batches (each rank its own, gradients reduce-scattered by FSDP2): every loss, param and
    gathered state bit for bit."""
    W._mark(rank, "offload parity", fmt)
    model, ref, opt, ref_opt = _pair(world, fmt)
    for step in range(steps):
        tokens = W.batch(step, rank)
        losses = []
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = m(tokens)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss)
        assert torch.equal(*losses), (fmt, step, losses)
        assert losses[0].dtype == (torch.bfloat16 if fmt in CORRECTED + ("8bit-bf16compute",) else torch.float32)
    assert_offloaded(model, opt, True)
    assert_offloaded(ref, ref_opt, False)
    assert_same(model, ref, opt, ref_opt, f"{fmt} offload vs not")
    if fmt in CORRECTED:  # the correction is live, not all zeros
        assert any(st["param_correction"].abs().sum() > 0 for st in W.full_states(opt))


def offload_in_backward_run(rank: int, world: int, name: str, steps: int = 3) -> None:
    """``bridge.step_in_backward`` on an offloaded FSDP2 model against ``opt.step()`` on the same
    model without offload: FSDP2 calls the hooks after copying each unit's gradient shard to the
    host; losses, params and every gathered state bit for bit, and no gradient is left."""
    import bridge

    W._mark(rank, "offload step_in_backward", name)
    make, dtype = W._in_backward_opts()[name]
    model = W.make_model(dtype=dtype)
    ref = copy.deepcopy(model)
    W.shard(model, world, offload=True)
    W.shard(ref, world, offload=False)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    with bridge.step_in_backward(model, opt):
        W.steps_in_backward_match(model, ref, opt, ref_opt, steps, rank, name)
    assert_offloaded(model, opt, True)
    assert all(float(opt.state[p]["step"]) == steps for p in model.parameters()), name
    assert_same(model, ref, opt, ref_opt, f"{name} in backward, offload vs not")


def parity_worker(rank: int, world: int) -> None:
    for fmt in FAMILIES:
        offload_parity_run(rank, world, fmt)
    for name in W._in_backward_opts():
        offload_in_backward_run(rank, world, name)
    host_bytes_worker(rank, world)


# ----------------------------------------------------------------------------
# host bytes per param (the guide's table)
# ----------------------------------------------------------------------------
ROWS, COLS = 64, 512  # each weight (64, 512): 32 rows a rank at 2 ranks, rows of whole 8-bit and 4-bit blocks


def counted_host_bytes(setup: str, local_rows: int) -> tuple[float, float, float]:
    """docs/guide/offload.md's count, per param element of one rank's (local_rows, COLS) shard:
    (params, gradients, states). Block scales are float32: one per 256 values in 8 bits, per 128
    in 4 bits; a rank-1 4-bit second moment keeps a float32 maximum per local row and per column
    of the whole matrix (completed across shards); the correction is one int8 per element."""
    scale8, scale4 = 4 / 256, 4 / 128
    rank1 = 0.5 + 4 * (local_rows + COLS) / (local_rows * COLS)
    return {
        "torch AdamW": (4, 4, 8),
        "AdamW8bit": (4, 4, 2 * (1 + scale8)),
        "AdamW8bit+correction": (2, 2, 1 + 2 * (1 + scale8)),
        "AdamW4bit+correction": (2, 2, 1 + (0.5 + scale4) + rank1),
    }[setup]


class TwoMatrices(nn.Module):
    """Two (ROWS, COLS) weights (no 1-D params, whose states stay float32), summed outputs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(COLS, ROWS, bias=False)
        self.b = nn.Linear(COLS, ROWS, bias=False)

    def forward(self, x):
        return self.a(x) + self.b(x)


def _host_setup(setup: str, world: int):
    import bridge
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dtype = torch.bfloat16 if setup.endswith("correction") else torch.float32
    torch.manual_seed(0)
    model = TwoMatrices().to(dtype)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), offload_policy=CPUOffloadPolicy(pin_memory=False))
    params = list(model.parameters())
    if setup == "torch AdamW":
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    elif setup == "AdamW8bit":
        opt = bridge.AdamW8bit(params, lr=1e-3)
    elif setup == "AdamW8bit+correction":
        opt = bridge.AdamW8bit(params, lr=1e-3, param_correction=True)
    else:
        opt = bridge.AdamW4bit(params, lr=1e-3, param_correction=True)
    return model, opt, dtype


def host_bytes_worker(rank: int, world: int) -> None:
    """Each rank's host bytes (its param shards, their gradients, its states: every part of every
    record, walked here, not by the bridge's report) per param element equal
    :func:`counted_host_bytes` exactly, for the guide's four setups, offloaded at ``world`` ranks."""
    from bridge import QState
    from bridge.distributed import to_local

    for setup in ("torch AdamW", "AdamW8bit", "AdamW8bit+correction", "AdamW4bit+correction"):
        W._mark(rank, "offload host bytes", setup)
        model, opt, dtype = _host_setup(setup, world)
        x = torch.randn(4, COLS, generator=torch.Generator().manual_seed(rank)).to(dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        params = list(model.parameters())
        local = [p.to_local() for p in params]
        n = sum(t.numel() for t in local)
        state = 0
        for p in params:
            for name, v in opt.state[p].items():
                if name == "step":
                    continue
                v = to_local(v)
                parts = v.parts.values() if isinstance(v, QState) else [v]
                state += sum(t.numel() * t.element_size() for t in parts)
        measured = (sum(t.numel() * t.element_size() for t in local) / n,
                    sum(p.grad.to_local().numel() * p.grad.to_local().element_size() for p in params) / n,
                    state / n)
        assert all(t.shape == (ROWS // world, COLS) and t.device.type == "cpu" for t in local), setup
        if setup != "torch AdamW":  # the bridge's own report agrees with the walk
            assert opt.state_bytes() == state, (setup, opt.state_bytes(), state)
        counted = counted_host_bytes(setup, ROWS // world)
        assert all(math.isclose(m, c, rel_tol=1e-12) for m, c in zip(measured, counted)), (setup, measured, counted)


# ----------------------------------------------------------------------------
# DCP: save at one world size with offload, resume at another
# ----------------------------------------------------------------------------
SAVE_STEPS, MORE_STEPS = 3, 3


def _offloaded(world: int, fmt: str, seed: int = 0):
    model = shard(W.make_model(seed=seed, dtype=param_dtype(fmt)), world, True, fmt)
    return model, make_opt(model.parameters(), fmt)


def dcp_worker(rank: int, world: int, mode: str, workdir: str) -> None:
    """``mode="save"``: per family, an offloaded FSDP2 run on the mesh-independent gradients
    (``fsdp_workers.set_global_grads``) saved with ``dcp.save`` after ``SAVE_STEPS`` steps, then
    ``MORE_STEPS`` more: its params and gathered states written by rank 0 (the uninterrupted run).
    ``mode="load"``: a fresh offloaded model (other weights) loads the checkpoint at this world
    size, takes the same ``MORE_STEPS`` steps, and equals the uninterrupted run bit for bit; so
    does a plain unsharded model stepped ``SAVE_STEPS + MORE_STEPS`` times in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    ref_path = os.path.join(workdir, "uninterrupted.pt")
    if mode == "save":
        out = {}
        for fmt in FAMILIES:
            W._mark(rank, "offload dcp save", fmt)
            model, opt = _offloaded(world, fmt)
            for step in range(SAVE_STEPS):
                W.set_global_grads(model, step)
                opt.step()
                opt.zero_grad()
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=os.path.join(workdir, f"ckpt_{fmt}"))
            for step in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS):
                W.set_global_grads(model, step)
                opt.step()
                opt.zero_grad()
            out[fmt] = {"states": W.full_states(opt), "params": W.full_params(model)}
        if rank == 0:
            torch.save(out, ref_path)
        return
    saved = torch.load(ref_path, weights_only=False)
    for fmt in FAMILIES:
        W._mark(rank, f"offload dcp load at {world}", fmt)
        model, opt = _offloaded(world, fmt, seed=1)  # other weights: the load must overwrite them
        W._dcp_load(model, opt, os.path.join(workdir, f"ckpt_{fmt}"))
        for step in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS):
            W.set_global_grads(model, step)
            opt.step()
            opt.zero_grad()
        assert_offloaded(model, opt, True)
        states, params = W.full_states(opt), W.full_params(model)
        W.assert_states_equal(states, saved[fmt]["states"], exact=True, what=f"{fmt} resumed at {world} ranks")
        for a, b in zip(params, saved[fmt]["params"]):
            assert a.dtype == b.dtype and torch.equal(a, b), fmt
        plain = W.make_model(dtype=param_dtype(fmt))  # never sharded, never saved
        plain_opt = make_opt(plain.parameters(), fmt)
        for step in range(SAVE_STEPS + MORE_STEPS):
            W.set_global_grads(plain, step)
            plain_opt.step()
            plain_opt.zero_grad()
        W.assert_states_equal(states, W.full_states(plain_opt), exact=True, what=f"{fmt} resumed vs one process")
        for a, b in zip(params, plain.parameters()):
            assert torch.equal(a, b.detach()), fmt


# ----------------------------------------------------------------------------
# the threads a rank's step runs on
# ----------------------------------------------------------------------------
WIDE = 1024  # two (1024, 1024) weights: 512 rows a rank, 2**20 elements a step (above the
# native kernel's single-thread threshold, so the kernel would use every thread it is allowed)


def other_threads_share(opt, steps: int = 4) -> tuple[float, float]:
    """The share of this process's CPU time that threads other than the caller's spent in
    ``steps`` calls of ``opt.step()`` (gradients already set), and the total CPU seconds.
    CPU-time clocks (``CLOCK_PROCESS_CPUTIME_ID``, ``CLOCK_THREAD_CPUTIME_ID``): what each thread
    ran, whatever else the machine is doing, for every thread pool (OpenMP's, torch's, gloo's)."""
    opt.step()  # the first step creates the states: leave it out
    proc0, thread0 = time.process_time(), time.thread_time()
    for _ in range(steps):
        opt.step()
    proc, thread = time.process_time() - proc0, time.thread_time() - thread0
    return (proc - thread) / proc, proc


def threads_worker(rank: int, world: int) -> None:
    """Under ``torchrun`` with ``OMP_NUM_THREADS=1``: torch reports one thread, and an offloaded
    ``AdamW8bit`` step (no collective in it) runs on the calling thread alone: other threads
    spend under 5% of the step's CPU time. The control, on rank 0 with two threads: other
    threads then spend over 20% of it (so the measurement can see a second thread)."""
    import bridge

    assert os.environ.get("OMP_NUM_THREADS") == "1", os.environ.get("OMP_NUM_THREADS")
    assert torch.get_num_threads() == 1, torch.get_num_threads()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDE, WIDE, bias=False), nn.Linear(WIDE, WIDE, bias=False))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), offload_policy=CPUOffloadPolicy(pin_memory=False))
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-3)
    model(torch.randn(4, WIDE)).sum().backward()  # a gradient shard on every param, kept across steps
    share, cpu = other_threads_share(opt)
    print(f"[rank {rank}] 1 thread: other threads {share:.1%} of {cpu * 1e3:.1f} ms CPU", file=sys.stderr, flush=True)
    assert share < 0.05, (rank, share, cpu)
    dist.barrier()
    if rank == 0:
        torch.set_num_threads(2)
        share, cpu = other_threads_share(opt)
        torch.set_num_threads(1)
        print(f"[rank 0] 2 threads: other threads {share:.1%} of {cpu * 1e3:.1f} ms CPU", file=sys.stderr, flush=True)
        assert share > 0.20, (share, cpu)


WORKERS = {"threads": threads_worker}


def torchrun_main(name: str) -> None:
    """One torchrun rank: a gloo process group from torchrun's environment, then ``WORKERS[name]``."""
    from bridge.distributed import run_and_exit

    def body():
        dist.init_process_group("gloo")
        WORKERS[name](dist.get_rank(), dist.get_world_size())
        dist.barrier()

    run_and_exit(body)


if __name__ == "__main__":
    torchrun_main(sys.argv[1])
