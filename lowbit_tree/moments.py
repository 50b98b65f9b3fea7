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
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Sequence, Union

import optree
import torch

from . import records
from .formats import get_format
from .qtensor import resolve_block_size
from .rank1 import RANK1_FORMAT, Rank1QTensor, rank1_dequantize, rank1_quantize
from .records import is_record, label, load, store
from .tree_utils import path_string

__all__ = [
    "STATE_FORMAT_NAMES",
    "StateFormat",
    "FORMAT_ARGUMENTS",
    "check_state_format",
    "state_formats",
    "RANK1_FORMAT",
    "is_record",
    "Rank1QTensor",
    "should_quantize",
    "init_moment",
    "load",
    "store",
    "rank1_quantize",
    "rank1_dequantize",
    "ReportRow",
    "leaf_row",
    "state_report",
    "format_state_report",
]

STATE_FORMAT_NAMES = ("fp32", "bf16", "8bit", "4bit", "nf4", "fp8", "8bit_bnb")

RANK1_STATE_FORMATS = ("4bit", "nf4")
"""The state formats whose second moment may be rank-1 normalized (their ``linear4_unsigned``)."""


def should_quantize(shape: Sequence[int], min_quant_size: int) -> bool:
    """Whether a parameter of this (global, unsharded) shape gets a quantized state.

    Only tensors with ``ndim >= 2`` and at least ``min_quant_size`` elements:
    biases, norms and scalars keep a float state (their memory is small, a 1-D
    block would mix unrelated channels, and a 1-D param is one row, which FSDP2
    would cut inside a block).
    """
    shape = tuple(shape)
    return len(shape) >= 2 and math.prod(shape) >= min_quant_size


StateFormat = Union[str, Mapping[str, str]]
"""A ``state_format`` argument: one format name for every state, or a mapping from torch.optim
state names to format names (``{"exp_avg": "8bit", "exp_avg_sq": "4bit"}``) for the states it
sets (:func:`state_formats`)."""

FORMAT_ARGUMENTS = {"exp_avg_slow": "slow_state_format"}
"""Arguments (and bridge param-group keys) that set one state's format beside ``state_format``:
AdEMAMix's ``slow_state_format`` is the ``exp_avg_slow`` entry (:func:`state_formats`)."""


def check_state_format(state_format: StateFormat, names: Sequence[str] | None = None, *,
                       argument: str = "state_format") -> None:
    """A ValueError naming ``argument`` unless ``state_format`` is a format name or a mapping
    from state names to format names; with ``names``, the mapping's keys must be among them
    (``None``: any string, for a caller that does not know the states)."""
    if isinstance(state_format, str):
        if state_format not in STATE_FORMAT_NAMES:
            raise ValueError(f"{argument} must be one of {STATE_FORMAT_NAMES} or a mapping {{state name: format}}, "
                             f"got {state_format!r}")
        return
    if not isinstance(state_format, Mapping):
        raise ValueError(f"{argument} must be one of {STATE_FORMAT_NAMES} or a mapping {{state name: format}} such "
                         f"as {{'exp_avg': '8bit', 'exp_avg_sq': '4bit'}}, got {type(state_format).__name__} "
                         f"{state_format!r}")
    for name, fmt in state_format.items():
        if not isinstance(name, str) or (names is not None and name not in names):
            known = f"the states are {', '.join(map(repr, names))}" if names is not None else "keys are state names"
            raise ValueError(f"{argument} names {name!r}, which is not a state here; {known} (torch.optim's "
                             f"names, as in optimizer.state[p]): name only those, e.g. "
                             f"{argument}={{{names[0] if names else 'exp_avg'!r}: '8bit'}}")
        if not isinstance(fmt, str) or fmt not in STATE_FORMAT_NAMES:
            raise ValueError(f"{argument}[{name!r}] must be one of {STATE_FORMAT_NAMES}, got {fmt!r}")


def state_formats(state_format: StateFormat, names: Sequence[str], *, default: StateFormat = "8bit",
                  **arguments: str | None) -> dict[str, str]:
    """The format of each state in ``names``: ``{name: format name}``.

    Args:
      state_format: a format name for every state, or a mapping ``{state name: format}`` that sets
        the states it names; the others take ``default``. Its keys must be in ``names``.
      names: the states' torch.optim names (:func:`lowbit_tree.base.state_names` of the state class).
      default: the format of the states a mapping leaves out (a format name, or a complete mapping).
      arguments: :data:`FORMAT_ARGUMENTS` given beside ``state_format`` (``slow_state_format=...``;
        ``None``: not given). With a format name such an argument overrides its state's format; with
        a mapping it sets its state when the mapping does not name it, and a mapping that names the
        state with another format contradicts it: a ValueError naming both.
    """
    check_state_format(state_format, names)
    if isinstance(state_format, str):
        formats = dict.fromkeys(names, state_format)
    else:
        fill = default if isinstance(default, Mapping) else dict.fromkeys(names, default)
        formats = {name: state_format.get(name, fill[name]) for name in names}
    for name, argument in FORMAT_ARGUMENTS.items():
        value = arguments.pop(argument, None)
        if value is None or name not in names:
            continue
        if not isinstance(value, str) or value not in STATE_FORMAT_NAMES:
            raise ValueError(f"{argument} must be one of {STATE_FORMAT_NAMES}, got {value!r}")
        given = None if isinstance(state_format, str) else state_format.get(name)
        if given is not None and given != value:
            raise ValueError(f"{argument}={value!r} and state_format[{name!r}]={given!r} contradict each other: "
                             f"they set the same state; give its format once")
        formats[name] = value
    if arguments:
        raise TypeError(f"state_formats() got unexpected arguments {sorted(arguments)}")
    return formats


def default_rank1(state_format: str) -> bool:
    """Whether second moments in ``state_format`` are rank-1 normalized unless told otherwise:
    ``"4bit"`` and ``"nf4"`` yes (the measurement: design.md, "The 4-bit default", and
    docs/results.md); other formats have no rank-1 record."""
    return state_format in RANK1_STATE_FORMATS


def resolve_rank1(rank1_normalization: bool | None, state_format: str) -> bool:
    """``rank1_normalization`` as given (``None``: :func:`default_rank1`); ``True`` needs a 4-bit
    state format (``"4bit"``, ``"nf4"``)."""
    if rank1_normalization is None:
        return default_rank1(state_format)
    if not isinstance(rank1_normalization, bool):
        raise ValueError(f"rank1_normalization must be True, False or None (the format's default), "
                         f"got {rank1_normalization!r}")
    if rank1_normalization and state_format not in RANK1_STATE_FORMATS:
        raise ValueError(f"rank1_normalization=True needs a 4-bit second moment (state_format='4bit' or 'nf4', or "
                         f"a mapping with 'exp_avg_sq': '4bit'), got {state_format!r} for it")
    return rank1_normalization


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
        return records.RANK1.zeros(shape, {}, device)
    fmt = get_format(state_format, signed)
    return records.BLOCK.zeros(shape, {"format": fmt.name, "block_size": resolve_block_size(fmt, block_size)}, device)


# ----------------------------------------------------------------------------
# What a state costs
# ----------------------------------------------------------------------------
class ReportRow(NamedTuple):
    """One stored state: where it is (``path``), its ``format``, its ``shape`` and ``nbytes``; its
    ``block`` size (``"-"``: none) and how it is ``detail``ed in tensors. The rows of
    :func:`state_report` and of ``lowbit-tree inspect`` (which reads saved files, where a path is
    ``param/state`` and a shape may be a record's row view)."""

    path: str
    format: str
    shape: tuple
    nbytes: int
    block: str = "-"
    detail: str = ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def leaf_row(path: str, leaf: Any, plain_format: Callable[[torch.dtype], str] = _dtype_name) -> ReportRow | None:
    """The row of a state leaf: a record's kind label (:func:`~lowbit_tree.records.label`),
    logical shape, bytes, block size and parts; a tensor's ``plain_format(dtype)`` (default: the
    dtype's name); ``None`` for anything else (a leaf that holds no tensor)."""
    kind = records.kind_of(leaf)
    if kind is not None:
        parts, meta = kind.parts_of(leaf), kind.meta_of(leaf)
        detail = ", ".join(f"{k} {_dtype_name(t.dtype)}{list(t.shape)}" for k, t in parts.items())
        return ReportRow(path, kind.label(leaf), leaf.shape, records.nbytes_of(parts),
                         str(meta.get("block_size", "-")), detail)
    if isinstance(leaf, torch.Tensor):
        return ReportRow(path, plain_format(leaf.dtype), tuple(leaf.shape), leaf.numel() * leaf.element_size(), "-",
                         _dtype_name(leaf.dtype))
    return None


def state_report(state: Any) -> list[ReportRow]:
    """One row per state leaf (``leaf_row``), then a ``"total"`` row.

    ``format`` is the QTensor format name (``"dynamic8"``, ...), ``"rank1_linear4_unsigned"``,
    ``"normal4+rank8"`` (a low-rank record: its residual's format and its factors' rank), or the
    dtype (``"float32"``, ``"bfloat16"``, ``"int32"``) of a plain tensor; ``shape`` is the
    logical shape.
    """
    accessors, leaves, _ = optree.tree_flatten_with_accessor(state, is_leaf=is_record)
    rows = [row for row in (leaf_row(path_string(acc), leaf) for acc, leaf in zip(accessors, leaves))
            if row is not None]
    rows.append(ReportRow("total", "", (), sum(r.nbytes for r in rows)))
    return rows


def format_state_report(rows: list[ReportRow]) -> str:
    """The report as an aligned text table."""
    width = max([len(r.path) for r in rows] + [4])
    lines = [f"{'path':<{width}}  {'format':<24} {'shape':<20} {'bytes':>12}"]
    for r in rows:
        lines.append(f"{r.path:<{width}}  {r.format:<24} {str(r.shape):<20} {r.nbytes:>12}")
    return "\n".join(lines)


# States saved before Rank1QTensor moved to lowbit_tree.rank1 name it by its old path.
torch.serialization.add_safe_globals([(Rank1QTensor, "lowbit_tree.moments.Rank1QTensor")])
