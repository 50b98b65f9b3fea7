"""The types every transformation shares (optax's ``base``).

A transformation is a pair of pure functions: ``init(params) -> state`` and
``update(updates, state, params=None, **extra) -> (updates, state)``. Neither
modifies its inputs; states are NamedTuples of tensors (and quantized
records), so they checkpoint with ``torch.save`` and trace with torch.compile.

Its third, optional member is the explicit in-place form: ``plan(state, params, *,
write=False, leaf_offset=0) -> step``, built once for one state and one set of params;
``step(updates)`` then runs ``update`` in place every time it is called (see
:class:`GradientTransformation`). A transformation without one gets it from
:func:`in_place`, which copies the pure ``update``'s new state back.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Optional, Protocol, Union

import optree
import torch

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "Schedule",
    "ScalarOrSchedule",
    "identity",
    "init_count",
    "scalar_value",
    "copy_into",
    "STEP",
    "SEED",
    "HYPERPARAMS",
    "state_roles",
    "state_names",
    "Step",
    "in_place",
    "plan_of",
    "plan_from_update",
    "renamed_argument",
]

Params = Any  # a pytree of tensors (None for "no parameter / no gradient")
Updates = Any
State = Any
Schedule = Callable[[torch.Tensor], torch.Tensor]
"""``count -> value``: a 0-d integer tensor in, a 0-d float32 tensor out (torch ops only)."""
ScalarOrSchedule = Union[float, torch.Tensor, Schedule]


class InitFn(Protocol):
    def __call__(self, params: Params) -> State: ...


class UpdateFn(Protocol):
    def __call__(self, updates: Updates, state: State, params: Params | None = None, **extra: Any) -> tuple[Updates, State]: ...


Step = Callable[[list], list]
"""A planned in-place step: this step's updates (gradients) as the leaves of the params tree
(``None`` for a leaf without one) -> the updates still to add to the params (``None`` where
the step wrote the param itself, or had no update)."""


class PlanFn(Protocol):
    def __call__(self, state: State, params: Params, *, write: bool = False, leaf_offset: int = 0) -> Step: ...


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(updates, state, params=None, **extra) -> (updates, state)``;
    optionally ``plan(state, params, *, write=False, leaf_offset=0) -> step``.

    ``update`` accepts (and ignores) keyword arguments it does not know, so a
    caller can pass extra context (``loss=...``) to a whole chain.

    ``plan`` is the in-place form, for a caller that gives up the old state (a
    ``torch.optim`` optimizer): built once for ``state`` and ``params``, the returned
    step advances ``state``'s own tensors each time it is called, with the same bits
    as ``update`` (the new state's values land in the old state's tensors). With ``write``
    it may also write params in place (``p + u`` rounded once into ``p``'s dtype, what
    :func:`~lowbit_tree.apply_updates` computes) and return ``None`` for them.
    ``leaf_offset`` is the position of the first leaf among a larger set of params (the
    stochastic-rounding key of a leaf is its position). ``None``: use :func:`in_place`.
    """

    init: InitFn
    update: UpdateFn
    plan: Optional[Callable] = None  # a PlanFn


def copy_into(old: State, new: State) -> None:
    """Write every tensor of ``new`` into the tensor at the same place in ``old`` (records part by
    part: a pytree node of its parts; ``None`` where ``old`` has ``None``)."""
    old_leaves, treespec = optree.tree_flatten(old, none_is_leaf=True)
    new_leaves = treespec.flatten_up_to(new)
    for o, n in zip(old_leaves, new_leaves):
        if isinstance(o, torch.Tensor):
            if o.dtype != n.dtype or o.shape != n.shape:
                raise TypeError(f"in_place: a new state tensor of {n.dtype} {tuple(n.shape)} does not fit the old one "
                                f"of {o.dtype} {tuple(o.shape)}")
            o.copy_(n)
        elif o is not n and o != n:
            raise TypeError(f"in_place: a state leaf that is not a tensor changed ({o!r} -> {n!r}); it cannot be "
                            "updated in place")


def plan_from_update(update: UpdateFn) -> PlanFn:
    """The plan that runs the pure ``update`` and copies its new state into the old one."""

    def plan(state, params, *, write: bool = False, leaf_offset: int = 0) -> Step:
        treespec = optree.tree_structure(params, none_is_leaf=True)

        def step(updates: list) -> list:
            out, new = update(treespec.unflatten(list(updates)), state, params)
            copy_into(state, new)
            return treespec.flatten_up_to(out)

        return step

    return plan


def in_place(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` with an in-place form that runs ``tx.update`` and copies the new state's tensors
    into the old state's (for a transformation written without ``plan``; its state must keep
    its structure, shapes and dtypes from step to step)."""
    return GradientTransformation(tx.init, tx.update, plan_from_update(tx.update))


def plan_of(tx: GradientTransformation, what: str = "this transformation") -> PlanFn:
    """``tx.plan``, or a TypeError naming ``what`` and the fix."""
    if getattr(tx, "plan", None) is None:
        raise TypeError(
            f"{what} has no in-place form (GradientTransformation.plan), which an in-place step needs; wrap it "
            "with lowbit_tree.in_place(tx) (runs its update and copies the new state into the old tensors) or give "
            "it a plan"
        )
    return tx.plan


STEP, SEED, HYPERPARAMS = "step", "seed", "hyperparams"
"""The roles of a state's scalar fields (values of a state class's ``roles``): the steps taken
(a count), a random seed, and the injected hyperparameters ``{name: 0-d tensor}``."""


def state_roles(state_type: type) -> dict:
    """``{field: role}`` that a state class declares in its ``roles`` attribute. A role is
    :data:`STEP`, :data:`SEED`, :data:`HYPERPARAMS`, or, for a field holding one leaf per
    param, the state's torch.optim name (``"exp_avg"``): the name a ``torch.optim`` wrapper
    keeps it under in ``optimizer.state[p]`` and in state dicts. A field holding, per param, a
    tuple of one leaf per dimension of the param (SOAP's bases) has a role with ``{dim}``
    (``"eigenbasis_{dim}"``): each leaf's name is the role with its dimension filled in."""
    return getattr(state_type, "roles", {})


def state_names(*state_types: type) -> tuple[str, ...]:
    """The torch.optim names that state classes declare for their per-param fields (every role
    but ``STEP``, ``SEED`` and ``HYPERPARAMS``), in declaration order, each once:
    ``state_names(ScaleByAdamState) == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")``."""
    names: list[str] = []
    for state_type in state_types:
        for role in state_roles(state_type).values():
            if role not in (STEP, SEED, HYPERPARAMS) and role not in names:
                names.append(role)
    return tuple(names)


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def identity() -> GradientTransformation:
    """Leaves updates unchanged."""

    def init(params):
        return EmptyState()

    def update(updates, state, params=None, **extra):
        return updates, state

    def plan(state, params, *, write=False, leaf_offset=0):
        return list

    update.lowbit_link = ("identity", {})  # chain passes over it when fusing links into a rule
    return GradientTransformation(init, update, plan)


def init_count(params: Params) -> torch.Tensor:
    """A 0-d int32 step counter on the device of the first parameter."""
    from .tree_utils import tree_device

    return torch.zeros((), dtype=torch.int32, device=tree_device(params))


def scalar_value(value: ScalarOrSchedule, count: torch.Tensor) -> float | torch.Tensor:
    """A hyperparameter's value at ``count``: schedules are called, numbers pass through."""
    return value(count) if callable(value) else value


torch.serialization.add_safe_globals([EmptyState])


def renamed_argument(old: str, old_value, new: str, new_value, default):
    """The value of an argument renamed from ``old`` to ``new`` (the old spelling still taken, for
    one release, with a ``FutureWarning``): ``old_value`` where the caller gave it (``None``: not
    given), else ``new_value``. Both given, with ``new_value`` not its ``default`` and not
    ``old_value``, is a ``TypeError``."""
    if old_value is None:
        return new_value
    warnings.warn(f"{old}= is renamed {new}=; the old name goes in the next release", FutureWarning, stacklevel=3)
    if new_value != default and new_value != old_value:
        raise TypeError(f"give {new}= only ({old}= is its old name), not both")
    return old_value

