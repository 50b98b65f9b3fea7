"""One rank steps a whole sharded tensor: every rank's block of a DTensor gathered to an owner
rank, and a whole tensor's blocks scattered back, for any ``Shard`` / ``Replicate`` placements
on a 1-D mesh or a mesh over all processes (FSDP2 rows, tensor-parallel rows or columns, FSDP2
+ TP blocks, HSDP). Muon's Newton-Schulz (:class:`bridge.muon.ShardedNS`) and SOAP's step
(:class:`bridge.SOAP`) use it.

The **owner** of the ``k``-th tensor of a step is a global rank chosen the same way on every
rank: the mesh's ranks ordered by their rank in the collective's group (a 1-D mesh's group, or
the default group for a mesh over all processes), then the ``k % n``-th of the ``n``. Each
rank's block comes from DTensor's own ``_compute_local_shape_and_global_offset`` (uneven,
empty, strided and replicated shards place themselves). Tensors travel as bytes (gloo has no
float8), each rank's block padded to the largest extent along every dim; one collective at a
time (design.md, "One collective in flight"); the group is
:func:`bridge.collectives.group_for`'s for the tensors' device.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple

import torch

__all__ = ["Layout", "Boxes", "layout", "blocks", "owner_rank", "gather", "scatter", "whole_box"]

Box = tuple  # (offset per dim, extent per dim) of a block in its whole tensor
Geometry = Callable[[tuple, tuple], Box]  # (param block's shape, its offset) -> a part's Box


class Layout(NamedTuple):
    """Where every rank's block of a sharded tensor lies, and which rank owns the tensor."""

    pg: Any  # the process group (None: the default group)
    blocks: dict  # global rank -> (shape, offset) of its block, one entry per dim
    group_rank: dict  # global rank -> rank in pg
    me: int
    owner: int
    shape: tuple  # the whole tensor's

    def on(self, device, what: str) -> "Layout":
        """This layout over the group that carries tensors on ``device``
        (:func:`bridge.collectives.group_for`: the mesh's, or a host group over the same ranks)."""
        import torch.distributed as dist

        from .collectives import group_for

        pg = group_for(self.pg, device, what)
        if pg is self.pg:
            return self
        return self._replace(pg=pg, group_rank={g: dist.get_group_rank(pg, g) for g in self.blocks})


class Boxes(NamedTuple):
    """A part's box on every rank and in its whole tensor, given outright: the geometry of a part
    laid out its own way, not by the param's blocks (an optimizer state sharded by its rows)."""

    where: dict  # global rank -> Box
    full: Box


def _boxes(lay: Layout, geom) -> tuple:
    """``(box per global rank, whole box)`` of a part: from a :class:`Boxes`, or a geometry of
    the param's blocks."""
    if isinstance(geom, Boxes):
        return geom.where, geom.full
    return {g: geom(*b) for g, b in lay.blocks.items()}, geom(lay.shape, (0,) * len(lay.shape))


def whole_box(shape, offset) -> Box:
    """The geometry of a part laid out like the param itself: its block is the param's."""
    return tuple(offset), tuple(shape)


def _mesh_group(p, who: str, remedy: str):
    import torch.distributed as dist

    mesh = p.device_mesh
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.mesh.numel() == dist.get_world_size():
        return None  # a mesh over every process (FSDP2 + TP, HSDP): the default group
    raise NotImplementedError(
        f"{who}: the param of shape {tuple(p.shape)} lives on a {tuple(mesh.shape)} mesh over {mesh.mesh.numel()} "
        f"of {dist.get_world_size()} processes; an owner rank's gather takes 1-D meshes and meshes over all "
        f"processes: {remedy}"
    )


def layout(p, k: int, who: str, remedy: str) -> Layout:
    """Every rank's block of DTensor ``p`` and its owner, the ``k``-th rank (module docstring);
    ``who`` and ``remedy`` name the caller and the fix in the error for a mesh over some of the
    processes, on more than one dim."""
    import torch.distributed as dist

    pg = _mesh_group(p, who, remedy)
    blocks = blocks_of(p.device_mesh, tuple(p.shape), p.placements)
    group_rank = {g: (dist.get_group_rank(pg, g) if pg is not None else g) for g in blocks}
    owner = sorted(blocks, key=group_rank.get)[k % len(blocks)]
    return Layout(pg, blocks, group_rank, dist.get_rank(), owner, tuple(p.shape))


def blocks_of(mesh, shape: tuple, placements) -> dict:
    """``{global rank: (shape, offset)}`` of every rank's block of a DTensor of ``shape`` placed
    ``placements`` on ``mesh`` (DTensor's own arithmetic: uneven, empty, strided, replicated)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    out = {}
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        bshape, off = _compute_local_shape_and_global_offset(shape, mesh.shape, list(coord), placements)
        out[int(mesh.mesh[coord])] = (tuple(bshape), tuple(off))
    return out


def owner_rank(p, k: int, who: str, remedy: str) -> int:
    """The global rank that owns DTensor ``p`` as the ``k``-th tensor (no communication)."""
    import torch.distributed as dist

    mesh = p.device_mesh
    pg = _mesh_group(p, who, remedy)
    ranks = sorted((int(r) for r in mesh.mesh.flatten()), key=lambda g: dist.get_group_rank(pg, g) if pg is not None else g)
    return ranks[k % len(ranks)]


def _slices(shape) -> tuple:
    return tuple(slice(0, n) for n in shape)


def _box_slices(box: Box, unit: int = 1) -> tuple:
    """Slices of ``box`` (offsets, extents) with the last dim counted in ``unit``-byte elements."""
    off, ext = box
    out = [slice(o, o + n) for o, n in zip(off[:-1], ext[:-1])]
    return (*out, slice(off[-1] * unit, (off[-1] + ext[-1]) * unit))


def _top(where: dict) -> tuple:
    """The largest extent along every dim over the ranks' boxes (each rank's padding)."""
    return tuple(max(b[1][d] for b in where.values()) for d in range(len(next(iter(where.values()))[1])))


def gather(lay: Layout, parts: list, what: str, sent: dict, key: str) -> list | None:
    """Each part's whole tensor on the owner (``None`` elsewhere). ``parts``: ``(this rank's
    local part, geometry)``, a geometry mapping a param block's ``(shape, offset)`` to the part's
    box in its own layout (:func:`whole_box` for a part shaped like the param). Every rank's part
    as bytes, padded to the largest extents, gathered one part at a time; a part the owner already
    holds whole (replicated) is not sent. Bytes a non-owner sends are added to ``sent[key]``."""
    import torch.distributed as dist

    whole = []
    for t, geom in parts:
        lay = lay.on(t.device, what)
        unit = t.element_size()
        where, full = _boxes(lay, geom)
        if where[lay.owner] == full:  # the owner holds all of it (a replicated part): nothing to send
            whole.append(t)
            continue
        top = _top(where)
        top = (*top[:-1], top[-1] * unit)
        b = t.contiguous().view(torch.uint8)
        pad = torch.zeros(top, dtype=torch.uint8, device=t.device)
        pad[_slices(b.shape)] = b
        dst = [torch.empty_like(pad) for _ in lay.blocks] if lay.me == lay.owner else None
        dist.gather(pad, dst, dst=lay.owner, group=lay.pg)
        if lay.me != lay.owner:
            sent[key] += pad.numel()
            continue
        ext = full[1]
        out = torch.zeros((*ext[:-1], ext[-1] * unit), dtype=torch.uint8, device=t.device)
        for g, box in where.items():
            out[_box_slices(box, unit)] = dst[lay.group_rank[g]][_slices((*box[1][:-1], box[1][-1] * unit))]
        whole.append(out.view(t.dtype))
    return whole if lay.me == lay.owner else None


def scatter(lay: Layout, parts: list, what: str, sent: dict, key, device) -> list:
    """This rank's block of each ``(whole tensor on the owner, geometry, dtype)`` part (the
    whole tensor is ignored elsewhere), in one scatter of bytes, each block padded to the largest
    extents. Bytes the owner sends to other ranks are added to ``sent[key]`` (``key``: one name,
    or one per part)."""
    import torch.distributed as dist

    lay = lay.on(device, what)
    keys = [key] * len(parts) if isinstance(key, str) else list(key)
    specs, total = [], 0
    for _, geom, dtype in parts:
        unit = torch.empty((), dtype=dtype).element_size()
        where, _ = _boxes(lay, geom)
        top = _top(where)
        n = unit
        for e in top:
            n *= e
        specs.append((where, top, n, dtype))
        total += n
    chunks = None
    if lay.me == lay.owner:
        chunks = [None] * len(lay.blocks)
        for g in lay.blocks:
            buf = torch.zeros(total, dtype=torch.uint8, device=device)
            off = 0
            for (whole, _, _), (where, top, n, dtype) in zip(parts, specs):
                box = where[g]
                piece = torch.zeros(top, dtype=dtype, device=device)
                piece[_slices(box[1])] = whole[_box_slices(box)]
                buf[off:off + n] = piece.reshape(-1).view(torch.uint8)
                off += n
            chunks[lay.group_rank[g]] = buf
            if g != lay.owner:
                for k, spec in zip(keys, specs):
                    sent[k] += spec[2]
    recv = torch.empty(total, dtype=torch.uint8, device=device)
    dist.scatter(recv, chunks, src=lay.owner, group=lay.pg)
    out, off = [], 0
    for where, top, n, dtype in specs:
        piece = recv[off:off + n]
        if off % piece.new_empty((), dtype=dtype).element_size():  # after a part of smaller elements
            piece = piece.clone()
        out.append(piece.view(dtype).reshape(top)[_slices(where[lay.me][1])])
        off += n
    return out
