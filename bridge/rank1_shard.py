"""Rank-1 normalized 4-bit states of sharded params (FSDP2 rows, tensor-parallel columns).

A shard's record keeps the *whole tensor's* maxima of its rows and columns: under FSDP2
(``Shard(0)``) its rows' maxima are its own and its columns' maxima are reduced over the
row shards; under tensor parallel (``Shard(1)`` of a 2-D param) the other way round. The
reduction (:class:`Rank1Reduce`, the record's ``reduce``) is an all-reduce(MAX) of a vector of
the shard's row or column length per mesh dim, exact, so states and params equal one
process's bit for bit. NaN (a poisoned row or column) travels as a separate flag: gloo's MAX
does not propagate it.

In a state dict the record is three DTensors: ``codes`` placed like the param (rows, and
columns under tensor parallel, which must then be even: two 4-bit codes a byte),
``row_max`` sharded like the param's rows and replicated over its column shards,
``col_max`` the other way round; DCP saves, loads and reshards them like any DTensor.
"""
from __future__ import annotations

import math

import torch

from .distributed import is_dtensor, row_dtensor, shard_dims

__all__ = ["Rank1Reduce", "rank1_reduce", "rank1_state_tensors", "rank1_local_part", "record_local_part"]


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


def _vector_placements(p, which: str) -> list:
    """Placements of the ``row_max`` (``which="rows"``) or ``col_max`` vector of ``p``."""
    from torch.distributed.tensor import Replicate, Shard

    rows, cols = _dims(p)
    out = []
    for mdim, pl in enumerate(p.placements):
        if which == "rows" and mdim in rows:
            out.append(pl)  # Shard(0) or _StridedShard(0): the rows' own placement
        elif which == "cols" and mdim in cols:
            out.append(Shard(0))
        else:
            out.append(Replicate())
    return out


def rank1_state_tensors(holder, p) -> dict:
    """The record's tensors for a state dict: DTensors of the whole tensor's shapes under
    sharding (module docstring), else the plain local tensors."""
    r = holder.record
    if not is_dtensor(p):
        return {"codes": r.codes, "row_max": r.row_max, "col_max": r.col_max}
    from torch.distributed.tensor import DTensor

    nrows, ncols = p.shape[0], math.prod(p.shape[1:])
    mesh = p.device_mesh
    return {
        "codes": row_dtensor(r.codes, p, -(-ncols // 2)),
        "row_max": DTensor.from_local(r.row_max, mesh, _vector_placements(p, "rows"), run_check=False,
                                      shape=(nrows,), stride=(1,)),
        "col_max": DTensor.from_local(r.col_max, mesh, _vector_placements(p, "cols"), run_check=False,
                                      shape=(ncols,), stride=(1,)),
    }


def record_local_part(t: torch.Tensor, p, along: str) -> torch.Tensor:
    """This rank's part of a saved record tensor: a DTensor's local shard, or the part of a full
    tensor that its layout gives this rank (no communication). ``along``: ``"param"`` (placed like
    the param: codes, scales), ``"rows"`` or ``"cols"`` (a per-row or per-column tensor: rank-1
    maxima, low-rank factors; :func:`_vector_placements`)."""
    if is_dtensor(t):
        return t.to_local()
    if not is_dtensor(p):
        return t
    from torch.distributed.tensor import distribute_tensor

    placements = p.placements if along == "param" else _vector_placements(p, along)
    return distribute_tensor(t, p.device_mesh, placements, src_data_rank=None).to_local()


def rank1_local_part(t: torch.Tensor, p, part: str) -> torch.Tensor:
    """This rank's part of a saved rank-1 record tensor (``codes``, ``row_max``, ``col_max``): the
    module docstring's layout."""
    return record_local_part(t, p, {"codes": "param", "row_max": "rows", "col_max": "cols"}[part])
