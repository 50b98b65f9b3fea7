"""How one optimizer-state leaf (a moment) is stored: fp32, bf16, or quantized.

A moment leaf is created once by :func:`init_moment` from its parameter's shape
and never changes kind afterwards: :func:`load` turns any leaf into a float32
tensor and :func:`store` writes a float32 tensor back into a leaf of the same
kind, format and block size. The quantize-or-not decision is static
(:func:`should_quantize`, from the global shape) and visible
(:func:`state_report`).

Besides :class:`~lowbit_tree.QTensor` (block-wise absmax scales) there is
:class:`Rank1QTensor`, the 4-bit second-moment record of arXiv 2309.01507:
each element of the row view ``(rows, R)`` is normalized by
``min(row_max[i], col_max[j])`` and coded with the zero-free ``linear4_unsigned``
map.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import optree
import optree.registry
import torch
import torch.utils._pytree as torch_pytree

from .formats import get_format
from .qtensor import QTensor, dequantize, quantize, row_layout
from .qtensor import zeros as qzeros
from .tree_utils import path_string

__all__ = [
    "STATE_FORMAT_NAMES",
    "Rank1QTensor",
    "should_quantize",
    "init_moment",
    "load",
    "store",
    "rank1_quantize",
    "rank1_dequantize",
    "ReportRow",
    "state_report",
    "format_state_report",
]

STATE_FORMAT_NAMES = ("fp32", "bf16", "8bit", "4bit", "fp8", "8bit_bnb")
RANK1_FORMAT = "linear4_unsigned"


def should_quantize(shape: Sequence[int], min_quant_size: int) -> bool:
    """Whether a parameter of this (global, unsharded) shape gets a quantized state.

    Only tensors with ``ndim >= 2`` and at least ``min_quant_size`` elements:
    biases, norms and scalars keep a float state (their memory is negligible,
    and a 1-D block would mix unrelated channels).
    """
    shape = tuple(shape)
    return len(shape) >= 2 and math.prod(shape) >= min_quant_size


def check_state_format(state_format: str) -> None:
    if state_format not in STATE_FORMAT_NAMES:
        raise ValueError(f"state_format must be one of {STATE_FORMAT_NAMES}, got {state_format!r}")


# ----------------------------------------------------------------------------
# Rank-1 normalized 4-bit record
# ----------------------------------------------------------------------------
class Rank1QTensor:
    """An immutable rank-1 normalized 4-bit record of a non-negative tensor.

    Children: ``codes`` (uint8, ``(rows, ceil(R/2))``, two codes a byte as in
    QTensor), ``row_max`` (float32 ``(rows,)``), ``col_max`` (float32 ``(R,)``).
    Static metadata: ``shape`` and ``format`` (``"linear4_unsigned"``).
    Element ``(i, j)`` dequantizes to ``map[code] * min(row_max[i], col_max[j])``.
    """

    __slots__ = ("codes", "row_max", "col_max", "shape", "format")

    def __init__(self, codes, row_max, col_max, shape: Sequence[int], format: str = RANK1_FORMAT):
        object.__setattr__(self, "codes", codes)
        object.__setattr__(self, "row_max", row_max)
        object.__setattr__(self, "col_max", col_max)
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "format", str(format))

    def __setattr__(self, name, value):
        raise AttributeError("Rank1QTensor is immutable")

    def __reduce__(self):
        return (Rank1QTensor, (self.codes, self.row_max, self.col_max, self.shape, self.format))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.row_max, self.col_max))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return rank1_dequantize(self, dtype)

    def __repr__(self) -> str:
        return f"Rank1QTensor(format={self.format!r}, shape={self.shape})"


optree.register_pytree_node(
    Rank1QTensor,
    lambda q: ((q.codes, q.row_max, q.col_max), (q.shape, q.format), ("codes", "row_max", "col_max")),
    lambda meta, children: Rank1QTensor(*children, *meta),
    path_entry_type=optree.GetAttrEntry,
    namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),
)
torch_pytree.register_pytree_node(
    Rank1QTensor,
    lambda q: ([q.codes, q.row_max, q.col_max], (q.shape, q.format)),
    lambda children, meta: Rank1QTensor(*children, *meta),
    serialized_type_name="lowbit_tree.Rank1QTensor",
)
torch.serialization.add_safe_globals([Rank1QTensor])


def rank1_quantize(x: torch.Tensor) -> Rank1QTensor:
    """Quantize a non-negative tensor with rank-1 normalization (a new record).

    A negative or NaN entry poisons its row and column maxima (NaN), so it
    dequantizes to NaN rather than to finite garbage.
    """
    fmt = get_format(RANK1_FORMAT)
    shape = tuple(x.shape)
    rows, r = row_layout(shape)
    x2 = x.detach().float().reshape(rows, r)
    x2 = torch.where(x2 < 0, torch.full_like(x2, float("nan")), x2)
    row_max = x2.amax(dim=1) if r > 0 else x2.new_zeros(rows)
    col_max = x2.amax(dim=0) if rows > 0 else x2.new_zeros(r)
    norm = torch.minimum(row_max[:, None], col_max[None, :])
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    idx = torch.bucketize((x2 / safe).double(), fmt.midpoints.to(x2.device), right=True)
    idx = idx.clamp_(0, fmt.values.numel() - 1).to(torch.uint8)
    if r % 2:
        idx = torch.nn.functional.pad(idx, (0, 1))
    pairs = idx.reshape(rows, idx.shape[1] // 2, 2)
    codes = pairs[..., 0] | (pairs[..., 1] << 4)
    return Rank1QTensor(codes, row_max, col_max, shape, RANK1_FORMAT)


def rank1_dequantize(q: Rank1QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, r = row_layout(q.shape)
    table = get_format(q.format).values.to(q.codes.device)
    idx = torch.stack([q.codes & 0x0F, q.codes >> 4], dim=-1).reshape(rows, 2 * q.codes.shape[1])[:, :r]
    norm = torch.minimum(q.row_max[:, None], q.col_max[None, :])
    return (table[idx.long()] * norm).reshape(q.shape).to(dtype)


def rank1_zeros(shape: Sequence[int], device=None) -> Rank1QTensor:
    rows, r = row_layout(shape)
    return Rank1QTensor(
        torch.zeros(rows, -(-r // 2), dtype=torch.uint8, device=device),
        torch.zeros(rows, dtype=torch.float32, device=device),
        torch.zeros(r, dtype=torch.float32, device=device),
        shape,
        RANK1_FORMAT,
    )


# ----------------------------------------------------------------------------
# Moment leaves
# ----------------------------------------------------------------------------
def init_moment(
    param: torch.Tensor | None,
    state_format: str,
    *,
    signed: bool,
    block_size: int | None = None,
    min_quant_size: int = 4096,
    rank1: bool = False,
) -> Any:
    """A zero moment for ``param`` on its device (``None`` for a ``None`` param).

    ``signed=True`` for first moments (momentum), ``False`` for second moments.
    """
    if param is None:
        return None
    shape, device = tuple(param.shape), param.device
    if state_format == "bf16":
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    if state_format == "fp32" or not should_quantize(shape, min_quant_size):
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if rank1 and not signed:
        return rank1_zeros(shape, device)
    return qzeros(shape, state_format, block_size, device, signed=signed)


def load(leaf: Any) -> torch.Tensor:
    """A moment leaf as a float32 tensor (a new tensor for quantized leaves)."""
    if isinstance(leaf, QTensor):
        return dequantize(leaf)
    if isinstance(leaf, Rank1QTensor):
        return rank1_dequantize(leaf)
    return leaf.float()


def store(x: torch.Tensor, like: Any) -> Any:
    """``x`` (float32) written as a leaf of the same kind, format and block size as ``like``."""
    if isinstance(like, QTensor):
        return quantize(x, like.format, like.block_size)
    if isinstance(like, Rank1QTensor):
        return rank1_quantize(x)
    return x.to(like.dtype)


# ----------------------------------------------------------------------------
# What a state costs
# ----------------------------------------------------------------------------
class ReportRow(NamedTuple):
    path: str
    format: str
    shape: tuple[int, ...]
    nbytes: int


def _leaf_format(leaf: Any) -> str:
    if isinstance(leaf, QTensor):
        return leaf.format
    if isinstance(leaf, Rank1QTensor):
        return "rank1_" + leaf.format
    return str(leaf.dtype).replace("torch.", "")


def state_report(state: Any) -> list[ReportRow]:
    """One row per state leaf (``path, format, shape, nbytes``), then a ``"total"`` row.

    ``format`` is the QTensor format name (``"dynamic8"``, ...), ``"rank1_linear4_unsigned"``,
    or the dtype (``"float32"``, ``"bfloat16"``, ``"int32"``) of a plain tensor;
    ``shape`` is the logical shape.
    """
    is_record = lambda x: isinstance(x, (QTensor, Rank1QTensor))
    accessors, leaves, _ = optree.tree_flatten_with_accessor(state, is_leaf=is_record)
    rows = []
    for acc, leaf in zip(accessors, leaves):
        if is_record(leaf):
            nbytes, shape = leaf.nbytes, leaf.shape
        elif isinstance(leaf, torch.Tensor):
            nbytes, shape = leaf.numel() * leaf.element_size(), tuple(leaf.shape)
        else:
            continue
        rows.append(ReportRow(path_string(acc), _leaf_format(leaf), shape, nbytes))
    rows.append(ReportRow("total", "", (), sum(r.nbytes for r in rows)))
    return rows


def format_state_report(rows: list[ReportRow]) -> str:
    """The report as an aligned text table."""
    width = max([len(r.path) for r in rows] + [4])
    lines = [f"{'path':<{width}}  {'format':<24} {'shape':<20} {'bytes':>12}"]
    for r in rows:
        lines.append(f"{r.path:<{width}}  {r.format:<24} {str(r.shape):<20} {r.nbytes:>12}")
    return "\n".join(lines)
