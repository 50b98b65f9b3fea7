"""The backend setting: ``LOWBIT_TREE_BACKEND``, read here alone (:func:`backend_setting`), for
the choice of backend (:mod:`.backend_choice`) and the native kernel's loader (:mod:`.native`)."""
from __future__ import annotations

import os

__all__ = ["BACKENDS", "backend_setting"]

BACKENDS = ("native", "compiled", "eager", "triton")
"""``triton`` (:mod:`.triton_backend`) imports triton, which the core does not need: chosen
automatically on CUDA only (torch's CUDA wheels bring triton), or when asked for."""


def backend_setting() -> str:
    """``LOWBIT_TREE_BACKEND``, validated: one of :data:`BACKENDS` or ``"auto"`` (unset or empty).

    The one reader of the variable: the choice below and the native kernel's loader
    (:func:`.native.library`) both ask here. It is read at each call, so a change takes effect at
    the next step; the native library's load is made once, so a process that turns the native
    kernel off or on after its first step calls :func:`.backend_choice.reset_backend_setting` (as tests do)."""
    value = os.environ.get("LOWBIT_TREE_BACKEND", "").strip().lower() or "auto"
    if value not in BACKENDS + ("auto",):
        raise ValueError(f"LOWBIT_TREE_BACKEND must be one of {BACKENDS} or 'auto', got {value!r}")
    return value
