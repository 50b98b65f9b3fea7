"""What an optimizer's states are stored in, and how many bytes they take.

Functions of a :class:`bridge.LowBitOptimizer` (its ``state_report``, ``state_bytes`` and
``format_state_report`` methods delegate here). Rows describe *this process's* tensors: under
FSDP2 that is the local shard of each state. :func:`format_state_report` adds the totals of
every rank and of the whole model; with DTensor params it is therefore a collective (every
process calls it), like ``full_tensor()``.

:func:`training_bytes` counts the whole training state, what training holds beside the
activations (which are the batch's): params, gradients and optimizer states. Gradients have their param's dtype; all of them are alive after ``backward()``,
while with steps in backward (:func:`bridge.step_in_backward`) each is freed after its step.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from lowbit_tree import records

from .collectives import group_for
from .distributed import is_dtensor, to_local
from .qstate import QState

__all__ = ["StateReportRow", "RankTotals", "TrainingBytes", "state_report", "state_bytes", "rank_totals",
           "training_bytes", "format_state_report"]


class StateReportRow(tuple):
    """(param_index, state_name, format, shape, nbytes); shape and bytes of the local tensor.

    The optimizer's view of a state: addressed as torch.optim addresses it (param index, state
    name: callers index ``row[0]``, ``row[1]``), its plain formats named as ``state_format``
    names them (``"fp32"``, ``"bf16"``). :class:`lowbit_tree.ReportRow` is a pytree leaf's (a
    path, plain formats by dtype) and a saved file's (``lowbit-tree inspect``)."""

    __slots__ = ()

    def __new__(cls, index, name, format, shape, nbytes):
        return super().__new__(cls, (index, name, format, tuple(shape), nbytes))

    index = property(lambda s: s[0])
    name = property(lambda s: s[1])
    format = property(lambda s: s[2])
    shape = property(lambda s: s[3])
    nbytes = property(lambda s: s[4])


class RankTotals(NamedTuple):
    """State bytes and param elements held by each rank (index = global rank), and the whole
    model's, computed from the global shapes (each param once: its replicas, such as the
    params tensor parallel leaves whole on a 2-D mesh, are not added again)."""

    state_bytes: list[int]
    param_elements: list[int]
    model_state_bytes: int = 0
    model_param_elements: int = 0


class TrainingBytes(NamedTuple):
    """The whole model's training state in bytes: params, the gradients alive at their peak,
    optimizer states; and the number of param elements, to divide by."""

    params: int
    grads: int
    states: int
    elements: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.states

    def per_param(self) -> tuple[float, float, float, float]:
        """(params, gradients, states, total) in bytes per param element."""
        n = max(self.elements, 1)
        return self.params / n, self.grads / n, self.states / n, self.total / n


def state_report(opt) -> list[StateReportRow]:
    """Each param's states: (param index, name, format, local shape, bytes). Nothing is hidden:
    unquantized states show as ``fp32`` / ``bf16``."""
    rows = []
    i = 0
    for group in opt.param_groups:
        for p in group["params"]:
            for name, v in opt.state.get(p, {}).items():
                if name == "step":
                    continue
                v = to_local(v)
                if isinstance(v, QState):
                    rows.append(StateReportRow(i, name, v.label, tuple(v.shape), v.state_nbytes))
                elif isinstance(v, torch.Tensor):
                    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
                    fmt = names.get(v.dtype, str(v.dtype).removeprefix("torch."))
                    rows.append(StateReportRow(i, name, fmt, tuple(v.shape), v.numel() * v.element_size()))
            i += 1
    return rows


def state_bytes(opt) -> int:
    """Bytes of this process's states (under FSDP2: its shards only; see :func:`rank_totals`)."""
    return sum(r.nbytes for r in state_report(opt))


def _local_param_elements(opt) -> int:
    return sum(math.prod(to_local(p).shape) for g in opt.param_groups for p in g["params"])


def _distributed(opt) -> bool:
    """Whether the params are DTensors in an initialised process group (then totals gather)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    return any(is_dtensor(p) for g in opt.param_groups for p in g["params"])


def _whole_state_bytes(p, v) -> int:
    """Bytes of state ``v`` (this rank's part) for the whole param ``p``: from the global shape,
    so a param replicated over ranks (on a mesh dim, or on another sub-mesh: TP's plain params
    under FSDP2 on a 2-D mesh) counts once."""
    v = to_local(v)
    if isinstance(v, QState):
        return records.whole_nbytes(v.kind, tuple(p.shape), v.meta)
    if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(to_local(p).shape):
        return math.prod(p.shape) * v.element_size()
    return v.numel() * v.element_size()


def rank_totals(opt) -> Optional[RankTotals]:
    """Per rank of the world, (state bytes, param elements), and the whole model's (from the
    global shapes: each param once); None when the params are not DTensors or no process group
    is initialised. A collective (every rank)."""
    if not _distributed(opt):
        return None
    dist = torch.distributed
    params = [p for g in opt.param_groups for p in g["params"]]
    model_bytes = sum(_whole_state_bytes(p, v) for p in params for k, v in opt.state.get(p, {}).items() if k != "step")
    model_elements = sum(p.numel() for p in params)
    device = next(to_local(p).device for p in params)
    if device.type != "cpu" and dist.get_backend() == "gloo":
        device = torch.device("cpu")
    mine = torch.tensor([state_bytes(opt), _local_param_elements(opt)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=group_for(None, device, "TrainingBytes' all-gather of per-rank totals"))
    return RankTotals([int(t[0]) for t in every], [int(t[1]) for t in every], model_bytes, model_elements)


def _steps_in_backward(opt) -> bool:
    return getattr(opt, "steps_in_backward", None) is not None  # set by bridge.step_in_backward's handle


def _training_bytes(opt, states: int) -> TrainingBytes:
    params = [p for g in opt.param_groups for p in g["params"]]
    sizes = [p.numel() * p.element_size() for p in params]  # a DTensor's numel is the global one
    # steps in backward free each gradient after its param's step, and autograd finishes one
    # param at a time: the largest is the most alive at once (under FSDP2, one unit's shards)
    grads = max(sizes, default=0) if _steps_in_backward(opt) else sum(sizes)
    return TrainingBytes(sum(sizes), grads, states, sum(p.numel() for p in params))


def training_bytes(opt) -> TrainingBytes:
    """Params + gradients + optimizer states of the whole model, each param once (under FSDP2
    the states' whole-model total: a collective, every rank calls it). Gradients: one per
    param, of its dtype (torch gives a gradient its param's dtype), as after ``backward()``;
    while :func:`bridge.step_in_backward` holds ``opt``, the largest param's, since each is
    freed after its step (under FSDP2 a unit's sharded gradients are alive together: there
    the count is a lower bound). ``step`` counters (4 bytes per param tensor) are not counted."""
    totals = rank_totals(opt)
    return _training_bytes(opt, state_bytes(opt) if totals is None else totals.model_state_bytes)


def _training_line(t: TrainingBytes, in_backward: bool) -> str:
    p, g, s, total = t.per_param()
    grads = f"gradients {g:.3f}" + (" (steps in backward: the largest)" if in_backward else "")
    return f"training state, bytes/param: params {p:.3f} + {grads} + optimizer states {s:.3f} = {total:.3f}"


def _total_line(label: str, nbytes: int, elements: int) -> str:
    return f"{label} {nbytes} bytes for {elements} param elements ({nbytes / max(elements, 1):.3f} bytes/param)"


def format_state_report(opt) -> str:
    """A table of this process's states, then totals. Unsharded: one ``total`` line. Under FSDP2
    (DTensor params, process group initialised): one line per rank and a ``total`` line for the
    whole model, gathered from every rank (a collective: call it on every rank). Last, the
    whole training state per param: params + gradients + states (:func:`training_bytes`)."""
    rows = state_report(opt)
    w = max([16] + [len(r.format) for r in rows])  # the format column fits its longest name
    lines = [f"{'param':>5s} {'state':16s} {'format':{w}s} {'shape':>18s} {'bytes':>12s}"]
    for r in rows:
        lines.append(f"{r.index:5d} {r.name:16s} {r.format:{w}s} {str(r.shape):>18s} {r.nbytes:12d}")
    totals = rank_totals(opt)
    in_backward = _steps_in_backward(opt)
    if totals is None:
        states = sum(r.nbytes for r in rows)
        lines.append(_total_line("total", states, _local_param_elements(opt)))
        lines.append(_training_line(_training_bytes(opt, states), in_backward))
        return "\n".join(lines)
    world = len(totals.state_bytes)
    lines[0] += f"   (rank {torch.distributed.get_rank()}'s shards)"
    for rank, (b, n) in enumerate(zip(totals.state_bytes, totals.param_elements)):
        lines.append(_total_line(f"rank {rank}:", b, n))
    lines.append(_total_line(f"total ({world} ranks, whole model):", totals.model_state_bytes,
                             totals.model_param_elements))
    lines.append(_training_line(_training_bytes(opt, totals.model_state_bytes), in_backward))
    return "\n".join(lines)
