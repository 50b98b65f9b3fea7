"""The step over a list of leaves (:func:`run_step`): the native C kernel's jobs, the compiled
torch backend's batches, the eager fallback, the triton launches, and the rank-1 records' maxima
completed across shards in leaf order (``_Rank1Wait``).

A rank-1 record on triton steps as its float32 values (decoded by :mod:`.triton_quant`, a
plain state of the step kernel); the new values' maxima, once completed, encode its new codes
(triton kernels too), as on the torch backend."""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..correction import CORRECTED_DTYPES
from ..qtensor import row_layout
from ..rank1 import rank1_quantize
from ..record_base import KERNEL_BLOCKS, KERNEL_VALUES, Record, kernel_of
from ..rounding import rounding_hash
from . import native, torch_backend
from . import backend_choice
from .backend_choice import backend_for, native_ok, triton_ok
from .spec import StepLeaf, StepSpec

__all__ = ["native_state", "run_step"]


class _Rank1Wait(NamedTuple):
    """A rank-1 state (:data:`~lowbit_tree.record_base.KERNEL_VALUES`) waiting for the maxima of
    its new values: they are completed across shards (the record's ``reduce``, a collective) in
    leaf order on every rank. From the torch backend: its new float32 ``values`` ``(rows, R)``,
    encoded once complete (by torch, or by the triton kernels: ``triton``). From the native
    kernel: the ``maxima`` its maxima job wrote, completed in place for its step job, which
    writes the new ``codes``."""

    leaf: int
    slot: int
    values: Optional[torch.Tensor]
    old: object  # the record
    maxima: Optional[tuple] = None  # native: (row_max, col_max) of the new values
    codes: Optional[torch.Tensor] = None  # native: where the step job writes the new codes
    triton: bool = False  # the values' maxima and codes by triton_quant's kernels


def _rank1_complete(w: _Rank1Wait, inplace: bool):
    """Completes ``w``'s maxima across shards. The torch backend's values: returns their new
    record (written into ``w.old`` with ``inplace``). Native: the maxima in place, for the
    step job; returns None."""
    old = w.old
    if w.triton:
        from . import triton_quant

        row_max, col_max = triton_quant.rank1_maxima(w.values)
        if old.reduce is not None:
            row_max, col_max = old.reduce(row_max, col_max)
        codes = triton_quant.rank1_encode(w.values, row_max, col_max, torch.empty_like(old.codes))
        if inplace:
            for dst, src in ((old.codes, codes), (old.row_max, row_max), (old.col_max, col_max)):
                dst.copy_(src)
            return old
        return old.with_parts({"codes": codes, "row_max": row_max, "col_max": col_max})
    if w.maxima is None:
        new = rank1_quantize(w.values.reshape(old.shape), old.reduce)  # KERNEL_VALUES: a rank-1 record
        if inplace:
            old.copy_(new)
            return old
        return new
    if old.reduce is not None:
        row_max, col_max = old.reduce(*w.maxima)
        w.maxima[0].copy_(row_max)
        w.maxima[1].copy_(col_max)
    return None


def _rank1_native_record(w: _Rank1Wait, inplace: bool):
    """The new record of a native rank-1 state once its step job has written ``w.codes``."""
    old = w.old
    row_max, col_max = w.maxima
    if inplace:
        old.row_max.copy_(row_max)
        old.col_max.copy_(col_max)
        return old
    return old.with_parts({"codes": w.codes, "row_max": row_max, "col_max": col_max})


def native_state(s, inplace: bool):
    """(NativeState, the new leaf) for state ``s`` (a plain tensor or a
    :data:`~lowbit_tree.record_base.KERNEL_BLOCKS` record): written in place, or into new tensors."""
    if isinstance(s, Record):
        if s.KERNEL != KERNEL_BLOCKS:
            raise TypeError(f"native_state takes plain tensors and block records, got a {type(s).__name__} "
                            f"(native_ok says which leaves the C kernel takes)")
        codes = s.codes if s.codes.dtype is torch.uint8 else s.codes.view(torch.uint8)  # fp8: a byte view
        if inplace:
            return native.NativeState(codes, codes, s.scale, s.scale, s.format, s.block_size), s
        new_codes, new_scale = torch.empty_like(codes), torch.empty_like(s.scale)
        leaf = s.with_parts({"codes": new_codes.view(s.codes.dtype), "scale": new_scale})
        return native.NativeState(codes, new_codes, s.scale, new_scale, s.format, s.block_size), leaf
    dst = s if inplace else torch.empty_like(s)
    return native.NativeState(s, dst, None, None, None, 0), dst


def _torch_leaf(spec, hyper, leaf: StepLeaf, i: int, write, inplace, sr_key, compile, waits: list):
    """A leaf on the torch backend. Rank-1 records step as their float32 values (eagerly);
    their new values join ``waits`` and their slots hold the old record until then."""
    states = list(leaf.states)
    rank1 = [kernel_of(s) == KERNEL_VALUES for s in states]
    if any(rank1):
        plain = [s.dequantize() if k else s for s, k in zip(states, rank1)]
        out, new, corr = torch_backend.step_leaf(spec, hyper, leaf.param, leaf.grad, plain, write=write,
                                                 sr=sr_key is not None, key=sr_key, leaf_index=leaf.index,
                                                 compile=False, correction=leaf.correction)
        new = list(new)
        for k, s in enumerate(states):
            if rank1[k]:
                rows, r = row_layout(s.shape)
                waits.append(_Rank1Wait(i, k, new[k].reshape(rows, r), s))
                new[k] = s
    else:
        out, new, corr = torch_backend.step_leaf(spec, hyper, leaf.param, leaf.grad, states, write=write,
                                                 sr=sr_key is not None, key=sr_key, leaf_index=leaf.index,
                                                 compile=compile, correction=leaf.correction)
    if inplace:
        for old, n, k in zip(states, new, rank1):
            if not k:
                _copy_leaf_(old, n)
        new = states
    if write:
        leaf.param.copy_(out)
        if corr is not None:
            leaf.correction.copy_(corr)
        out = None
    return out, list(new)


def _triton_leaves(spec, hyper, leaves, where: Sequence[int], write, inplace, sr_key, waits: list):
    """``leaves[i]`` for ``i`` in ``where`` on the triton backend (one :func:`.triton_backend.run_step`):
    ``(outs, news)`` in ``where``'s order. A rank-1 record steps as its float32 values
    (:func:`.triton_quant.rank1_values`); its new values join ``waits`` (encoded by triton once
    their maxima are complete) and its slot holds the old record until then."""
    from . import triton_backend, triton_quant  # import triton: only here

    subs = []
    for i in where:
        leaf = leaves[i]
        if any(kernel_of(s) == KERNEL_VALUES for s in leaf.states):
            states = tuple(triton_quant.rank1_values(s).reshape(s.shape) if kernel_of(s) == KERNEL_VALUES else s
                           for s in leaf.states)
            leaf = leaf._replace(states=states)
        subs.append(leaf)
    outs, news = triton_backend.run_step(spec, hyper, subs, write=write, inplace=inplace, sr_key=sr_key)
    news = [list(n) for n in news]
    for i, new in zip(where, news):
        for k, s in enumerate(leaves[i].states):
            if kernel_of(s) != KERNEL_VALUES:
                continue
            if leaves[i].grad.numel() or s.reduce is not None:  # an empty shard joins its reduce all the same
                waits.append(_Rank1Wait(i, k, new[k].reshape(row_layout(s.shape)), s, triton=True))
                new[k] = s
            else:
                new[k] = s if inplace else s.clone()
    return outs, news


def _complete_waits(waits: list, news: list, inplace: bool) -> None:
    """The torch backend's and triton's rank-1 waits completed, in leaf order (a record's reduce
    is a collective: every rank completes its records in the same order)."""
    waits.sort(key=lambda w: (w.leaf, w.slot))
    for w in waits:
        new = _rank1_complete(w, inplace)
        if new is not None:
            news[w.leaf][w.slot] = new


def _copy_leaf_(dst, src) -> None:
    """Overwrite a state leaf's tensors with another's of the same kind."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    else:
        dst.copy_(src)


def run_step(
    spec: StepSpec,
    hyper: torch.Tensor,
    leaves: Sequence[StepLeaf],
    *,
    write: bool = False,
    inplace: bool = False,
    sr_key: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> tuple[list, list]:
    """One step of ``spec`` on every leaf, with ``hyper`` (:func:`step_hyperparams`).

    Args:
      write: update each param in place (``p + u`` rounded once to its dtype) instead
        of returning the float32 update ``u``.
      inplace: overwrite the states' tensors (the caller gives up the old state);
        else new tensors are returned and nothing passed in is modified.
      sr_key: with ``write``, round bfloat16 params stochastically with this key
        (int64 words, :func:`lowbit_tree.update.rounding_key`) and each leaf's index.
      backend: see :func:`backend_for`.
    Returns:
      ``(outs, new_states)``: per leaf the float32 update (``None`` with ``write``)
      and the tuple of its new states (the same objects with ``inplace``).
    """
    if write and not spec.lr:
        raise ValueError("run_step(write=True) needs a fused learning-rate link (spec.lr)")
    if leaves and backend_for(leaves[0].grad.device, backend) == "triton":
        waits: list = []
        outs, news = _triton_leaves(spec, hyper, leaves, range(len(leaves)), write, inplace, sr_key, waits)
        _complete_waits(waits, news, inplace)
        return outs, [tuple(n) for n in news]
    outs: list = [None] * len(leaves)
    news: list = [None] * len(leaves)
    jobs = []  # native jobs
    maxima_jobs, rank1_jobs = [], []  # native leaves with rank-1 states: their maxima jobs, then their steps
    waits: list = []  # _Rank1Wait, in leaf order: completed in that order on every rank
    batched: list = []  # leaves for the compiled backend
    on_triton: list = []  # on CUDA, automatically: the leaves the triton kernel has (step_backend)
    backends: dict = {}  # device -> backend, decided once per call

    for i, leaf in enumerate(leaves):
        g, p = leaf.grad, leaf.param
        if spec.needs_param or write:
            if p is None:
                raise ValueError(f"{spec} needs params: call update(updates, state, params)")
            if p.shape != g.shape:
                raise ValueError(f"gradient shape {tuple(g.shape)} does not match param shape {tuple(p.shape)}")
        if leaf.correction is not None and not (write and p is not None and p.dtype in CORRECTED_DTYPES
                                                 and leaf.correction.shape == p.shape
                                                 and leaf.correction.dtype is torch.int8):
            raise ValueError("a param correction goes with a bfloat16 / float16 param written in place and is an "
                             f"int8 tensor of its shape (param {None if p is None else (p.dtype, tuple(p.shape))})")
        if len(leaf.states) != spec.nstates:
            raise ValueError(f"the {spec.rule} rule takes {spec.nstates} states per leaf, got {len(leaf.states)}")
        sr = sr_key if write and p is not None and p.dtype is torch.bfloat16 else None
        if g.numel() == 0:
            outs[i] = None if write else torch.zeros(g.shape, dtype=torch.float32, device=g.device)
            news[i] = [s if inplace else _clone_leaf(s) for s in leaf.states]
            for k, s in enumerate(leaf.states):
                if kernel_of(s) == KERNEL_VALUES and s.reduce is not None:
                    # an empty shard's record is requantized all the same: its reduce is a
                    # collective the other shards' steps join, and leaves the global maxima in it
                    waits.append(_Rank1Wait(i, k, s.dequantize().reshape(row_layout(s.shape)), s))
            continue
        which = backends.get(g.device)
        if which is None:
            which = backends[g.device] = backend_for(g.device, backend)
        if which == "compiled" and backend_choice.auto_triton(g.device, backend) and triton_ok(spec, leaf, write):
            on_triton.append(i)
        elif which == "native" and native_ok(leaf, write):
            rows, r = row_layout(g.shape)
            pairs, has_rank1 = [], False
            for k, s in enumerate(leaf.states):
                if kernel_of(s) == KERNEL_VALUES:  # a maxima job, the completed maxima, then the step encodes with them
                    maxima = (torch.empty(rows, dtype=torch.float32, device=g.device),
                              torch.empty(r, dtype=torch.float32, device=g.device))
                    codes = s.codes if inplace else torch.empty_like(s.codes)
                    waits.append(_Rank1Wait(i, k, None, s, maxima, codes))
                    pairs.append((native.NativeState(s.codes, codes, s.row_max, s.col_max, s.format,
                                                     native.RANK1_BLOCK, *maxima), s))
                    has_rank1 = True
                else:
                    pairs.append(native_state(s, inplace))
            out = p if write else torch.empty(g.shape, dtype=torch.float32, device=g.device)
            sr_hash = 0
            if sr is not None:
                sr_hash = rounding_hash(sr, leaf.index)
            p_in = p if write else (p.contiguous() if spec.needs_param else None)
            # a corrected param is rounded to nearest from its master value (the torch backend's step too)
            stochastic = sr is not None and leaf.correction is None
            job = native.NativeJob(rows, r, p_in, g.contiguous(), out, spec, write, stochastic, sr_hash, hyper,
                                   tuple(ns for ns, _ in pairs), leaf.correction)
            outs[i] = None if write else out
            news[i] = [leaf_ for _, leaf_ in pairs]
            if has_rank1:
                maxima_jobs.append(job._replace(write=False, stochastic=False, correction=None, maxima=True))
                rank1_jobs.append(job)
            else:
                jobs.append(job)
        elif which == "compiled" and not any(kernel_of(s) == KERNEL_VALUES for s in leaf.states):
            batched.append(i)  # stepped below, with the others of its static combination
        else:
            if which == "native":
                which = "eager"
            outs[i], news[i] = _torch_leaf(spec, hyper, leaf, i, write, inplace, sr, which == "compiled", waits)
    native.run_jobs(_hyper_jobs(jobs, hyper))
    if on_triton:
        t_outs, t_news = _triton_leaves(spec, hyper, leaves, on_triton, write, inplace, sr_key, waits)
        for i, out, new in zip(on_triton, t_outs, t_news):
            outs[i], news[i] = out, new
    _compiled_leaves(spec, hyper, leaves, batched, write, inplace, sr_key, outs, news)
    native.run_jobs(_hyper_jobs(maxima_jobs, hyper))
    _complete_waits(waits, news, inplace)
    native.run_jobs(_hyper_jobs(rank1_jobs, hyper))
    for w in waits:
        if w.maxima is not None:
            news[w.leaf][w.slot] = _rank1_native_record(w, inplace)
    return outs, [tuple(n) for n in news]


def _compiled_leaves(spec, hyper, leaves, which: list, write: bool, inplace: bool, sr_key, outs: list, news: list):
    """Leaves ``which`` on the compiled backend: one call per chunk of a static combination
    (:func:`.torch_backend.step_leaves`), bf16 params written with stochastic rounding apart
    from the others (a static flag of the graph)."""
    for stochastic in (False, True):
        chosen = [i for i in which if (write and sr_key is not None and leaves[i].param.dtype is torch.bfloat16)
                  == stochastic]
        if not chosen:
            continue
        items = [(leaves[i].param, leaves[i].grad, leaves[i].states, leaves[i].index, leaves[i].correction)
                 for i in chosen]
        results = torch_backend.step_leaves(spec, hyper, items, write=write, sr=stochastic,
                                            key=sr_key if stochastic else None)
        for i, (out, new, corr) in zip(chosen, results):
            states = leaves[i].states
            if inplace:
                for old, n in zip(states, new):
                    _copy_leaf_(old, n)
                new = list(states)
            if write:
                leaves[i].param.copy_(out)
                if corr is not None:
                    leaves[i].correction.copy_(corr)
                out = None
            outs[i], news[i] = out, list(new)


def _hyper_jobs(jobs: list, hyper: torch.Tensor) -> list:
    """``jobs`` with ``hyper`` as the contiguous float32 vector the C kernel reads."""
    if jobs and not (hyper.dtype is torch.float32 and hyper.is_contiguous()):
        hyper_c = hyper.float().contiguous()
        return [j._replace(hyper=hyper_c) for j in jobs]
    return jobs


def _clone_leaf(s):
    """A state leaf of new tensors holding ``s``'s values."""
    return s.clone() if isinstance(s, (torch.Tensor, Record)) else s
