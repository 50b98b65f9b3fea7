"""Applying updates to parameters, with optional stochastic rounding.

Stochastic rounding to bfloat16 keeps updates smaller than bf16's resolution
alive on average: ``x`` (float32) rounds up with probability equal to its
distance from the lower neighbour. The random bits come from a counter-based
hash of ``(seed, counter, leaf index, element index)`` computed with int64 torch
ops, so they are a pure function of a key kept in the optimizer state: a run
resumed from a checkpoint draws the same bits as an uninterrupted one.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .base import SEED, STEP, GradientTransformation, plan_of
from .rounding import stochastic_round
from . import kernels
from .kernels import native
from .tree_utils import flatten

__all__ = [
    "apply_updates",
    "step_",
    "apply_rest_",
    "stochastic_round",
    "stochastic_rounding",
    "StochasticRoundingState",
    "rounding_key",
]

_stochastic_round = stochastic_round  # apply_updates has an argument of the same name


def _compute_dtype(p: torch.Tensor) -> torch.dtype:
    d = p.dtype
    return d if d is torch.float32 or d is torch.float64 else torch.promote_types(d, torch.float32)


def _native_apply(p: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether the C kernel adds this update (CPU float32 / bfloat16 param, float32 update, both
    contiguous, of one shape, the native backend in use): the same bits as ``torch.add``."""
    return (p.device.type == "cpu" and u.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16)
            and u.dtype is torch.float32 and p.shape == u.shape and p.is_contiguous() and u.is_contiguous()
            and not (p.requires_grad or u.requires_grad) and not torch.compiler.is_compiling() and p.numel() >= _NATIVE_APPLY_MIN
            and kernels.backend_for(p.device) == "native")


_NATIVE_APPLY_MIN = 1 << 16  # smaller: torch.add's own loop, no ctypes call


def apply_updates(params: Any, updates: Any, *, stochastic_round: bool = False, key: torch.Tensor | None = None) -> Any:
    """``params + updates`` as new tensors, each in its param's dtype (pure).

    Sums are float32 (float64 for float64 params). ``None`` params, and params
    whose update is ``None``, pass through unchanged.

    Args:
      stochastic_round: round bfloat16 results stochastically (other dtypes
        round to nearest).
      key: int64 tensor with one or more words (e.g. ``rounding_key(state)``),
        required with ``stochastic_round``; the same key gives the same result.
    """
    if stochastic_round and key is None:
        raise ValueError("stochastic_round=True needs key= (an int64 tensor, e.g. rounding_key(state))")
    leaves, treespec = flatten(params)
    ups = treespec.flatten_up_to(updates)
    out = []
    for i, (p, u) in enumerate(zip(leaves, ups)):
        if p is None or u is None:
            out.append(p)
            continue
        if stochastic_round:
            x = p.to(_compute_dtype(p)) + u.to(_compute_dtype(p))
            out.append(_stochastic_round(x, p.dtype, key, i))
        else:  # computed in the promoted dtype, rounded once into the param's dtype
            new = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            if _native_apply(p, u):
                native.apply(p, u, new)
            else:
                dtype = _compute_dtype(p)
                torch.add(p, u if u.dtype is dtype else u.to(dtype), out=new)
            out.append(new)
    return treespec.unflatten(out)


def step_(tx: GradientTransformation, grads: Any, state: Any, params: Any, *, leaf_offset: int = 0) -> Any:
    """``updates, state = tx.update(grads, state, params)`` then ``params = apply_updates(params,
    updates)``, **in place**, for a caller that gives up the old state and param values
    (as a ``torch.optim`` optimizer does): ``tx.plan(state, params, write=True)`` run once.

    The rules' kernels overwrite the state's tensors instead of allocating new ones,
    and when a chain's rule is fused up to its last link (learning rate, optional
    stochastic rounding), they write each param in place too. The result is the same,
    bit for bit, as the pure path. Returns ``state``, whose tensors now hold the new
    state. A caller stepping the same state and params again and again builds the plan
    once and calls it (as :class:`bridge.LowBitOptimizer` does).
    """
    step = plan_of(tx)(state, params, write=True, leaf_offset=leaf_offset)
    leaves, treespec = flatten(params)
    apply_rest_(leaves, step(treespec.flatten_up_to(grads)))
    return state


def apply_rest_(params: list, updates: list) -> None:
    """Add to each param, in place, the update a planned step left for it (``None``: none)."""
    for p, u in zip(params, updates):
        if p is not None and u is not None:
            p.copy_(p.to(_compute_dtype(p)) + u.to(_compute_dtype(p)))


class StochasticRoundingState(NamedTuple):
    seed: torch.Tensor  # int64, 0-d
    count: torch.Tensor  # int64, 0-d: steps taken

    roles = {"seed": SEED, "count": STEP}


def rounding_key(state: StochasticRoundingState) -> torch.Tensor:
    """The ``(seed, count)`` key this step's rounding uses."""
    return torch.stack([state.seed, state.count])


def stochastic_rounding(seed: int = 0) -> GradientTransformation:
    """Last link of a chain: make ``apply_updates(params, updates)`` land on a
    stochastically rounded bfloat16 value.

    For each bf16 param, the target ``t = stochastic_round(p + u)`` is drawn with
    the key ``(seed, count)`` from this transformation's state, and the update
    becomes ``t - p``. Between bf16 numbers within a factor 2 of each other that
    difference is exact in bf16 (Sterbenz), so the plain round-to-nearest sum in
    :func:`apply_updates` reproduces ``t`` exactly; a larger step (a sign change,
    a jump past 2x) is rounded once more, still deterministically. Other
    dtypes pass through.
    """

    def init(params):
        from .tree_utils import tree_device

        device = tree_device(params)
        return StochasticRoundingState(
            torch.tensor(seed, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)
        )

    def targets(leaves: list, ups: list, key: torch.Tensor, offset: int) -> list:
        out = []
        for i, (p, u) in enumerate(zip(leaves, ups)):
            if p is None or u is None or p.dtype != torch.bfloat16:
                out.append(u)
                continue
            target = stochastic_round(p.float() + u.float(), torch.bfloat16, key, offset + i)
            out.append(target.float() - p.float())
        return out

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("stochastic_rounding needs params: call update(updates, state, params)")
        leaves, treespec = flatten(params)
        out = targets(leaves, treespec.flatten_up_to(updates), rounding_key(state), 0)
        return treespec.unflatten(out), StochasticRoundingState(state.seed, state.count + 1)

    def plan(state, params, *, write=False, leaf_offset=0):
        leaves = flatten(params)[0]

        def step(updates: list) -> list:
            out = targets(leaves, updates, rounding_key(state), leaf_offset)
            state.count.add_(1)
            return out

        return step

    def in_plan(state):  # in a chain's plan: each step's key, advancing the count in place
        def value():
            key = rounding_key(state)
            state.count.add_(1)
            return key

        return value

    update.lowbit_link = ("sr", {"in_plan": in_plan})
    return GradientTransformation(init, update, plan)


torch.serialization.add_safe_globals([StochasticRoundingState])
