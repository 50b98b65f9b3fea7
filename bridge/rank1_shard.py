"""The wiring of rank-1 normalized 4-bit records of sharded params (FSDP2 rows, tensor-parallel columns).

A shard's record keeps the *whole tensor's* maxima of its rows and columns: under FSDP2
(``Shard(0)``) its rows' maxima are its own and its columns' maxima are reduced over the
row shards; under tensor parallel (``Shard(1)`` of a 2-D param) the other way round. The
reduction (:class:`Rank1Reduce`, the record's ``reduce``) is an all-reduce(MAX) of a vector of
the shard's row or column length per mesh dim, exact, so states and params equal one
process's bit for bit. NaN (a poisoned row or column) travels as a separate flag: gloo's MAX
does not propagate it.

The record itself is a :class:`~bridge.qstate.QState` like every other state; its parts'
layout is declared in :mod:`lowbit_tree.records`.
"""
from __future__ import annotations

import torch

from .collectives import group_for
from .distributed import is_dtensor, shard_dims

__all__ = ["Rank1Reduce", "rank1_reduce"]


def _dims(p) -> tuple[list[int], list[int]]:
    """Mesh dims that shard ``p``'s rows, and its columns (:func:`~bridge.distributed.shard_dims`)."""
    return shard_dims(p, "use rank1_normalization=False for it")


class Rank1Reduce:
    """A sharded rank-1 record's ``reduce``: column maxima over the row shards, row maxima over
    the column shards (each an all-reduce of values and of NaN flags, one at a time).
    ``sent`` counts the bytes this rank contributed (values and flags), since creation."""

    def __init__(self, p):
        rows, cols = _dims(p)
        mesh = p.device_mesh
        self.row_groups = [mesh.get_group(d) for d in rows if mesh.size(d) > 1]
        self.col_groups = [mesh.get_group(d) for d in cols if mesh.size(d) > 1]
        self.sent = 0

    def _max(self, t: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        nan = torch.isnan(t)
        values = torch.where(nan, torch.zeros_like(t), t)  # maxima of a non-negative tensor: 0 is neutral
        flags = nan.to(torch.int32)
        group = group_for(group, t.device, "the rank-1 record's all-reduce MAX of maxima")
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        self.sent += values.numel() * 4 + flags.numel() * 4
        return torch.where(flags.bool(), torch.full_like(values, float("nan")), values)

    def __call__(self, row_max: torch.Tensor, col_max: torch.Tensor):
        for g in self.row_groups:
            col_max = self._max(col_max, g)
        for g in self.col_groups:
            row_max = self._max(row_max, g)
        return row_max, col_max


def rank1_reduce(p, local: torch.Tensor):
    """The ``reduce`` of a rank-1 record of param ``p``'s local shard (``None`` unsharded)."""
    if not is_dtensor(p):
        return None
    rows, cols = _dims(p)
    if cols and local.shape[1] % 2:
        raise ValueError(
            f"rank-1 normalized 4-bit state of the param of shape {tuple(p.shape)} placed {tuple(p.placements)}: "
            f"this rank's {local.shape[1]} columns are an odd number, and a 4-bit byte holds two; use an even "
            "tensor-parallel split, or 8-bit states for this param"
        )
    return Rank1Reduce(p) if rows or cols else None
