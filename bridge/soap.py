"""``bridge.SOAP``, ``SOAP8bit``, ``SOAP4bit``: the reference SOAP optimizer's signature over
:func:`lowbit_tree.scale_by_soap`, one process.

SOAP's factors are not shaped like their param (an ``(n, n)`` basis per dimension), so this is
not a :class:`~bridge.LowBitOptimizer` (whose states, layouts, state dicts and FSDP2 placements
follow the param's rows); it is a plain ``torch.optim.Optimizer`` that keeps each param's core
state under names in ``optimizer.state[p]``, every value a tensor:

- ``step`` (float32, 0-d, torch's), ``soap_step`` (int32: gradients seen), ``precond_failures``
  (int32: refreshes that kept an old basis);
- ``exp_avg``, ``exp_avg_sq``: shaped like the param (a :class:`~bridge.QState` when quantized);
- per rotated dimension ``d``: ``eigenbasis_d`` and ``coupling_d`` (``(n, n)``, float32 or a
  QState of a block record) and ``eigenvalues_d`` (float32 ``(n,)``).

The core's in-place plan steps these tensors themselves (a QState's record shares its storage).
``state_dict()`` holds plain tensors only (a record as a dict of its parts), so it loads with
``weights_only=True``; ``load_state_dict`` checks every name and part shape against a fresh
state before it writes anything.

A DTensor param (FSDP2, tensor parallel, both, HSDP: any ``Shard`` / ``Replicate`` placements on a
1-D mesh or a 2-D mesh over all processes) keeps every state but the 0-d scalars as a DTensor on
its mesh (:mod:`bridge.soap_states`: the moments placed like the param, the factors by rows), so
``full_tensor()`` gives the one-process state. It has an owner rank,
:func:`bridge.owner_step.owner_rank` of its index over all groups (on a 1-D mesh: that index
modulo the mesh size): the ranks gather their blocks of the param, its gradient and its states to
the owner, which alone runs the unsharded step and scatters each rank its block of the update (in
the param's dtype, to add) and of the new states -- the same bits as one process. ``state_dict()``
holds the DTensors, so DCP reshards them at any world size. ``skip_nonfinite`` decides on every
rank alike (an all-reduce).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from lowbit_tree import moments, records
from lowbit_tree.soap_transform import LEAF_FIELDS, ScaleBySoapState, SoapLeafReport, scale_by_soap, soap_report

from . import group_args, owner_step, soap_states
from .distributed import is_dtensor, local_grad, to_local
from .optimizer import all_grads_finite
from .qstate import QState

__all__ = ["SOAP", "SOAP8bit", "SOAP4bit", "SOAP4BIT_STATE_FORMAT"]

STATIC_KEYS = ("state_format", "precond_format", "max_precond_dim", "precondition_1d", "merge_dims", "block_size",
               "min_quant_size")
"""Group options that decide which states exist and how they are stored: a state dict whose groups
differ in one is refused (as the other classes refuse another ``state_format``)."""
_PER_DIM = (("basis", "eigenbasis"), ("eigenvalues", "eigenvalues"), ("coupling", "coupling"))


def _wrap(leaf):
    return QState(leaf) if records.is_record(leaf) else leaf


def _unwrap(value):
    value = to_local(value)
    return value.record if isinstance(value, QState) else value


_GATHER = "SOAP's gather of a param's and its gradient's blocks to the owner"
_GATHER_STATES = "SOAP's gather of a param's states' blocks to the owner"
_SCATTER = "SOAP's scatter of the update's blocks from the owner"
_SENT = ("gather", "scatter", "state_gather", "state_scatter")
_REMEDY = "place it on a 1-D mesh or on a mesh over all processes"


def _unsupported_sharding(p) -> str:
    """Why a param's sharding is not supported (empty if it is): ``Shard`` and ``Replicate``
    placements (FSDP2, tensor parallel, both, HSDP) on a 1-D mesh or a 2-D mesh over all
    processes."""
    if not is_dtensor(p):
        return ""
    placements = tuple(p.placements)
    mesh = p.device_mesh
    if mesh.ndim > 2 or not all(pl.is_replicate() or pl.is_shard() or type(pl).__name__ == "_StridedShard"
                                for pl in placements):
        return (f"placed {placements} on a {mesh.ndim}-D mesh: only Shard and Replicate placements on a 1-D or "
                "2-D mesh are implemented (FSDP2, tensor parallel, both, HSDP)")
    if mesh.ndim == 2 and mesh.mesh.numel() != dist.get_world_size():
        return (f"placed {placements} on a {tuple(mesh.shape)} mesh over {mesh.mesh.numel()} of "
                f"{dist.get_world_size()} processes: a 2-D mesh must span every process; {_REMEDY}")
    return ""


_CACHES = ("_txs", "_plans", "_templates", "_block_cache", "builds")


def _core(state: dict, count: torch.Tensor, template: ScaleBySoapState) -> ScaleBySoapState:
    """The one-leaf core state over ``state``'s tensors (records sharing their storage)."""
    per_dim = {}
    for field, name in _PER_DIM:
        per_dim[field] = [tuple(None if t is None else _unwrap(state[f"{name}_{d}"])
                                for d, t in enumerate(getattr(template, field)[0]))]
    return ScaleBySoapState(count, [state["soap_step"]], [_unwrap(state["exp_avg"])],
                            [_unwrap(state["exp_avg_sq"])], per_dim["basis"], per_dim["eigenvalues"],
                            per_dim["coupling"], [state["precond_failures"]])


class _ParamPlan:
    """One param's in-place core step (``tx.plan``) over its whole states, built once: the
    core's count is read from ``step`` here and kept beside it; a step then reads nothing on the
    host. ``live``: the param's ``optimizer.state`` entry, whose objects the plan holds while it is
    current. ``update`` is the last step's update (float32).

    A sharded param's owner steps whole states gathered anew at each step: :meth:`step` points
    the plan's state and param leaves at them (the core's plan reads its leaves at each call and
    keeps each leaf's count on the host, so nothing is built again)."""

    def __init__(self, tx, live: dict, state: dict, whole: torch.Tensor, template: ScaleBySoapState):
        self.tx, self.live, self.template = tx, live, template
        self.held = tuple(live.values())
        self.count = torch.tensor(int(live["step"]), dtype=torch.int32)
        self.core, self.params = _core(state, self.count, template), [whole]
        self.plan = tx.plan(self.core, self.params)
        self.version = live["step"]._version
        self.update = None

    def current(self, tx, live: dict) -> bool:
        """Whether this plan still holds: the same transformation and state objects, ``step``
        advanced by this plan only."""
        if tx is not self.tx or live is not self.live or live["step"]._version != self.version:
            return False
        return len(live) == len(self.held) and all(a is b for a, b in zip(live.values(), self.held))

    def step(self, grads: list, state: Optional[dict] = None, whole: Optional[torch.Tensor] = None) -> None:
        """One step; ``state`` and ``whole`` (a sharded param's owner): this step's whole states and
        param, which the plan's leaves are pointed at first."""
        if state is not None:
            new = _core(state, self.count, self.template)
            for field in LEAF_FIELDS:
                getattr(self.core, field)[0] = getattr(new, field)[0]
            self.params[0] = whole
        self.update = self.plan(grads)[0]
        self.live["step"] += 1
        self.version = self.live["step"]._version


class SOAP(torch.optim.Optimizer):
    """SOAP (github.com/nikhilvyas/SOAP ``soap.py`` at a1e5535: same arguments, defaults and
    param steps; ``lowbit_tree.soap_transform`` has the algorithm) with states in
    ``state_format`` (the Adam moments, as the other classes) and ``precond_format`` (the
    eigenbases and couplings: ``"fp32"``, ``"8bit"``, ``"4bit"``).

    ``merge_dims=True`` is refused (not implemented); ``data_format`` is checked and, without it,
    changes nothing (as in the reference). ``skip_nonfinite=True`` skips the whole step (params,
    states, steps) when any gradient of its groups is NaN or infinite (with DTensor params: in any
    rank's block; every rank skips). ``bjorck_steps``, ``block_size``,
    ``min_quant_size``: :func:`lowbit_tree.scale_by_soap`'s.
    """

    _default_state_format = "fp32"
    _default_precond_format = "fp32"

    def __init__(self, params, lr: float = 3e-3, betas=(0.95, 0.95), shampoo_beta: float = -1, eps: float = 1e-8,
                 weight_decay: float = 0.01, precondition_frequency: int = 10, max_precond_dim: int = 10000,
                 merge_dims: bool = False, precondition_1d: bool = False, normalize_grads: bool = False,
                 data_format: str = "channels_first", correct_bias: bool = True, *, state_format=None,
                 precond_format: Optional[str] = None, bjorck_steps: Optional[int] = None,
                 block_size: Optional[int] = None, min_quant_size: int = 4096, skip_nonfinite: bool = False):
        group_args.betas(type(self).__name__, betas)
        defaults = dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
                        precondition_frequency=precondition_frequency, max_precond_dim=max_precond_dim,
                        merge_dims=merge_dims, precondition_1d=precondition_1d, normalize_grads=normalize_grads,
                        data_format=data_format, correct_bias=correct_bias,
                        state_format=self._state_format_default() if state_format is None else state_format,
                        precond_format=self._default_precond_format if precond_format is None else precond_format,
                        bjorck_steps=bjorck_steps, block_size=block_size, min_quant_size=min_quant_size,
                        skip_nonfinite=skip_nonfinite)
        self._clear_caches()
        super().__init__(params, defaults)

    def _clear_caches(self) -> None:
        self._txs: dict = {}  # id(group) -> (group, its values but lr and params, transformation, lr tensor)
        self._plans: dict = {}  # param -> its _ParamPlan
        self._templates: dict = {}  # param -> (transformation, its meta core state)
        self._block_cache: dict = {}  # DTensor param -> (its state objects, their blocks)
        self.builds = {"transform": 0, "plan": 0}
        """How many times a group's transformation and a param's plan were built (each once, and
        again only when a group's values or a param's state objects change)."""

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k not in _CACHES}

    def __setstate__(self, state: dict) -> None:
        builds = self.__dict__.get("builds")  # torch's load_state_dict comes through here too
        super().__setstate__(state)
        self._clear_caches()
        if builds is not None:
            self.builds = builds

    def _state_format_default(self):
        return self._default_state_format

    # -- groups ------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the group's arguments checked (a ValueError naming the class and the
        argument) and its params: a DTensor is refused unless placed ``Shard`` / ``Replicate`` on a
        1-D mesh or a 2-D mesh over all processes."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        owner = type(self).__name__
        try:
            group_args.betas(owner, group["betas"])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        try:
            if group["merge_dims"] is not False:
                raise ValueError("merge_dims=True is not implemented (the reference's folding of small "
                                 "dimensions); use merge_dims=False")
            if not isinstance(group["skip_nonfinite"], bool):
                raise ValueError(f"skip_nonfinite must be True or False, got {group['skip_nonfinite']!r}")
            if not isinstance(group["lr"], (int, float)) or not group["lr"] >= 0:
                raise ValueError(f"lr must be a number >= 0, got {group['lr']!r}")
            self._tx(group, None)
        except ValueError as e:
            self.param_groups.pop()
            raise ValueError(f"{owner}: {e}") from None
        for p in group["params"]:
            why = _unsupported_sharding(p)
            if why:
                self.param_groups.pop()
                raise ValueError(f"{owner}: a DTensor param of shape {tuple(p.shape)} {why}")

    @staticmethod
    def _tx(group: dict, lr=None):
        """The group's transformation; ``lr``: its learning rate (a 0-d tensor the step sets), else
        the group's."""
        b1, b2 = group["betas"]
        sb = group["shampoo_beta"]
        return scale_by_soap(b1, b2, None if sb is None or sb < 0 else sb, group["eps"],
                             group["precondition_frequency"], group["max_precond_dim"], group["precondition_1d"],
                             group["normalize_grads"], group["data_format"], group["correct_bias"],
                             learning_rate=float(group["lr"]) if lr is None else lr, weight_decay=group["weight_decay"],
                             state_format=group["state_format"], precond_format=group["precond_format"],
                             bjorck_steps=group["bjorck_steps"], block_size=group["block_size"],
                             min_quant_size=group["min_quant_size"])

    # -- state: the core's one-leaf tree <-> optimizer.state[p] --------------------------------
    @staticmethod
    def _named(core: ScaleBySoapState) -> dict:
        """``optimizer.state[p]``'s entries from a one-leaf core state."""
        out = {"soap_step": core.steps[0], "exp_avg": _wrap(core.exp_avg[0]), "exp_avg_sq": _wrap(core.exp_avg_sq[0]),
               "precond_failures": core.failures[0]}
        for field, name in _PER_DIM:
            for d, leaf in enumerate(getattr(core, field)[0]):
                if leaf is not None:
                    out[f"{name}_{d}"] = _wrap(leaf)
        return out

    def _fresh(self, p: torch.Tensor, group: dict) -> tuple[dict, ScaleBySoapState]:
        core = self._tx(group, None).init([p.detach()])
        return self._named(core), core

    # -- the step ----------------------------------------------------------------------------
    def _transform(self, group: dict) -> tuple:
        """``(the group's transformation, its learning rate)``: built once per group and again
        only when one of the group's values other than ``lr`` changes; ``lr`` reaches it as a
        0-d float64 CPU tensor set at each step (a scheduler's new value rebuilds nothing)."""
        values = tuple((k, v) for k, v in group.items() if k not in ("params", "lr"))
        hit = self._txs.get(id(group))
        if hit is not None and hit[0] is group and hit[1] == values:
            return hit[2], hit[3]
        lr = torch.zeros((), dtype=torch.float64)
        tx = self._tx(group, lr)
        self.builds["transform"] += 1
        self._txs[id(group)] = (group, values, tx, lr)
        return tx, lr

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(g["skip_nonfinite"] for g in self.param_groups) and all_grads_finite(
                [g for g in self.param_groups if g["skip_nonfinite"]], self._params()) is False:
            return loss
        index = 0
        self._sent = dict.fromkeys(_SENT, 0)
        for group in self.param_groups:
            tx, lr = self._transform(group)
            if isinstance(group["lr"], torch.Tensor):
                lr.copy_(group["lr"].detach().reshape(()))
            else:
                lr.fill_(group["lr"])
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if is_dtensor(p):
                    self._sharded_step(tx, group, p, index - 1)
                else:
                    state = self.state[p]
                    if "soap_step" not in state:
                        state.update(self._fresh(p.detach(), group)[0])
                        state["step"] = torch.zeros((), dtype=torch.float32)
                    plan = self._param_plan(tx, group, p, state, state, p)
                    plan.step([p.grad])
                    p.add_(plan.update.to(p.dtype))
        return loss

    def _param_plan(self, tx, group: dict, p, live: dict, state: dict, whole: torch.Tensor) -> _ParamPlan:
        """Param ``p``'s step (:class:`_ParamPlan`) over its whole states ``state`` (``live``, its
        ``optimizer.state`` entry, or on a sharded param's owner the gathered whole states),
        built once and again only when the transformation, the state objects or ``step``
        (changed from outside) change; ``whole``: the whole param the plan reads."""
        plan = self._plans.get(p)
        if plan is None or not plan.current(tx, live):
            plan = self._plans[p] = _ParamPlan(tx, live, state, whole, self._meta_template(p, group))
            self.builds["plan"] += 1
        return plan

    def _meta_template(self, p, group: dict) -> ScaleBySoapState:
        """The one-leaf core state of ``p`` on the meta device (which dimensions are rotated, the
        kinds of the states): made once per param and transformation."""
        tx, _ = self._transform(group)
        hit = self._templates.get(p)
        if hit is None or hit[0] is not tx:
            hit = self._templates[p] = (tx, tx.init([torch.empty(tuple(p.shape), device="meta")]))
        return hit[1]

    def _sharded_step(self, tx, group: dict, p: torch.Tensor, index: int) -> None:
        """A DTensor param: every rank's block of the param, of its gradient and of its states
        gathered to the owner (:func:`bridge.owner_step.layout`'s ``index``-th rank), which steps
        the whole param (its plan built once, pointed at the gathered states) and scatters
        each rank its block of the update and of the new states (:mod:`bridge.soap_states`);
        each collective on :func:`~bridge.collectives.group_for`'s group for the blocks' device
        (the mesh's, or a registered host group)."""
        lay = owner_step.layout(p, index, type(self).__name__, _REMEDY)
        local = to_local(p.detach())
        state = self._sharded_state(p, group)
        box = owner_step.whole_box
        whole = owner_step.gather(lay, [(local, box), (local_grad(p), box)], _GATHER, self._sent, "gather")
        sharded = self._blocks(p, state)
        got = owner_step.gather(lay, [(t, boxes) for _, _, parts in sharded for _, t, boxes, _ in parts],
                                _GATHER_STATES, self._sent, "state_gather")
        u, out = None, [None] * len(sharded)
        if whole is not None:
            full_state, at = {name: state[name] for name in soap_states.SOAP_SCALARS}, 0
            for name, v, parts in sharded:
                full_state[name] = soap_states.assemble(v, got[at:at + len(parts)])
                at += len(parts)
            plan = self._param_plan(tx, group, p, state, full_state, whole[0])
            plan.step([whole[1]], full_state, whole[0])
            u = plan.update.to(p.dtype)
            out = [soap_states.whole_parts(full_state[name]) for name, _, _ in sharded]
        else:
            state["step"] += 1
        one = owner_step.Boxes(dict.fromkeys(lay.blocks, ((0,), (1,))), ((0,), (1,)))  # a counter, to every rank
        scalars = [state[n] for n in soap_states.SOAP_SCALARS if n != "step"]
        parts = [(u, box, p.dtype)]
        parts += [(None if w is None else w[j], boxes, t.dtype) for (_, _, ps), w in zip(sharded, out)
                  for j, (_, t, boxes, _) in enumerate(ps)]
        parts += [(s.reshape(1), one, s.dtype) for s in scalars]
        keys = ["scatter"] + ["state_scatter"] * (len(parts) - 1)
        news = owner_step.scatter(lay, parts, _SCATTER, self._sent, keys, local.device)
        local.add_(news[0])
        targets = [t for _, _, ps in sharded for _, t, _, _ in ps] + scalars
        for t, new in zip(targets, news[1:]):
            t.copy_(new.reshape(t.shape))

    def _blocks(self, p, state: dict) -> list:
        """``[(name, DTensor state, soap_states.state_parts(state))]`` of a DTensor param's sharded
        states, made once per state object."""
        held = tuple(state.values())
        hit = self._block_cache.get(p)
        if hit is None or len(hit[0]) != len(held) or any(a is not b for a, b in zip(hit[0], held)):
            sharded = [(name, v, soap_states.state_parts(v)) for name, v in state.items()
                       if name not in soap_states.SOAP_SCALARS]
            hit = self._block_cache[p] = (held, sharded)
        return hit[1]

    def _sharded_state(self, p, group: dict) -> dict:
        """``self.state[p]`` of a DTensor param, its zero states made first if it has none
        (:func:`bridge.soap_states.create`: zeros are the core's ``init``)."""
        state = self.state[p]
        if "soap_step" not in state:
            state.update(soap_states.create(p, self._whole_template(p, group)))
        return state

    def _whole_template(self, p, group: dict) -> dict:
        """The whole states of param ``p`` with ``step``, on the meta device: names, parts,
        shapes and dtypes."""
        fresh, _ = self._fresh(torch.empty(tuple(p.shape), dtype=p.dtype, device="meta"), group)
        fresh["step"] = torch.zeros((), dtype=torch.float32, device="meta")
        return fresh

    def communication(self) -> dict:
        """Bytes this rank sent in the last step for DTensor params: ``gather`` (its blocks of the
        params it does not own and of their gradients, padded to the largest rank's extents),
        ``scatter`` (the other ranks' padded blocks of the updates of the params it owns),
        ``state_gather`` and ``state_scatter`` (the same of their states, and the 0-d scalars
        scattered to every rank)."""
        return dict(getattr(self, "_sent", dict.fromkeys(_SENT, 0)))

    # -- reports -----------------------------------------------------------------------------
    def state_report(self) -> list:
        """One :class:`lowbit_tree.ReportRow` per state (``param{i}/{name}``), then a total: this
        rank's blocks of a DTensor param's states."""
        rows = []
        for i, p in enumerate(self._params()):
            for name, value in self.state.get(p, {}).items():
                row = moments.leaf_row(f"param{i}/{name}", _unwrap(value))
                if row is not None:
                    rows.append(row)
        rows.append(moments.ReportRow("total", "", (), sum(r.nbytes for r in rows)))
        return rows

    def soap_report(self) -> list[SoapLeafReport]:
        """Per param with a state: rotated dimensions, gradients seen, refreshes that failed
        (``index``: the param's position over all groups)."""
        out = []
        for i, p in enumerate(self._params()):
            state = self.state.get(p)
            if not state or "soap_step" not in state:  # none yet
                continue
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            template = self._meta_template(p, group)
            row = soap_report(_core(state, torch.zeros((), dtype=torch.int32), template))[0]
            out.append(row._replace(index=i))
        return out

    def _params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    # -- state dicts ---------------------------------------------------------------------------
    def _template(self, p, group: dict) -> dict:
        """A fresh whole state of plain param ``p`` with its ``step``: the names, parts, shapes and
        dtypes a saved state of ``p`` must have."""
        fresh, _ = self._fresh(torch.zeros(tuple(p.shape), dtype=p.dtype, device=to_local(p).device), group)
        fresh["step"] = torch.zeros((), dtype=torch.float32)
        return fresh

    def state_dict(self) -> dict:
        """torch's layout, every state a tensor: a quantized state is a dict of its parts.

        With DTensor params every param has an entry (a fresh one for a param not stepped yet:
        its zero states are made now), a DTensor param's states as DTensors (a record's parts
        each a DTensor of the whole record's part, views of the live storage;
        :mod:`bridge.soap_states`), so ``torch.distributed.checkpoint`` saves each block once and
        loads it at another world size."""
        params = self._params()
        if any(is_dtensor(p) for p in params):
            for p in params:
                if is_dtensor(p):
                    self._sharded_state(p, self._group_of(p))
        sd = super().state_dict()
        state = {}
        for k, entries in sd["state"].items():
            state[k] = {name: (soap_states.saved(value) if is_dtensor(value) else
                               dict(value.parts) if isinstance(value, QState) else value)
                        for name, value in entries.items()}
        if any(is_dtensor(p) for p in params):
            ids = [i for g in sd["param_groups"] for i in g["params"]]
            for k, p in zip(ids, params):
                if not is_dtensor(p) and "soap_step" not in state.get(k, {}):
                    state[k] = {name: (dict(v.parts) if isinstance(v, QState) else v)
                                for name, v in self._template(p, self._group_of(p)).items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def _group_of(self, p) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def load_state_dict(self, state_dict: dict) -> None:
        """Every param's saved states checked against a fresh state of this optimizer (names,
        parts, whole shapes, dtypes) before anything is written; then torch's group restore. A
        DTensor param's states take this rank's blocks of the saved ones (DTensors of any
        placement, or whole tensors)."""
        params = self._params()
        saved_groups = state_dict["param_groups"]
        ids = [i for g in saved_groups for i in g["params"]]
        if len(ids) != len(params):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state dict has {len(ids)} params, "
                             f"this optimizer {len(params)}")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state dict has {len(saved_groups)} param "
                             f"groups, this optimizer {len(self.param_groups)}")
        for n, (saved, live) in enumerate(zip(saved_groups, self.param_groups)):
            for key in STATIC_KEYS:
                if saved.get(key, self.defaults[key]) != live[key]:
                    raise ValueError(f"{type(self).__name__}.load_state_dict: param group {n} was saved with "
                                     f"{key}={saved.get(key)!r}, this optimizer's has {live[key]!r}; build the "
                                     f"optimizer with {key}={saved.get(key)!r} to load it")
        by_id = dict(zip(ids, params))
        new = {}
        for k, entries in state_dict["state"].items():
            p = by_id[k]
            group = next(g for g in saved_groups if k in g["params"])
            group = {**self.defaults, **{a: b for a, b in group.items() if a != "params"}}
            fresh = self._whole_template(p, group) if is_dtensor(p) else self._template(p, group)
            if set(entries) != set(fresh):
                raise ValueError(f"{type(self).__name__}.load_state_dict: param {k} has states {sorted(entries)}, "
                                 f"this optimizer keeps {sorted(fresh)} (another state_format, precond_format "
                                 "or max_precond_dim?)")
            for name, live in fresh.items():
                value = entries[name]
                parts = live.parts if isinstance(live, QState) else {"": live}
                given = value if isinstance(value, dict) else {"": value}
                for part, t in parts.items():
                    s = given.get(part)
                    want = torch.uint8 if t.dtype == torch.float8_e4m3fn and is_dtensor(p) else t.dtype
                    if not isinstance(s, torch.Tensor) or s.shape != t.shape or s.dtype not in (t.dtype, want):
                        what = f"{name}/{part}" if part else name
                        raise ValueError(f"{type(self).__name__}.load_state_dict: param {k}'s {what} is "
                                         f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}, "
                                         f"expected {t.dtype} {tuple(t.shape)}")
            new[p] = (fresh, entries, group)
        super().load_state_dict({"state": {}, "param_groups": saved_groups})
        for p, (fresh, entries, group) in new.items():
            if is_dtensor(p):
                fresh = soap_states.create(p, fresh)
                for name, live in fresh.items():
                    if name in soap_states.SOAP_SCALARS:
                        live.copy_(to_local(entries[name]))
                    else:
                        soap_states.load(live, entries[name])
                self.state[p] = fresh
                continue
            for name, live in fresh.items():
                value = entries[name]
                if isinstance(live, QState):
                    for part, t in live.parts.items():
                        t.copy_(value[part])
                else:
                    live.copy_(value)
            self.state[p] = fresh


SOAP4BIT_STATE_FORMAT = {"exp_avg": "nf4", "exp_avg_sq": "8bit"}
"""SOAP4bit's moments. In the eigenbasis the second moment spans more decades than in Adam's
coordinates; the rank-1 normalized 4-bit map rounds its small entries up to its smallest code:
on the GPT of docs/guide/soap.md it cost 1.7% held-out loss where an 8-bit one cost 0.4%."""


class SOAP8bit(SOAP):
    """SOAP with 8-bit moments (``"8bit"``) and 8-bit eigenbases and couplings (the signed
    dynamic map, blocks of 64, two Bjorck steps after decoding): 6.3 state bytes a param on a
    2048 x 2048 matrix (fp32 SOAP: 24)."""

    _default_state_format = "8bit"
    _default_precond_format = "8bit"


class SOAP4bit(SOAP):
    """SOAP with 4-bit eigenbases and couplings (the normal-float map, blocks of 64, three Bjorck
    steps after decoding) and ``exp_avg`` (normal-float, blocks of 32); ``exp_avg_sq`` is 8-bit
    (``SOAP4BIT_STATE_FORMAT``): 3.9 state bytes a param on a 2048 x 2048 matrix."""

    _default_precond_format = "4bit"

    def _state_format_default(self):
        return dict(SOAP4BIT_STATE_FORMAT)
