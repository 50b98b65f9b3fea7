"""``QState``: a quantized optimizer state that looks like a float32 tensor.

A wrapper tensor subclass around one :class:`lowbit_tree.QTensor` record (codes,
scale, logical shape, block size, format). It exists for the boundary: torch.optim
state dicts, ``torch.save``, DTensor (``DTensor.from_local(qstate, ...)`` under
FSDP2, where ``full_tensor()`` all-gathers codes and scales) and distributed
checkpointing. The math never sees it: the optimizer unwraps ``.record`` and runs
the core's pure functions on plain tensors.

Each aten / c10d op it supports is a small function in a dispatch table
(``@QState.implements(op)``). Shape ops act on dim 0: because blocks never
straddle a row, rows ``[a, b)`` of the state are rows ``[a, b)`` of codes and
scale. On dim 1 of a 2-D state (tensor parallel's ``Shard(1)``) they cut only on
block boundaries (and even columns for 4-bit), where columns ``[a, b)`` are codes
columns ``[a, b)`` (4-bit: ``[a/2, b/2)``) and scale columns ``[a/bs, b/bs)``; a cut
inside a block raises. Any other op raises ``NotImplementedError`` naming the op.
"""
from __future__ import annotations

import math

import torch
import torch.distributed  # noqa: F401  (registers the c10d op namespaces)
import torch.distributed._functional_collectives  # noqa: F401

import lowbit_tree as lt
from lowbit_tree import QTensor

aten = torch.ops.aten
c10d_functional = torch.ops.c10d_functional
_c10d_functional = torch.ops._c10d_functional

__all__ = ["QState"]


class QState(torch.Tensor):
    """A float32-looking tensor of the record's logical shape holding codes and scales."""

    _OPS: dict = {}

    @staticmethod
    def __new__(cls, record: QTensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(record.shape), dtype=torch.float32, device=record.codes.device, requires_grad=False
        )

    def __init__(self, record: QTensor):
        rows, r = lt.row_layout(record.shape)
        fmt = lt.get_format(record.format)
        ncols = -(-r // 2) if fmt.bits == 4 else r
        if tuple(record.codes.shape) != (rows, ncols) or tuple(record.scale.shape) != (rows, -(-r // record.block_size)):
            raise ValueError(f"QState: codes {tuple(record.codes.shape)} / scale {tuple(record.scale.shape)} do not fit {record!r}")
        self.codes = record.codes
        self.scale = record.scale
        self.block_size = record.block_size
        self.format = record.format

    @classmethod
    def zeros(cls, shape, format: str, block_size: int | None = None, device=None) -> "QState":
        return cls(lt.zeros(shape, format, block_size, device=device))

    @classmethod
    def from_float(cls, x: torch.Tensor, format: str, block_size: int | None = None) -> "QState":
        return cls(lt.quantize(x, format, block_size))

    @property
    def record(self) -> QTensor:
        """The core record (shares codes and scale storage with this state)."""
        return QTensor._trusted(self.codes, self.scale, tuple(self.shape), self.block_size, self.format)

    @property
    def is_float8(self) -> bool:
        return self.codes.dtype == torch.float8_e4m3fn

    @property
    def state_nbytes(self) -> int:
        return self.record.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return lt.dequantize(self.record, dtype)

    def set_(self, record: QTensor) -> "QState":  # noqa: D401 - in place, like Tensor.set_
        """Copy a record of the same layout into this state's storage, in place."""
        if (record.format, record.block_size, tuple(record.shape)) != (self.format, self.block_size, tuple(self.shape)):
            raise ValueError(f"QState.set_: {record!r} does not match {self!r}")
        self.codes.copy_(record.codes)
        self.scale.copy_(record.scale)
        return self

    def _with(self, codes, scale, rows=None, shape=None):
        shape = tuple(self.shape) if shape is None else tuple(shape)
        if rows is not None:
            shape = (rows,) + shape[1:]
        return QState(QTensor(codes, scale, shape, self.block_size, self.format))

    def __repr__(self):
        return f"QState(format={self.format!r}, shape={tuple(self.shape)}, block_size={self.block_size}, device={self.codes.device})"

    # traceable wrapper subclass protocol
    def __tensor_flatten__(self):
        return ["codes", "scale"], (tuple(self.shape), self.block_size, self.format)

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        shape, block_size, fmt = meta
        return cls(QTensor(inner["codes"], inner["scale"], shape, block_size, fmt))

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
            raise NotImplementedError(
                f"QState (a quantized optimizer state) does not support {func}; call .dequantize() "
                f"for a float32 tensor"
            )
        return fn(func, types, args, kwargs or {})


def _is_q(x):
    return isinstance(x, QState)


def _same_meta(a, b):
    return a.block_size == b.block_size and a.format == b.format and a.shape == b.shape


def _gloo_view(codes):
    # float8 is not a gloo dtype -> communicate a uint8 view (same itemsize)
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes


# ---- aliasing / trivial ----
@QState.implements([aten.detach.default, aten.alias.default])
def _(func, types, args, kwargs):
    x = args[0]
    return x._with(func(x.codes), func(x.scale))


@QState.implements(aten.clone.default)
def _(func, types, args, kwargs):
    x = args[0]
    return x._with(x.codes.clone(), x.scale.clone())


@QState.implements(aten.is_pinned.default)
def _(func, types, args, kwargs):
    return args[0].codes.is_pinned() and args[0].scale.is_pinned()


@QState.implements(aten._to_copy.default)
def _(func, types, args, kwargs):
    x = args[0]
    dtype = kwargs.get("dtype")
    if dtype not in (None, torch.float32):
        raise NotImplementedError(f"QState._to_copy to dtype {dtype}")
    dev = kwargs.get("device")
    pin = kwargs.get("pin_memory", False)
    c, s = x.codes.to(device=dev), x.scale.to(device=dev)
    if pin:
        c, s = c.pin_memory(), s.pin_memory()
    return x._with(c.clone() if c is x.codes else c, s.clone() if s is x.scale else s)


@QState.implements([aten.empty_like.default, aten.zeros_like.default])
def _(func, types, args, kwargs):
    x = args[0]
    dev = kwargs.get("device") or x.device
    return QState.zeros(tuple(x.shape), x.format, x.block_size, device=dev)


@QState.implements(aten.new_zeros.default)
def _(func, types, args, kwargs):
    # used by fill_empty_tensor_to_shards (empty shards when the mesh dim is larger than the
    # sharded dim): other rows, or (2-D, tensor parallel) other columns
    x, size = args[0], list(args[1])
    if len(size) != x.ndim or (list(size[1:]) != list(x.shape[1:]) and x.ndim != 2):
        raise NotImplementedError(f"QState.new_zeros with size {size}")
    return QState.zeros(tuple(size), x.format, x.block_size, device=x.device)


@QState.implements(aten.copy_.default)
def _(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if _is_q(dst) and _is_q(src):
        if not _same_meta(dst, src):
            raise ValueError(f"QState.copy_ meta mismatch {dst!r} <- {src!r}")
        dst.codes.copy_(src.codes)
        dst.scale.copy_(src.scale)
    elif _is_q(dst):  # plain float -> quantize into dst
        q = lt.quantize(src.detach().reshape(dst.shape).float(), dst.format, dst.block_size)
        dst.codes.copy_(q.codes)
        dst.scale.copy_(q.scale)
    else:
        dst.copy_(src.dequantize())
    return dst


# ---- shape ops (dim 0; dim 1 of 2-D states on block boundaries, for tensor parallel) ----
@QState.implements(aten.view.default)
def _(func, types, args, kwargs):
    x, shape = args[0], list(args[1])
    if -1 in shape:
        shape[shape.index(-1)] = x.numel() // max(1, -math.prod(shape))
    if tuple(shape) == tuple(x.shape):
        return x._with(x.codes.view(x.codes.shape), x.scale.view(x.scale.shape))
    if x.ndim == 2 and len(shape) == 2 and shape[0] * shape[1] == x.shape[0] * x.shape[1]:
        # rows merged or split (DTensor gathers a Shard(1) state of one row with a view): the
        # same memory order, so codes and scales follow when every row piece is whole blocks
        piece = min(x.shape[1], shape[1])
        half = lt.get_format(x.format).bits == 4
        if piece and piece % x.block_size == 0 and not (half and piece % 2):
            c = x.codes.view(shape[0], shape[1] // 2 if half else shape[1])
            return x._with(c, x.scale.view(shape[0], shape[1] // x.block_size), shape=tuple(shape))
    raise NotImplementedError(f"QState.view {tuple(x.shape)} -> {shape} (rows merged or split only on whole blocks)")


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
        raise NotImplementedError("QState.slice step != 1")
    if dim != 0:
        if start == 0 and end == n:  # full-range slice on inner dim = alias
            return x._with(x.codes.view(x.codes.shape), x.scale.view(x.scale.shape))
        if dim in (1, -1) and x.ndim == 2:
            return _column_range(x, start, end)
        raise NotImplementedError(f"QState.slice on dim {dim} ({start}:{end} of {n})")
    return x._with(x.codes[start:end], x.scale[start:end], rows=max(0, end - start))


@QState.implements([aten.split.Tensor, aten.split_with_sizes.default])
def _(func, types, args, kwargs):
    x, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if dim in (1, -1) and x.ndim == 2:  # tensor parallel: columns, on block boundaries
        n = x.shape[1]
        if isinstance(sizes, int):
            sizes = [min(sizes, n - a) for a in range(0, n, sizes)] if n else [0]
        out, a = [], 0
        for k in sizes:
            out.append(_column_range(x, a, a + k))
            a += k
        return out
    if dim != 0:
        raise NotImplementedError(f"QState.split on dim {dim}")
    cs, ss = func(x.codes, sizes, 0), func(x.scale, sizes, 0)
    return [x._with(c, s, rows=c.shape[0]) for c, s in zip(cs, ss)]


def _column_cut(x, j: int, what: str) -> None:
    """Columns can be cut at ``j`` only where no block (and, 4-bit, no byte) straddles it."""
    n = x.shape[1]
    if j in (0, n):
        return
    if j % x.block_size or (lt.get_format(x.format).bits == 4 and j % 2):
        raise NotImplementedError(
            f"QState.{what}: column {j} of a ({x.shape[0]}, {n}) {x.format!r} state with block size "
            f"{x.block_size} cuts a block; tensor-parallel shards must hold whole blocks (see design.md)"
        )


def _column_range(x, a: int, b: int):
    """Columns ``[a, b)`` of a 2-D state (codes and scales of whole blocks: a view)."""
    n = x.shape[1]
    a, b = max(0, min(a, n)), max(0, min(b, n))
    b = max(a, b)
    _column_cut(x, a, "slice")
    _column_cut(x, b, "slice")
    half = lt.get_format(x.format).bits == 4
    c0, c1 = (a // 2, -(-b // 2)) if half else (a, b)
    s0, s1 = a // x.block_size, -(-b // x.block_size)
    return x._with(x.codes[:, c0:c1], x.scale[:, s0:s1], shape=(x.shape[0], b - a))


@QState.implements(aten.constant_pad_nd.default)
def _(func, types, args, kwargs):
    x, pad = args[0], list(args[1])
    # pad is [last_lo, last_hi, ..., dim0_lo, dim0_hi]; only dim0_hi allowed
    nd = x.ndim
    full = pad + [0] * (2 * nd - len(pad))
    if nd == 2 and full[1] > 0 and not full[0] and not any(full[2:]):  # columns (tensor parallel)
        return _pad_columns(x, full[1])
    if any(full[:-1]) or full[-1] < 0:
        raise NotImplementedError(f"QState.constant_pad_nd pad={pad}")
    p = full[-1]
    # new_zeros: the pad lives where the state lives (a bare torch.zeros would be a CPU tensor
    # next to CUDA codes, and the default-device mode does not reach into __torch_dispatch__)
    c = torch.cat([x.codes, x.codes.new_zeros((p, x.codes.shape[1]))])
    s = torch.cat([x.scale, x.scale.new_zeros((p, x.scale.shape[1]))])
    return x._with(c, s, rows=x.shape[0] + p)


def _pad_columns(x, p: int):
    """``p`` zero columns after the last one of a 2-D state (whole new blocks: the last
    block must be full, as tensor-parallel shards are)."""
    _column_cut(x, x.shape[1], "pad")
    if x.shape[1] % x.block_size:
        raise NotImplementedError(
            f"QState.pad: the last block of a ({x.shape[0]}, {x.shape[1]}) state with block size "
            f"{x.block_size} is partial; padding it would change its scale"
        )
    z = QState.zeros((x.shape[0], p), x.format, x.block_size, device=x.device)
    return _cat_columns([x, z])


def _cat_columns(xs):
    """2-D states side by side: every part but the last must end on a block (and byte)
    boundary, so the codes and scales of the result are the parts' side by side."""
    x0 = xs[0]
    for t in xs:
        if t.ndim != 2 or t.shape[0] != x0.shape[0] or (t.format, t.block_size) != (x0.format, x0.block_size):
            raise NotImplementedError(f"QState.cat along dim 1 of {t!r} and {x0!r}")
    for t in xs[:-1]:
        if t.shape[1] % t.block_size or (lt.get_format(t.format).bits == 4 and t.shape[1] % 2):
            raise NotImplementedError(
                f"QState.cat along dim 1: a part of {t.shape[1]} columns ends inside a block of "
                f"{t.block_size}; tensor-parallel shards must hold whole blocks (see design.md)"
            )
    return x0._with(torch.cat([t.codes for t in xs], dim=1), torch.cat([t.scale for t in xs], dim=1),
                    shape=(x0.shape[0], sum(t.shape[1] for t in xs)))


@QState.implements(aten.cat.default)
def _(func, types, args, kwargs):
    xs = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not all(_is_q(t) for t in xs):
        raise NotImplementedError("QState.cat of QStates only")
    if dim in (1, -1) and xs[0].ndim == 2:
        return _cat_columns(list(xs))
    if dim != 0:
        raise NotImplementedError(f"QState.cat along dim {dim} (dims 0, and 1 of 2-D states, only)")
    x0 = xs[0]
    return x0._with(torch.cat([t.codes for t in xs]), torch.cat([t.scale for t in xs]),
                    rows=sum(t.shape[0] for t in xs))


# ---- functional collectives (DTensor.full_tensor / redistribute) ----
@QState.implements([c10d_functional.all_gather_into_tensor.default,
                    _c10d_functional.all_gather_into_tensor.default])
def _(func, types, args, kwargs):
    # Codes, then scale, each waited before the next is issued: never two functional
    # all-gathers in flight. With both in flight, gloo's allgather_into_tensor_coalesced
    # corrupts the heap (glibc "malloc(): unaligned tcache chunk detected", SIGSEGV), a torch
    # bug reproduced without this library by benchmarks/gloo_inflight_allgather.py; see
    # design.md, "One collective in flight". On NCCL the wait only orders streams.
    x, rest = args[0], args[1:]
    world = rest[0]
    wait = _c10d_functional.wait_tensor.default
    c = wait(func(_gloo_view(x.codes), *rest, **kwargs))
    s = wait(func(x.scale, *rest, **kwargs))
    if x.is_float8:
        c = c.view(torch.float8_e4m3fn)  # same storage
    return x._with(c, s, rows=x.shape[0] * world)


@QState.implements([c10d_functional.wait_tensor.default,
                    _c10d_functional.wait_tensor.default,
                    _c10d_functional._wrap_tensor_autograd.default])
def _(func, types, args, kwargs):
    # torch 2.13 eager: funcol.all_gather_single -> _maybe_wrap_tensor ->
    # _c10d_functional._wrap_tensor_autograd(QState) (NOT wait_tensor).  Applying
    # that op to the inner tensors would make codes/scale AsyncCollectiveTensors
    # (waited lazily on first use; never waited if unused -> "unwaited collective"
    # warnings, and raw-storage readers could see unfinished data).  So we wait
    # eagerly on the inner tensors for all three ops (after our all-gather above
    # they are waited already, and waiting again is a no-op).
    x = args[0]
    wait = _c10d_functional.wait_tensor.default
    c = wait(_gloo_view(x.codes))
    if x.is_float8:
        c = c.view(torch.float8_e4m3fn)
    s = wait(x.scale)
    return x._with(c, s)


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
    return _gloo_view(getattr(obj, attr))


@QState.implements(torch.ops.c10d.scatter_.default)
def _(func, types, args, kwargs):
    outs, ins, rest = args[0], args[1], args[2:]
    _, w1 = func(_inner_lists(outs, "codes"), _inner_lists(ins, "codes"), *rest, **kwargs)
    w1.wait()
    _, w2 = func(_inner_lists(outs, "scale"), _inner_lists(ins, "scale"), *rest, **kwargs)
    return outs, w2


# NOTE: c10d.broadcast_ deliberately NOT implemented. In
# set_optimizer_state_dict(broadcast_from_rank0=True) only rank 0 holds a QState,
# the other ranks receive into plain float32 buffers; a codes/scale broadcast
# would mismatch sizes and hang until the gloo timeout (observed). Unimplemented,
# rank 0 raises at once.


torch.serialization.add_safe_globals([QState])
