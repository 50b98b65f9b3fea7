"""What an optimizer's states are stored in, and how many bytes they take.

Functions of a :class:`bridge.LowBitOptimizer` (its ``state_report``, ``state_bytes`` and
``format_state_report`` methods delegate here). Rows describe *this process's* tensors: under
FSDP2 that is the local shard of each state. :func:`format_state_report` adds the totals of
every rank and of the whole model; under FSDP2 it is therefore a collective (every rank of the
params' mesh must call it), like ``full_tensor()``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from lowbit_tree.moments import Rank1QTensor

from .distributed import is_dtensor, to_local
from .qstate import QState

__all__ = ["StateReportRow", "RankTotals", "state_report", "state_bytes", "rank_totals", "format_state_report"]


class StateReportRow(tuple):
    """(param_index, state_name, format, shape, nbytes); shape and bytes of the local tensor."""

    __slots__ = ()

    def __new__(cls, index, name, format, shape, nbytes):
        return super().__new__(cls, (index, name, format, tuple(shape), nbytes))

    index = property(lambda s: s[0])
    name = property(lambda s: s[1])
    format = property(lambda s: s[2])
    shape = property(lambda s: s[3])
    nbytes = property(lambda s: s[4])


class RankTotals(NamedTuple):
    """State bytes and param elements held by each rank (index = rank in the params' mesh)."""

    state_bytes: list[int]
    param_elements: list[int]


def state_report(opt) -> list[StateReportRow]:
    """Each param's states: (param index, name, format, local shape, bytes). Nothing is hidden:
    unquantized states show as ``fp32`` / ``bf16``."""
    rows = []
    i = 0
    for group in opt.param_groups:
        for p in group["params"]:
            for name, v in opt.state.get(p, {}).items():
                if name == "step":
                    continue
                v = to_local(v)
                if isinstance(v, QState):
                    rows.append(StateReportRow(i, name, v.format, tuple(v.shape), v.state_nbytes))
                elif isinstance(getattr(v, "record", None), Rank1QTensor):  # bridge.optimizer's rank-1 holder
                    rows.append(StateReportRow(i, name, "linear4_rank1", v.record.shape, v.nbytes))
                elif isinstance(v, torch.Tensor):
                    fmt = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(v.dtype, str(v.dtype))
                    rows.append(StateReportRow(i, name, fmt, tuple(v.shape), v.numel() * v.element_size()))
            i += 1
    return rows


def state_bytes(opt) -> int:
    """Bytes of this process's states (under FSDP2: its shards only; see :func:`rank_totals`)."""
    return sum(r.nbytes for r in state_report(opt))


def _local_param_elements(opt) -> int:
    return sum(math.prod(to_local(p).shape) for g in opt.param_groups for p in g["params"])


def _shard_group(opt):
    """The process group over which the params are sharded, or None (not sharded, no process
    group, or a mesh with more than one sharded dimension, whose totals this does not sum)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    for g in opt.param_groups:
        for p in g["params"]:
            if is_dtensor(p):
                dims = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
                if len(dims) != 1:
                    return None
                return p.device_mesh.get_group(dims[0])
    return None


def rank_totals(opt) -> Optional[RankTotals]:
    """Per rank of the params' sharding group, (state bytes, param elements); None when the
    params are not sharded DTensors or no process group is initialised. A collective."""
    group = _shard_group(opt)
    if group is None:
        return None
    dist = torch.distributed
    device = next(to_local(p).device for g in opt.param_groups for p in g["params"])
    if device.type != "cpu" and dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    mine = torch.tensor([state_bytes(opt), _local_param_elements(opt)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return RankTotals([int(t[0]) for t in every], [int(t[1]) for t in every])


def _total_line(label: str, nbytes: int, elements: int) -> str:
    return f"{label} {nbytes} bytes for {elements} param elements ({nbytes / max(elements, 1):.3f} bytes/param)"


def format_state_report(opt) -> str:
    """A table of this process's states, then totals. Unsharded: one ``total`` line. Under FSDP2
    (DTensor params, process group initialised): one line per rank and a ``total`` line for the
    whole model, gathered from every rank (a collective: call it on every rank)."""
    rows = state_report(opt)
    lines = [f"{'param':>5s} {'state':16s} {'format':16s} {'shape':>18s} {'bytes':>12s}"]
    for r in rows:
        lines.append(f"{r.index:5d} {r.name:16s} {r.format:16s} {str(r.shape):>18s} {r.nbytes:12d}")
    totals = rank_totals(opt)
    if totals is None:
        lines.append(_total_line("total", sum(r.nbytes for r in rows), _local_param_elements(opt)))
        return "\n".join(lines)
    world = len(totals.state_bytes)
    me = torch.distributed.get_rank(_shard_group(opt))
    lines[0] += f"   (rank {me}'s shards)"
    for rank, (b, n) in enumerate(zip(totals.state_bytes, totals.param_elements)):
        lines.append(_total_line(f"rank {rank}:", b, n))
    lines.append(_total_line(f"total ({world} ranks, whole model):", sum(totals.state_bytes),
                             sum(totals.param_elements)))
    return "\n".join(lines)
