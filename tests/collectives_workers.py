"""Workers of test_collectives.py: which process group and device each of the bridge's own
collectives uses under FSDP2, with and without ``CPUOffloadPolicy``, over a group whose backend
carries host tensors, one that (simulated) does not, and a registered host group.

The recorder wraps ``torch.distributed``'s ``all_reduce``, ``gather`` and ``scatter`` and keeps the
calls made from the ``bridge`` package (FSDP2's own collectives are not the bridge's), then runs
the real gloo collective.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import bridge.collectives as C
import fsdp_workers as W

NAMES = ("all_reduce", "gather", "scatter")


class Recorder:
    """``(name, group, device type)`` of every collective called from ``bridge``."""

    def __init__(self):
        self.calls: list[tuple[str, object, str]] = []
        self.real = {n: getattr(dist, n) for n in NAMES}

    def _wrap(self, name):
        real = self.real[name]

        def call(tensor, *args, group=None, **kw):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("bridge"):
                self.calls.append((name, group, tensor.device.type))
            return real(tensor, *args, group=group, **kw)

        return call

    def __enter__(self):
        for n in NAMES:
            setattr(dist, n, self._wrap(n))
        return self

    def __exit__(self, *exc):
        for n in NAMES:
            setattr(dist, n, self.real[n])


def _step(fmt: str, offload: bool, world: int, **kw):
    """One FSDP2 step of ``fmt`` (fsdp_workers' optimizers) with every collective recorded:
    ``(calls, the params' mesh group)``."""
    model = W.shard(W.make_model(), world, offload=offload)
    opt = W.make_opt(model.parameters(), fmt, **kw)
    W.set_global_grads(model, 1)
    with Recorder() as rec:
        opt.step()
    mesh = next(model.parameters()).device_mesh
    return rec.calls, mesh.get_group()


def _soap_step(offload: bool, world: int):
    """One SOAP step (``skip_nonfinite=True``) under FSDP2, then one on a 1 x ``world`` mesh over
    every process (tensor-parallel columns, as FSDP2 + TP's 2-D meshes), each recorded:
    ``(FSDP2 calls, the mesh's group, 2-D calls)``."""
    import bridge
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = W.shard(W.make_model(), world, offload=offload)
    opt = bridge.SOAP(model.parameters(), skip_nonfinite=True, **W.SOAP_KW)
    W.set_global_grads(model, 1)
    with Recorder() as rec:
        opt.step()
    mesh = init_device_mesh("cpu", (1, world))
    gen = torch.Generator().manual_seed(0)  # the same whole tensors on every rank
    p = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4, generator=gen), mesh, [Shard(0), Shard(1)]))
    p.grad = distribute_tensor(torch.randn(6, 4, generator=gen), mesh, [Shard(0), Shard(1)])
    opt2 = bridge.SOAP([p], **W.SOAP_KW)
    with Recorder() as rec2:
        opt2.step()
    return rec.calls, next(model.parameters()).device_mesh.get_group(), rec2.calls


def _names(calls) -> set:
    return {c[0] for c in calls}


def placement_worker(rank, world):
    """AdamW4bit (rank-1 maxima, ``skip_nonfinite``), Muon8bit and SOAP (gathers and scatters), with
    and without offload, over gloo (carries host tensors): each collective runs on the mesh's group
    (``skip_nonfinite``'s, and SOAP's on a 2-D mesh, on the default group) on the params' device,
    the host."""
    for offload in (False, True):
        calls, mesh_pg = _step("4bit", offload, world, skip_nonfinite=True)
        assert calls[0] == ("all_reduce", None, "cpu"), calls[0]  # skip_nonfinite's MIN over every rank
        assert len(calls) > 1 and all(c == ("all_reduce", mesh_pg, "cpu") for c in calls[1:]), (offload, calls)
        calls, mesh_pg = _step("muon8bit", offload, world)
        assert _names(calls) == {"gather", "scatter"}, calls
        assert all(c[1] is mesh_pg and c[2] == "cpu" for c in calls), (offload, calls)
        calls, mesh_pg, calls_2d = _soap_step(offload, world)
        assert calls[0] == ("all_reduce", None, "cpu"), calls[0]  # skip_nonfinite's MIN over every rank
        assert _names(calls[1:]) == {"gather", "scatter"}, calls
        assert all(c[1] is mesh_pg and c[2] == "cpu" for c in calls[1:]), (offload, calls)
        assert _names(calls_2d) == {"gather", "scatter"} and all(c[1] is None for c in calls_2d), calls_2d


def nccl_only_worker(rank, world):
    """The mesh's and the default group's backends reported as carrying cuda alone (an NCCL-only
    group, simulated by patching :func:`bridge.collectives.device_types`): an offloaded step of
    AdamW4bit and of Muon8bit raises the error naming the fix; with a gloo group over the same
    ranks passed to ``bridge.set_host_group`` every collective runs on it, on the host."""
    real = C.device_types
    host = dist.new_group(list(range(world)), backend="gloo")
    C.device_types = lambda g: real(g) if g is host else {"cuda"}
    try:
        for fmt, what in (("4bit", "the rank-1 record's all-reduce MAX of maxima"),
                          ("muon8bit", "Muon's gather of Newton-Schulz inputs")):
            try:
                _step(fmt, True, world)
            except RuntimeError as e:
                msg = str(e)
            else:
                raise AssertionError(f"{fmt}: an offloaded step over an NCCL-only group did not raise")
            assert msg.startswith(f"{what}: a collective of cpu tensors"), msg
            for fix in ("init_process_group(backend='cpu:gloo,cuda:nccl')", f"new_group({list(range(world))}, backend='gloo')",
                        "bridge.set_host_group(...)", "carries only ['cuda']"):
                assert fix in msg, (fix, msg)
        C.set_host_group(host)
        try:
            calls, _ = _step("4bit", True, world, skip_nonfinite=True)
            assert len(calls) > 1 and all(c == ("all_reduce", host, "cpu") for c in calls), calls
            calls, _ = _step("muon8bit", True, world)
            assert _names(calls) == {"gather", "scatter"} and all(c[1] is host and c[2] == "cpu" for c in calls), calls
        finally:
            C.set_host_group()
    finally:
        C.device_types = real
