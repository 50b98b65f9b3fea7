"""The backends of the core's transitions: one step of any rule, on any format and dtype.

``run_step`` executes one :class:`~.spec.StepSpec` on a list of leaves (param,
gradient, states) with one of three backends, which give the same bits:

- ``native``: the C kernel (``cpu.c``, built on first use; CPU tensors);
- ``compiled``: the torch backend under ``torch.compile`` (CUDA's default);
- ``eager``: the same torch code run eagerly.

``LOWBIT_TREE_BACKEND`` (``native``, ``compiled``, ``eager``, ``triton``; unset or ``auto``)
chooses, read by ``backend_setting()`` alone (``reset_backend_setting()`` forgets the native
library's load, which is made once). ``auto``: native on CPU, compiled elsewhere (inside a caller's
``torch.compile``, the torch code is traced into the caller's graph); on a CPU where the C kernel
cannot be built, eager (said once, with a warning naming the switch), never
inductor, which needs the same C compiler. Leaves the native kernel does not take
(float64 params, non-contiguous params written in place) run on the torch backend of
their device, with the same float operations. Rank-1 records (:mod:`lowbit_tree.rank1`)
are encoded with the maxima of their new values, completed across shards first
(``_Rank1Wait``; design.md, "Rank-1 normalization"): the C kernel computes those maxima in a
job of their own, then steps and encodes; the torch backends step the float32 values and
encode them after.

The modules, one job each, whose public names this package re-exports: ``backend_choice`` (which
backend steps a leaf), ``stepper`` (``run_step``), ``fast_quant`` (the fast quantize / dequantize,
``quantize_rows_fast``, ..., with codes bit-identical to the reference quantizer in
:mod:`lowbit_tree.qtensor`).
"""
from __future__ import annotations

from .backend_choice import (BACKENDS, backend_for, backend_setting, native_ok, reset_backend_setting, step_backend,
                             triton_ok)
from .fast_quant import dequantize_fast, dequantize_rows_fast, quantize_rows_fast
from .spec import StepLeaf
from .stepper import native_state, run_step
from .spec import NHYPER, RULES, StepSpec, step_hyperparams
from .tables import CodeTable, code_table

__all__ = [
    "BACKENDS",
    "backend_setting",
    "reset_backend_setting",
    "backend_for",
    "step_backend",
    "triton_ok",
    "StepSpec",
    "RULES",
    "NHYPER",
    "step_hyperparams",
    "StepLeaf",
    "native_ok",
    "native_state",
    "run_step",
    "CodeTable",
    "code_table",
    "quantize_rows_fast",
    "dequantize_rows_fast",
    "dequantize_fast",
]
