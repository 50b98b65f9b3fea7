"""Wrappers around a transformation: ``masked`` and ``inject_hyperparams``."""
from __future__ import annotations

import inspect
import numbers
import operator
from typing import Any, Callable, Iterable, NamedTuple

import optree
import torch

from .rules import STATIC_ARGS
from .base import HYPERPARAMS, STEP, GradientTransformation, init_count, plan_of
from .kernels.pure_rows import rows_from
from .tree_utils import broadcast_mask, map_leaves

__all__ = ["masked", "MaskedState", "inject_hyperparams", "InjectHyperparamsState"]


class MaskedState(NamedTuple):
    inner_state: Any


def masked(inner: GradientTransformation, mask: Any | Callable[[Any], Any]) -> GradientTransformation:
    """Apply ``inner`` only to the leaves where ``mask`` is True; others pass through.

    Args:
      inner: the transformation to restrict.
      mask: a tree of Python bools shaped like params (or a prefix of it), or a
        function ``params -> mask`` (called with ``params`` in ``init`` and with
        ``params`` -- or ``updates`` when no params are given -- in ``update``).
        ``inner`` sees masked-out leaves as ``None``: no state is created for them.
    """

    def select(tree, m):
        return map_leaves(lambda x, keep: x if keep else None, tree, m)

    def init(params):
        return MaskedState(inner.init(select(params, broadcast_mask(mask, params))))

    def update(updates, state, params=None, **extra):
        m = broadcast_mask(mask, params if params is not None else updates)
        inner_updates, inner_state = inner.update(
            select(updates, m), state.inner_state, None if params is None else select(params, m), **extra
        )
        new = map_leaves(lambda u, keep, iu: iu if keep else u, updates, m, inner_updates)
        return new, MaskedState(inner_state)

    def plan(state, params, *, write=False, leaf_offset=0):
        m = broadcast_mask(mask, params)
        keep = optree.tree_leaves(m, none_is_leaf=True)
        inner_step = plan_of(inner, "masked's inner transformation")(state.inner_state, select(params, m), write=write,
                                                                     leaf_offset=leaf_offset)

        def step(updates: list) -> list:
            sub = inner_step([u if k else None for u, k in zip(updates, keep)])
            return [s if k else u for u, s, k in zip(updates, sub, keep)]

        return step

    return GradientTransformation(init, update, plan)


class InjectHyperparamsState(NamedTuple):
    count: torch.Tensor  # int32, 0-d
    hyperparams: dict  # {name: 0-d float32 tensor}; replace entries to change them
    inner_state: Any

    roles = {"count": STEP, "hyperparams": HYPERPARAMS}


def inject_hyperparams(
    factory: Callable[..., GradientTransformation],
    static_args: Iterable[str] = (),
    hyperparam_dtype: torch.dtype = torch.float32,
) -> Callable[..., GradientTransformation]:
    """Make a factory's numeric arguments part of the state, so they can change between steps.

    ``inject_hyperparams(adamw)(learning_rate=1e-3, weight_decay=0.1)`` returns a
    transformation whose state is :class:`InjectHyperparamsState`. Every numeric
    argument given (float, int, 0-d tensor) becomes a 0-d ``hyperparam_dtype``
    tensor in ``state.hyperparams`` on the params' device; a callable argument
    is a schedule, evaluated at ``state.count`` each step and its value stored
    there. Write a new 0-d tensor into ``state.hyperparams[name]`` (e.g. the
    learning rate) to change it: a compiled ``update`` sees a new input value,
    not a new program, so nothing recompiles. Each call's step reads the state's
    own tensors: the factory is called with them (as optax does), except in a loop
    that passes the tensors of the first state again (the transformation built for
    them is kept), and no call writes what another reads, so one transformation
    may serve several callers at once (threads, each with its own state). The job
    rows of its rules, which depend on the tree's structure only, are kept across
    the factory's calls (``kernels.pure_rows.rows_from``). Arguments named in
    ``static_args`` or :data:`~lowbit_tree.rules.STATIC_ARGS`, and non-numeric ones
    (str, bool, None, trees), are passed through unchanged. Arguments left at
    their defaults are not injected (as in optax).
    """
    static_names = STATIC_ARGS | frozenset(static_args)
    signature = inspect.signature(factory)

    def wrapped(*args, **kwargs) -> GradientTransformation:
        given = signature.bind(*args, **kwargs).arguments
        static, numeric, schedules = {}, {}, {}
        for name, value in given.items():
            if name in static_names or isinstance(value, bool):
                static[name] = value
            elif isinstance(value, (numbers.Real, torch.Tensor)):
                numeric[name] = value
            elif callable(value):
                schedules[name] = value
            else:
                static[name] = value
        names = list(numeric) + list(schedules)
        rows: list = []  # the rules' job rows, kept across the builds below (kernels.pure_rows.rows_from)
        first: list = []  # set once: (the first state's hyperparameter tensors, the transformation over them)

        def as_tensor(value, device):
            return torch.as_tensor(value, dtype=hyperparam_dtype, device=device).reshape(())

        def build(hyperparams: dict) -> GradientTransformation:
            """The factory's transformation over one call's hyperparameter tensors: it reads those
            tensors, the state's own, and holds no other call's values."""
            if torch.compiler.is_compiling():  # traced: a caller's compiled step runs no job rows
                return factory(**static, **{k: hyperparams[k] for k in names})
            with rows_from(rows):
                return factory(**static, **{k: hyperparams[k] for k in names})

        def built_for(hyperparams: dict) -> GradientTransformation:
            """``build(hyperparams)``, or the one built for the first state (the first ``init`` or
            ``update``) when ``hyperparams`` holds the very tensors it was built over (a loop that
            keeps its state's tensors, as ``update`` does: the factory is not called again).
            Written once, then only read, so a call never changes what another reads. Schedules
            give new tensors each step: built."""
            if schedules or torch.compiler.is_compiling():
                return build(hyperparams)
            tensors = [hyperparams[k] for k in names]
            if first:
                seen, tx = first[0]
                if all(map(operator.is_, tensors, seen)):
                    return tx
                return build(hyperparams)
            tx = build(hyperparams)
            first.append((tensors, tx))  # (two first calls at once may both append: each is right)
            return tx

        def inner() -> GradientTransformation:
            """The factory's transformation, for a reader of what the transformation is made of
            (``init.lowbit_inner``): the first state's, else one over the values given
            (schedules at step 0)."""
            if first:
                return first[0][1]
            zero = torch.zeros((), dtype=torch.int32)
            values = {**numeric, **{k: as_tensor(s(zero), "cpu") for k, s in schedules.items()}}
            return build({k: as_tensor(v, "cpu") for k, v in values.items()})

        def init(params):
            count = init_count(params)
            hyperparams = {k: as_tensor(v, count.device) for k, v in numeric.items()}
            hyperparams.update({k: as_tensor(s(count), count.device) for k, s in schedules.items()})
            return InjectHyperparamsState(count, hyperparams, built_for(hyperparams).init(params))

        def current(state) -> dict:
            device = state.count.device
            hyperparams = {
                k: v if isinstance(v, torch.Tensor) and v.dtype == hyperparam_dtype else as_tensor(v, device)
                for k, v in state.hyperparams.items()
            }
            hyperparams.update({k: s(state.count).to(hyperparam_dtype) for k, s in schedules.items()})
            return hyperparams

        def update(updates, state, params=None, **extra):
            hyperparams = current(state)
            updates, inner_state = built_for(hyperparams).update(updates, state.inner_state, params, **extra)
            return updates, InjectHyperparamsState(state.count + 1, hyperparams, inner_state)

        def plan(state, params, *, write=False, leaf_offset=0):
            # built over the state's own hyperparameter tensors: a step reads them where they are
            tx = build(state.hyperparams)
            inner_step = plan_of(tx, f"{getattr(factory, '__name__', 'the factory')}'s transformation")(
                state.inner_state, params, write=write, leaf_offset=leaf_offset)

            def step(updates: list) -> list:
                for k, s in schedules.items():
                    state.hyperparams[k].copy_(s(state.count))
                out = inner_step(updates)
                state.count.add_(1)
                return out

            return step

        init.lowbit_inner = inner
        return GradientTransformation(init, update, plan)

    return wrapped


torch.serialization.add_safe_globals([MaskedState, InjectHyperparamsState])
