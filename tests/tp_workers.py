"""Worker functions for the tensor-parallel tests (tests/test_tp.py): TP on a 1-D mesh and
FSDP2 + TP on a 2-D mesh, gloo on CPU. Launched like the FSDP2 workers
(:func:`tests.fsdp_workers.launch`); every rank asserts, a failing rank fails the launch.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_workers import launch  # noqa: F401  (re-exported for test_tp.py)

V, D, H = 15, 24, 40  # fc2 (24, 40) on a TP degree of 2: columns 20 + 20 (blocks of 4, not 8);
# on 3: 14 + 14 + 12 (blocks of 2). tiny (1, 4): columns 2 + 2 on 2 ranks, 2 + 2 + 0 (an empty
# shard) on 3; on the 2x2 mesh its one row is 1 + 0 over dp (an empty shard), and emb / head's
# 15 rows are uneven on both mesh dims.


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, H)               # ColwiseParallel: weight Shard(0)
        self.fc2 = nn.Linear(H, D)               # RowwiseParallel: weight Shard(1)
        self.head = nn.Linear(D, V, bias=False)  # ColwiseParallel, logits gathered
        self.tiny = nn.Linear(4, 1)              # RowwiseParallel (its weight only gets set gradients)

    def forward(self, tokens):
        logits = self.head(self.fc2(torch.relu(self.fc1(self.emb(tokens)))))
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))



def parallelize(model: Net, mesh_shape: tuple, names: tuple):
    """TP over the last mesh dim; FSDP2 over the first when the mesh is 2-D."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    tp = mesh["tp"]
    parallelize_module(model, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
                                   "head": ColwiseParallel(output_layouts=Replicate()), "tiny": RowwiseParallel()})
    if "dp" in names:
        fully_shard(model, mesh=mesh["dp"])
    return model


def make_net(fmt: str) -> Net:
    """The test model; bfloat16 params for ``"8bitc"`` (param_correction)."""
    return Net().to(torch.bfloat16) if fmt == "8bitc" else Net()


def make_opt(params, fmt: str, **kw):
    """The FSDP2 tests' optimizers (blocks of 8, every 2-D state quantized); ``"fp32"``: AdamW
    with float32 states and the same hyperparameters."""
    from fsdp_workers import make_opt as _make

    if fmt == "fp32":
        import bridge

        return bridge.AdamW(params, lr=1e-2, weight_decay=0.1, **kw)
    return _make(params, fmt, **kw)


def full_grad(name: str, shape, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + sum(map(ord, name)))
    return torch.randn(tuple(shape), generator=g)


def set_grads(model: nn.Module, step: int) -> None:
    """Each param's gradient: a fixed full tensor (independent of the mesh), laid out like
    the param (``distribute_tensor`` with the param's placements)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        g = full_grad(name, p.shape, step).to(p.dtype)
        # src_data_rank=None: every rank cuts its part (torch 2.13 scatters _StridedShard only when even)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g


def full_states(opt, model) -> dict:
    """name -> {state: (codes uint8, scale, block size, dequantized) or a plain tensor}, gathered."""
    from torch.distributed.tensor import DTensor

    from bridge import QState
    from bridge.param_states import SCALARS

    out = {}
    for name, p in model.named_parameters():
        st = {}
        for k, v in opt.state[p].items():
            assert torch.is_tensor(v), (name, k, type(v))  # every state a tensor, of every kind
            if k not in SCALARS and isinstance(p, DTensor):  # placed like its param (step, mu_product: CPU scalars)
                assert isinstance(v, DTensor) and tuple(v.placements) == tuple(p.placements), (name, k, v)
            f = v.full_tensor() if isinstance(v, DTensor) else v  # all-gather of each record's parts
            if isinstance(f, QState):
                assert tuple(f.shape) == tuple(p.shape), (name, k, f.shape)
                parts = {n: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).detach().clone()
                         for n, t in f.parts.items()}
                if "scale" in parts:  # block-quantized values (a low-rank record's residual)
                    st[k] = (parts.pop("codes"), parts.pop("scale"), f.block_size, f.dequantize())
                for part, t in parts.items():
                    st[f"{k}::{part}"] = t
            else:
                st[k] = f.detach().clone()
        out[name] = st
    return out


def full_params(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        sa, sb = a[name], b[name]
        if isinstance(sa, dict):
            assert sa.keys() == sb.keys(), (what, name)
            for k in sa:
                x, y = sa[k], sb[k]
                if isinstance(x, tuple):
                    assert x[2] == y[2], f"{what}: {name}.{k} block size {x[2]} != {y[2]}"
                    assert torch.equal(x[0], y[0]), f"{what}: {name}.{k} codes differ"
                    assert torch.equal(x[1], y[1]), f"{what}: {name}.{k} scales differ"
                else:
                    assert torch.equal(x, y), f"{what}: {name}.{k} differs"
        else:
            assert torch.equal(sa, sb), f"{what}: {name} differs"


def reference_run(fmt: str, steps: int, block_sizes: dict) -> tuple[dict, dict]:
    """The unsharded optimizer on the same params and full gradients, each param in a group
    with the block size the sharded run chose for it."""
    torch.manual_seed(0)
    model = make_net(fmt)
    names = [n for n, _ in model.named_parameters()]
    groups = [{"params": [p], **({"block_size": block_sizes[n]} if n in block_sizes else {})}
              for n, p in model.named_parameters()]
    opt = make_opt(groups, fmt)
    for step in range(steps):
        for n, p in model.named_parameters():
            p.grad = full_grad(n, p.shape, step).to(p.dtype)
        opt.step()
    st = full_states(opt, model)
    return {n: st[n] for n in names}, full_params(model), opt.state_bytes()


def tp_worker(rank, world, mesh_shape, names, fmts, workdir):
    """Steps on fixed gradients equal the unsharded optimizer's (states and params bit for
    bit); every state gathers; DCP save/load and full state dicts round-trip exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict,
    )

    mesh_shape, names = tuple(mesh_shape), tuple(names)
    for fmt in fmts:
        torch.manual_seed(0)
        model = parallelize(make_net(fmt), mesh_shape, names)
        opt = make_opt(model.parameters(), fmt)
        steps = 3
        for step in range(steps):
            set_grads(model, step)
            opt.step()
        got = full_states(opt, model)
        blocks = {n: next(v[2] for v in st.values() if isinstance(v, tuple))
                  for n, st in got.items() if any(isinstance(v, tuple) for v in st.values())}
        if mesh_shape[-1] == 2:  # fc2's 40 columns in 2 x 20: blocks of 4 (not 8); the rest keep 8
            assert blocks["fc2.weight"] == 4 and blocks["fc1.weight"] == 8 and blocks["tiny.weight"] == 2, blocks
        if mesh_shape[-1] == 3:  # 14 + 14 + 12 columns, and 2 + 2 + 0
            assert blocks["fc2.weight"] == 2 and blocks["tiny.weight"] == 2, blocks
        if fmt == "8bitc":  # every param keeps its int8 correction, placed like it
            assert all(st["param_correction"].dtype == torch.int8 for st in got.values()), sorted(got)
        ref_states, ref_params, ref_bytes = reference_run(fmt, steps, blocks)
        # the whole-model total of the state report counts each param once (TP replicas of
        # fc2's bias, emb, ... on a 2-D mesh are not added twice)
        import re

        text = opt.format_state_report()
        total = re.search(r"^total \((\d+) ranks, whole model\): (\d+) bytes for (\d+) param elements", text, re.M)
        n_global = sum(p.numel() for p in model.parameters())
        assert total and (int(total[1]), int(total[2]), int(total[3])) == (world, ref_bytes, n_global), (text, ref_bytes)
        assert_same(got, ref_states, f"{fmt} {mesh_shape} states vs unsharded")
        assert_same(full_params(model), ref_params, f"{fmt} {mesh_shape} params vs unsharded")

        # DCP at the same mesh: exact states, identical continuation
        path = os.path.join(workdir, f"ckpt_{fmt}")
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        set_grads(model, steps)
        opt.step()
        after = full_states(opt, model)

        torch.manual_seed(1)
        m2 = parallelize(make_net(fmt), mesh_shape, names)
        o2 = make_opt(m2.parameters(), fmt)
        osd = get_optimizer_state_dict(m2, o2)
        dcp.load({"optim": osd}, checkpoint_id=path)
        set_optimizer_state_dict(m2, o2, osd)
        assert_same(full_states(o2, m2), got, f"{fmt} {mesh_shape} dcp round trip")

        # full state dict (gathered to plain tensors) into a fresh optimizer
        full = copy.deepcopy(get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)))
        m3 = parallelize(make_net(fmt), mesh_shape, names)
        o3 = make_opt(m3.parameters(), fmt)
        if len(mesh_shape) == 1:
            set_optimizer_state_dict(m3, o3, full, options=StateDictOptions(full_state_dict=True))
        else:
            # torch 2.13's set_optimizer_state_dict(full_state_dict=True) scatters every full tensor
            # (distribute_tensor from rank 0), which fails on the uneven _StridedShard(0) that
            # FSDP2 + TP gives head's 15 rows (AssertionError in _StridedShard._shard_tensor, for
            # torch.optim's states too; uneven strided shards: pytorch issue 168134). Our
            # load_state_dict cuts the full tensors locally (distribute_tensor(src_data_rank=None)).
            index = {n: i for i, (n, _) in enumerate(m3.named_parameters())}
            full["state"] = {index[n]: st for n, st in full["state"].items()}
            for g in full["param_groups"]:
                g["params"] = [index[n] for n in g["params"]]
            o3.load_state_dict(full)
        assert_same(full_states(o3, m3), after, f"{fmt} {mesh_shape} full state dict")
        dist.barrier()


def reshard_save_worker(rank, world, mesh_shape, names, fmt, workdir):
    """Two steps, then ``dcp.save`` and, on rank 0, the gathered states and the full
    (unsharded, CPU) optimizer state dict, for the load workers and the single-process load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = parallelize(Net(), tuple(mesh_shape), tuple(names))
    opt = make_opt(model.parameters(), fmt)
    for step in range(2):
        set_grads(model, step)
        opt.step()
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=os.path.join(workdir, "ckpt"))
    st = full_states(opt, model)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"states": st, "full": full}, os.path.join(workdir, "saved.pt"))


def check_loaded(got: dict, saved: dict, messages: list, what: str, labels: dict | None = None) -> dict:
    """Same block size: bit for bit. Another one: a requantize warning names the param and
    the state, and the values are within 3% of the state's absmax of the saved ones.
    Returns {"param.state": largest change / absmax} of the requantized states."""
    errors = {}
    for pname, st in got.items():
        for k, v in st.items():
            sv = saved[pname][k]
            if not isinstance(v, tuple):
                assert torch.equal(v, sv), f"{what}: {pname}.{k}"
                continue
            if v[2] == sv[2]:
                assert torch.equal(v[0], sv[0]) and torch.equal(v[1], sv[1]), f"{what}: {pname}.{k} not exact"
                continue
            label = (labels or {}).get(pname, pname)  # how the warning names the param
            assert any(f"param {label} " in m and repr(k) in m for m in messages), (what, pname, k, messages)
            err = ((v[3] - sv[3]).abs().max() / sv[3].abs().max().clamp_min(1e-30)).item()
            assert err <= 0.03, f"{what}: {pname}.{k} moved by {err:.3g} of its absmax"
            errors[f"{pname}.{k}"] = err
    return errors


def reshard_load_worker(rank, world, mesh_shape, names, fmt, workdir):
    """The checkpoint on another mesh: ``bridge.dcp.load_optimizer`` (exact where the block
    sizes agree, requantized with a warning where they do not)."""
    import warnings

    from bridge.dcp import load_optimizer

    torch.manual_seed(1)
    model = parallelize(Net(), tuple(mesh_shape), tuple(names))
    opt = make_opt(model.parameters(), fmt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_optimizer(model, opt, os.path.join(workdir, "ckpt"))
    saved = torch.load(os.path.join(workdir, "saved.pt"), weights_only=False)
    errors = check_loaded(full_states(opt, model), saved["states"], [str(w.message) for w in caught],
                          f"{fmt} loaded at {mesh_shape}")
    if rank == 0:
        torch.save(errors, os.path.join(workdir, f"errors_{'x'.join(map(str, mesh_shape))}.pt"))
    for step in range(2, 4):  # training continues
        set_grads(model, step)
        opt.step()


def backward_worker(rank, world, mesh_shape, names, fmt, workdir):
    """Real forward / backward on the parallel model against the unsharded one (dp ranks take
    their own batches, the unsharded run their union): TP and FSDP sum gradients in another
    order, so params agree within float tolerance; rank 0 saves the largest difference."""
    mesh_shape, names = tuple(mesh_shape), tuple(names)
    dp = mesh_shape[0] if "dp" in names else 1
    dp_rank = rank // mesh_shape[-1]
    torch.manual_seed(0)
    model = parallelize(Net(), mesh_shape, names)
    opt = make_opt(model.parameters(), fmt)
    torch.manual_seed(0)
    ref = Net()
    ref_opt = make_opt(ref.parameters(), fmt)  # the same block sizes where TP keeps them
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, V, (2 * dp, 6), generator=g)
        model(tokens[2 * dp_rank: 2 * dp_rank + 2]).backward()
        opt.step()
        opt.zero_grad()
        sum(ref(tokens[2 * i: 2 * i + 2]) for i in range(dp)).div(dp).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = full_params(model), {n: p.detach() for n, p in ref.named_parameters()}
    worst = max((got[n] - want[n]).abs().max().item() for n in want if n != "tiny.weight")
    # float32 states: only the summation order differs. 8-bit: a gradient that differs in its last
    # bits can round to a neighbouring code, and Adam's normalized step carries that to the param
    # (at most a few 1e-4 per step at lr 1e-2)
    assert worst <= (1e-5 if fmt == "fp32" else 3e-3), (fmt, worst)
    if rank == 0:
        torch.save(worst, os.path.join(workdir, f"backward_{fmt}.pt"))


def refusals_worker(rank, world, workdir):
    """Placements a quantized state cannot follow are refused with errors naming them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import bridge

    torch.manual_seed(0)  # every rank draws the same full tensors
    mesh = init_device_mesh("cpu", (world,))
    odd = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))  # 3 + 3 columns
    odd.grad = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])
    try:
        bridge.AdamW4bit([odd], min_quant_size=1, rank1_normalization=False).step()
        raise AssertionError("4-bit states on odd column shards were accepted")
    except ValueError as e:
        assert "odd" in str(e) and "(4, 6)" in str(e), e
    try:
        bridge.AdamW4bit([odd], min_quant_size=1).step()  # 4-bit's default: rank-1 second moments
        raise AssertionError("rank-1 4-bit states on odd column shards were accepted")
    except ValueError as e:
        assert "odd" in str(e) and "(4, 6)" in str(e), e
    deep = nn.Parameter(distribute_tensor(torch.randn(4, 6, 2), mesh, [Shard(1)]))
    deep.grad = distribute_tensor(torch.randn(4, 6, 2), mesh, [Shard(1)])
    try:
        bridge.AdamW8bit([deep], min_quant_size=1).step()
        raise AssertionError("a 3-D param sharded along dim 1 was accepted")
    except NotImplementedError as e:
        assert "(4, 6, 2)" in str(e) and "Shard(1)" in str(e), e
