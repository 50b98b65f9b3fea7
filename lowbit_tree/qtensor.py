"""The quantized-tensor record and its pure quantize / dequantize functions.

Layout (see design.md): a tensor of ``ndim >= 2`` is viewed as rows
``(shape[0], R)`` with ``R = prod(shape[1:])``; ``ndim <= 1`` is one row. Each row
is cut into blocks of ``block_size`` consecutive elements (the last may be
shorter); blocks never straddle a row. One float32 scale per block:
``scale.shape == (rows, ceil(R / block_size))``. Codes keep the rows:
``(rows, R)`` for 8-bit and fp8, ``(rows, ceil(R / 2))`` for 4-bit (element
``2j`` in the low nibble, ``2j+1`` in the high nibble). Hence rows ``[a, b)`` of a
tensor quantize to exactly rows ``[a, b)`` of its codes and scale.

Rounding is to the nearest map value, ties to the larger value: the exact
real-number midpoints of the float32 map are compared with the float32
normalized value ``x / scale`` in float64, where both are exact.

Non-finite input: a block holding NaN or +-inf (or a negative value in an
unsigned format) gets a NaN scale, so it dequantizes to NaN; it never becomes
finite garbage. ``has_nonfinite(q)`` finds such blocks.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .formats import Format, get_format
from .record_base import KERNEL_BLOCKS, Record

__all__ = [
    "QTensor",
    "quantize",
    "dequantize",
    "zeros",
    "row_layout",
    "has_nonfinite",
    "resolve_block_size",
]


class QTensor(Record):
    """An immutable block-quantized tensor record.

    Children (pytree leaves): ``codes`` (uint8, or float8_e4m3fn for fp8 formats)
    and ``scale`` (float32, one per block). Static metadata (part of the tree
    structure, never leaves): the logical ``shape``, ``block_size`` and
    ``format`` name. ``lowbit_tree.record_base.Record.unchecked`` builds one
    from fields already normalized (another record's) without the conversions.
    """

    CHILDREN = ("codes", "scale")
    STATIC = ("shape", "block_size", "format")
    KERNEL = KERNEL_BLOCKS
    __slots__ = CHILDREN + STATIC

    codes: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]
    block_size: int
    format: str

    def __init__(self, codes, scale, shape: Sequence[int], block_size: int, format: str):
        Record.__init__(self, codes, scale, tuple(int(s) for s in shape), int(block_size), str(format))

    def replace(self, **changes) -> "QTensor":
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return QTensor(**fields)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        def leaf(t):  # leaves may be anything after a tree_map
            if isinstance(t, torch.Tensor):
                return f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}@{t.device}"
            return repr(t)

        return (
            f"QTensor(format={self.format!r}, shape={self.shape}, block_size={self.block_size}, "
            f"codes={leaf(self.codes)}, scale={leaf(self.scale)})"
        )


def row_layout(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, R)``: the 2-D row view of a tensor of this shape."""
    shape = tuple(shape)
    if len(shape) <= 1:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def resolve_block_size(fmt: Format, block_size: int | None, name: str = "block_size") -> int:
    if block_size is None:
        return fmt.default_block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{name} must be a positive int (or None for the default {fmt.default_block_size}), got {block_size!r}")
    return block_size


def _check_float(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got {x.dtype}")


def _blocks(x2: torch.Tensor, block_size: int) -> torch.Tensor:
    """(rows, R) -> (rows, nblocks, block_size), zero-padding the last block."""
    rows, r = x2.shape
    nblocks = -(-r // block_size)
    pad = nblocks * block_size - r
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    return x2.reshape(rows, nblocks, block_size)


def quantize(x: torch.Tensor, format: str | Format, block_size: int | None = None, *, signed: bool | None = None) -> QTensor:
    """Quantize ``x`` block-wise into a new :class:`QTensor` (``x`` is not modified).

    Args:
      x: floating tensor of any shape and dtype.
      format: a name from ``lowbit_tree.FORMATS`` (or ``"8bit"``/``"4bit"``/``"fp8"``
        with ``signed=``).
      block_size: elements per block within a row; ``None`` picks the format's default.
    """
    fmt = get_format(format, signed)
    bs = resolve_block_size(fmt, block_size)
    _check_float(x, "x")
    codes, scale = quantize_rows(x.detach().reshape(row_layout(x.shape)), fmt, bs)
    return QTensor(codes, scale, tuple(x.shape), bs, fmt.name)


def quantize_rows(x2: torch.Tensor, fmt: Format, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer on a 2-D row view: returns ``(codes, scale)``."""
    rows, r = x2.shape
    x2 = x2.float()
    if not fmt.signed:
        # negative input is invalid for an unsigned format: poison its block
        x2 = torch.where(x2 < 0, torch.full_like(x2, float("nan")), x2)
    if fmt.sqrt:
        # correctly rounded float32 sqrt: eager CPU torch.sqrt(float32) is not
        # (AVX2 build: ~20% of values 1 ulp off), compiled code and CUDA are.
        x2 = torch.sqrt(x2.double()).float()
    xb = _blocks(x2, block_size)
    absmax = xb.abs().amax(dim=-1) if r > 0 else xb.new_zeros(rows, 0)
    # inf -> NaN scale as well (inf/inf would otherwise give a NaN code only)
    absmax = torch.where(torch.isfinite(absmax), absmax, torch.full_like(absmax, float("nan")))
    scale = absmax / fmt.scale_divisor
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    n = xb / safe.unsqueeze(-1)
    idx = torch.bucketize(n.double(), fmt.midpoints.to(x2.device), right=True)
    nvalues = fmt.values.numel()
    idx = idx.clamp_(0, nvalues - 1).reshape(rows, xb.shape[1] * block_size)[:, :r]
    if fmt.float8:
        codes = fmt.values.to(x2.device)[idx].to(torch.float8_e4m3fn)
    elif fmt.bits == 4:
        idx = idx.to(torch.uint8)
        if r % 2:
            idx = torch.nn.functional.pad(idx, (0, 1))
        pairs = idx.reshape(rows, idx.shape[1] // 2, 2)
        codes = pairs[..., 0] | (pairs[..., 1] << 4)
    else:
        codes = idx.to(torch.uint8)
    return codes, scale


def _code_values(q: QTensor, fmt: Format) -> torch.Tensor:
    """Codes -> normalized float32 values, shape (rows, R)."""
    rows, r = row_layout(q.shape)
    if fmt.float8:
        return q.codes.float()
    table = fmt.values.to(q.codes.device)
    if fmt.bits == 4:
        lo = q.codes & 0x0F
        hi = q.codes >> 4
        idx = torch.stack([lo, hi], dim=-1).reshape(rows, 2 * q.codes.shape[1])[:, :r]
    else:
        idx = q.codes
    return table[idx.long()]


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float tensor a :class:`QTensor` stands for (a new tensor)."""
    fmt = get_format(q.format)
    rows, r = row_layout(q.shape)
    vals = _code_values(q, fmt)
    # per-element scale by gather (a pad/reshape/slice here was miscompiled by
    # inductor 2.13 on CPU when followed by a square: garbage in the last block,
    # its C++ loop split dropping the tail, pytorch issue 195582)
    block_of = torch.arange(r, device=vals.device) // q.block_size
    out = vals * q.scale[:, block_of]
    if fmt.sqrt:
        out = out * out
    return out.reshape(q.shape).to(dtype)


def zeros(shape: Sequence[int], format: str | Format, block_size: int | None = None, device=None, *, signed: bool | None = None) -> QTensor:
    """A record that dequantizes to exact zeros (all scales 0)."""
    fmt = get_format(format, signed)
    bs = resolve_block_size(fmt, block_size)
    shape = tuple(int(s) for s in shape)
    rows, r = row_layout(shape)
    ncols = -(-r // 2) if fmt.bits == 4 else r
    codes = torch.zeros(rows, ncols, dtype=fmt.code_dtype, device=device)
    scale = torch.zeros(rows, -(-r // bs), dtype=torch.float32, device=device)
    return QTensor(codes, scale, shape, bs, fmt.name)


def has_nonfinite(q: QTensor) -> torch.Tensor:
    """0-d bool tensor: does any block hold a non-finite value (no host sync)."""
    return (~torch.isfinite(q.scale)).any()
