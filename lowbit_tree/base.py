"""The types every transformation shares (optax's ``base``).

A transformation is a pair of pure functions: ``init(params) -> state`` and
``update(updates, state, params=None, **extra) -> (updates, state)``. Neither
modifies its inputs; states are NamedTuples of tensors (and quantized
records), so they checkpoint with ``torch.save`` and trace with torch.compile.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol, Union

import torch

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "Schedule",
    "ScalarOrSchedule",
    "identity",
    "init_count",
    "scalar_value",
    "STEP",
    "SEED",
    "HYPERPARAMS",
    "state_roles",
    "state_names",
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


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(updates, state, params=None, **extra) -> (updates, state)``.

    ``update`` accepts (and ignores) keyword arguments it does not know, so a
    caller can pass extra context (``loss=...``) to a whole chain.
    """

    init: InitFn
    update: UpdateFn


STEP, SEED, HYPERPARAMS = "step", "seed", "hyperparams"
"""The roles of a state's scalar fields (values of a state class's ``roles``): the steps taken
(a count), a random seed, and the injected hyperparameters ``{name: 0-d tensor}``."""


def state_roles(state_type: type) -> dict:
    """``{field: role}`` that a state class declares in its ``roles`` attribute. A role is
    :data:`STEP`, :data:`SEED`, :data:`HYPERPARAMS`, or, for a field holding one leaf per
    param, the state's torch.optim name (``"exp_avg"``): the name a ``torch.optim`` wrapper
    keeps it under in ``optimizer.state[p]`` and in state dicts."""
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

    update.lowbit_link = ("identity", {})  # chain passes over it when fusing links into a rule
    return GradientTransformation(init, update)


def init_count(params: Params) -> torch.Tensor:
    """A 0-d int32 step counter on the device of the first parameter."""
    from .tree_utils import tree_device

    return torch.zeros((), dtype=torch.int32, device=tree_device(params))


def scalar_value(value: ScalarOrSchedule, count: torch.Tensor) -> float | torch.Tensor:
    """A hyperparameter's value at ``count``: schedules are called, numbers pass through."""
    return value(count) if callable(value) else value


torch.serialization.add_safe_globals([EmptyState])
