"""``p + u`` computed in the update's own pass, for the ``apply_updates`` that follows.

A pure ``tx.update`` then ``apply_updates`` reads the param and the update again and writes
the new param: a second pass over memory, about 12 bytes a param, which the in-place step
(the bridge's) does not make. So where the native kernel writes an update that is a whole
step (the learning rate fused in), it also writes ``p + u`` rounded once to the param's dtype
(to nearest: the bits of ``apply_updates``, tested) into a new tensor, and leaves it here,
keyed by the update. ``apply_updates(params, updates)`` takes it instead of computing the
sum when, and only when, it is handed that very update and that very param, neither
modified since: the same tensor objects, with the version counters they had (the check
autograd makes before it uses a saved tensor). A sum is taken once; it goes when its update
goes, unused.

What the check cannot see is what autograd cannot see either: writes that bypass the version
counter (through ``.data``, numpy or DLPack) to a param or update between the two calls.
``LOWBIT_TREE_PRESUM=0`` turns the sums off (``apply_updates`` then always computes).
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Optional

import torch

__all__ = ["MIN_NUMEL", "enabled", "remember", "take", "pending"]

MIN_NUMEL = 1 << 16
"""Smaller params are summed by ``apply_updates`` itself (the pass is short; the bookkeeping is not)."""

_sums: dict = {}  # id(update) -> (weakref to update, its version, weakref to param, its version, sum)
_lock = threading.RLock()  # reentrant: a weakref callback (_forget) may run inside a locked block, at a GC


def enabled() -> bool:
    """Whether update steps leave their sums (``LOWBIT_TREE_PRESUM`` unset or ``1``)."""
    flag = os.environ.get("LOWBIT_TREE_PRESUM", "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"LOWBIT_TREE_PRESUM must be 0 or 1, got {flag!r}")
    return flag == "1"


def _forget(key: int, ref: weakref.ref) -> None:
    with _lock:
        entry = _sums.get(key)
        if entry is not None and entry[0] is ref:
            del _sums[key]


def remember(param: torch.Tensor, update: torch.Tensor, total: torch.Tensor) -> None:
    """Leaves ``total`` (``param + update`` in the param's dtype) for :func:`take`, until
    ``update`` is freed."""
    key = id(update)
    ref = weakref.ref(update, lambda r, key=key: _forget(key, r))
    with _lock:
        _sums[key] = (ref, update._version, weakref.ref(param), param._version, total)


def take(param: torch.Tensor, update: torch.Tensor) -> Optional[torch.Tensor]:
    """The sum left for exactly this ``param`` and ``update``, unmodified since, or None. A sum
    is handed out once (two ``apply_updates`` calls never share a result)."""
    with _lock:
        entry = _sums.pop(id(update), None)
    if entry is None:
        return None
    ref, u_version, p_ref, p_version, total = entry
    if ref() is update and update._version == u_version and p_ref() is param and param._version == p_version:
        return total
    return None


def pending() -> int:
    """How many sums wait for their ``apply_updates``."""
    with _lock:
        return len(_sums)
