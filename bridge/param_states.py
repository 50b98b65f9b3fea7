"""``ParamStates``: what each param of an optimizer keeps, and the live records over it.

A param's state is a dict of torch.optim's names (``step``, ``exp_avg``, ...): plain tensors
and :class:`bridge.qstate.QState` records, DTensor-wrapped like the param. Its *layout* (which
states, their record kind, format and block size) is the core's ``tx.init`` of one meta tensor
of the param's global shape, decided when the state is created and never recomputed; tensor
parallel's column shards get whole blocks (:func:`bridge.distributed.shard_block_size`).

The step reads a state through a *live record*: the core record over the state's storage,
wired to its param's shards (a rank-1 record's ``reduce``, :func:`bridge.rank1_shard.rank1_reduce`).
``ParamStates`` makes layouts, new states, the layout check, live records, reducers and a
group's state-tree :class:`bridge.state_tree.Binding`, and remembers them:

- layouts and bindings by value: the group's transformation key (its static arguments) and
  the params' shapes and dtypes;
- reducers and live records by param (the param object itself, as ``optimizer.state`` is
  keyed); a live record is made again when its state object is replaced (created, loaded,
  moved).

The optimizer (``opt.param_states``) makes states and builds each group's step
(:class:`bridge.group_plan.GroupPlan`, given the live records) with it; :mod:`bridge.state_dict` and
:mod:`bridge.master` create and read states through it. None of them reads its caches.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

import lowbit_tree as lt
from lowbit_tree import records
from lowbit_tree.rules import SCALAR_STATES

from .distributed import is_dtensor, mesh_axes, shard_block_size, to_local, wrap_like
from .qstate import QState
from .rank1_shard import rank1_reduce
from .state_tree import Binding, binding

__all__ = ["ParamStates", "stored_layout", "SCALARS"]

SCALARS = ("step", *SCALAR_STATES)
"""The per-param 0-d CPU float32 states of torch.optim (``step``, NAdam's ``mu_product``): no
layout, no record; a step's plan holds them as views of one tensor (:class:`bridge.group_plan.GroupPlan`)."""


def stored_layout(v) -> tuple:
    """A live state's layout as :meth:`ParamStates.layout` writes it: ``(record kind, meta)``
    or ``(None, dtype)``."""
    v = to_local(v)
    if isinstance(v, QState):
        return v.kind, {k: x for k, x in v.meta.items() if k != "reduce"}
    return None, v.dtype


def _layout_label(layout: tuple) -> str:
    kind, meta = layout
    return str(meta) if kind is None else f"{kind.name} {meta}"


class ParamStates:
    """The per-param states of one optimizer: layouts, creation, the layout check, live
    records and reducers (module docstring).

    Args:
      transform_of: ``group -> (transformation, key, numeric kwargs)``: the group's
        transformation (its ``init`` gives the layouts) and a hashable key of its static
        arguments (two groups with equal keys keep the same states for the same params).
      owner: the optimizer's class name, for error messages.
      whole_steps: whether a sharded param is stepped whole on one process (SOAP: its states
        gathered to an owner, :mod:`bridge.soap_states`) rather than shard by shard: its states
        then keep the unsharded layout (no tensor-parallel block size, no rank-1 reducer) and are
        placed as :func:`bridge.soap_states.placements` says.
    """

    def __init__(self, transform_of: Callable[[dict], tuple], owner: str, whole_steps: bool = False):
        self.transform_of = transform_of
        self.owner = owner
        self.whole_steps = whole_steps
        self._layouts: dict = {}  # (tx key, global shape, dtype, local shape) -> {name: (kind, meta)}
        self._bindings: dict = {}  # (tx key, ((shape, dtype) per param), positions) -> Binding
        self._reducers: dict = {}  # param -> its rank-1 reduce (None: unsharded)
        self._live: dict = {}  # param -> {state name: (its QState, the core record over it)}
        self._scalars: dict = {}  # layout key -> the rule scalars the state keeps
        self._shapes: dict = {}  # layout key -> {name: whole shape} of each state

    # -- layouts ------------------------------------------------------------------
    def layout(self, p: torch.Tensor, group: dict) -> dict:
        """The states ``group`` keeps for ``p`` as it is now (its global shape and dtype):
        ``{name: (record kind, meta)}``, ``(None, dtype)`` for a plain tensor; the core's
        ``tx.init`` of this one param, with tensor parallel's whole blocks on every shard."""
        tx, key, _ = self.transform_of(group)
        cache_key = (key, tuple(p.shape), p.dtype, tuple(to_local(p).shape))
        layout = self._layouts.get(cache_key)
        if layout is None:
            meta = torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")
            layout = {}
            b = binding(tx.init([meta]))
            self._scalars[cache_key] = b.scalar_names
            self._shapes[cache_key] = {name: tuple(leaf.shape) for name, leaf in b.state_leaves(0).items()}
            for name, leaf in b.state_leaves(0).items():
                kind = records.kind_of(leaf)
                if kind is None:
                    layout[name] = (None, leaf.dtype)
                    continue
                meta = kind.meta_of(leaf)
                if "block_size" in meta and not self.whole_steps:  # tensor parallel: whole blocks on every shard
                    meta["block_size"] = shard_block_size(p, meta["block_size"], lt.get_format(meta["format"]).bits)
                layout[name] = (kind, meta)
            self._layouts[cache_key] = layout
        return layout

    def shapes(self, p: torch.Tensor, group: dict) -> dict:
        """``{name: whole shape}`` of the states ``group`` keeps for ``p`` (the param's shape, or a
        per-dimension factor's: SOAP's ``(n, n)`` bases), found with its :meth:`layout`."""
        tx, key, _ = self.transform_of(group)
        self.layout(p, group)
        return self._shapes[(key, tuple(p.shape), p.dtype, tuple(to_local(p).shape))]

    def scalar_names(self, p: torch.Tensor, group: dict) -> tuple:
        """The rule scalars ``group`` keeps for ``p`` beside ``step`` (NAdam's ``mu_product``),
        found with its :meth:`layout`."""
        tx, key, _ = self.transform_of(group)
        self.layout(p, group)
        return self._scalars[(key, tuple(p.shape), p.dtype, tuple(to_local(p).shape))]

    def binding(self, group: dict, params: list, present: tuple) -> Binding:
        """The state-tree binding of ``group`` for the params at positions ``present``
        (``tx.init`` on meta tensors of their *global* shapes: formats, block sizes and the
        quantize-or-not decision come from there)."""
        tx, key, _ = self.transform_of(group)
        cache_key = (key, tuple((tuple(p.shape), p.dtype) for p in params), present)
        b = self._bindings.get(cache_key)
        if b is None:
            on = set(present)
            metas = [torch.empty(tuple(p.shape), dtype=p.dtype, device="meta") if i in on else None
                     for i, p in enumerate(params)]
            b = self._bindings[cache_key] = binding(tx.init(metas))
        return b

    def kept_states(self, group: dict) -> set:
        """The names of the states ``group``'s params keep: its ``tx.init`` of meta tensors of
        their shapes (no memory; the binding the group's step uses). A state the rule keeps only
        with a setting (``max_exp_avg_sq``: ``amsgrad``) is not among them without it."""
        params = group["params"]
        return {s.name for s in self.binding(group, params, tuple(range(len(params)))).slots if s.kind == "state"}

    # -- states -------------------------------------------------------------------
    def create(self, p: torch.Tensor, group: dict) -> dict:
        """A new state for ``p``: torch.optim's names, zeros in the formats the core chose,
        every state a tensor (records as :class:`QState`), DTensor-wrapped like ``p``."""
        local = to_local(p)
        st: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float32, device="cpu")}  # as torch.optim: a CPU count
        for name in self.scalar_names(p, group):  # as torch.optim.NAdam's mu_product: a CPU float32 scalar
            st[name] = torch.full((), SCALAR_STATES[name], dtype=torch.float32, device="cpu")
        if self.whole_steps:
            st.update(self._whole_stepped(p, group))
            return st
        for name, (kind, meta) in self.layout(p, group).items():
            if kind is None:
                st[name] = wrap_like(torch.zeros(local.shape, dtype=meta, device=local.device), p)
                continue
            if "reduce" in kind.wiring:
                self.reducer(p)  # made now: raises at creation for a shard it cannot complete
            record = kind.zeros(tuple(local.shape), dict(meta), local.device)
            st[name] = wrap_like(QState(record, mesh_axes(p)), p)
        return st

    def _whole_stepped(self, p: torch.Tensor, group: dict) -> dict:
        """The new states of a param stepped whole (``whole_steps``): zeros of the whole states'
        shapes; a DTensor param's cut to this rank's blocks (:func:`bridge.soap_states.create`)."""
        from . import soap_states

        shapes, local = self.shapes(p, group), to_local(p)
        device = "meta" if is_dtensor(p) else local.device
        whole = {}
        for name, (kind, meta) in self.layout(p, group).items():
            if kind is None:
                whole[name] = torch.zeros(shapes[name], dtype=meta, device=device)
            else:
                whole[name] = QState(kind.zeros(shapes[name], dict(meta), device))
        return soap_states.create(p, whole) if is_dtensor(p) else whole

    def check(self, p: torch.Tensor, group: dict, st: dict) -> None:
        """Refuses a state that is not what ``group`` keeps for ``p`` now: the param's dtype
        (``param_correction`` keeps a correction only for bfloat16 / float16 params) or a
        storage option of the group changed after the state was created."""
        want = self.layout(p, group)
        have = {k: stored_layout(v) for k, v in st.items() if k not in SCALARS}
        if have == want:
            return
        if set(have) != set(want):
            problem = f"holds {sorted(have)} where the group now keeps {sorted(want)}"
        else:
            name = next(n for n in want if have[n] != want[n])
            problem = (f"stores {name!r} as {_layout_label(have[name])} where the group now keeps "
                       f"{_layout_label(want[name])}")
        raise ValueError(
            f"{self.owner}: the state of a param of shape {tuple(p.shape)} ({p.dtype}) {problem}: the "
            "param's dtype or the group's storage options (state_format, block_size, min_quant_size, "
            "rank1_normalization, amsgrad, param_correction, ...) changed after its state was created, and "
            "states keep the layout they were made with; cast the model before building the optimizer and set "
            "these options at construction (or load a state dict saved with them)")

    # -- live records ---------------------------------------------------------------
    def live(self, p: torch.Tensor, st: dict) -> dict:
        """A param's states as the core sees them: records sharing the live storage, wired to
        their param's shards (a rank-1 record's ``reduce``)."""
        out = {}
        made = self._live.setdefault(p, {})
        for name, v in st.items():
            if name in SCALARS:
                continue
            v = to_local(v)
            if isinstance(v, QState):
                hit = made.get(name)
                if hit is None or hit[0] is not v:  # a new state object (created, loaded, moved)
                    hit = made[name] = (v, self.record(p, v))
                v = hit[1]
            out[name] = v
        return out

    def record(self, p: torch.Tensor, q: QState):
        """The core record of state ``q`` of param ``p`` (sharing its storage), with the wiring
        its kind takes (:attr:`lowbit_tree.records.RecordKind.wiring`)."""
        kind = q.kind
        if not kind.wiring or self.whole_steps:  # (a param stepped whole needs no shard's wiring)
            return q.record
        meta = q.meta
        meta["reduce"] = self.reducer(p)
        return kind.make(q.parts, tuple(q.shape), meta)

    def reducer(self, p: torch.Tensor):
        """Param ``p``'s rank-1 ``reduce`` (maxima across its shards; ``None`` unsharded), made
        once per param."""
        if p not in self._reducers:
            self._reducers[p] = rank1_reduce(p, to_local(p))
        return self._reducers[p]

    def reducers(self) -> list:
        """The reducers made so far (``None`` for an unsharded param), e.g. to sum what they sent."""
        return list(self._reducers.values())
