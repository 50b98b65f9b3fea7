"""Which backend steps each leaf: the setting (``LOWBIT_TREE_BACKEND``, read by
:func:`backend_setting` alone), the automatic choice per device, and the per-leaf checks of what
the native (:func:`native_ok`) and triton (:func:`triton_ok`) kernels take.

The automatic choice (no ``backend``, no ``LOWBIT_TREE_BACKEND``): native on CPU (eager where it
cannot be built); on CUDA, per leaf, triton where its kernel has the rule and every state's kind
(:func:`triton_ok`; a rank-1 record steps as its float32 values) and triton is importable, compiled
otherwise. A backend named explicitly runs every leaf it is given, or raises."""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch

from ..correction import CORRECTED_DTYPES
from ..record_base import KERNEL_BLOCKS, KERNEL_VALUES, Record, kernel_of
from . import native
from .setting import BACKENDS, backend_setting
from .spec import StepLeaf, StepSpec

__all__ = ["BACKENDS", "backend_setting", "reset_backend_setting", "backend_for", "step_backend", "triton_ok", "auto_triton",
           "native_ok"]

def reset_backend_setting() -> None:
    """Forget what was decided from :func:`backend_setting` once per process: the native library's
    load (built, or refused because the setting chose a torch backend) and its notice."""
    native.reset()


def backend_for(device: torch.device, backend: Optional[str] = None) -> str:
    """The backend that runs steps on ``device``: ``backend`` if given, else
    ``LOWBIT_TREE_BACKEND``, else auto (see the module docstring)."""
    if torch.compiler.is_compiling():
        return "eager"  # inside a caller's torch.compile: trace the torch code into its graph
    want = backend or backend_setting()
    if want not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {want!r}")
    if want == "triton":  # CUDA, or CPU tensors under TRITON_INTERPRET=1
        return want
    if device.type != "cpu":
        return "eager" if want == "eager" else "compiled"
    if want == "native":
        if not native.available():
            raise RuntimeError(
                "LOWBIT_TREE_BACKEND=native, but the native CPU kernel could not be built (no working C compiler?)"
            )
        return "native"
    if want == "auto":  # native.library() warns once when it cannot be built
        return "native" if native.available() else "eager"
    return want


def auto_triton(device: torch.device, backend: Optional[str]) -> bool:
    """Whether the automatic choice puts leaves on ``device`` on triton where it can (CUDA, nothing
    asked for, triton importable, not inside a caller's torch.compile)."""
    return (device.type == "cuda" and (backend or backend_setting()) == "auto" and not torch.compiler.is_compiling()
            and _triton_importable())


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_ok(spec: StepSpec, leaf: StepLeaf, write: bool) -> bool:
    """Whether the triton kernel has this leaf: its rule, every state's kind and block size
    (:func:`.triton_backend.launch_key`, the key it launches under), its dtypes, and a param
    correction only where it is written in place. Imports triton."""
    from . import triton_backend  # imports triton: only on CUDA or when asked for

    if spec.rule not in triton_backend.backend_rules()["triton"]:
        return False
    p, g, c = leaf.param, leaf.grad, leaf.correction
    if c is not None and not (write and p is not None and p.dtype in CORRECTED_DTYPES and c.dtype is torch.int8
                              and c.is_contiguous() and c.numel() == g.numel()):
        return False
    if write and not p.is_contiguous():
        return False
    if any(isinstance(s, torch.Tensor) and not s.is_contiguous() for s in leaf.states):
        return False  # stepped in place only when contiguous
    # a rank-1 record steps as its float32 values (stepper._triton_leaves): a float32 state's key
    states = [torch.empty(0, dtype=torch.float32) if kernel_of(s) == KERNEL_VALUES else s for s in leaf.states]
    try:
        key = triton_backend.launch_key(spec, p if (write or spec.needs_param) else None, g, states, write,
                                        False, c is not None)
        triton_backend.tile_length([b for _, b in key[0]])
    except (NotImplementedError, TypeError, KeyError, ValueError):
        return False  # a record kind, dtype or block sizes the kernel does not have
    return True


def step_backend(spec: StepSpec, leaf: StepLeaf, write: bool, backend: Optional[str] = None,
                 device: Optional[torch.device] = None) -> str:
    """The backend that steps ``leaf`` (on ``device``, default its gradient's): :func:`backend_for`,
    except that the automatic choice on CUDA is triton where :func:`triton_ok`, compiled otherwise."""
    device = leaf.grad.device if device is None else device
    which = backend_for(device, backend)
    if which == "compiled" and auto_triton(device, backend) and triton_ok(spec, leaf, write):
        return "triton"
    return which


def native_ok(leaf: StepLeaf, write: bool) -> bool:
    """Whether the C kernel takes this leaf (else the torch backend runs it). Plain states
    (a :data:`~lowbit_tree.record_base.KERNEL_VALUES` record, rank-1, counts as one: the kernel steps
    its float32 values) go beside block records only after a block record first, and a record
    (rank-1 too) only after a record (``native.job_row``): a plain ``exp_avg`` beside a rank-1
    ``exp_avg_sq`` runs in torch."""
    p, g, c = leaf.param, leaf.grad, leaf.correction
    if c is not None and not (write and p is not None and p.dtype in CORRECTED_DTYPES and c.dtype is torch.int8
                              and c.is_contiguous() and c.numel() == g.numel()):
        return False  # a correction the kernel does not write in place: the torch backend's step (or its error)
    if g.dtype not in native.DTYPE_IDS or (p is not None and p.dtype not in native.DTYPE_IDS):
        return False
    if write and not p.is_contiguous():
        return False
    quantized = plain = values = 0
    for s in leaf.states:
        if isinstance(s, Record):
            if not s.kernel_ready():
                return False
            if s.KERNEL == KERNEL_BLOCKS:
                quantized += 1
            else:
                plain += 1
                values += 1
        elif isinstance(s, torch.Tensor) and s.dtype in (torch.float32, torch.bfloat16) and s.is_contiguous():
            plain += 1
        else:
            return False
    if values and isinstance(leaf.states[0], torch.Tensor):
        return False
    return not (quantized and plain) or kernel_of(leaf.states[0]) == KERNEL_BLOCKS
