"""``QState``: a quantized optimizer state that looks like a float32 tensor.

A wrapper tensor subclass around one record of any kind (:mod:`lowbit_tree.records`: block,
rank-1, low-rank): its parts (codes, scales, maxima, factors) are attributes of the same
names, its static metadata too, and its shape is the record's logical shape. It exists for the
boundary: ``optimizer.state``, torch.optim state dicts, ``torch.save``, DTensor
(``DTensor.from_local(qstate, ...)`` under FSDP2 and tensor parallel, where ``full_tensor()``
all-gathers the parts) and distributed checkpointing. The math never sees it: the optimizer
unwraps ``.record`` and runs the core's pure functions on plain tensors.

Each aten / c10d op it supports is a small function in a dispatch table
(``@QState.implements(op)``), written once for every kind from the kind's part layout. Tensor
dims map to the record's row view: dim 0 of a state of 2 or more dims is its rows, dim 1 of a
2-D state (tensor parallel's ``Shard(1)``) and dim 0 of a 1-D state its columns. Along rows,
``"param"`` and ``"rows"`` parts are cut and joined and ``"cols"`` parts stay whole; along
columns ``"param"`` parts are cut only on whole units (blocks, and bytes of two 4-bit codes),
``"cols"`` parts follow and ``"rows"`` parts stay whole. A cut inside a block, and any other op,
raises naming the op and the kind.
"""
from __future__ import annotations

import math

import torch
import torch.distributed  # noqa: F401  (registers the c10d op namespaces)
import torch.distributed._functional_collectives  # noqa: F401
import torch.utils._pytree

import lowbit_tree as lt
from lowbit_tree import records
from lowbit_tree.qtensor import row_layout

aten = torch.ops.aten
c10d_functional = torch.ops.c10d_functional
_c10d_functional = torch.ops._c10d_functional

__all__ = ["QState"]

# per kind name: (kind, part names, metadata names besides the derived ones): the step reads
# every state's record, so this lookup stays a dict access
_KINDS = {k.name: (k, tuple(p.name for p in k.parts), k.meta) for k in records.KINDS}

# gloo has no float8, bfloat16 or int16: such parts travel as their bytes
_WIRE = {torch.float8_e4m3fn: torch.uint8, torch.bfloat16: torch.uint8}


class QState(torch.Tensor):
    """A float32-looking tensor of a record's logical shape holding the record's parts.

    ``QState(record)`` wraps a record of any kind; ``.record`` gives it back (sharing the
    parts' storage), ``.dequantize()`` its float32 value. ``axes`` maps a process group's name
    to the row-view axis (``"rows"`` or ``"cols"``) that group shards, for kinds with per-row or
    per-column parts (``bridge.distributed.mesh_axes``)."""

    _OPS: dict = {}

    @staticmethod
    def __new__(cls, record, axes=None, stacked: int = 0):
        kind = records.kind_of(record)
        if kind is None:
            raise TypeError(f"QState wraps a record (one of {[k.cls.__name__ for k in records.KINDS]}), "
                            f"got {type(record).__name__}")
        device = getattr(record, kind.parts[0].name).device
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(record.shape), dtype=torch.float32, device=device, requires_grad=False
        )

    def __init__(self, record, axes=None, stacked: int = 0):
        kind = records.kind_of(record)
        self.kind_name = kind.name
        meta = kind.meta_of(record)
        parts = kind.parts_of(record)
        if not stacked:
            _check_parts(kind, tuple(record.shape), meta, parts, repr(record))
        for name, t in parts.items():
            setattr(self, name, t)
        for k, v in meta.items():
            setattr(self, k, v)
        self.axes = dict(axes or {})
        self.stacked = int(stacked)

    # -- the record ------------------------------------------------------------------------
    @property
    def kind(self) -> records.RecordKind:
        return _KINDS[self.kind_name][0]

    @property
    def parts(self) -> dict:
        d = self.__dict__
        return {n: d[n] for n in _KINDS[self.kind_name][1]}

    @property
    def meta(self) -> dict:
        kind, _, names = _KINDS[self.kind_name]
        d = self.__dict__
        out = {n: d[n] for n in names}
        out.update(kind.derived(self))
        return out

    @property
    def record(self):
        """The core record (shares the parts' storage with this state)."""
        if self.stacked:
            self._not_stacked("record")
        kind, part_names, names = _KINDS[self.kind_name]
        d = self.__dict__
        return kind.make({n: d[n] for n in part_names}, tuple(self.shape), {n: d[n] for n in names})

    @classmethod
    def zeros(cls, shape, format: str, block_size: int | None = None, device=None) -> "QState":
        return cls(lt.zeros(shape, format, block_size, device=device))

    @classmethod
    def from_float(cls, x: torch.Tensor, format: str, block_size: int | None = None) -> "QState":
        return cls(lt.quantize(x, format, block_size))

    @property
    def is_float8(self) -> bool:
        return self.codes.dtype == torch.float8_e4m3fn

    @property
    def state_nbytes(self) -> int:
        """Bytes of the parts (what the state costs; ``nbytes`` would be the float32 view's)."""
        return records.nbytes_of(self.parts)

    @property
    def label(self) -> str:
        """The record's format as reports name it (:func:`lowbit_tree.records.label`)."""
        return self.kind.label(self.meta)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The state's value as a plain tensor (float32 unless ``dtype`` says otherwise)."""
        return self.kind.dequantize(self.record).to(dtype)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> torch.Tensor:
        """``Tensor.flatten``, which may copy (torch's contract): a view of the parts where the
        record's layout allows one, else the float32 value flattened. Comparison tools
        (``torch.testing.assert_close``'s mismatch report) flatten what they compare."""
        try:
            return super().flatten(start_dim, end_dim)
        except NotImplementedError:
            return self.dequantize().flatten(start_dim, end_dim)

    def set_(self, record) -> "QState":  # noqa: D401 - in place, like Tensor.set_
        """Copy a record of the same kind and layout into this state's storage, in place."""
        kind = records.kind_of(record)
        if kind is not self.kind or tuple(record.shape) != tuple(self.shape) or kind.meta_of(record) != self.meta:
            raise ValueError(f"QState.set_: {record!r} does not match {self!r}")
        for name, t in kind.parts_of(record).items():
            getattr(self, name).copy_(t)
        return self

    def _with(self, parts: dict, shape, stacked: int = 0) -> "QState":
        return QState(self.kind.make(parts, tuple(shape), self.meta), self.axes, stacked)

    def _not_stacked(self, what: str) -> None:
        if self.stacked:
            raise NotImplementedError(
                f"QState.{what} of a {self.kind_name} record gathered along its columns (a stack of "
                f"{self.stacked} column shards, only to be split or viewed back): see bridge/qstate.py"
            )

    def __repr__(self):
        meta = ", ".join(f"{k}={v!r}" for k, v in self.meta.items())
        return f"QState({self.kind_name}, shape={tuple(self.shape)}, {meta}, device={self.device})"

    # traceable wrapper subclass protocol
    def __tensor_flatten__(self):
        meta = tuple(sorted(self.meta.items()))
        return [p.name for p in self.kind.parts], (self.kind_name, tuple(self.shape), meta,
                                                   tuple(sorted(self.axes.items())), self.stacked)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        kind_name, shape, meta, axes, stacked = ctx
        kind = records.kind_named(kind_name)
        return cls(kind.make(dict(inner), shape, dict(meta)), dict(axes), stacked)

    @classmethod
    def implements(cls, ops):
        ops = ops if isinstance(ops, (list, tuple)) else [ops]

        def register(fn):
            for op in ops:
                cls._OPS[op] = fn
            return fn

        return register

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        fn = cls._OPS.get(func)
        if fn is None:
            kind = next((a.kind_name for a in args if isinstance(a, QState)), "?")
            raise NotImplementedError(
                f"QState (a quantized optimizer state, {kind} record) does not support {func}; call "
                ".dequantize() for a float32 tensor"
            )
        return fn(func, types, args, kwargs or {})


def _check_parts(kind, shape: tuple, meta: dict, parts: dict, what: str) -> None:
    rows, r = row_layout(shape)
    for part in kind.parts:
        t = parts[part.name]
        if part.along == "param":
            want = (rows, -(-r // part.unit(meta)))
            ok = tuple(t.shape) == want
        else:
            want = (rows if part.along == "rows" else r,)
            ok = t.ndim >= 1 and tuple(t.shape[:1]) == want
        if not ok:
            got = ", ".join(f"{k} {tuple(v.shape)}" for k, v in parts.items())
            raise ValueError(f"QState: {got} do not fit {what} (its {part.name} should lead with {want})")


def _is_q(x):
    return isinstance(x, QState)


def _wire(t: torch.Tensor) -> torch.Tensor:
    w = _WIRE.get(t.dtype)
    return t.view(w) if w is not None else t


def _unwire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if t.dtype != dtype else t


def _axis(x: QState, dim: int) -> str:
    """The row-view axis of tensor dim ``dim`` (module docstring)."""
    nd = x.ndim
    d = dim % max(nd, 1)
    if nd == 1 and d == 0:
        return "cols"
    if nd >= 2 and d == 0:
        return "rows"
    if nd == 2 and d == 1:
        return "cols"
    raise NotImplementedError(f"QState ({x.kind_name} record of shape {tuple(x.shape)}): dim {dim} is neither "
                              "its rows nor its columns")


def _shape_with(x: QState, axis: str, n: int) -> tuple:
    s = list(x.shape)
    if axis == "rows":
        s[0] = n
    elif x.ndim == 1:
        s[0] = n
    else:
        s[1] = n
    return tuple(s)


def _ncols(x: QState) -> int:
    return row_layout(tuple(x.shape))[1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A part's bits as integers of its width (NaN equals itself; float8 and bfloat16 compare)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two parts hold the same bits (a part kept whole across shards)."""
    if a is b:
        return True
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(_bits(a), _bits(b)))


# ---- the generic cuts and joins --------------------------------------------------------
def _rows(x: QState, a: int, b: int) -> QState:
    """Rows ``[a, b)``."""
    out = {}
    for part in x.kind.parts:
        t = getattr(x, part.name)
        out[part.name] = t if part.along == "cols" else t[a:b]
    return x._with(out, _shape_with(x, "rows", max(0, b - a)))


def _straddled(x: QState, j: int):
    """``(part, unit)`` of the first ``"param"`` part whose units (blocks, 4-bit bytes) column
    ``j`` falls inside, or ``None`` when ``j`` is on a boundary of every one."""
    meta = x.meta
    for part in x.kind.parts:
        if part.along == "param" and j % part.unit(meta):
            return part.name, part.unit(meta)
    return None


def _cut(x: QState, j: int, what: str) -> None:
    """Columns can be cut at ``j`` only where no unit (block, 4-bit byte) straddles it."""
    hit = None if j in (0, _ncols(x)) else _straddled(x, j)
    if hit is not None:
        raise NotImplementedError(
            f"QState.{what}: column {j} of a {x.kind_name} record of shape {tuple(x.shape)} ({x.label}, "
            f"{hit[0]} in units of {hit[1]} columns) cuts a block; cut on block boundaries "
            "(tensor-parallel shards must hold whole blocks, see design.md)"
        )


def _cols(x: QState, a: int, b: int) -> QState:
    """Columns ``[a, b)`` (of the row view): whole units of the param parts (views)."""
    n = _ncols(x)
    a, b = max(0, min(a, n)), max(0, min(b, n))
    b = max(a, b)
    _cut(x, a, "slice")
    _cut(x, b, "slice")
    meta, out = x.meta, {}
    for part in x.kind.parts:
        t = getattr(x, part.name)
        if part.along == "param":
            u = part.unit(meta)
            out[part.name] = t[:, a // u:-(-b // u)]
        elif part.along == "cols":
            out[part.name] = t[a:b]
        else:
            out[part.name] = t
    return x._with(out, _shape_with(x, "cols", b - a))


def _shared(xs, part: str, axis: str):
    """A part kept whole along ``axis``: the same in every piece joined, else an error."""
    t0 = getattr(xs[0], part)
    for x in xs[1:]:
        if not _same(t0, getattr(x, part)):
            raise NotImplementedError(
                f"QState.cat along {axis}: the pieces' {part} differ, and a {xs[0].kind_name} record keeps "
                f"one {part} whole along its {axis}"
            )
    return t0


def _join(xs, axis: str) -> QState:
    """Records side by side along ``axis`` (rows, or the row view's columns)."""
    x0 = xs[0]
    for t in xs:
        if not _is_q(t) or t.kind_name != x0.kind_name or t.meta != x0.meta or t.ndim != x0.ndim:
            raise NotImplementedError(f"QState.cat of {t!r} and {x0!r}: records of one kind and layout only")
        t._not_stacked("cat")
    out = {}
    if axis == "cols":
        for t in xs[:-1]:
            hit = _straddled(t, _ncols(t))
            if hit is not None:
                raise NotImplementedError(
                    f"QState.cat along columns: a piece of {_ncols(t)} columns ends inside a block ({hit[0]} "
                    f"in units of {hit[1]} columns); tensor-parallel shards must hold whole blocks (see design.md)"
                )
    for part in x0.kind.parts:
        if part.along == ("cols" if axis == "rows" else "rows"):
            out[part.name] = _shared(xs, part.name, axis)
        elif part.along == "param" and axis == "cols":
            out[part.name] = torch.cat([getattr(t, part.name) for t in xs], dim=1)
        else:
            out[part.name] = torch.cat([getattr(t, part.name) for t in xs], dim=0)
    n = sum(t.shape[0] if axis == "rows" else _ncols(t) for t in xs)
    return x0._with(out, _shape_with(x0, axis, n))


def _zeros(x: QState, shape) -> QState:
    z = x.kind.zeros(tuple(shape), x.meta, x.device)
    return QState(z, x.axes)


def _pad(x: QState, axis: str, p: int) -> QState:
    """``p`` zero rows or columns after the last (columns: whole new units; the last one must
    be full, as tensor-parallel shards are)."""
    if axis == "cols":
        hit = _straddled(x, _ncols(x))
        if hit is not None:
            raise NotImplementedError(
                f"QState.pad: the last unit ({hit[0]}, {hit[1]} columns) of a {x.kind_name} record "
                f"of shape {tuple(x.shape)} is partial; padding it would change its value"
            )
        z = _zeros(x, _shape_with(x, "cols", p))
        for part in x.kind.parts:  # the pad's whole-along-columns parts are the record's own
            if part.along == "rows":
                setattr(z, part.name, getattr(x, part.name))
        return _join([x, z], "cols")
    z = _zeros(x, _shape_with(x, "rows", p))
    for part in x.kind.parts:
        if part.along == "cols":
            setattr(z, part.name, getattr(x, part.name))
    return _join([x, z], "rows")


# ---- aliasing / trivial ----
@QState.implements([aten.detach.default, aten.alias.default])
def _(func, types, args, kwargs):
    x = args[0]
    return x._with({k: func(t) for k, t in x.parts.items()}, x.shape, x.stacked)


@QState.implements(aten.clone.default)
def _(func, types, args, kwargs):
    x = args[0]
    return x._with({k: t.clone() for k, t in x.parts.items()}, x.shape, x.stacked)


@QState.implements(aten.is_pinned.default)
def _(func, types, args, kwargs):
    return all(t.is_pinned() for t in args[0].parts.values())


@QState.implements(aten._to_copy.default)
def _(func, types, args, kwargs):
    x = args[0]
    dtype = kwargs.get("dtype")
    if dtype not in (None, torch.float32):
        raise NotImplementedError(f"QState ({x.kind_name} record) to dtype {dtype}: call .dequantize({dtype}) "
                                  "for a plain tensor")
    dev = kwargs.get("device")
    pin = kwargs.get("pin_memory", False)
    out = {}
    for k, t in x.parts.items():
        c = t.to(device=dev)
        c = c.clone() if c is t else c
        out[k] = c.pin_memory() if pin else c
    return x._with(out, x.shape, x.stacked)


@QState.implements([aten.empty_like.default, aten.zeros_like.default])
def _(func, types, args, kwargs):
    x = args[0]
    z = x.kind.zeros(tuple(x.shape), x.meta, kwargs.get("device") or x.device)
    return QState(z, x.axes)


@QState.implements(aten.new_zeros.default)
def _(func, types, args, kwargs):
    # used by fill_empty_tensor_to_shards (empty shards when the mesh dim is larger than the
    # sharded dim): other rows, or (2-D, tensor parallel) other columns
    x, size = args[0], list(args[1])
    if len(size) != x.ndim or (list(size[1:]) != list(x.shape[1:]) and x.ndim != 2):
        raise NotImplementedError(f"QState.new_zeros with size {size} ({x.kind_name} record of shape {tuple(x.shape)})")
    return _zeros(x, size)


@QState.implements(aten.copy_.default)
def _(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if _is_q(dst) and _is_q(src):
        if dst.kind_name != src.kind_name or dst.meta != src.meta or dst.shape != src.shape:
            raise ValueError(f"QState.copy_: {src!r} into {dst!r}: records of one kind and layout only")
        for k, t in src.parts.items():
            getattr(dst, k).copy_(t)
    elif _is_q(dst):  # plain float -> stored into dst's kind
        try:
            rec = records.store(src.detach().reshape(dst.shape).float(), dst.record)
        except TypeError as e:
            raise NotImplementedError(f"QState.copy_ of a plain tensor into a {dst.kind_name} record: {e}") from e
        dst.set_(rec)
    else:
        dst.copy_(src.dequantize())
    return dst


# ---- comparisons ----
@QState.implements(aten.equal.default)
def _(func, types, args, kwargs):
    a, b = args[0], args[1]
    if not (_is_q(a) and _is_q(b)):
        raise NotImplementedError("torch.equal of a QState and a plain tensor: compare a.dequantize() instead")
    if a.kind_name != b.kind_name or a.meta != b.meta or a.shape != b.shape:
        return False
    return all(_same(t, getattr(b, k)) for k, t in a.parts.items())


@QState.implements([aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar])
def _(func, types, args, kwargs):
    a, b = (x.dequantize() if _is_q(x) else x for x in args[:2])
    return func(a, b)


# ---- read-only ops, answered on the float32 value ----
_READ_ONLY = [
    aten.isnan.default, aten.isinf.default, aten.isfinite.default, aten.isneginf.default, aten.isposinf.default,
    aten.abs.default, aten.neg.default, aten.sign.default,
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar,
    aten.add.Scalar, aten.sub.Scalar,
    aten.lt.Tensor, aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar,
    aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.isclose.default, aten.allclose.default,
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.max.default, aten.min.default, aten.amax.default, aten.amin.default,
    aten.any.default, aten.all.default, aten.linalg_vector_norm.default,
]
"""Ops that read a state without changing it (what ``torch.testing.assert_close``, torch's
``TestCase.assertEqual`` and a user's ``state.abs().max()`` call): they run on the dequantized
float32 value and return plain tensors. Every op that would write into a state (``add_``,
``mul_``, ...) stays unsupported and raises, naming ``.dequantize()``."""


@QState.implements(_READ_ONLY)
def _(func, types, args, kwargs):
    args, kwargs = torch.utils._pytree.tree_map_only(QState, lambda q: q.dequantize(), (args, kwargs))
    return func(*args, **kwargs)


# ---- shape ops ----
@QState.implements(aten.view.default)
def _(func, types, args, kwargs):
    x, shape = args[0], list(args[1])
    if -1 in shape:
        shape[shape.index(-1)] = x.numel() // max(1, -math.prod(shape))
    if tuple(shape) == tuple(x.shape):
        return x._with({k: t.view(t.shape) for k, t in x.parts.items()}, x.shape, x.stacked)
    if x.ndim == 2 and len(shape) == 2 and shape[0] == 1 and shape[1] == x.shape[0] * x.shape[1] and x.stacked:
        # one-row shards gathered along their columns ((world, c) -> (1, world * c), as
        # DTensor's chunk-cat view does): the pieces side by side
        return _join(_unstack(x, x.shape[0]), "cols")
    if x.ndim == 2 and len(shape) == 2 and shape[0] * shape[1] == x.shape[0] * x.shape[1] and not x.stacked:
        # rows merged or split in memory order: whole rows side by side, or rows cut in pieces
        (r0, c0), (r1, c1) = x.shape, shape
        if r0 * c0 == 0:
            return _zeros(x, shape)
        if c1 % c0 == 0:
            k = c1 // c0
            rows = [_join([_rows(x, i * k + j, i * k + j + 1) for j in range(k)], "cols") for i in range(r1)]
            return _join(rows, "rows")
        if c0 % c1 == 0:
            k = c0 // c1
            return _join([_cols(_rows(x, i, i + 1), j * c1, (j + 1) * c1) for i in range(r0) for j in range(k)], "rows")
    raise NotImplementedError(f"QState.view {tuple(x.shape)} -> {shape} ({x.kind_name} record)")


@QState.implements(aten.slice.Tensor)
def _(func, types, args, kwargs):
    x, dim = args[0], args[1] if len(args) > 1 else 0
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    n = x.shape[dim]
    start = 0 if start is None else start
    end = n if end is None else end
    start, end = max(0, min(start + n if start < 0 else start, n)), max(0, min(end + n if end < 0 else end, n))
    if step != 1:
        raise NotImplementedError(f"QState.slice with step {step} ({x.kind_name} record)")
    if start == 0 and end == n:  # the whole range: an alias
        return x._with({k: t.view(t.shape) for k, t in x.parts.items()}, x.shape, x.stacked)
    x._not_stacked("slice")
    axis = _axis(x, dim)
    return _rows(x, start, end) if axis == "rows" else _cols(x, start, end)


@QState.implements([aten.split.Tensor, aten.split_with_sizes.default])
def _(func, types, args, kwargs):
    x, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    n = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - a) for a in range(0, n, sizes)] if n else [0]
    if x.stacked:
        if dim % x.ndim != 0 or len(sizes) != x.stacked or len(set(sizes)) != 1:
            x._not_stacked(f"split into {list(sizes)} along dim {dim}")
        return _unstack(x, x.stacked)
    axis = _axis(x, dim)
    out, a = [], 0
    for k in sizes:
        out.append(_rows(x, a, a + k) if axis == "rows" else _cols(x, a, a + k))
        a += k
    return out


def _unstack(x: QState, world: int) -> list:
    """The ``world`` records of a stack of column shards gathered along dim 0 (:func:`_gather`),
    or of a plain record cut into ``world`` row pieces."""
    if not x.stacked:
        r = x.shape[0] // world
        return [_rows(x, i * r, (i + 1) * r) for i in range(world)]
    if world != x.stacked:
        x._not_stacked(f"split into {world} pieces")
    r = x.shape[0] // world
    out = []
    for i in range(world):
        parts = {}
        for part in x.kind.parts:
            t = getattr(x, part.name)
            if part.along == "param":
                parts[part.name] = t[i * r:(i + 1) * r]
            elif part.along == "cols":
                c = t.shape[0] // world
                parts[part.name] = t[i * c:(i + 1) * c]
            else:
                parts[part.name] = t
        out.append(x._with(parts, (r,) + tuple(x.shape[1:])))
    return out


@QState.implements(aten.constant_pad_nd.default)
def _(func, types, args, kwargs):
    x, pad = args[0], list(args[1])
    # pad is [last_lo, last_hi, ..., dim0_lo, dim0_hi]; only a high pad of one dim
    nd = x.ndim
    full = pad + [0] * (2 * nd - len(pad))
    highs = [(d, full[2 * (nd - 1 - d) + 1]) for d in range(nd)]
    lows = [full[2 * (nd - 1 - d)] for d in range(nd)]
    padded = [(d, h) for d, h in highs if h]
    if any(lows) or len(padded) != 1 or padded[0][1] < 0:
        if not padded and not any(lows):
            return x._with({k: t.view(t.shape) for k, t in x.parts.items()}, x.shape)
        raise NotImplementedError(f"QState.constant_pad_nd pad={pad} ({x.kind_name} record)")
    x._not_stacked("pad")
    d, h = padded[0]
    return _pad(x, _axis(x, d), h)


@QState.implements(aten.cat.default)
def _(func, types, args, kwargs):
    xs = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not all(_is_q(t) for t in xs):
        raise NotImplementedError("QState.cat of QStates only")
    return _join(xs, _axis(xs[0], dim))


# ---- functional collectives (DTensor.full_tensor / redistribute) ----
@QState.implements([c10d_functional.all_gather_into_tensor.default,
                    _c10d_functional.all_gather_into_tensor.default])
def _(func, types, args, kwargs):
    # One part at a time, each waited before the next is issued: never two functional
    # all-gathers in flight. With both in flight, gloo's allgather_into_tensor_coalesced
    # corrupts the heap (glibc "malloc(): unaligned tcache chunk detected", SIGSEGV), a torch
    # bug reproduced without this library by benchmarks/gloo_inflight_allgather.py; see
    # design.md, "One collective in flight". On NCCL the wait only orders streams.
    x, rest = args[0], args[1:]
    world, group = rest[0], rest[1] if len(rest) > 1 else kwargs.get("group_name")
    x._not_stacked("all_gather")
    if x.ndim < 2:
        raise NotImplementedError(f"QState all_gather of a {x.ndim}-D {x.kind_name} record (states of sharded "
                                  "params are 2-D or more)")
    has_vectors = any(p.along != "param" for p in x.kind.parts)
    axis = x.axes.get(group, "rows" if not has_vectors else None)
    if axis is None:
        raise NotImplementedError(
            f"QState all_gather of a {x.kind_name} record over process group {group!r}, which does not shard "
            f"its param (it shards {x.axes or 'nothing'}): create states with the optimizer, which binds them "
            "to their param's mesh"
        )
    wait = _c10d_functional.wait_tensor.default
    out = {}
    for part in x.kind.parts:
        t = getattr(x, part.name)
        if part.along == "param" or part.along == axis:
            out[part.name] = _unwire(wait(func(_wire(t), *rest, **kwargs)), t.dtype)
        else:
            out[part.name] = t  # whole on every shard of this group: taken as it is
    shape = (x.shape[0] * world,) + tuple(x.shape[1:])
    if axis == "cols" and has_vectors:  # a stack of column shards, split back by DTensor
        return QState(x.kind.make(out, shape, x.meta), x.axes, stacked=world)
    return x._with(out, shape)


@QState.implements([c10d_functional.wait_tensor.default,
                    _c10d_functional.wait_tensor.default,
                    _c10d_functional._wrap_tensor_autograd.default])
def _(func, types, args, kwargs):
    # torch 2.13 eager: funcol.all_gather_single -> _maybe_wrap_tensor ->
    # _c10d_functional._wrap_tensor_autograd(QState) (NOT wait_tensor).  Applying
    # that op to the inner tensors would make the parts AsyncCollectiveTensors
    # (waited lazily on first use; never waited if unused -> "unwaited collective"
    # warnings, and raw-storage readers could see unfinished data).  So we wait
    # eagerly on the inner tensors for all three ops (after our all-gather above
    # they are waited already, and waiting again is a no-op).
    x = args[0]
    wait = _c10d_functional.wait_tensor.default
    return x._with({k: _unwire(wait(_wire(t)), t.dtype) for k, t in x.parts.items()}, x.shape, x.stacked)


# ---- eager c10d collectives (dist.scatter on QStates) ----
# Only works when EVERY rank passes QStates with the same meta (it is what
# distribute_tensor -> Shard._shard_tensor -> mesh_scatter does).  It cannot
# work for set_optimizer_state_dict(broadcast_from_rank0=True): the receivers
# allocate plain float32 buffers from _TensorInfo(size, dtype).
def _inner_lists(obj, attr):
    if isinstance(obj, (list, tuple)):
        return [_inner_lists(o, attr) for o in obj]
    if not _is_q(obj):
        raise NotImplementedError(f"QState c10d op with mixed operand {type(obj)}")
    return _wire(getattr(obj, attr))


@QState.implements(torch.ops.c10d.scatter_.default)
def _(func, types, args, kwargs):
    outs, ins, rest = args[0], args[1], args[2:]
    x = outs[0] if isinstance(outs, (list, tuple)) else outs
    work = None
    for part in x.kind.parts:
        if work is not None:
            work.wait()
        _, work = func(_inner_lists(outs, part.name), _inner_lists(ins, part.name), *rest, **kwargs)
    return outs, work


# NOTE: c10d.broadcast_ deliberately NOT implemented. In
# set_optimizer_state_dict(broadcast_from_rank0=True) only rank 0 holds a QState,
# the other ranks receive into plain float32 buffers; a part-wise broadcast
# would mismatch sizes and hang until the gloo timeout (observed). Unimplemented,
# rank 0 raises at once.


torch.serialization.add_safe_globals([QState])
