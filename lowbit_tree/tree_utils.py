"""Small pytree helpers shared by the transformations.

Parameters, gradients and updates are pytrees whose leaves are tensors or
``None`` (a parameter without a gradient). Every helper flattens the *primary*
tree with ``None`` as a leaf, and reads the other trees only up to that
structure, so a state subtree (a :class:`~lowbit_tree.QTensor`, a tuple of
moments) arrives whole at the per-leaf function. All helpers are plain Python
over optree, which torch.compile traces without graph breaks.
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

__all__ = ["flatten", "map_leaves", "tree_device", "path_string", "broadcast_mask"]


def flatten(tree: Any) -> tuple[list, optree.PyTreeSpec]:
    """Leaves (tensors or ``None``) and the structure of a parameter-like tree."""
    return optree.tree_flatten(tree, none_is_leaf=True)


def map_leaves(fn: Callable, tree: Any, *rests: Any) -> Any:
    """``fn(leaf, *rest_subtrees)`` for each leaf of ``tree`` (``None`` included)."""
    leaves, treespec = flatten(tree)
    rest_leaves = [treespec.flatten_up_to(r) for r in rests]
    return treespec.unflatten([fn(*args) for args in zip(leaves, *rest_leaves)])


def tree_device(tree: Any) -> torch.device:
    """The device of the first tensor leaf (CPU for a tree without tensors)."""
    for leaf in optree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def broadcast_mask(mask: Any, tree: Any) -> Any:
    """Expand a mask/label tree that is a prefix of ``tree`` to one entry per leaf."""
    if callable(mask):
        mask = mask(tree)
    return optree.tree_broadcast_prefix(mask, tree, none_is_leaf=True)


def path_string(accessor: optree.PyTreeAccessor) -> str:
    """``"mu/0/codes"``: field names for NamedTuples and records, keys, indices."""
    parts = []
    for entry in accessor:
        name = getattr(entry, "field", None)
        parts.append(str(name if name is not None else entry.entry))
    return "/".join(parts)
