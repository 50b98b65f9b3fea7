"""Composing transformations: ``chain``, ``named_chain``, ``partition``."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from .base import GradientTransformation
from .tree_utils import broadcast_mask, map_leaves

__all__ = ["chain", "named_chain", "partition", "PartitionState"]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; the state is the tuple of their states."""

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None, **extra):
        if len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transformations got a state of length {len(state)}")
        new_states = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params, **extra)
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init, update)


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with the state a dict ``{name: state}`` (readable paths)."""
    names = [n for n, _ in transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain names must be unique, got {names}")

    def init(params):
        return {n: t.init(params) for n, t in transforms}

    def update(updates, state, params=None, **extra):
        new_state = {}
        for n, t in transforms:
            updates, new_state[n] = t.update(updates, state[n], params, **extra)
        return updates, new_state

    return GradientTransformation(init, update)


class PartitionState(NamedTuple):
    inner_states: dict  # {label: state of txs[label] over its leaves (others None)}


def _select(tree: Any, labels: Any, label: str) -> Any:
    return map_leaves(lambda x, lab: x if lab == label else None, tree, labels)


def partition(transforms: dict[str, GradientTransformation], labels: Any | Callable[[Any], Any]) -> GradientTransformation:
    """Route each leaf to the transformation named by its label.

    Args:
      transforms: ``{label: transformation}``.
      labels: a tree of ``str`` shaped like params (or a prefix of it), or a
        function ``params -> labels``. E.g. fp32 state for embeddings and
        8-bit for the rest::

          partition({"fp32": adam(lr, state_format="fp32"), "8bit": adam(lr)},
                    {"embed": "fp32", "blocks": "8bit"})

    Each inner transformation sees the full tree with the other labels' leaves
    set to ``None`` (no parameter, no state).
    """

    def full_labels(tree):
        lab = broadcast_mask(labels, tree)
        unknown = set(optree.tree_leaves(lab, none_is_leaf=True)) - set(transforms) - {None}
        if unknown:
            raise ValueError(f"labels {sorted(map(str, unknown))} have no transformation in {sorted(transforms)}")
        return lab

    def init(params):
        lab = full_labels(params)
        return PartitionState({k: t.init(_select(params, lab, k)) for k, t in transforms.items()})

    def update(updates, state, params=None, **extra):
        lab = full_labels(params if params is not None else updates)
        new_updates = updates
        new_states = {}
        for k, t in transforms.items():
            sub_params = None if params is None else _select(params, lab, k)
            sub_updates, new_states[k] = t.update(_select(updates, lab, k), state.inner_states[k], sub_params, **extra)
            new_updates = map_leaves(lambda u, lb, su: su if lb == k else u, new_updates, lab, sub_updates)
        return new_updates, PartitionState(new_states)

    return GradientTransformation(init, update)


torch.serialization.add_safe_globals([PartitionState])
