"""A pure step's job rows, built once per structure and written with each call's addresses.

:func:`~lowbit_tree.kernels.run_step` builds every leaf's ``lbt_job`` row on every call: the
backend choice, the checks of every tensor, the flags, the format tables. A pure ``tx.update``
in a training loop sees the same structure every call (leaf shapes, dtypes, state record classes and
formats) in new tensors. :class:`PureRows` keeps the rows of the first call, and a later call of
the same structure copies them and writes in the addresses of its own tensors (gradient,
param, new update, each state's old and new parts, the hyperparameter vector) after checking
what the structure does not fix (layout, device, part sizes). Outputs are new tensors every
call, as :func:`run_step` makes them (``inplace=False``): the same bits, nothing modified.

The caller holds a :class:`PureRows` (a rule's transformation holds one); nothing is kept in a
module. A call that the rows cannot take (another backend, rank-1 records, empty leaves, a
layout the checks refuse) returns ``None``: the caller runs :func:`run_step`.

No hyperparameter value enters the rows (a call writes in the address of its own vector), so
one :class:`PureRows` serves concurrent calls and transformations built again and again of one
structure: :func:`rows_from` hands a rebuilt transformation's rules the ones its earlier
builds made (``inject_hyperparams`` builds its factory's transformation on every call).
"""
from __future__ import annotations

import array
import contextvars
from typing import Optional, Sequence

import torch

from ..record_base import KERNEL_BLOCKS, Record
from ..qtensor import row_layout
from . import native
from .backend_choice import backend_for, native_ok
from .spec import StepLeaf
from .stepper import native_state
from .spec import NHYPER, STATE_SLOTS, StepSpec, job_row_index

__all__ = ["PureRows", "rows_from", "rule_rows"]

_P, _G, _OUT, _HYPER = (job_row_index(f) for f in ("p", "g", "out", "hyper"))
_STATE = [tuple(job_row_index(f, k) for f in ("in", "out", "scale_in", "scale_out")) for k in range(STATE_SLOTS)]


def _signature(spec: StepSpec, leaves: Sequence[StepLeaf]) -> Optional[tuple]:
    """What the rows are built for: per leaf the gradient's and param's dtype and shape, each
    state's record class (or dtype), format, block size and shape; ``None`` for leaves the rows never take."""
    sig = [spec]
    for leaf in leaves:
        g, p = leaf.grad, leaf.param
        if leaf.correction is not None or g.numel() == 0:
            return None
        states = []
        for s in leaf.states:
            if isinstance(s, Record):
                if s.KERNEL != KERNEL_BLOCKS:
                    return None
                states.append((type(s), s.format, s.block_size, s.shape, s.codes.dtype, s.scale.dtype))
            elif isinstance(s, torch.Tensor):
                states.append((s.dtype, s.shape))
            else:
                return None
        sig.append((g.dtype, g.shape, g.device, None if p is None else (p.dtype, p.shape), tuple(states)))
    return tuple(sig)


def _fits(t: torch.Tensor, numel: int) -> bool:
    return t.is_cpu and t.is_contiguous() and t.numel() == numel


class PureRows:
    """The job rows of a pure native step over leaves of one structure (see the module)."""

    def __init__(self):
        self._built: Optional[tuple] = None  # (signature, rows, row width, part sizes); replaced whole
        self.builds = 0  # how many times rows were built (a structure change builds again)

    def run(self, spec: StepSpec, hyper: torch.Tensor, leaves: Sequence[StepLeaf]) -> Optional[tuple[list, list]]:
        """``run_step(spec, hyper, leaves)``'s result (new updates, new states), or ``None``."""
        if not leaves or backend_for(leaves[0].grad.device) != "native":
            return None
        sig = _signature(spec, leaves)
        if sig is None:
            return None
        hyper_c = hyper if hyper.dtype is torch.float32 and hyper.is_contiguous() else hyper.float().contiguous()
        if not _fits(hyper_c, NHYPER):
            return None
        built = self._built
        if built is not None and built[0] == sig:
            return self._rerun(built, spec, hyper_c, leaves)
        return self._build(sig, spec, hyper_c, leaves)

    def _build(self, sig, spec, hyper, leaves):
        if not all(native_ok(leaf, False) for leaf in leaves):
            return None
        jobs, outs, news, sizes = [], [], [], []
        for leaf in leaves:
            g, p = leaf.grad, leaf.param
            if spec.needs_param and (p is None or not p.is_contiguous() or p.shape != g.shape):
                return None  # run_step copies it, or names the error
            rows, r = row_layout(g.shape)
            out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
            pairs = [native_state(s, False) for s in leaf.states]
            states = tuple(ns for ns, _ in pairs)
            sizes.append(tuple((ns.src.numel(), 0 if ns.scale_src is None else ns.scale_src.numel()) for ns in states))
            jobs.append(native.NativeJob(rows, r, p if spec.needs_param else None, g.contiguous(), out, spec, False,
                                         False, 0, hyper, states))
            outs.append(out)
            news.append(tuple(leaf_ for _, leaf_ in pairs))
        flat = array.array("q")
        for job in jobs:  # every tensor checked here, as run_step checks it
            flat.extend(native.job_row(job))
        width = len(flat) // len(jobs)
        self._built = (sig, flat, width, sizes)
        self.builds += 1
        native.run_rows(flat, len(jobs), sum(j.rows * j.r for j in jobs))
        return outs, news

    def _rerun(self, built, spec, hyper, leaves):
        _, template, width, sizes = built
        rows = array.array("q", template)  # this call's copy: concurrent calls share nothing written
        outs, news = [], []
        numel = 0
        hyper_ptr = hyper.data_ptr()
        for j, (leaf, size) in enumerate(zip(leaves, sizes)):
            g, p = leaf.grad, leaf.param
            n = g.numel()
            if not _fits(g, n) or (spec.needs_param and not _fits(p, n)):
                return None
            base = j * width
            out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
            rows[base + _G] = g.data_ptr()
            rows[base + _OUT] = out.data_ptr()
            rows[base + _HYPER] = hyper_ptr
            if spec.needs_param:
                rows[base + _P] = p.data_ptr()
            new = []
            for k, (s, (n_src, n_scale)) in enumerate(zip(leaf.states, size)):
                ns, leaf_ = native_state(s, False)
                if not _fits(ns.src, n_src) or (n_scale and not _fits(ns.scale_src, n_scale)):
                    return None
                i_in, i_out, i_sin, i_sout = _STATE[k]
                rows[base + i_in] = ns.src.data_ptr()
                rows[base + i_out] = ns.dst.data_ptr()
                if n_scale:
                    rows[base + i_sin] = ns.scale_src.data_ptr()
                    rows[base + i_sout] = ns.scale_dst.data_ptr()
                new.append(leaf_)
            outs.append(out)
            news.append(tuple(new))
            numel += n
        native.run_rows(rows, len(leaves), numel)
        return outs, news


_BUILDING: contextvars.ContextVar = contextvars.ContextVar("lowbit_tree_rows_from", default=None)


class rows_from:  # lower case: used as ``with rows_from(store):``, as a function
    """While this block builds a transformation, its rules take their :class:`PureRows` from
    ``store`` in the order they are built, and a rule past its end puts a new one there: a
    transformation rebuilt with other hyperparameter values keeps the job rows the earlier
    builds made. ``store`` is the caller's (a list, first empty). Two first builds at once may
    both add rows (a rule then finds another's, of another structure, and builds its own
    again): rows are looked up by structure, so that costs a build, never a wrong step.
    (A class, not a generator: it is entered on every call of ``inject_hyperparams``.)"""

    __slots__ = ("store", "token")

    def __init__(self, store: list):
        self.store = store

    def __enter__(self):
        self.token = _BUILDING.set([self.store, 0])

    def __exit__(self, *exc):
        _BUILDING.reset(self.token)


def rule_rows() -> PureRows:
    """The job rows of a rule being built: the next of :func:`rows_from`'s store inside that
    block, a new :class:`PureRows` elsewhere (and under a caller's torch.compile, whose traced
    step runs no rows)."""
    building = None if torch.compiler.is_compiling() else _BUILDING.get()
    if building is None:
        return PureRows()
    store, i = building
    building[1] = i + 1
    if i < len(store):
        return store[i]
    rows = PureRows()
    store.append(rows)
    return rows
