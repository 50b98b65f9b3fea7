"""``QState``: a quantized optimizer state that looks like a float32 tensor.

A wrapper tensor subclass around one :class:`lowbit_tree.QTensor` record (codes,
scale, logical shape, block size, format). It exists for the boundary: torch.optim
state dicts, ``torch.save``, DTensor (``DTensor.from_local(qstate, ...)`` under
FSDP2, where ``full_tensor()`` all-gathers codes and scales) and distributed
checkpointing. The math never sees it: the optimizer unwraps ``.record`` and runs
the core's pure functions on plain tensors.

Each aten / c10d op it supports is a small function in a dispatch table
(``@QState.implements(op)``). Shape ops act on dim 0 only: because blocks never
straddle a row, rows ``[a, b)`` of the state are rows ``[a, b)`` of codes and
scale. Any other op raises ``NotImplementedError`` naming the op.
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
        return QTensor(self.codes, self.scale, tuple(self.shape), self.block_size, self.format)

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

    def _with(self, codes, scale, rows=None):
        shape = tuple(self.shape)
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
    # used by fill_empty_tensor_to_shards (empty shards when world > dim0)
    x, size = args[0], list(args[1])
    if list(size[1:]) != list(x.shape[1:]):
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


# ---- shape ops (dim 0 only; other dims only as no-ops) ----
@QState.implements(aten.view.default)
def _(func, types, args, kwargs):
    x, shape = args[0], list(args[1])
    if -1 in shape:
        shape[shape.index(-1)] = x.numel() // max(1, -math.prod(shape))
    if tuple(shape) != tuple(x.shape):
        raise NotImplementedError(f"QState.view {tuple(x.shape)} -> {shape}")
    return x._with(x.codes.view(x.codes.shape), x.scale.view(x.scale.shape))


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
        raise NotImplementedError(f"QState.slice on dim {dim} ({start}:{end} of {n})")
    return x._with(x.codes[start:end], x.scale[start:end], rows=max(0, end - start))


@QState.implements([aten.split.Tensor, aten.split_with_sizes.default])
def _(func, types, args, kwargs):
    x, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if dim != 0:
        raise NotImplementedError(f"QState.split on dim {dim}")
    cs, ss = func(x.codes, sizes, 0), func(x.scale, sizes, 0)
    return [x._with(c, s, rows=c.shape[0]) for c, s in zip(cs, ss)]


@QState.implements(aten.constant_pad_nd.default)
def _(func, types, args, kwargs):
    x, pad = args[0], list(args[1])
    # pad is [last_lo, last_hi, ..., dim0_lo, dim0_hi]; only dim0_hi allowed
    nd = x.ndim
    full = pad + [0] * (2 * nd - len(pad))
    if any(full[:-1]) or full[-1] < 0:
        raise NotImplementedError(f"QState.constant_pad_nd pad={pad}")
    p = full[-1]
    # new_zeros: the pad lives where the state lives (a bare torch.zeros would be a CPU tensor
    # next to CUDA codes, and the default-device mode does not reach into __torch_dispatch__)
    c = torch.cat([x.codes, x.codes.new_zeros((p, x.codes.shape[1]))])
    s = torch.cat([x.scale, x.scale.new_zeros((p, x.scale.shape[1]))])
    return x._with(c, s, rows=x.shape[0] + p)


@QState.implements(aten.cat.default)
def _(func, types, args, kwargs):
    xs = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if dim != 0 or not all(_is_q(t) for t in xs):
        raise NotImplementedError("QState.cat only along dim 0 of QStates")
    x0 = xs[0]
    return x0._with(torch.cat([t.codes for t in xs]), torch.cat([t.scale for t in xs]),
                    rows=sum(t.shape[0] for t in xs))


# ---- functional collectives (DTensor.full_tensor / redistribute) ----
@QState.implements([c10d_functional.all_gather_into_tensor.default,
                    _c10d_functional.all_gather_into_tensor.default])
def _(func, types, args, kwargs):
    x, rest = args[0], args[1:]
    world = rest[0]
    c = func(_gloo_view(x.codes), *rest, **kwargs)
    s = func(x.scale, *rest, **kwargs)
    if x.is_float8:
        c = c.view(torch.float8_e4m3fn)  # same storage; wait_tensor is keyed on storage
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
    # eagerly on the inner tensors for all three ops.
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
