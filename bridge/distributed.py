"""DTensor plumbing for quantized states under FSDP2 (plain tensors in, DTensors out).

FSDP2 shards every parameter along dim 0 (``Shard(0)``, possibly unevenly, possibly
empty on some ranks). A quantized state is the record of the *local* shard wrapped
with ``DTensor.from_local(..., shape=p.shape, stride=p.stride())``, so it carries the
param's global shape and placement. Because blocks never straddle a row, the
codes and scales of a shard are rows of the global codes and scales: in a state
dict we expose them as two plain row-sharded DTensors (``{"codes", "scale"}`` nested under
the state's name) with global shapes ``(S0, C)`` and ``(S0, nblocks)``.
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
    "wrap_like",
    "row_dtensor",
    "local_row_range",
]


def is_dtensor(x: Any) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


def to_local(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (aliasing its storage), or ``x`` itself."""
    return x.to_local() if is_dtensor(x) else x


def wrap_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Wrap a local state like param ``p`` (a DTensor): same mesh, placements, global shape."""
    if not is_dtensor(p):
        return local
    return DTensor.from_local(
        local, device_mesh=p.device_mesh, placements=p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def row_dtensor(local: torch.Tensor, p: torch.Tensor, ncols: int) -> torch.Tensor:
    """A plain ``(rows, ncols)`` local tensor as a DTensor of global shape ``(p.shape[0], ncols)``."""
    if not is_dtensor(p):
        return local
    rows = p.shape[0] if p.ndim >= 1 else 1
    return DTensor.from_local(
        local, device_mesh=p.device_mesh, placements=p.placements, run_check=False, shape=(rows, ncols), stride=(ncols, 1)
    )


def local_row_range(p: torch.Tensor) -> tuple[int, int]:
    """Rows ``[a, b)`` of the global param held by this rank (all rows if not a DTensor)."""
    if not is_dtensor(p):
        return 0, (p.shape[0] if p.ndim >= 1 else 1)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if len(shape) == 0:
        return 0, 1
    return offset[0], offset[0] + shape[0]


def global_numel(p: torch.Tensor) -> int:
    return math.prod(p.shape)


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
