"""A matrix stored as a low-rank factor plus a quantized residual: Muon's ``momentum_rank``.

``value = row_factor @ col_factor.T + residual``: the factors are bfloat16, ``(m, K)`` and
``(n, K)``; the residual is a :class:`~lowbit_tree.QTensor`'s codes and scales (row-aligned
blocks). Newton-Schulz makes every direction of the momentum as loud as its strongest, so a
4-bit rounding error in the weak directions costs held-out loss; keeping the top-``K`` part
exact and rounding only what is left shrinks the error with the residual's absmax
(4-bit-Muon-GRASP and MuonQ take the same structure; design.md, "Muon").

Every operation here gives the same bits on any row or column shard as on the whole matrix:
:func:`lowrank_expand` is elementwise (bfloat16 products are exact in float32; the sum runs
``k = 0 .. K-1``), and the quantized residual's blocks never straddle a row. Only
:func:`refresh_factors` (a power iteration) needs the whole matrix; a sharded caller runs it
on one owner rank (``bridge.muon.ShardedNS``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .qtensor import QTensor
from .record_base import Record
from .qtensor import zeros as qzeros

__all__ = ["FACTOR_DTYPE", "LowRankQTensor", "lowrank_rank", "lowrank_zeros", "lowrank_expand",
           "lowrank_dequantize", "refresh_factors"]

FACTOR_DTYPE = torch.bfloat16
"""The factors' storage: 2 bytes a value, and products exact in float32."""


class LowRankQTensor(Record):
    """An immutable low-rank-plus-residual record of a 2-D tensor (module docstring).

    Children: ``codes`` and ``scale`` (the residual, as in a QTensor of ``shape``, ``block_size``
    and ``format``), ``row_factor`` (bfloat16 ``(m, K)``), ``col_factor`` (bfloat16 ``(n, K)``).
    Static metadata: ``shape``, ``block_size``, ``format``.
    """

    CHILDREN = ("codes", "scale", "row_factor", "col_factor")
    STATIC = ("shape", "block_size", "format")
    __slots__ = CHILDREN + STATIC

    def __init__(self, codes, scale, row_factor, col_factor, shape: Sequence[int], block_size: int, format: str):
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2:
            raise ValueError(f"LowRankQTensor holds a matrix, got shape {shape}")
        if row_factor.ndim != 2 or col_factor.ndim != 2 or row_factor.shape[1] != col_factor.shape[1]:
            raise ValueError(f"LowRankQTensor factors must be (m, K) and (n, K), got {tuple(row_factor.shape)} and "
                             f"{tuple(col_factor.shape)}")
        super().__init__(codes, scale, row_factor, col_factor, shape, int(block_size), str(format))

    @property
    def rank(self) -> int:
        return int(self.row_factor.shape[1])

    @property
    def residual(self) -> QTensor:
        return QTensor.unchecked(self.codes, self.scale, self.shape, self.block_size, self.format)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return lowrank_dequantize(self).to(dtype)

    def __repr__(self) -> str:
        return f"LowRankQTensor(format={self.format!r}, shape={self.shape}, block_size={self.block_size}, rank={self.rank})"


def lowrank_rank(shape: Sequence[int], rank: int) -> int:
    """The rank a matrix of ``shape`` gets for ``momentum_rank=rank``: at most its smaller side
    (a higher rank cannot hold more)."""
    return max(0, min(int(rank), int(shape[0]), int(shape[1])))


def lowrank_zeros(shape: Sequence[int], rank: int, format: str, block_size: int | None, device=None) -> LowRankQTensor:
    """A zero record: zero factors of ``rank`` columns (as given: the caller decides it from the
    *global* shape, :func:`lowrank_rank`) and a zero residual."""
    res = qzeros(tuple(shape), format, block_size, device, signed=True)
    m, n = shape
    return LowRankQTensor(res.codes, res.scale, torch.zeros(m, rank, dtype=FACTOR_DTYPE, device=device),
                          torch.zeros(n, rank, dtype=FACTOR_DTYPE, device=device), shape, res.block_size, res.format)


def lowrank_expand(row_factor: torch.Tensor, col_factor: torch.Tensor) -> torch.Tensor:
    """``row_factor @ col_factor.T`` in float32, elementwise: ``sum_k P[i, k] R[j, k]`` for
    ``k = 0 .. K-1`` in that order, each product exact (bfloat16 inputs), each sum rounded once.
    So rows (columns) of the whole matrix's result are the result of its rows (columns): the
    bits do not depend on how the matrix is sharded, as a BLAS product's may. Torch ops, or the
    native backend's C loop (the same additions in the same order). A new tensor."""
    from . import kernels

    p, r = row_factor.float(), col_factor.float()
    m, n = p.shape[0], r.shape[0]
    if p.shape[1] == 0 or m * n == 0:
        return torch.zeros(m, n, dtype=torch.float32, device=p.device)
    out = torch.empty(m, n, dtype=torch.float32, device=p.device)
    if kernels.backend_for(p.device) == "native":  # the same sum in C: one pass
        kernels.native.lowrank_expand(p.contiguous(), r.T.contiguous(), out)
        return out
    torch.mul(p[:, :1], r[:, 0], out=out)
    term = torch.empty_like(out)
    for k in range(1, p.shape[1]):
        torch.mul(p[:, k:k + 1], r[:, k], out=term)
        out.add_(term)
    return out


def lowrank_dequantize(q: LowRankQTensor, low: torch.Tensor | None = None) -> torch.Tensor:
    """The record's value, float32: ``lowrank_expand(factors) + dequantize(residual)`` (a new
    tensor). ``low``: that product, when the caller has it already (the same bits)."""
    from . import kernels  # imported on first use

    if low is None:
        low = lowrank_expand(q.row_factor, q.col_factor)
    if not low.numel():
        return low.clone()
    return kernels.dequantize_fast(q.residual).reshape(low.shape).add_(low)  # a + b is b + a, bit for bit


def refresh_factors(b: torch.Tensor, col_factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New factors of the *whole* matrix ``b`` (float32 ``(m, n)``): one power iteration warm-started
    from the old column factor's span, ``Q = qr(R_old)``, ``P = qr(b Q)`` (orthonormal columns),
    ``R = b^T P``, so ``P R^T`` is ``b`` projected on its (approximate) top-``K`` column space.
    Returns ``(P, R)`` in bfloat16. A zero ``R_old`` (the first step) starts from the first ``K``
    coordinate directions; a non-finite ``b`` gives NaN factors (the param's state is poisoned,
    as a quantized block with a NaN is)."""
    k = col_factor.shape[1]
    m, n = b.shape
    if k == 0 or b.numel() == 0:
        return (torch.zeros(m, k, dtype=FACTOR_DTYPE, device=b.device),
                torch.zeros(n, k, dtype=FACTOR_DTYPE, device=b.device))
    q = torch.linalg.qr(col_factor.float())[0]
    p = torch.linalg.qr(b @ q)[0]
    r = b.T @ p
    return p.to(FACTOR_DTYPE), r.to(FACTOR_DTYPE)

