"""The process group each of the bridge's own collectives runs on: one whose backend carries the
tensor's device.

The bridge's collectives (a rank-1 record's all-reduce MAX of maxima, Muon's gathers and scatters
of Newton-Schulz blocks, SOAP's of param blocks, ``skip_nonfinite``'s all-reduce MIN) act on the tensors where the params
live: CUDA tensors on a GPU cluster, host tensors under FSDP2's ``CPUOffloadPolicy``. An NCCL-only
group carries no host tensor, so :func:`group_for` picks, for a tensor's device: the param's own
group where its backend has one for that device (``init_process_group(backend="cpu:gloo,cuda:nccl")``
gives every group both), else a group over the same ranks registered with :func:`set_host_group`,
else it raises an error naming both fixes. Nothing is created behind the caller's back: a new
group is a collective call every rank must make in the same order. docs/guide/distributed.md
lists each collective a step makes.
"""
from __future__ import annotations

import torch

__all__ = ["set_host_group", "host_groups", "group_for", "device_types", "all_ranks_finite"]

_HOST_GROUPS: dict[tuple[int, ...], object] = {}


def _dist():
    import torch.distributed as dist

    return dist


def _ranks(group) -> tuple[int, ...]:
    dist = _dist()
    return tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))


def device_types(group) -> set[str]:
    """The device types ``group``'s backends carry (``None``: the default group), from the
    ProcessGroup's own registry (``cpu:gloo,cuda:nccl``: both; ``nccl``: cuda only)."""
    dist = _dist()
    pg = group if group is not None else dist.group.WORLD
    return {d.type for d in pg._device_types}


def set_host_group(*groups) -> None:
    """Register process groups with a CPU backend (e.g. ``dist.new_group(ranks, backend="gloo")``)
    for the bridge's collectives of host tensors (FSDP2's ``CPUOffloadPolicy``) whose own group has
    no CPU backend (NCCL only). Each serves the collectives over its exact set of ranks (a 1-D
    mesh's group; a 2-D mesh's dims need one each; Muon and SOAP on a 2-D mesh and ``skip_nonfinite``
    use all ranks). Call it on every rank; ``set_host_group()`` clears the registry."""
    if not groups:
        _HOST_GROUPS.clear()
        return
    for g in groups:
        if g is None or "cpu" not in device_types(g):
            have = "the default group" if g is None else f"a group whose backend carries {sorted(device_types(g))}"
            raise ValueError(
                f"bridge.set_host_group: got {have}; pass groups with a CPU backend, e.g. "
                "torch.distributed.new_group(ranks, backend='gloo')"
            )
        _HOST_GROUPS[_ranks(g)] = g


def host_groups() -> dict:
    """The registered host groups, by their ranks (a copy)."""
    return dict(_HOST_GROUPS)


def group_for(group, device: torch.device, what: str):
    """The group a collective ``what`` of tensors on ``device`` over ``group``'s ranks runs on
    (``None``: the default group): ``group`` itself where its backend carries ``device``, else
    the registered host group over the same ranks (host tensors only), else a ``RuntimeError``
    naming the fix."""
    device = torch.device(device)
    if device.type in device_types(group):
        return group
    ranks = _ranks(group)
    if device.type == "cpu" and ranks in _HOST_GROUPS:
        return _HOST_GROUPS[ranks]
    dist = _dist()
    backend = dist.get_backend(group)
    where = "the default group" if group is None else f"the process group over ranks {list(ranks)}"
    carries = f"over {where}, whose backend {backend!r} carries only {sorted(device_types(group))}"
    if device.type != "cpu":
        raise RuntimeError(f"{what}: a collective of {device.type} tensors {carries}: use a process group whose "
                           f"backend carries {device.type} tensors")
    raise RuntimeError(
        f"{what}: a collective of cpu tensors (FSDP2's CPUOffloadPolicy keeps gradients and states on the host) "
        f"{carries}: initialize the process group with "
        f"torch.distributed.init_process_group(backend='cpu:gloo,cuda:nccl'), or create a gloo group over ranks "
        f"{list(ranks)} on every rank (torch.distributed.new_group({list(ranks)}, backend='gloo')) and pass it to "
        "bridge.set_host_group(...)"
    )


def all_ranks_finite(ok: torch.Tensor) -> bool:
    """``skip_nonfinite``'s decision, the same on every process: this rank's finiteness flag
    ``ok`` (a 0-d tensor, true where all its gradients are finite) and-ed over the default group
    by an all-reduce MIN (of int32: gloo has no bool), on :func:`group_for`'s group for its
    device. Every process calls it, once a step."""
    dist = _dist()
    flag = ok.to(torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group_for(None, flag.device, "skip_nonfinite's all-reduce MIN"))
    return bool(flag)
