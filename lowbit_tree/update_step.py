"""One optimizer step as one call: ``params, state = step(grads, state, params)``.

``tx.update`` then :func:`~lowbit_tree.apply_updates` returns new tensors for every state and
param, and adds the update in a second pass. A caller that never looks at the old state and
params again (a training loop) can say so: ``donate=True`` gives them up, as JAX's
``donate_argnums`` does, and the step writes the new values into their tensors in one pass of
the kernel (``tx.plan(state, params, write=True)``), then returns the same objects.

:class:`UpdateStep` is the object the caller holds; what it builds (the plan and the kernel's
job rows) lives on it, never in a module. The values it returns depend on its arguments only:
the held plan is reused when the call gives the state and params it returned last (the same
objects, no container in them changed), and rebuilt otherwise.
"""
from __future__ import annotations

from operator import is_
from typing import Any, NamedTuple

import optree
import torch

from .base import GradientTransformation, plan_of
from .record_base import Record
from .tree_utils import flatten
from .update import apply_rest_, apply_updates

__all__ = ["UpdateStep"]


def _containers(tree: Any, out: list) -> list:
    """``(container, snapshot)`` for every mutable container of ``tree`` (lists, dicts; other
    pytree nodes by their leaves), so that a later call can tell the tree is unchanged
    without flattening it again. Tensors, records (frozen) and scalars are leaves."""
    if tree is None or isinstance(tree, (torch.Tensor, Record, bool, int, float, str)):
        return out
    if isinstance(tree, tuple):
        for x in tree:
            _containers(x, out)
    elif isinstance(tree, list):
        out.append((tree, list(tree)))
        for x in tree:
            _containers(x, out)
    elif isinstance(tree, dict):
        out.append((tree, (list(tree.keys()), list(tree.values()))))
        for x in tree.values():
            _containers(x, out)
    else:  # another registered node: compared by its leaves every call
        out.append((tree, optree.tree_leaves(tree, none_is_leaf=True)))
    return out


def _unchanged(snapshots: list) -> bool:
    for c, snap in snapshots:
        if isinstance(c, list):
            if len(c) != len(snap) or not all(map(is_, c, snap)):
                return False
        elif isinstance(c, dict):
            keys, values = snap
            if len(c) != len(keys) or list(c.keys()) != keys or not all(map(is_, c.values(), values)):
                return False
        else:
            leaves = optree.tree_leaves(c, none_is_leaf=True)
            if len(leaves) != len(snap) or not all(map(is_, leaves, snap)):
                return False
    return True


class _Held(NamedTuple):
    """The plan of the last donated call and what it was built for."""

    state: Any
    params: Any
    snapshots: list  # _containers of state and params
    leaves: list  # the params' leaves
    treespec: Any
    run: Any  # the plan's step


class UpdateStep:
    """``params, state = step(grads, state, params, *, donate=False)``: one step of ``tx``.

    Pure (``donate=False``): ``tx.update`` then :func:`~lowbit_tree.apply_updates`; new params
    and a new state, nothing passed in modified.

    Donated (``donate=True``): the caller gives up ``state`` and ``params`` and must not read
    them again except through what is returned: the kernels write the new state and params into
    their tensors (one pass: ``p + u`` rounded once into the param, as ``apply_updates`` rounds
    it) and the same ``state`` and ``params`` objects come back. The same bits as the pure form.
    The plan (the kernel's job rows, built once) is kept here and reused while each call passes
    what the last one returned; a call with another state or params, or with a list or dict in
    them changed, builds a new one. Needs ``tx.plan`` (:func:`~lowbit_tree.in_place` gives a
    transformation one).

    An ``UpdateStep`` holds the last donated state and params (its plan writes into them): one
    per training loop; two threads donating through one step would share its plan.
    """

    def __init__(self, tx: GradientTransformation):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"UpdateStep takes a GradientTransformation (e.g. lowbit_tree.adamw(...)), got "
                            f"{type(tx).__name__}")
        self.tx = tx
        self._held: _Held | None = None

    def __call__(self, grads: Any, state: Any, params: Any, *, donate: bool = False) -> tuple[Any, Any]:
        if not donate:
            updates, new_state = self.tx.update(grads, state, params)
            return apply_updates(params, updates), new_state
        held = self._held
        if held is None or held.state is not state or held.params is not params or not _unchanged(held.snapshots):
            self._held = None  # a failed build holds nothing
            leaves, treespec = flatten(params)
            run = plan_of(self.tx, "UpdateStep(donate=True)'s transformation")(state, params, write=True)
            held = _Held(state, params, _containers(params, _containers(state, [])), leaves, treespec, run)
            self._held = held
        apply_rest_(held.leaves, held.run(held.treespec.flatten_up_to(grads)))
        return params, state

    def release(self) -> None:
        """Drops the held plan and, with it, the references to the last donated state and params."""
        self._held = None
