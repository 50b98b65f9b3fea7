"""Workers of tests/test_soap_tp.py: SOAP under tensor parallel (a 1-D mesh) and FSDP2 + TP (a 2x2
mesh, plus one HSDP param placed ``(Replicate(), Shard(0))``), gloo on CPU, against the unsharded
optimizer in the same process fed the same whole gradients (tp_workers' model and gradients).
Launched like the FSDP2 workers; every rank asserts.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import tp_workers as T
from fsdp_workers import launch, step_on_after_load  # noqa: F401  (launch: re-exported for test_soap_tp.py)

KW = dict(lr=1e-2, precondition_frequency=2, min_quant_size=64, skip_nonfinite=True)
CLASSES = ("SOAP", "SOAP4bit")
EXTRA = "hsdp.weight"  # a param beside the model's: (Replicate(), Shard(0)) on the 2x2 mesh, (Shard(0),) on a 1-D one


PLACEMENTS = {  # what the test covers: each param's placements on the TP mesh and on the 2x2 (dp, tp) mesh
    1: {"fc1.weight": "(Shard(dim=0),)", "fc1.bias": "(Shard(dim=0),)", "fc2.weight": "(Shard(dim=1),)",
        "fc2.bias": "(Replicate(),)", "head.weight": "(Shard(dim=0),)", "tiny.weight": "(Shard(dim=1),)",
        "tiny.bias": "(Replicate(),)", EXTRA: "(Shard(dim=0),)"},  # emb: a plain tensor on every rank
    2: {"emb.weight": "(Shard(dim=0),)",  # FSDP2 alone, on the dp sub-mesh: one owner per dp group
        "fc1.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))", "fc1.bias": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "fc2.weight": "(Shard(dim=0), Shard(dim=1))", "fc2.bias": "(Shard(dim=0), Replicate())",
        "head.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))", "tiny.weight": "(Shard(dim=0), Shard(dim=1))",
        "tiny.bias": "(Shard(dim=0), Replicate())", EXTRA: "(Replicate(), Shard(dim=0))"},
}


def _extra_value() -> torch.Tensor:
    return torch.randn(10, 6, generator=torch.Generator().manual_seed(5))


def build(mesh_shape: tuple, names: tuple, cls_name: str, ref_steps: int = 0):
    """The unsharded reference (params, optimizer) after ``ref_steps`` steps, and a sharded copy
    of its params with a fresh optimizer: the model parallelized as tp_workers does, and the extra
    param placed ``(Replicate(), Shard(0))`` on the 2-D mesh (HSDP) or ``(Shard(0),)`` on a 1-D one."""
    import bridge
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    cls = getattr(bridge, cls_name)
    torch.manual_seed(0)
    ref = T.Net()
    ref_params = dict(ref.named_parameters())
    ref_params[EXTRA] = torch.nn.Parameter(_extra_value())
    ref_opt = cls(list(ref_params.values()), **KW)
    for step in range(ref_steps):
        set_whole_grads(ref_params, step)
        ref_opt.step()
    model = T.parallelize(copy.deepcopy(ref), mesh_shape, names)
    params = dict(model.named_parameters())
    mesh = params["fc2.weight"].device_mesh
    placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
    params[EXTRA] = torch.nn.Parameter(distribute_tensor(ref_params[EXTRA].detach().clone(), mesh, placements))
    return ref_params, ref_opt, params, cls(list(params.values()), **KW)


def set_whole_grads(params: dict, step: int) -> None:
    for name, p in params.items():
        p.grad = T.full_grad(name, p.shape, step)


def set_sharded_grads(params: dict, step: int) -> None:
    """Each param's whole gradient (:func:`tp_workers.full_grad`) laid out like the param."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in params.items():
        g = T.full_grad(name, p.shape, step)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g


def states(opt, p) -> dict:
    """``opt.state[p]`` as plain whole tensors: a DTensor state's ``full_tensor()`` (the 0-d scalars
    stay plain), a QState's parts under ``name::part`` and its value under ``name::value``."""
    from torch.distributed.tensor import DTensor

    from bridge import QState

    out = {}
    for name, v in opt.state[p].items():
        scalar = name in ("step", "soap_step", "precond_failures")
        assert isinstance(v, DTensor) == (isinstance(p, DTensor) and not scalar), (name, type(v))
        if isinstance(v, DTensor):
            assert v.device_mesh == p.device_mesh, name
            v = v.full_tensor()
        if isinstance(v, QState):
            out[f"{name}::value"] = v.dequantize()
        for part, t in (v.parts.items() if isinstance(v, QState) else [("", v)]):
            out[f"{name}::{part}" if part else name] = t.clone()
    return out


def assert_exact(opt, params: dict, ref_opt, ref_params: dict, what: str) -> None:
    """Every param, and ``full_tensor()`` of every state of each param on every rank, bit for bit
    the reference's."""
    from torch.distributed.tensor import DTensor

    for name, p in params.items():
        rp = ref_params[name]
        whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        assert torch.equal(whole, rp.detach()), (what, name)
        got, want = states(opt, p), states(ref_opt, rp)
        assert sorted(got) == sorted(want), (what, name, sorted(got), sorted(want))
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (what, name, k)


def exact_worker(rank, world, mesh_shape, names, steps, nan_at, workdir=None, save_at=None):
    """SOAP and SOAP4bit on ``mesh_shape``, ``steps`` steps with an eigenbasis refresh every 2:
    params and ``full_tensor()`` of every state on every rank bit for bit the unsharded run's (each
    sharded param stepped by one owner rank of its mesh; tp-replicated FSDP2 params by one rank of
    each dp group). At step
    ``nan_at`` the last rank alone finds a NaN in its block of fc1's gradient: every rank skips
    the step (``skip_nonfinite=True``), and the reference does not take it. With ``workdir``,
    ``dcp.save`` of ``opt.state_dict()`` after ``save_at`` steps, under ``workdir/<class>``."""
    import torch.distributed.checkpoint as dcp

    for cls_name in CLASSES:
        ref_params, ref_opt, params, opt = build(tuple(mesh_shape), tuple(names), cls_name)
        placed = {n: str(tuple(p.placements)) for n, p in params.items() if hasattr(p, "placements")}
        assert placed == PLACEMENTS[len(mesh_shape)], placed
        for step in range(steps):
            if workdir is not None and step == save_at:
                dcp.save({"optim": opt.state_dict()}, checkpoint_id=os.path.join(workdir, cls_name))
            set_whole_grads(ref_params, step)
            set_sharded_grads(params, step)
            if step == nan_at:
                if rank == world - 1:
                    params["fc1.weight"].grad.to_local()[0, -1] = float("nan")
                before = {n: p.full_tensor() for n, p in params.items() if n != "emb.weight"}
                opt.step()
                assert all(torch.equal(params[n].full_tensor(), b) for n, b in before.items()), "a NaN step moved params"
                continue
            ref_opt.step()
            opt.step()
        what = f"{cls_name} on {tuple(mesh_shape)}"
        assert_exact(opt, params, ref_opt, ref_params, what)
        assert int(ref_opt.state[ref_params["fc2.weight"]]["soap_step"]) == steps - (nan_at is not None)
        if cls_name == "SOAP4bit":  # the test reaches quantized bases
            assert any(type(v).__name__ == "QState" for n, v in ref_opt.state[ref_params["fc1.weight"]].items()
                       if n.startswith("eigenbasis"))


def load_worker(rank, world, mesh_shape, names, workdir, save_at, more):
    """The checkpoint of :func:`exact_worker` loaded on ``mesh_shape`` (blocks and owners change):
    ``full_tensor()`` of every state bit for bit the unsharded run's after ``save_at`` steps, and after ``more`` steps further
    (eigenbasis refreshes among them)."""
    import torch.distributed.checkpoint as dcp

    for cls_name in CLASSES:
        ref_params, ref_opt, params, opt = build(tuple(mesh_shape), tuple(names), cls_name, ref_steps=save_at)
        sd = opt.state_dict()
        dcp.load({"optim": sd}, checkpoint_id=os.path.join(workdir, cls_name))
        opt.load_state_dict(sd)
        step_on_after_load(opt, ref_opt, range(save_at, save_at + more),
                           lambda step: (set_whole_grads(ref_params, step), set_sharded_grads(params, step)),
                           lambda what: assert_exact(opt, params, ref_opt, ref_params, what),
                           f"{cls_name} saved on 2x2, loaded on {tuple(mesh_shape)}")
