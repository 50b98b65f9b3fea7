"""Between ``optimizer.state[p]`` (torch.optim's names) and the core's state pytree.

A core transformation's state for a list of params is a pytree whose moment
leaves sit under field names (``mu``, ``nu``, ``nu_max``, ``trace``) and list
indices; the bridge keeps them per param under torch.optim's names (``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``) and one ``step``. A
:class:`Binding` is computed once per transformation and set of params (from
``tx.init`` of meta tensors of the *global* shapes): for every leaf of the
state tree, where its value comes from. :meth:`Binding.tree` then builds the
state tree of a step from the live states (records that share their storage),
so the core's in-place step writes straight into ``optimizer.state``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from lowbit_tree.records import is_record

__all__ = ["STATE_NAMES", "Slot", "Binding", "binding"]

STATE_NAMES = {
    "mu": "exp_avg",
    "nu": "exp_avg_sq",
    "nu_max": "max_exp_avg_sq",
    "mu_slow": "exp_avg_slow",
    "trace": "momentum_buffer",
}
"""Core state field -> torch.optim state name."""


class Slot(NamedTuple):
    """Where one leaf of the state tree comes from: ``kind`` is ``"state"`` (param
    ``index``'s state ``name``), ``"count"``, ``"hyper"`` (group option ``name``) or
    ``"seed"`` (a stochastic-rounding seed: the group's ``seed``, default 0) or
    ``"fixed"`` (the template's own value, e.g. ``None``)."""

    kind: str
    name: str
    index: int


def _names(accessor) -> list:
    out = []
    for entry in accessor:
        field = getattr(entry, "field", None)
        out.append(field if field is not None else entry.entry)
    return out


def _slot(names: list) -> Slot:
    if "hyperparams" in names:
        return Slot("hyper", str(names[-1]), -1)
    strs = [n for n in names if isinstance(n, str)]
    if strs and strs[-1] in ("count", "seed"):
        return Slot(strs[-1], strs[-1], -1)
    for k, n in enumerate(names):
        if n in STATE_NAMES and k + 1 < len(names) and isinstance(names[k + 1], int):
            return Slot("state", STATE_NAMES[n], names[k + 1])
    return Slot("fixed", "/".join(map(str, names)), -1)


class Binding(NamedTuple):
    """A state tree's structure and the :class:`Slot` of each of its leaves."""

    treespec: Any
    slots: tuple
    template: tuple  # the template's leaves (used by "fixed" slots and for kinds)

    def tree(self, live: list, count: int, hyper: dict, seed: int = 0) -> Any:
        """The state tree for a step: ``live[i]`` is param ``i``'s ``{name: leaf}``
        (records or plain tensors; ``None`` for params not in this step); counts and
        seeds become CPU tensors of the template's dtypes."""
        leaves = []
        for slot, tmpl in zip(self.slots, self.template):
            if slot.kind == "state":
                leaves.append(live[slot.index][slot.name])
            elif slot.kind in ("count", "seed"):
                leaves.append(torch.tensor(count if slot.kind == "count" else seed, dtype=tmpl.dtype, device="cpu"))
            elif slot.kind == "hyper":
                leaves.append(hyper[slot.name])
            else:
                leaves.append(tmpl)
        return self.treespec.unflatten(leaves)

    def state_leaves(self, index: int) -> dict:
        """Param ``index``'s state leaves in the template: ``{torch name: template leaf}``."""
        return {s.name: t for s, t in zip(self.slots, self.template) if s.kind == "state" and s.index == index}


def binding(template: Any) -> Binding:
    """The :class:`Binding` of a state tree (``tx.init`` of a list of meta tensors)."""
    accessors, leaves, treespec = optree.tree_flatten_with_accessor(template, is_leaf=is_record, none_is_leaf=True)
    slots = []
    for acc, leaf in zip(accessors, leaves):
        slot = _slot(_names(acc))
        if slot.kind == "state" and leaf is None:
            slot = Slot("fixed", slot.name, slot.index)  # no state for an absent param
        slots.append(slot)
    return Binding(treespec, tuple(slots), tuple(leaves))
