"""The rank-1 normalized 4-bit record of a non-negative tensor (arXiv 2309.01507).

Each element of the row view ``(rows, R)`` is normalized by ``min(row_max[i],
col_max[j])`` and coded with the zero-free ``linear4_unsigned`` map: one float per
row and per column instead of one per block. Used for 4-bit second moments with
``rank1_normalization=True``.

A record of a *shard* (FSDP2 rows, tensor-parallel columns) holds its rows' and columns'
maxima over the whole tensor: its ``reduce`` (set by whoever shards it, e.g. the bridge)
completes the shard's own maxima across the other shards (an exact max: the same bits as
one process) each time it is requantized.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .formats import get_format
from .qtensor import row_layout
from .record_base import KERNEL_VALUES, Record

__all__ = ["RANK1_FORMAT", "Rank1QTensor", "rank1_quantize", "rank1_dequantize", "rank1_zeros"]

RANK1_FORMAT = "linear4_unsigned"


class Rank1QTensor(Record):
    """An immutable rank-1 normalized 4-bit record of a non-negative tensor.

    Children: ``codes`` (uint8, ``(rows, ceil(R/2))``, two codes a byte as in
    QTensor), ``row_max`` (float32 ``(rows,)``), ``col_max`` (float32 ``(R,)``).
    Static metadata: ``shape`` and ``format`` (``"linear4_unsigned"``).
    Element ``(i, j)`` dequantizes to ``map[code] * min(row_max[i], col_max[j])``.
    ``reduce`` (static, optional): ``(row_max, col_max) -> (row_max, col_max)``, this shard's
    maxima completed over all shards (module docstring); not pickled (it is wiring, not data).
    """

    CHILDREN = ("codes", "row_max", "col_max")
    STATIC = ("shape", "format", "reduce")
    WIRING = ("reduce",)
    KERNEL = KERNEL_VALUES
    __slots__ = CHILDREN + STATIC

    def __init__(self, codes, row_max, col_max, shape: Sequence[int], format: str = RANK1_FORMAT,
                 reduce: Optional[Callable] = None):
        super().__init__(codes, row_max, col_max, tuple(int(s) for s in shape), str(format), reduce)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return rank1_dequantize(self, dtype)

    def __repr__(self) -> str:
        return f"Rank1QTensor(format={self.format!r}, shape={self.shape})"


def rank1_quantize(x: torch.Tensor, reduce: Optional[Callable] = None) -> Rank1QTensor:
    """Quantize a non-negative tensor with rank-1 normalization (a new record).

    A negative or NaN entry poisons its row and column maxima (NaN), so it
    dequantizes to NaN rather than to finite garbage. ``x`` a shard: ``reduce``
    completes its maxima (:class:`Rank1QTensor`) and goes with the record.
    """
    fmt = get_format(RANK1_FORMAT)
    shape = tuple(x.shape)
    rows, r = row_layout(shape)
    x2 = x.detach().float().reshape(rows, r)
    x2 = torch.where(x2 < 0, torch.full_like(x2, float("nan")), x2)
    row_max = x2.amax(dim=1) if r > 0 else x2.new_zeros(rows)
    col_max = x2.amax(dim=0) if rows > 0 else x2.new_zeros(r)
    if reduce is not None:
        row_max, col_max = reduce(row_max, col_max)
    norm = torch.minimum(row_max[:, None], col_max[None, :])
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    idx = torch.bucketize((x2 / safe).double(), fmt.midpoints.to(x2.device), right=True)
    idx = idx.clamp_(0, fmt.values.numel() - 1).to(torch.uint8)
    if r % 2:
        idx = torch.nn.functional.pad(idx, (0, 1))
    pairs = idx.reshape(rows, idx.shape[1] // 2, 2)
    codes = pairs[..., 0] | (pairs[..., 1] << 4)
    return Rank1QTensor(codes, row_max, col_max, shape, RANK1_FORMAT, reduce)


def rank1_dequantize(q: Rank1QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, r = row_layout(q.shape)
    table = get_format(q.format).values.to(q.codes.device)
    idx = torch.stack([q.codes & 0x0F, q.codes >> 4], dim=-1).reshape(rows, 2 * q.codes.shape[1])[:, :r]
    norm = torch.minimum(q.row_max[:, None], q.col_max[None, :])
    return (table[idx.long()] * norm).reshape(q.shape).to(dtype)


def rank1_zeros(shape: Sequence[int], device=None, reduce: Optional[Callable] = None) -> Rank1QTensor:
    rows, r = row_layout(shape)
    return Rank1QTensor(
        torch.zeros(rows, -(-r // 2), dtype=torch.uint8, device=device),
        torch.zeros(rows, dtype=torch.float32, device=device),
        torch.zeros(r, dtype=torch.float32, device=device),
        shape,
        RANK1_FORMAT,
        reduce,
    )
