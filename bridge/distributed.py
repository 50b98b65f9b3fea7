"""DTensor plumbing for quantized states under FSDP2 (plain tensors in, DTensors out).

FSDP2 shards every parameter along dim 0 (``Shard(0)``, possibly unevenly, possibly
empty on some ranks). A quantized state is the record of the *local* shard wrapped
with ``DTensor.from_local(..., shape=p.shape, stride=p.stride())``, so it carries the
param's global shape and placement. Because blocks never straddle a row, the
codes and scales of a shard are rows of the global codes and scales: in a state
dict we expose them as two plain row-sharded DTensors (``{"codes", "scale"}`` nested under
the state's name) with global shapes ``(S0, C)`` and ``(S0, nblocks)``.

Tensor parallel also shards dim 1 of 2-D weights (``RowwiseParallel``: ``Shard(1)``;
under FSDP2 + TP on a 2-D mesh ``(Shard(0), Shard(1))``). Then the block size is chosen
when the state is created so that every rank's columns are whole blocks
(:func:`shard_block_size`); the shards' codes and scales are then columns of the global
ones too, and the same DTensor layout (placed like the param) holds them.
"""
from __future__ import annotations

import math
import os
import sys
import traceback
from typing import Any, Callable, NoReturn

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment]

__all__ = [
    "run_and_exit",
    "is_dtensor",
    "to_local",
    "local_grad",
    "wrap_like",
    "local_row_range",
    "column_extents",
    "shard_dims",
    "shard_block_size",
    "mesh_axes",
    "part_placements",
    "part_dtensor",
    "part_local",
]


def is_dtensor(x: Any) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


def to_local(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (aliasing its storage), or ``x`` itself."""
    return x.to_local() if is_dtensor(x) else x


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p.grad``, laid out like ``p``'s local shard. A DTensor gradient
    placed otherwise than its param (a ``Partial`` sum left by a tensor-parallel plan, a
    ``Replicate`` one for a sharded param) is redistributed to the param's placements first
    (a collective): stepping on a partial sum or on the wrong slice would be wrong."""
    g = p.grad
    if is_dtensor(g) and is_dtensor(p) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return to_local(g)


def wrap_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Wrap a local state like param ``p`` (a DTensor): same mesh, placements, global shape."""
    if not is_dtensor(p):
        return local
    return DTensor.from_local(
        local, device_mesh=p.device_mesh, placements=p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def row_chunks(n: int, k: int) -> list[int]:
    """The sizes of ``torch.chunk(range(n), k)`` padded with empty chunks to ``k`` (how
    DTensor's ``Shard`` splits a dim, unevenly and possibly with empty shards)."""
    c = -(-n // k) if n else 0
    return [max(0, min(c, n - i * c)) for i in range(k)]


def shard_dims(p: torch.Tensor, remedy: str) -> tuple[list[int], list[int]]:
    """The mesh dims that shard ``p``'s rows (dim 0: ``Shard(0)``, and ``_StridedShard(0)``,
    which torch 2.13 does not count as ``is_shard()``) and those that shard its columns
    (``Shard(1)`` of a 2-D param). Any other sharded dim is refused with an error naming the
    placements and ``remedy``."""
    rows, cols = [], []
    for mdim, pl in enumerate(p.placements):
        if not (pl.is_shard() or type(pl).__name__ == "_StridedShard"):
            continue  # Replicate, Partial
        d = pl.dim % p.ndim
        if d == 0:
            rows.append(mdim)
        elif d == 1 and p.ndim == 2 and type(pl).__name__ == "Shard":
            cols.append(mdim)
        else:
            raise NotImplementedError(
                f"a quantized state of a param of shape {tuple(p.shape)} placed {tuple(p.placements)}: only dim 0 "
                f"of any param, and dim 1 of a 2-D param (Shard(1)), can be sharded; {remedy}"
            )
    return rows, cols


def column_extents(p: torch.Tensor) -> list[int] | None:
    """Every rank's number of columns (dim 1) of a 2-D param sharded along dim 1 (tensor
    parallel's ``Shard(1)``, on any mesh dims, in mesh order), or ``None`` when no mesh dim
    shards a dim other than 0. A quantized state's blocks run along rows, so sharding dim 0
    (FSDP2, ``ColwiseParallel``, ``_StridedShard(0)``) never cuts one; other placements of
    dims >= 1 are refused with an error naming them."""
    if not is_dtensor(p) or p.ndim < 2:
        return None
    _, cols = shard_dims(p, "keep this param's states unquantized (a larger min_quant_size, or a param group "
                            "with state_format='fp32')")
    sizes = [p.shape[1]]
    for mdim in cols:
        sizes = [s for e in sizes for s in row_chunks(e, p.device_mesh.size(mdim))]
    return sizes if cols else None


def shard_block_size(p: torch.Tensor, block_size: int, bits: int) -> int:
    """The block size of ``p``'s quantized states: ``block_size``, unless tensor parallel cuts
    ``p``'s columns into extents it does not divide; then the largest power of two below it
    that divides every non-empty extent (so no block straddles a shard and the shards'
    records side by side are the whole param's record). Chosen when the state is created and
    kept with it."""
    ext = column_extents(p)
    if ext is None:
        return block_size
    ext = [e for e in ext if e]
    if all(e % block_size == 0 for e in ext):
        return block_size
    b = 1 << (block_size.bit_length() - 1)
    while b > 1 and any(e % b for e in ext):
        b //= 2
    if bits == 4 and b < 2:
        raise ValueError(
            f"4-bit states of the param of shape {tuple(p.shape)} placed {tuple(p.placements)}: its column shards "
            f"{ext} have an odd size, and a 4-bit byte holds two columns; use an even tensor-parallel split, "
            "or 8-bit states for this param"
        )
    return b


def local_row_range(p: torch.Tensor) -> tuple[int, int]:
    """Rows ``[a, b)`` of the global param held by this rank (all rows if not a DTensor)."""
    if not is_dtensor(p):
        return 0, (p.shape[0] if p.ndim >= 1 else 1)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if len(shape) == 0:
        return 0, 1
    return offset[0], offset[0] + shape[0]


def mesh_axes(p: torch.Tensor) -> dict:
    """``{process group name: "rows" or "cols"}``: which axis of ``p``'s row view each mesh dim
    that shards ``p`` cuts (a record's per-row and per-column parts follow it, see
    :mod:`bridge.qstate`). Empty for a plain tensor, or a param sharded along dims the records
    cannot follow (a record with per-row or per-column parts is then refused when gathered)."""
    if not is_dtensor(p) or p.ndim < 2:
        return {}
    try:
        rows, cols = shard_dims(p, "")
    except NotImplementedError:
        return {}
    mesh = p.device_mesh
    out = {mesh.get_group(d).group_name: "rows" for d in rows}
    out.update({mesh.get_group(d).group_name: "cols" for d in cols})
    return out


def part_placements(p: torch.Tensor, along: str) -> list:
    """Placements of a record part of param ``p`` laid out ``along`` ``"param"`` (as ``p``),
    ``"rows"`` (one entry per row: sharded like ``p``'s rows, replicated over its column shards)
    or ``"cols"`` (the other way round)."""
    from torch.distributed.tensor import Replicate, Shard

    if along == "param":
        return list(p.placements)
    rows, cols = shard_dims(p, "keep this param's states unquantized")
    out = []
    for mdim, pl in enumerate(p.placements):
        if along == "rows" and mdim in rows:
            out.append(pl)  # Shard(0) or _StridedShard(0): the rows' own placement
        elif along == "cols" and mdim in cols:
            out.append(Shard(0))
        else:
            out.append(Replicate())
    return out


def part_dtensor(local: torch.Tensor, p: torch.Tensor, along: str, whole_shape: tuple) -> torch.Tensor:
    """A record part of this rank as a DTensor of the whole param's part shape ``whole_shape``
    (``local`` itself for a plain param)."""
    if not is_dtensor(p):
        return local
    stride = tuple(math.prod(whole_shape[i + 1:]) for i in range(len(whole_shape)))
    return DTensor.from_local(local, device_mesh=p.device_mesh, placements=part_placements(p, along),
                              run_check=False, shape=tuple(whole_shape), stride=stride)


def part_local(t: torch.Tensor, p: torch.Tensor, along: str) -> torch.Tensor:
    """This rank's part of a saved record part: a DTensor's local shard, or the part of a whole
    tensor that its layout gives this rank (``distribute_tensor`` without communication: every
    rank holds the whole tensor)."""
    if is_dtensor(t):
        return t.to_local()
    if not is_dtensor(p):
        return t
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, p.device_mesh, part_placements(p, along), src_data_rank=None).to_local()


def run_and_exit(fn: Callable[[], Any]) -> NoReturn:
    """Run ``fn()`` on one rank, then ``destroy_process_group()``, flush the output and end the
    process with ``os._exit``: status ``fn()``'s int (0 for ``None``), a ``SystemExit``'s code,
    or 1 after printing the traceback of any other exception or of a failed teardown.

    Why (pytorch issue 190489): during interpreter shutdown gloo's worker thread can free a
    finished Work whose tensors own Python objects; taking the GIL in ``Py_FinalizeEx`` ends
    the thread with ``pthread_exit`` (CPython 3.11), the forced unwind crosses a noexcept
    destructor and the process aborts after its work is done. Not going through interpreter
    shutdown avoids it; ``faulthandler`` still prints every thread's stack on a real crash.
    """
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable(all_threads=True)
    code = 1
    try:
        result = fn()
        code = result if isinstance(result, int) else 0
    except SystemExit as e:  # argparse --help / usage errors, sys.exit(...)
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed, and the exit status fails the run
        traceback.print_exc()
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = code or 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
