"""The record protocol: every kind of quantized state record, declared once.

A record is an immutable object of tensors ("parts") and static metadata standing for one
float32 state of a param's shape. Each kind says here, and nowhere else:

- its parts, and how each is laid out against the param's row view ``(rows, R)``
  (:func:`~lowbit_tree.row_layout`): ``"param"`` parts are 2-D, their rows are the
  param's rows and each of their columns covers ``unit`` param columns (codes: 1, or 2 for
  4-bit; scales: the block size), so they split with both; ``"rows"`` parts have one entry
  (row) per param row and ``"cols"`` parts one per param column, each whole along the other;
- its static metadata (besides the logical shape) and the name its format is reported by;
- how a zero record is made, how it dequantizes and how a float32 value is stored into one.

Everything that handles records generically (the bridge's tensor subclass and its shard ops,
state dicts, DCP, reports, ``inspect``) reads a :class:`RecordKind`. The record classes name
their fields once (``lowbit_tree.record_base.Record``: ``CHILDREN``, ``STATIC``,
``WIRING``, and ``KERNEL``, how the step kernels take them), which gives each its pytree
registration, freezing and pickling; a kind's part names, metadata and wiring here are read off
its class. The kernels read the class's declaration through that base (they cannot import this
module: it imports ``lowbit_tree.lowrank``, whose fast paths import the kernels).

Adding a kind: its class (a ``lowbit_tree.record_base.Record``) with its quantize and
dequantize, and its :class:`RecordKind` here. If the kernels step it as an existing ``KERNEL``
does, nothing in the kernels changes; a new way to step it is a new ``KERNEL`` value, its branch
in ``lowbit_tree.kernels`` and its C and torch code.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from .formats import get_format
from .lowrank import LowRankQTensor, lowrank_dequantize, lowrank_zeros
from .qtensor import QTensor, dequantize, quantize, row_layout
from .qtensor import zeros as qzeros
from .rank1 import RANK1_FORMAT, Rank1QTensor, rank1_dequantize, rank1_quantize, rank1_zeros
from .record_base import KERNEL_BLOCKS, KERNEL_VALUES

__all__ = ["Part", "RecordKind", "KERNEL_BLOCKS", "KERNEL_VALUES", "KINDS", "kind_of", "kind_of_part_names", "kind_named", "is_record", "parts_of", "label",
           "describe", "nbytes_of", "load", "store", "whole_nbytes"]


class Part(NamedTuple):
    """One tensor of a record. ``along``: ``"param"``, ``"rows"`` or ``"cols"`` (module
    docstring). ``unit(meta)``: param columns per column of a ``"param"`` part. ``is_scale``:
    values are block scales (>= 0 and finite, or NaN for a poisoned block), checked on load."""

    name: str
    along: str
    unit: Optional[Callable[[dict], int]] = None
    is_scale: bool = False
    optional: bool = False  # a state dict may leave it out (all optional parts, or none): zeros


def _code_unit(meta: dict) -> int:
    return 2 if get_format(meta["format"]).bits == 4 else 1


def _block_unit(meta: dict) -> int:
    return int(meta["block_size"])


def _meta_names(cls) -> tuple:
    """A record class's static metadata besides ``shape`` and its wiring."""
    return tuple(k for k in cls.STATIC if k != "shape" and k not in cls.WIRING)


class RecordKind(NamedTuple):
    """A record kind's declaration (module docstring)."""

    name: str                     # the kind's name in reports and errors
    cls: type
    parts: tuple                  # of Part
    regrid: bool                  # a whole saved record on another block grid is requantized on load
    meta: tuple                   # static metadata names besides ``shape``
    make: Callable                # (parts: dict, shape, meta: dict) -> record
    zeros: Callable               # (shape, meta: dict, device) -> record
    dequantize: Callable          # record -> float32 tensor
    store: Callable               # (float32 tensor, like record) -> record: the core's store
    from_float: Callable          # (float32 tensor, like record) -> record: a float state loaded
    label: Callable               # record or meta -> format name in reports
    derived: Callable = lambda record: {}  # metadata read off the parts (a low-rank record's rank)
    wiring: tuple = ()            # non-data arguments of ``make`` set by whoever shards the record
    flat_prefix: str = ""         # before the format name in lowbit_tree.checkpoint's flat dicts

    def parts_of(self, record) -> dict:
        return {p.name: getattr(record, p.name) for p in self.parts}

    def meta_of(self, record) -> dict:
        return {**{k: getattr(record, k) for k in self.meta}, **self.derived(record)}

    @property
    def kernel(self) -> Optional[str]:
        """How the step kernels take a record of this kind (the class's ``KERNEL``:
        ``KERNEL_BLOCKS``, ``KERNEL_VALUES``, or ``None``)."""
        return self.cls.KERNEL

    @property
    def part_names(self) -> tuple:
        return tuple(p.name for p in self.parts)

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def whole_part_shape(self, part: Part, shape: Sequence[int], meta: dict, local) -> tuple:
        """The shape ``part`` has in the record of the whole param of ``shape`` (``local``: the
        part in some record of this kind, for its trailing dims and dtype)."""
        rows, r = row_layout(shape)
        if part.along == "param":
            u = part.unit(meta)
            return (rows, -(-r // u))
        n = rows if part.along == "rows" else r
        return (n,) + tuple(local.shape[1:])


def _store_lowrank(x, like):
    raise TypeError("a low-rank momentum record is written by its optimizer's step (it needs the whole "
                    "matrix's factors), not stored from a float32 tensor")


def _lowrank_from_float(x, like):
    """A float buffer as a low-rank record: the residual, with zero factors (the same value)."""
    q = quantize(x, like.format, like.block_size)
    return LowRankQTensor(q.codes, q.scale, torch.zeros_like(like.row_factor), torch.zeros_like(like.col_factor),
                          like.shape, like.block_size, like.format)


BLOCK = RecordKind(
    name="block",
    cls=QTensor,
    parts=(Part("codes", "param", _code_unit), Part("scale", "param", _block_unit, is_scale=True)),
    regrid=True,
    meta=_meta_names(QTensor),
    make=lambda parts, shape, meta: QTensor.unchecked(parts["codes"], parts["scale"], tuple(shape),
                                                      meta["block_size"], meta["format"]),
    zeros=lambda shape, meta, device: qzeros(tuple(shape), meta["format"], meta["block_size"], device),
    dequantize=dequantize,
    store=lambda x, like: quantize(x, like.format, like.block_size),
    from_float=lambda x, like: quantize(x, like.format, like.block_size),
    label=lambda r: r["format"] if isinstance(r, dict) else r.format,
)

RANK1 = RecordKind(
    name="rank1",
    cls=Rank1QTensor,
    parts=(Part("codes", "param", lambda meta: 2), Part("row_max", "rows"), Part("col_max", "cols")),
    regrid=False,
    meta=_meta_names(Rank1QTensor),
    make=lambda parts, shape, meta: Rank1QTensor(parts["codes"], parts["row_max"], parts["col_max"], shape,
                                                 meta["format"], meta.get("reduce")),
    zeros=lambda shape, meta, device: rank1_zeros(tuple(shape), device),
    dequantize=rank1_dequantize,
    store=lambda x, like: rank1_quantize(x, like.reduce),
    from_float=lambda x, like: rank1_quantize(x, like.reduce),
    label=lambda r: "rank1_" + RANK1_FORMAT,
    wiring=Rank1QTensor.WIRING,
    flat_prefix="rank1:",
)

LOWRANK = RecordKind(
    name="lowrank",
    cls=LowRankQTensor,
    parts=(Part("codes", "param", _code_unit), Part("scale", "param", _block_unit, is_scale=True),
           Part("row_factor", "rows", optional=True), Part("col_factor", "cols", optional=True)),
    regrid=False,
    meta=_meta_names(LowRankQTensor),
    make=lambda parts, shape, meta: LowRankQTensor(parts["codes"], parts["scale"], parts["row_factor"],
                                                   parts["col_factor"], shape, meta["block_size"], meta["format"]),
    zeros=lambda shape, meta, device: lowrank_zeros(tuple(shape), meta["rank"], meta["format"], meta["block_size"],
                                                    device),
    dequantize=lambda r: lowrank_dequantize(r).float(),
    store=_store_lowrank,
    from_float=lambda x, like: _lowrank_from_float(x, like),
    label=lambda r: f"{r['format']}+rank{r['rank']}" if isinstance(r, dict) else f"{r.format}+rank{r.rank}",
    derived=lambda record: {"rank": record.rank},
    flat_prefix="lowrank:",
)

KINDS = (BLOCK, RANK1, LOWRANK)
"""Every record kind."""

_BY_CLASS = {k.cls: k for k in KINDS}
_BY_NAME = {k.name: k for k in KINDS}


def kind_of(x: Any) -> Optional[RecordKind]:
    """The kind of record ``x`` (``None`` for anything else)."""
    return _BY_CLASS.get(type(x))


def kind_of_part_names(names) -> Optional[RecordKind]:
    """The kind whose parts are all among ``names`` (a state dict entry's keys, or the part
    suffixes a checkpoint holds under one state), the one with the most parts where several
    are (a low-rank record holds a block record's parts too); ``None`` if none is."""
    names = set(names)
    found = [k for k in KINDS if set(k.part_names) <= names]
    return max(found, key=lambda k: len(k.parts)) if found else None


def kind_named(name: str) -> RecordKind:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown record kind {name!r}; known: {sorted(_BY_NAME)}") from None


def is_record(x: Any) -> bool:
    """A quantized state record of any kind: one leaf as far as states are concerned, though
    optree sees its tensors."""
    return type(x) in _BY_CLASS


def parts_of(record) -> dict:
    return kind_of(record).parts_of(record)


def label(leaf: Any) -> str:
    """The name a leaf's format is reported by: a record's kind's label, else the dtype."""
    kind = kind_of(leaf)
    if kind is not None:
        return kind.label(leaf)
    return str(leaf.dtype).replace("torch.", "")


def describe(leaf: Any) -> str:
    """A record or tensor in words, for error messages."""
    kind = kind_of(leaf)
    if kind is None:
        return f"{str(leaf.dtype).replace('torch.', '')}{list(leaf.shape)}"
    meta = kind.meta_of(leaf)
    extra = f" with block size {meta['block_size']}" if "block_size" in meta else ""
    return f"a {kind.label(leaf)!r} {kind.name} record of shape {list(leaf.shape)}{extra}"


def nbytes_of(parts: dict) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())


def whole_nbytes(kind: RecordKind, shape: Sequence[int], meta: dict) -> int:
    """Bytes of a record of this kind for the whole param of ``shape`` (no allocation)."""
    z = kind.zeros(tuple(shape), meta, "meta")
    return nbytes_of(kind.parts_of(z))


def load(leaf: Any) -> torch.Tensor:
    """A state leaf as a float32 tensor (a new tensor for records)."""
    kind = kind_of(leaf)
    return kind.dequantize(leaf) if kind is not None else leaf.float()


def store(x: torch.Tensor, like: Any) -> Any:
    """``x`` (float32) written as a leaf of the same kind and metadata as ``like``."""
    kind = kind_of(like)
    return kind.store(x, like) if kind is not None else x.to(like.dtype)


