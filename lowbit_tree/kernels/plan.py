"""One rule's in-place step over fixed leaves, built once and run every step.

:func:`~lowbit_tree.kernels.run_step` decides everything per call: for each leaf, its backend,
its checks, its ``lbt_job`` row. A training loop steps the same params and states every step,
so :class:`KernelPlan` decides it once. On the native backend the rows of all leaves sit in one
int64 buffer; a step writes into it what changes (each gradient's address, the update buffer
when params are not written, the rounding hash of a stochastically rounded leaf), copies the
hyperparameter vector into the one vector the rows point at, and makes one call. The compiled
and eager backends take each leaf through one compiled graph per static combination
(:mod:`.torch_backend`). Leaves a plan cannot hold fixed (rank-1 records, whose maxima are
completed across shards after the step; empty shards; leaves the C kernel does not take) run
through :func:`~lowbit_tree.kernels.run_step` on every step, as before.

At each step the gradients are checked against the rows (dtype, shape, layout, device) and
each param's address against its row: a param whose storage was replaced (``p.data = ...``,
``module.to(...)``) or a gradient of another dtype rebuilds the rows, never reads stale
memory. A plan holds its states' tensors: a caller that swaps a state tensor's storage
(``Tensor.set_``) builds a new plan.
"""
from __future__ import annotations

import array
from typing import Optional, Sequence

import torch

from . import native, native_ok, native_state, run_step, StepLeaf, step_backend, torch_backend
from ..record_base import KERNEL_VALUES, kernel_of
from ..rounding import rounding_hash
from .spec import NHYPER, StepSpec, job_row_index

__all__ = ["KernelPlan"]

_GRAD, _OUT, _SR_HASH = (job_row_index(f) for f in ("g", "out", "sr_hash"))  # the row fields a step rewrites
_MASK32 = 0xFFFFFFFF


class KernelPlan:
    """The in-place step of ``spec`` over fixed leaves (``params[k]``, ``states[k]``, tree index
    ``indices[k]``), writing params (``write``) or returning float32 updates.

    :meth:`run` takes this step's gradients (one per leaf, ``None`` to skip a leaf) and the
    hyperparameter vector (:func:`~lowbit_tree.kernels.step_hyperparams`), and gives the
    same bits as ``run_step(spec, hyper, leaves, write=write, inplace=True, sr_key=...)``.
    """

    def __init__(self, spec: StepSpec, params: Sequence[Optional[torch.Tensor]], states: Sequence[tuple],
                 indices: Sequence[int], *, write: bool, backend: Optional[str] = None,
                 corrections: Optional[Sequence[Optional[torch.Tensor]]] = None):
        self.spec, self.write, self.backend = spec, write, backend
        self.params, self.states, self.indices = list(params), [tuple(s) for s in states], list(indices)
        self.corrections = list(corrections) if corrections is not None else [None] * len(self.params)
        self._rows: Optional[array.array] = None  # built at the first run, from its gradients
        self._native: list = []  # leaf positions whose rows are in _rows, in row order
        self._compiled: list = []  # (leaf positions, torch_backend.CompiledSteps) per static combination and shape class
        self._other: list = []  # leaf positions run through run_step
        self._signature: tuple = ()  # per native leaf: (grad dtype, addresses) the rows were built for

    # -- building ---------------------------------------------------------------------
    def _static(self, k: int, g: torch.Tensor) -> Optional[str]:
        """The backend that holds leaf ``k`` fixed ("native": a row; "compiled": a place in a
        prepared call), or ``None``."""
        p, states = self.params[k], self.states[k]
        if g.numel() == 0 or any(kernel_of(s) == KERNEL_VALUES for s in states):
            return None
        which = step_backend(self.spec, StepLeaf(p, g, states, self.indices[k], self.corrections[k]), self.write,
                             self.backend)
        if which == "triton":  # held in a launch whose address table is built once (triton_backend.TritonSteps)
            return which
        if which == "compiled":  # (a single row with quantized states steps eagerly: torch_backend.compiles)
            return which if torch_backend.compiles(g.shape, torch_backend.state_storages(states)) else None
        if which == "native" and native_ok(StepLeaf(p, g, states, self.indices[k], self.corrections[k]), self.write):
            return which
        return None

    def _leaf_signature(self, k: int, g: torch.Tensor) -> tuple:
        p = self.params[k]
        return g.dtype, g.shape, None if p is None else p.data_ptr()

    def _build(self, grads: Sequence) -> None:
        self._native, self._other = [], []
        compiled: dict = {}
        for k, g in enumerate(grads):
            if g is None:
                continue
            which = self._static(k, g)
            if which == "triton":
                compiled.setdefault(("triton", self.write and self._stochastic, g.device, None), []).append(k)
            elif which == "compiled":
                p, corr = self.params[k], self.corrections[k]
                stochastic = self.write and self._stochastic and p.dtype is torch.bfloat16 and corr is None
                storages = torch_backend.state_storages(self.states[k])
                key = (storages, stochastic, g.device, torch_backend.leaf_class(p, g, storages, corr))
                compiled.setdefault(key, []).append(k)
            else:
                (self._native if which == "native" else self._other).append(k)
        self._compiled = []
        for (storages, stochastic, _, _), ks in compiled.items():  # storages: "triton" for a Triton launch
            leaves = [(self.params[k], grads[k], self.states[k], self.indices[k], self.corrections[k]) for k in ks]
            if storages == "triton":
                from . import triton_backend  # imports triton: only on that backend

                steps = triton_backend.TritonSteps(self.spec, leaves, write=self.write, sr=stochastic)
            else:
                steps = torch_backend.CompiledSteps(self.spec, leaves, write=self.write, sr=stochastic)
            self._compiled.append((ks, steps))
        self._held = [k for ks, _ in self._compiled for k in ks]
        self._held_signature = tuple(self._leaf_signature(k, grads[k]) for k in self._held)
        self._hyper = torch.zeros(NHYPER, dtype=torch.float32, device="cpu")
        rows = array.array("q")
        for k in self._native:
            rows.extend(native.job_row(self._job(k, grads[k]), self._hyper.data_ptr()))
        self._rows = rows
        self._width = len(rows) // len(self._native) if self._native else 0
        self._signature = tuple(self._leaf_signature(k, grads[k]) for k in self._native)
        self._numel = sum(grads[k].numel() for k in self._native)
        self._pattern = tuple(g is not None for g in grads)

    def _job(self, k: int, g: torch.Tensor) -> native.NativeJob:
        from ..qtensor import row_layout

        p = self.params[k]
        rows, r = row_layout(g.shape)
        out = p if self.write else torch.empty(g.shape, dtype=torch.float32, device=g.device)
        sts = tuple(native_state(s, True)[0] for s in self.states[k])
        p_in = p if (self.write or self.spec.needs_param) else None
        corr = self.corrections[k]  # a state: its address stays in the row
        stochastic = self.write and self._stochastic and p.dtype is torch.bfloat16 and corr is None
        return native.NativeJob(rows, r, p_in, g.contiguous(), out, self.spec, self.write, stochastic, 0,
                                self._hyper, sts, corr)

    # -- running -------------------------------------------------------------------------
    def _valid(self, grads: Sequence) -> bool:
        if self._rows is None or tuple(g is not None for g in grads) != self._pattern:
            return False
        params = self.params
        for k, (dtype, shape, ptr) in zip(self._native, self._signature):
            g, p = grads[k], params[k]
            if (g.dtype is not dtype or g.shape != shape or not g.is_cpu or not g.is_contiguous()
                    or (p is not None and p.data_ptr() != ptr)):
                return False
        for k, (dtype, shape, ptr) in zip(self._held, self._held_signature):
            g, p = grads[k], params[k]
            if g.dtype is not dtype or g.shape != shape or (p is not None and p.data_ptr() != ptr):
                return False
        return True

    def run(self, grads: Sequence, hyper: torch.Tensor, sr_key: Optional[torch.Tensor] = None) -> list:
        """One step: params (``write``) and states in place. Returns per leaf the float32
        update (``None`` with ``write`` or for a leaf without gradient)."""
        self._stochastic = sr_key is not None
        if len(grads) != len(self.params):
            raise ValueError(f"the plan has {len(self.params)} leaves, got {len(grads)} gradients")
        if not self._valid(grads) or getattr(self, "_built_stochastic", None) != self._stochastic:
            self._build(grads)
            self._built_stochastic = self._stochastic
        outs: list = [None] * len(grads)
        if self._native:
            rows, w = self._rows, self._width
            for j, k in enumerate(self._native):
                g = grads[k]
                rows[j * w + _GRAD] = g.data_ptr()
                if not self.write:
                    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
                    rows[j * w + _OUT] = out.data_ptr()
                    outs[k] = out
                elif self._stochastic and self.params[k].dtype is torch.bfloat16:
                    rows[j * w + _SR_HASH] = rounding_hash(sr_key, self.indices[k]) & _MASK32
            self._hyper.copy_(hyper)
            native.run_rows(rows, len(self._native), self._numel)
        for ks, steps in self._compiled:
            for k, u in zip(ks, steps.run([grads[k] for k in ks], hyper, sr_key if steps.sr else None)):
                outs[k] = u
        if self._other:
            leaves = [StepLeaf(self.params[k], grads[k], self.states[k], self.indices[k], self.corrections[k])
                      for k in self._other]
            o, _ = run_step(self.spec, hyper, leaves, write=self.write, inplace=True, sr_key=sr_key,
                            backend=self.backend)
            for k, u in zip(self._other, o):
                outs[k] = u
        return outs

