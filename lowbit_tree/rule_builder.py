"""The rule builder: one function, :func:`declared_rule`, turns a rule's declaration
(:data:`lowbit_tree.rules.RULE_DEFS`) into a :class:`~lowbit_tree.GradientTransformation`: its
states made in their formats, its pure ``update`` (:func:`run_rule`, one kernel call over the
tree), its in-place step (:class:`RulePlan`), the fused forms :func:`~lowbit_tree.chain`
calls with the links around it (:class:`Fusion`), and a :class:`RuleStage` around the kernel
where the rule's update is more than its kernel (Muon). The catalogue of building blocks that
call it is :mod:`lowbit_tree.transform`."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch

from . import kernels, moments, rules
from .base import STEP, GradientTransformation, init_count
from .kernels.pure_rows import PureRows, rule_rows
from .moments import StateFormat
from .tree_utils import flatten, map_leaves

__all__ = ["rule_state", "state_type", "Fusion", "fused_spec", "hyper_vector", "run_rule", "RulePlan",
           "rule_transformation", "RuleStage", "staged_rule", "declared_rule"]

_STATE_TYPES: dict = {}
"""rule -> its core state class: those the catalogue names (:func:`rule_state`), then those
:func:`state_type` made from a declaration alone."""


def _fields(declared: rules.RuleDef) -> tuple:
    """A rule's state fields in order: ``count`` where it counts, its scalars, its states."""
    return ((("count",) if declared.counted else ()) + tuple(f for f, _ in declared.scalars)
            + tuple(s.field for s in declared.states))


def rule_state(name: str):
    """Class decorator: the core state class of the declared rule ``name`` (a NamedTuple whose
    fields are the declaration's, :func:`_fields`); sets its ``roles`` from the declaration and
    makes it the class :func:`state_type` gives for ``name``."""
    declared = rules.rule(name)

    def register(cls):
        if tuple(cls._fields) != _fields(declared):
            raise TypeError(f"{cls.__name__}'s fields {cls._fields} are not the {name} rule's {_fields(declared)}")
        cls.roles = declared.roles(STEP if declared.counted else None)
        _STATE_TYPES[name] = cls
        return cls

    return register


def state_type(name: str) -> type:
    """The core state class of the declared rule ``name``: the catalogue's (:func:`rule_state`), or
    for a rule declared without one a NamedTuple made from its declaration (same fields and roles),
    so that a new rule's declaration is all the bridge's classes need of its state."""
    if name not in _STATE_TYPES:
        declared = rules.rule(name)
        cls = NamedTuple(f"Scale{name.title().replace('_', '')}State", [(f, Any) for f in _fields(declared)])
        rule_state(name)(cls)
    return _STATE_TYPES[name]


class Fusion(NamedTuple):
    """The links around a rule that :func:`~lowbit_tree.chain` runs inside the
    rule's kernel (``None``: no such link): ``maximize`` (a :func:`flip_sign`
    before), ``l2`` (an :func:`add_decayed_weights` before: L2 decay of the
    gradient), ``decay`` (one after: decoupled decay), ``lr`` (the learning-rate
    factor's negative, from :func:`scale_by_learning_rate`), ``sr_key`` (a final
    :func:`~lowbit_tree.stochastic_rounding` when params are written in place),
    ``correction`` (a final :func:`~lowbit_tree.param_correction` when params are written
    in place: its tree of int8 corrections, read and written by the kernel).

    In a rule's ``update`` these are this step's values. In its plan, ``lr`` and
    ``sr_key`` are functions of no argument, called once a step: each returns that
    step's value and advances its link's state in place."""

    maximize: bool = False
    l2: Any = None
    decay: Any = None
    lr: Any = None
    sr_key: Any = None
    correction: Any = None


def fused_spec(spec: kernels.StepSpec, fusion: Fusion) -> kernels.StepSpec:
    return dataclasses.replace(spec, maximize=fusion.maximize, l2=fusion.l2 is not None,
                               decay=fusion.decay is not None, lr=fusion.lr is not None)


def hyper_vector(spec, rule_hyper: dict, count, fusion: Fusion, lr, device) -> torch.Tensor:
    """This step's hyperparameter vector (:func:`~lowbit_tree.kernels.step_hyperparams`), from
    its arguments only (built every call: about 12 us on the host, nothing remembered)."""
    values = dict(rule_hyper, count=count, lr=0.0 if lr is None else lr,
                  weight_decay=0.0 if fusion.decay is None else fusion.decay,
                  l2=0.0 if fusion.l2 is None else fusion.l2)
    return kernels.step_hyperparams(spec, **values, device=device)


def run_rule(spec: kernels.StepSpec, rule_hyper: dict, updates, state_trees: tuple, params, count, fusion: Fusion,
              *, inplace: bool = False, leaf_offset: int = 0, rows: PureRows | None = None):
    """One rule's pure step on a tree (``inplace``: the states' tensors are overwritten, for
    a plan that could not hold the leaves fixed): every leaf with a gradient goes to the
    kernels in one call, with the ``fusion``'s links; ``rows``: the caller's job rows, reused
    while the tree keeps its structure (:class:`~lowbit_tree.kernels.pure_rows.PureRows`).
    Returns ``(updates, new state trees)``."""
    spec = fused_spec(spec, fusion)
    g_leaves, treespec = flatten(updates)
    per_state = [treespec.flatten_up_to(t) for t in state_trees]
    p_leaves = treespec.flatten_up_to(params) if params is not None else [None] * len(g_leaves)
    if spec.needs_param and params is None:
        raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
    leaves, where = [], []
    for i, g in enumerate(g_leaves):
        if g is None:
            continue
        leaves.append(kernels.StepLeaf(p_leaves[i], g, tuple(s[i] for s in per_state), leaf_offset + i))
        where.append(i)
    if not leaves:
        return updates, state_trees
    hyper = hyper_vector(spec, rule_hyper, count, fusion, fusion.lr, leaves[0].grad.device)
    done = rows.run(spec, hyper, leaves) if rows is not None and not inplace else None
    outs, news = done if done is not None else kernels.run_step(spec, hyper, leaves, inplace=inplace)
    new_updates = list(g_leaves)
    new_states = [list(s) for s in per_state]
    for k, i in enumerate(where):
        new_updates[i] = outs[k]
        for j in range(len(state_trees)):
            new_states[j][i] = news[k][j]
    return treespec.unflatten(new_updates), tuple(treespec.unflatten(s) for s in new_states)


class RulePlan:
    """A rule's in-place step over fixed leaves (the rule's plan): the kernel plan of its
    leaves (:class:`~lowbit_tree.kernels.plan.KernelPlan`), built once; a call computes this
    step's hyperparameter vector and runs it. Params are written in place when ``write`` and
    a learning rate is fused."""

    def __init__(self, spec, rule_hyper, state_trees: tuple, count, params, fusion: Fusion, write: bool,
                 leaf_offset: int, scalars: tuple | None = None):
        from .kernels.plan import KernelPlan

        if params is None:
            raise ValueError("a rule's plan needs the params tree (plan(state, params))")
        self.spec = spec = fused_spec(spec, fusion)
        self.rule_hyper, self.count, self.fusion, self.scalars = rule_hyper, count, fusion, scalars
        p_leaves, treespec = flatten(params)
        per_state = [treespec.flatten_up_to(t) for t in state_trees]
        self.where = [i for i, p in enumerate(p_leaves) if all(s[i] is not None for s in per_state)]
        self.write = bool(write and spec.lr)
        corrections = None
        if fusion.correction is not None and self.write:
            c_leaves = treespec.flatten_up_to(fusion.correction)
            corrections = [c_leaves[i] for i in self.where]
        self.kernel = KernelPlan(spec, [p_leaves[i] for i in self.where],
                                 [tuple(s[i] for s in per_state) for i in self.where],
                                 [leaf_offset + i for i in self.where], write=self.write, corrections=corrections)

    def __call__(self, updates: list) -> list:
        fusion, count = self.fusion, self.count
        lr = fusion.lr() if fusion.lr is not None else None
        sr_key = fusion.sr_key() if (fusion.sr_key is not None and self.write) else None
        grads = [updates[i] for i in self.where]
        out = list(updates)
        device = next((g.device for g in grads if g is not None), None)
        if self.scalars is not None:  # advanced with the count (their new values written in place)
            rule_hyper, new = self.rule_hyper(0 if count is None else count, self.scalars)
            for s, v in zip(self.scalars, new):
                s.copy_(v)
        else:
            rule_hyper = self.rule_hyper(count) if callable(self.rule_hyper) else self.rule_hyper
        if device is not None:
            hyper = hyper_vector(self.spec, rule_hyper, 0 if count is None else count, fusion, lr, device)
            for i, u in zip(self.where, self.kernel.run(grads, hyper, sr_key)):
                out[i] = u
        if count is not None:
            count.add_(1)
        return out


def rule_transformation(spec: kernels.StepSpec, trees_of, rebuild, rule_hyper, count_of, init,
               scalars_of=None) -> GradientTransformation:
    """A rule as a transformation: its pure ``update``, its ``plan``, and the fused forms
    :func:`~lowbit_tree.chain` calls with the links around it (``trees_of(state)``: the
    rule's state trees in its order; ``rebuild(state, new trees)``: the next state;
    ``rule_hyper(count)`` or a dict: this step's rule hyperparameters; ``count_of(state)``:
    its step count tensor, or ``None``). A rule with scalar states (:attr:`RuleDef.scalars
    <lowbit_tree.rules.RuleDef.scalars>`) gives ``scalars_of(state)``, their tensors; its
    ``rule_hyper(count, scalars)`` returns this step's hyperparameters and the scalars' next
    values, and its ``rebuild(state, new trees, new scalars)``."""

    pure_rows = rule_rows()  # the pure step's job rows, built once per structure of the tree

    def hyper_at(count):
        return rule_hyper(count) if callable(rule_hyper) else rule_hyper

    def fused_update(updates, state, params, fusion: Fusion):
        count = count_of(state)
        count = 0 if count is None else count
        if scalars_of is None:
            hyper, extra = hyper_at(count), None
        else:
            hyper, extra = rule_hyper(count, scalars_of(state))
        updates, new = run_rule(spec, hyper, updates, trees_of(state), params, count, fusion, rows=pure_rows)
        return updates, (rebuild(state, new) if scalars_of is None else rebuild(state, new, extra))

    def update(updates, state, params=None, **extra):
        return fused_update(updates, state, params, Fusion())

    def fused_plan(state, params, fusion: Fusion, *, write: bool = False, leaf_offset: int = 0):
        return RulePlan(spec, rule_hyper, trees_of(state), count_of(state), params, fusion, write, leaf_offset,
                         None if scalars_of is None else scalars_of(state))

    def plan(state, params, *, write=False, leaf_offset=0):
        return fused_plan(state, params, Fusion(), write=write, leaf_offset=leaf_offset)

    update.lowbit_link = ("rule", {"fused_update": fused_update, "fused_plan": fused_plan, "pure_rows": pure_rows})
    return GradientTransformation(init, update, plan)


def _count(state):
    return state.count


def _no_count(state):
    return None


class RuleStage(NamedTuple):
    """What a rule's transformation does around its kernel step when that is not all of it
    (Muon: Newton-Schulz after the kernel, low-rank buffers around it): ``leaf(param, record)``
    is a state leaf from the builder's record of it (``moments.init_moment``'s); ``before(updates,
    trees) -> (the kernel's updates, its state trees, context)``; ``after(updates, kernel updates,
    new trees, context, params, count, inplace, leaf_offset) -> (updates, new trees)``. The
    builder makes the state, runs the kernel between the two and advances the count; a staged
    rule is not fused into a chain's kernel (its update is not elementwise)."""

    leaf: Callable
    before: Callable
    after: Callable


def staged_rule(name: str, state_type: type, variants: dict, rule_hyper: dict, stage: RuleStage, *,
                state_format: StateFormat, block_size: int | None, min_quant_size: int) -> GradientTransformation:
    """The builder's rule ``name`` with a :class:`RuleStage` around its kernel step (the arguments
    as ``declared_rule``'s; the rule's vector does not depend on the count)."""
    return declared_rule(name, state_type, variants, rule_hyper, state_format=state_format, block_size=block_size,
                          min_quant_size=min_quant_size, stage=stage)


def staged_transformation(spec: kernels.StepSpec, stage: RuleStage, hyper: dict, trees_of, rebuild, count_of,
                 init) -> GradientTransformation:
    """A rule with a stage as a transformation: ``stage.before``, the kernel step (``run_rule``),
    ``stage.after``; its plan runs the same in place and advances the count."""

    def step(updates, state, params, inplace: bool, offset: int):
        grads, trees, context = stage.before(updates, trees_of(state))
        out, new = run_rule(spec, hyper, grads, trees, None, 0, Fusion(), inplace=inplace, leaf_offset=offset)
        return stage.after(updates, out, new, context, params, count_of(state), inplace, offset)

    def update(updates, state, params=None, **extra):
        out, new = step(updates, state, params, False, 0)
        return out, rebuild(state, new)

    def plan(state, params, *, write=False, leaf_offset=0):
        treespec = flatten(params)[1]
        count = count_of(state)

        def run(updates: list) -> list:
            out, _ = step(treespec.unflatten(list(updates)), state, params, True, leaf_offset)
            if count is not None:
                count.add_(1)
            return treespec.flatten_up_to(out)

        return run

    return GradientTransformation(init, update, plan)


def declared_rule(name: str, state_type: type, variants: dict, rule_hyper, *, state_format: StateFormat,
                   block_size: int | None, min_quant_size: int, advance=None, rank1_normalization: bool | None = False,
                   format_args: dict | None = None, stage: RuleStage | None = None) -> GradientTransformation:
    """A rule whose states are all its declaration says (:data:`lowbit_tree.rules.RULE_DEFS`): each
    kept state made by ``moments.init_moment`` in its format and signedness, the others ``None``;
    ``state_type`` has a ``count`` (unless the rule keeps none: :class:`TraceState`, as
    torch.optim.SGD), one field per declared scalar (a 0-d float32 tensor, its initial value)
    and one per declared state.

    ``rule_hyper``: the rule's hyperparameters by argument name, a dict or a function of the
    count returning one (AdEMAMix's warm-ups). A rule with scalars gives ``advance(count,
    scalars)``: this step's vector entries beyond ``rule_hyper`` and the scalars' next values.
    ``rank1_normalization``: as :func:`scale_by_adam` (``False``: no rank-1 records, the rule
    does not offer them); ``format_args``: ``moments.state_formats``' arguments beside
    ``state_format`` (``slow_state_format``); ``stage``: a :class:`RuleStage` around the kernel
    step (:func:`staged_rule`). The transformation's ``init`` carries the declaration as
    ``lowbit_rule``: the builder's mark."""
    declared = rules.rule(name)
    formats = moments.state_formats(state_format, declared.state_names, **(format_args or {}))
    kept = declared.kept(**variants)
    counted = "count" in state_type.__annotations__  # a NamedTuple's fields
    if declared.scalars and not counted:
        raise TypeError(f"{state_type.__name__} needs a count: the {name} rule's scalars advance with it")
    second = next((s.name for s in declared.states if not s.signed), None)
    if rank1_normalization is not False:  # True needs a 4-bit second moment
        moments.resolve_rank1(rank1_normalization, formats[second])

    def moment(s):
        rank1 = rank1_normalization is not False and moments.default_rank1(formats[s.name])
        def make(p):
            record = moments.init_moment(p, formats[s.name], signed=s.signed, block_size=block_size,
                                         min_quant_size=min_quant_size, rank1=rank1)
            return record if stage is None else stage.leaf(p, record)

        return make

    def init(params):
        trees = {s.field: map_leaves(moment(s), params) if s in kept else None for s in declared.states}
        if not counted:
            return state_type(**trees)
        count = init_count(params)
        scalars = {f: torch.full((), v, dtype=torch.float32, device=count.device) for f, v in declared.scalars}
        return state_type(count=count, **scalars, **trees)

    init.lowbit_rule = declared

    def trees_of(state):
        return tuple(getattr(state, s.field) for s in kept)

    def rebuild(state, new, scalars=()):
        step = {"count": state.count + 1} if counted else {}
        # Built field by field, not with state._replace: torch 2.11's dynamo hands back a
        # zero-length namedtuple from a _replace whose result leaves a torch.compile'd region
        # (tests/test_wrappers.py::test_changing_lr_does_not_recompile; torch 2.13 and 2.14 do not).
        fields = state._asdict()
        fields.update(step, **{s.field: t for s, t in zip(kept, new)},
                      **{f: v for (f, _), v in zip(declared.scalars, scalars)})
        return type(state)(**fields)

    spec = kernels.StepSpec(name, **variants)
    count_of = _count if counted else _no_count
    if callable(rule_hyper):
        def hyper(count):
            return declared.hyper(**rule_hyper(count))
    else:
        hyper = declared.hyper(**rule_hyper)
    if stage is not None:
        if callable(hyper) or declared.scalars or declared.bias_correction or declared.rectified:
            raise TypeError(f"the {name} rule's vector depends on the count: a staged rule's may not")
        return staged_transformation(spec, stage, hyper, trees_of, rebuild, count_of, init)
    if not declared.scalars:
        return rule_transformation(spec, trees_of, rebuild, hyper, count_of, init)

    def hyper_and_scalars(count, scalars):
        extra, new = advance(count, scalars)
        return dict(hyper(count) if callable(hyper) else hyper, **extra), new

    return rule_transformation(spec, trees_of, rebuild, hyper_and_scalars, count_of, init,
                      scalars_of=lambda state: tuple(getattr(state, f) for f, _ in declared.scalars))
