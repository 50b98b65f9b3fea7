"""Recycled output buffers for the pure steps on the CPU.

A pure ``tx.update`` returns new states and a new update every step, and
``apply_updates`` new params; the caller then drops the previous ones. glibc serves
tensors this large with a fresh ``mmap`` and unmaps them when they are freed, so each
step faults every page of its outputs in again (about 30,000 faults a step for two
2048x2048 float32 params with float32 states, most of the gap between the functional
and the in-place step on this machine). The pool keeps the large buffers it hands out
and hands one out again only when nothing else refers to its memory: no tensor or view
of it, no numpy array, no DLPack capsule (the tensor's and its storage's reference
counts say so; nothing is guessed). Whatever a caller still holds is never reused.

Only CPU tensors of at least :data:`MIN_BYTES` go through it, never inside a caller's
``torch.compile`` (the compiled graph allocates its own). ``LOWBIT_TREE_RECYCLE=0``
turns it off (plain ``torch.empty`` every time); :func:`stats` says what it holds and
:func:`release` drops the buffers nobody uses (the memory a training loop's previous
step held, kept until then, as a caching allocator keeps it).
"""
from __future__ import annotations

import math
import os
import sys
import threading
from collections import deque
from typing import NamedTuple

import torch

__all__ = ["MIN_BYTES", "enabled", "empty", "stats", "release", "PoolStats"]

MIN_BYTES = 1 << 20
"""Smaller tensors come from malloc's own free lists, where reuse is already cheap."""

_SCAN = 4  # buffers looked at per request: the oldest first (a loop frees in order)
_pools: dict = {}  # (dtype, numel) -> deque of flat base tensors, oldest hand-out first
_lock = threading.Lock()  # a buffer seen idle is handed out before another thread can see it
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def enabled() -> bool:
    """Whether outputs are recycled (``LOWBIT_TREE_RECYCLE`` unset or ``1``, and this
    torch exposes storage reference counts)."""
    flag = os.environ.get("LOWBIT_TREE_RECYCLE", "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"LOWBIT_TREE_RECYCLE must be 0 or 1, got {flag!r}")
    return flag == "1" and _storage_use_count is not None


def _refs(base: torch.Tensor) -> tuple:
    """Reference counts of ``base``'s TensorImpl, of its storage, and of the storage's
    Python object (one per storage: a caller holding ``untyped_storage()`` raises it)."""
    storage = base.untyped_storage()
    return base._use_count(), _storage_use_count(storage._cdata), sys.getrefcount(storage)


def _idle(base: torch.Tensor) -> bool:
    # The counts of a tensor nothing else refers to, seen through the same code (so that
    # this interpreter's own temporaries count the same), taken once below.
    return _refs(base) == _IDLE_REFS


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized contiguous tensor, like ``torch.empty(shape, dtype=dtype,
    device=device)``, from a recycled buffer when one is free."""
    numel = math.prod(shape)
    if (device.type != "cpu" or numel * dtype.itemsize < MIN_BYTES or torch.compiler.is_compiling()
            or not enabled()):
        return torch.empty(shape, dtype=dtype, device=device)
    with _lock:
        pool = _pools.setdefault((dtype, numel), deque())
        for _ in range(min(_SCAN, len(pool))):
            base = pool.popleft()
            pool.append(base)  # looked at: to the back, idle or not
            if _idle(base):
                return base.view(shape)
        base = torch.empty(numel, dtype=dtype, device=device)
        pool.append(base)
        return base.view(shape)


_IDLE_REFS = _refs(torch.empty(1)) if _storage_use_count is not None else None


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """:func:`empty` of ``t``'s shape, dtype and device."""
    return empty(tuple(t.shape), t.dtype, t.device)


class PoolStats(NamedTuple):
    buffers: int
    bytes: int
    idle_buffers: int
    idle_bytes: int


def stats() -> PoolStats:
    """How many buffers (and bytes) the pool holds, and how many of them nobody uses."""
    n = b = ni = bi = 0
    for (dtype, numel), pool in _pools.items():
        for base in pool:
            size = numel * dtype.itemsize
            n, b = n + 1, b + size
            if _idle(base):
                ni, bi = ni + 1, bi + size
    return PoolStats(n, b, ni, bi)


def release() -> int:
    """Drop the buffers nobody uses (their memory goes back to the allocator); returns
    the bytes released. Buffers still in use stay tracked."""
    freed = 0
    with _lock:
        for (dtype, numel), pool in list(_pools.items()):
            keep = deque(base for base in pool if not _idle(base))
            freed += (len(pool) - len(keep)) * numel * dtype.itemsize
            if keep:
                _pools[(dtype, numel)] = keep
            else:
                del _pools[(dtype, numel)]
    return freed
