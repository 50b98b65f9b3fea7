"""Where :class:`bridge.SOAP`'s states of a DTensor param live between steps, and their blocks.

Every state but the scalars is a DTensor on the param's mesh whose ``full_tensor()`` is the
one-process state (a quantized one: a :class:`~bridge.QState` of this rank's rows in a DTensor,
as :class:`~bridge.LowBitOptimizer` keeps its states):

- ``exp_avg``, ``exp_avg_sq`` (shaped like the param): placed like the param, unless a quantized
  one (a matrix: 1-D states stay float32) would have a block (or a 4-bit byte) cut by a column
  shard (tensor parallel's ``Shard(1)``): then by rows (``Shard(0)`` on every mesh dim). The
  owner's step quantizes with the unsharded block size, so the shards cannot choose their own.
- ``eigenbasis_d``, ``coupling_d`` (``(n, n)``) and ``eigenvalues_d`` (``(n,)``): ``Shard(0)`` on
  every mesh dim (``torch.chunk`` of the rows, then of each chunk); a block record's codes and
  scales are cut with its rows.
- ``step``, ``soap_step``, ``precond_failures``: plain 0-d tensors, the same on every rank.

A step gathers every rank's block of each state to the param's owner (:class:`bridge.soap.OwnerStep`,
:mod:`bridge.owner_step`, each part in its own :class:`~bridge.owner_step.Boxes`), which steps the
whole state, and scatters the new blocks back with the update's. These states are made by
:class:`bridge.param_states.ParamStates` (``whole_steps``) through :func:`create`; state dicts are
:mod:`bridge.state_dict`'s, as for every optimizer (a record as a nested dict of its parts, each a
DTensor of the whole record's part placed as the state), so ``torch.distributed.checkpoint``
reshards them by placement at any world size.
"""
from __future__ import annotations

import math

import torch

from lowbit_tree.qtensor import row_layout

from . import owner_step
from .distributed import to_local
from .qstate import QState

__all__ = ["MOMENTS", "placements", "create", "state_parts", "assemble", "whole_parts"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def _contiguous_stride(shape) -> tuple:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _whole_units(p, q: QState) -> bool:
    """Whether every rank's block of param ``p`` holds whole units (blocks, 4-bit bytes) of the
    record ``q`` of ``p``'s shape: its columns cut on unit boundaries, a state of 3 or more dims
    cut along its rows only."""
    units = [part.unit(q.meta) for part in q.kind.parts if part.along == "param"]
    ncols = row_layout(tuple(q.shape))[1]
    for bshape, off in owner_step.blocks_of(p.device_mesh, tuple(p.shape), p.placements).values():
        if q.ndim >= 3 and tuple(bshape[1:]) != tuple(q.shape[1:]):
            return False
        if q.ndim == 2 and any(j != ncols and any(j % u for u in units) for j in (off[1], off[1] + bshape[1])):
            return False
    return True


def placements(p, name: str, t) -> tuple:
    """The placements of state ``name`` (template value ``t``: a whole state, possibly on the meta
    device) of DTensor param ``p`` (module docstring)."""
    from torch.distributed.tensor import Shard

    if name in MOMENTS and (not isinstance(t, QState) or _whole_units(p, t)):
        return tuple(p.placements)
    return (Shard(0),) * p.device_mesh.ndim


def _axes(mesh, pls, ndim: int) -> dict:
    """A QState's ``axes``: the row-view axis each sharding mesh dim cuts."""
    out = {}
    for mdim, pl in enumerate(pls):
        if pl.is_shard() or type(pl).__name__ == "_StridedShard":
            out[mesh.get_group(mdim).group_name] = "rows" if ndim >= 2 and pl.dim == 0 else "cols"
    return out


def create(p, template: dict) -> dict:
    """This rank's new states of DTensor param ``p``: zeros of ``template``'s whole states (the
    core's ``init``, which is zeros) cut to this rank's blocks, each a DTensor placed by
    :func:`placements`; 0-d ones plain (``step`` on the CPU, as torch.optim keeps it)."""
    from torch.distributed.tensor import DTensor

    import torch.distributed as dist

    mesh, device, me = p.device_mesh, to_local(p).device, dist.get_rank()
    out = {}
    for name, t in template.items():
        if t.ndim == 0:
            out[name] = torch.zeros((), dtype=t.dtype, device="cpu" if name == "step" else device)
            continue
        pls = placements(p, name, t)
        shape = owner_step.blocks_of(mesh, tuple(t.shape), pls)[me][0]
        if isinstance(t, QState):
            local = QState(t.kind.zeros(tuple(shape), dict(t.meta), device), _axes(mesh, pls, t.ndim))
        else:
            local = torch.zeros(shape, dtype=t.dtype, device=device)
        out[name] = DTensor.from_local(local, device_mesh=mesh, placements=pls, run_check=False,
                                       shape=tuple(t.shape), stride=_contiguous_stride(tuple(t.shape)))
    return out


def _part_box(part, meta: dict, qshape: tuple, bshape: tuple, off: tuple, trailing: tuple) -> tuple:
    """The box of a record part for the block ``(bshape, off)`` of a record of ``qshape``."""
    nd = len(qshape)
    if nd >= 2:
        r0, rn = off[0], bshape[0]
        c0, cn = (off[1], bshape[1]) if nd == 2 else (0, math.prod(bshape[1:]))
    else:
        r0, rn = 0, 1
        c0, cn = (off[0], bshape[0]) if nd == 1 else (0, 1)
    if part.along == "param":
        u = part.unit(meta)
        return (r0, c0 // u), (rn, -(-cn // u))
    z = (0,) * len(trailing)
    return ((r0, *z), (rn, *trailing)) if part.along == "rows" else ((c0, *z), (cn, *trailing))


def _saved_dtype(t: torch.Tensor) -> torch.Tensor:
    """A part as it travels and is saved: float8 codes as their bits (uint8), a view."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def state_parts(v) -> list:
    """``[(part name or "", this rank's tensor, its Boxes, the whole part's shape)]`` of one
    DTensor state ``v``: one entry for a plain tensor, one per part of a record."""
    mesh, shape, pls = v.device_mesh, tuple(v.shape), v.placements
    blocks = owner_step.blocks_of(mesh, shape, pls)
    local = v.to_local()
    if not isinstance(local, QState):
        where = {g: (off, bs) for g, (bs, off) in blocks.items()}
        return [("", local, owner_step.Boxes(where, ((0,) * len(shape), shape)), shape)]
    out, meta = [], local.meta
    for part in local.kind.parts:
        t = _saved_dtype(getattr(local, part.name))
        trailing = tuple(t.shape[1:]) if part.along != "param" else ()
        where = {g: _part_box(part, meta, shape, bs, off, trailing) for g, (bs, off) in blocks.items()}
        full = _part_box(part, meta, shape, shape, (0,) * len(shape), trailing)
        out.append((part.name, t, owner_step.Boxes(where, full), tuple(full[1])))
    return out


def assemble(v, wholes: list):
    """The whole state (on the owner) of DTensor state ``v`` from its parts' whole tensors, in
    :func:`state_parts`' order."""
    local = v.to_local()
    if not isinstance(local, QState):
        return wholes[0]
    parts = {}
    for part, w in zip(local.kind.parts, wholes):
        live = getattr(local, part.name)
        parts[part.name] = w.view(live.dtype) if w.dtype != live.dtype else w
    return QState(local.kind.make(parts, tuple(v.shape), local.meta))


def whole_parts(whole) -> list:
    """A whole state's tensors in :func:`state_parts`' order (what the owner scatters)."""
    if isinstance(whole, QState):
        return [_saved_dtype(getattr(whole, part.name)) for part in whole.kind.parts]
    return [whole]
