"""The process group and device of each of the bridge's own collectives (bridge/collectives.py;
the table is docs/guide/distributed.md): on the params' group and device without offload and
under ``CPUOffloadPolicy``; over a group that cannot carry host tensors, the error naming the fix,
or the host group the user registered. Multi-process cases (gloo, 2 ranks) in collectives_workers.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import bridge
import bridge.collectives as C

gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")


@pytest.fixture
def fake_world():
    """A single-process world of 2 ranks on torch's fake backend (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        C.set_host_group()
        dist.destroy_process_group()


def test_group_for_keeps_a_group_that_carries_the_device(fake_world):
    assert C.device_types(None) >= {"cpu", "cuda"}
    assert C.group_for(None, torch.device("cpu"), "x") is None
    assert C.group_for(fake_world, "cpu", "x") is fake_world


def test_group_for_without_a_cpu_backend_names_the_fix(fake_world, monkeypatch):
    """An NCCL-only default group (its capability patched to cuda alone: CPU-only torch has no
    NCCL) and no host group: the error names the collective, the ranks, and both fixes; a
    registered host group over the same ranks serves instead; a CUDA tensor over a gloo-only group
    is refused (a host group never serves device tensors)."""
    monkeypatch.setattr(C, "device_types", lambda g: {"cuda"})
    with pytest.raises(RuntimeError) as e:
        C.group_for(None, torch.device("cpu"), "the rank-1 record's all-reduce MAX of maxima")
    assert str(e.value) == (
        "the rank-1 record's all-reduce MAX of maxima: a collective of cpu tensors (FSDP2's CPUOffloadPolicy keeps "
        "gradients and states on the host) over the default group, whose backend 'fake' carries only ['cuda']: "
        "initialize the process group with torch.distributed.init_process_group(backend='cpu:gloo,cuda:nccl'), or "
        "create a gloo group over ranks [0, 1] on every rank (torch.distributed.new_group([0, 1], backend='gloo')) "
        "and pass it to bridge.set_host_group(...)")
    with pytest.raises(ValueError, match=r"set_host_group: got a group whose backend carries \['cuda'\]"):
        bridge.set_host_group(fake_world)  # the patched check: no CPU backend
    monkeypatch.undo()
    bridge.set_host_group(fake_world)
    assert C.host_groups() == {(0, 1): fake_world}
    monkeypatch.setattr(C, "device_types", lambda g: {"cuda"} if g is None else {"cpu"})
    assert C.group_for(None, torch.device("cpu"), "x") is fake_world
    monkeypatch.setattr(C, "device_types", lambda g: {"cpu"})  # gloo alone
    with pytest.raises(RuntimeError, match="over the default group, whose backend 'fake' carries only \\['cpu'\\]: "
                                           "use a process group whose backend carries cuda tensors"):
        C.group_for(None, torch.device("cuda"), "x")  # a host group never carries device tensors
    bridge.set_host_group()
    assert C.host_groups() == {}
    with pytest.raises(ValueError, match="the default group"):
        bridge.set_host_group(None)


@gloo
@pytest.mark.extended
def test_each_collective_runs_on_the_mesh_group_on_the_params_device():
    """2 gloo ranks: AdamW4bit (rank-1 maxima, skip_nonfinite), Muon8bit (Newton-Schulz gathers
    and scatters) and SOAP (owner gathers and scatters, skip_nonfinite) under FSDP2, with and without
    CPUOffloadPolicy: every collective the bridge makes on the mesh's group (skip_nonfinite's, and
    SOAP's on a 2-D mesh, on the default group), on the host (the params' device)."""
    import collectives_workers as CW
    import fsdp_workers as W

    W.launch(CW.placement_worker, 2)


@gloo
@pytest.mark.extended
def test_offloaded_step_over_an_nccl_only_group_names_the_fix_or_uses_the_host_group():
    """2 gloo ranks whose mesh and default groups are reported NCCL-only (bridge.collectives.device_types
    patched): an offloaded AdamW4bit and Muon8bit step raise the error naming the fix; with a gloo
    group registered by bridge.set_host_group every collective runs on it, on the host."""
    import collectives_workers as CW
    import fsdp_workers as W

    W.launch(CW.nccl_only_worker, 2)
