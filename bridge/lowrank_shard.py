"""Low-rank momentum records (Muon's ``momentum_rank``) of sharded params, in state dicts.

A shard's record holds the residual's codes and scales of its block (placed like the param,
as a quantized state's), the row factor's rows for its rows and the column factor's rows for
its columns. In a state dict the record is four DTensors of the whole matrix's shapes:
``codes`` and ``scale`` placed like the param, ``row_factor`` ``(m, K)`` sharded like the
param's rows and replicated over its column shards, ``col_factor`` ``(n, K)`` the other way
round (the layout of a rank-1 record's maxima: :mod:`bridge.rank1_shard`). DCP saves, loads
and reshards them like any DTensor.
"""
from __future__ import annotations

import torch

import lowbit_tree as lt

from .distributed import is_dtensor, row_dtensor
from .rank1_shard import _vector_placements, record_local_part

__all__ = ["LOWRANK_PARTS", "lowrank_state_tensors", "lowrank_local_part"]

LOWRANK_PARTS = ("codes", "scale", "row_factor", "col_factor")


def lowrank_state_tensors(holder, p) -> dict:
    """The record's tensors for a state dict: DTensors of the whole matrix's shapes under
    sharding (module docstring), else the plain local tensors."""
    r = holder.record
    codes = r.codes.view(torch.uint8) if r.codes.dtype != torch.uint8 else r.codes  # fp8 codes as their bits
    if not is_dtensor(p):
        return {"codes": codes, "scale": r.scale, "row_factor": r.row_factor, "col_factor": r.col_factor}
    from torch.distributed.tensor import DTensor

    m, n = p.shape
    k = r.rank
    ccols = -(-n // 2) if lt.get_format(r.format).bits == 4 else n
    mesh = p.device_mesh
    return {
        "codes": row_dtensor(codes, p, ccols),
        "scale": row_dtensor(r.scale, p, -(-n // r.block_size)),
        "row_factor": DTensor.from_local(r.row_factor, mesh, _vector_placements(p, "rows"), run_check=False,
                                         shape=(m, k), stride=(k, 1)),
        "col_factor": DTensor.from_local(r.col_factor, mesh, _vector_placements(p, "cols"), run_check=False,
                                         shape=(n, k), stride=(k, 1)),
    }


def lowrank_local_part(t: torch.Tensor, p, part: str) -> torch.Tensor:
    """This rank's part of a saved record tensor (the module docstring's layout; no communication)."""
    return record_local_part(t, p, {"codes": "param", "scale": "param", "row_factor": "rows", "col_factor": "cols"}[part])
