"""Between ``optimizer.state[p]`` (torch.optim's names) and the core's state pytree.

A core transformation's state for a list of params is a pytree whose moment
leaves sit under field names (``mu``, ``nu``, ``nu_max``, ``trace``) and list
indices; the bridge keeps them per param under torch.optim's names (``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``) and one ``step``: the
names and roles each state class declares (``roles``, :func:`lowbit_tree.base.state_roles`). A
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

from lowbit_tree.base import HYPERPARAMS, SEED, STEP, state_roles
from lowbit_tree.rules import SCALAR_STATES
from lowbit_tree.records import is_record

__all__ = ["Slot", "Binding", "binding"]


class Slot(NamedTuple):
    """Where one leaf of the state tree comes from: ``kind`` is ``"state"`` (param
    ``index``'s state ``name``), ``"count"``, ``"hyper"`` (group option ``name``) or
    ``"seed"`` (a stochastic-rounding seed: the group's ``seed``, default 0),
    ``"scalar"`` (a rule's scalar state ``name``, :data:`lowbit_tree.rules.SCALAR_STATES`: kept
    per param like ``step``) or ``"fixed"`` (the template's own value: ``None``, or a leaf of no param)."""

    kind: str
    name: str
    index: int


_SCALAR_SLOTS = {STEP: "count", SEED: "seed"}


def _slot(accessor, leaf) -> Slot:
    """The slot of one leaf, from the roles its state classes declare
    (:func:`lowbit_tree.base.state_roles`); a tensor no role covers is an error."""
    entries = list(accessor)
    for k, entry in enumerate(entries):
        field = getattr(entry, "field", None)
        role = state_roles(entry.type).get(field) if field is not None else None
        if role is None:
            continue
        rest = [e.entry for e in entries[k + 1:]]
        if role in _SCALAR_SLOTS:
            return Slot(_SCALAR_SLOTS[role], field, -1)
        if role in SCALAR_STATES and not rest:
            return Slot("scalar", role, -1)
        if role == HYPERPARAMS:
            return Slot("hyper", str(rest[-1]), -1)
        if rest and isinstance(rest[0], int):
            if "{dim}" in role and len(rest) > 1:  # a state per dimension of the param (SOAP's bases): the next
                return Slot("state", role.format(dim=rest[1]), rest[0])  # index (none: an absent param's None)
            return Slot("state", role, rest[0])
    if leaf is not None and (isinstance(leaf, torch.Tensor) or is_record(leaf)):
        path = "/".join(str(getattr(e, "field", None) or e.entry) for e in entries)
        owner = next((e.type.__name__ for e in reversed(entries) if getattr(e, "field", None)), "the state")
        raise TypeError(
            f"state leaf {path!r} of {owner} has no declared role: a state class kept by a torch.optim "
            "wrapper declares roles = {field: role} (lowbit_tree.base.state_roles): STEP, SEED, "
            "HYPERPARAMS, or a torch.optim state name for a leaf per param"
        )
    return Slot("fixed", "/".join(str(e.entry) for e in entries), -1)


class Binding(NamedTuple):
    """A state tree's structure and the :class:`Slot` of each of its leaves."""

    treespec: Any
    slots: tuple
    template: tuple  # the template's leaves (used by "fixed" slots and for kinds)

    def tree(self, live: list, hyper: dict) -> tuple[Any, list, list]:
        """The state tree for a step: ``live[i]`` is param ``i``'s ``{name: leaf}`` (records
        or plain tensors; ``None`` for params not in this step); ``hyper`` the group's
        injected hyperparameters ``{name: 0-d tensor}``. Returns ``(tree, counts, seeds,
        scalars)``: counts, seeds and scalars (``[(name, tensor)]``) are new CPU tensors of the
        template's dtypes, for the caller to set before each step (the plan advances counts and
        scalars in place)."""
        leaves, counts, seeds, scalars = [], [], [], []
        for slot, tmpl in zip(self.slots, self.template):
            if slot.kind == "state":
                leaves.append(live[slot.index][slot.name])
            elif slot.kind in ("count", "seed"):
                t = torch.zeros((), dtype=tmpl.dtype, device="cpu")
                (counts if slot.kind == "count" else seeds).append(t)
                leaves.append(t)
            elif slot.kind == "scalar":
                t = torch.zeros((), dtype=tmpl.dtype, device="cpu")
                scalars.append((slot.name, t))
                leaves.append(t)
            elif slot.kind == "hyper":
                leaves.append(hyper[slot.name])
            else:
                leaves.append(tmpl)
        return self.treespec.unflatten(leaves), counts, seeds, scalars

    def state_leaves(self, index: int) -> dict:
        """Param ``index``'s state leaves in the template: ``{torch name: template leaf}``."""
        return {s.name: t for s, t in zip(self.slots, self.template) if s.kind == "state" and s.index == index}

    @property
    def scalar_names(self) -> tuple:
        """The rule scalars of the tree, by torch.optim's name (``("mu_product",)``)."""
        return tuple(s.name for s in self.slots if s.kind == "scalar")


def binding(template: Any) -> Binding:
    """The :class:`Binding` of a state tree (``tx.init`` of a list of meta tensors)."""
    accessors, leaves, treespec = optree.tree_flatten_with_accessor(template, is_leaf=is_record, none_is_leaf=True)
    slots = []
    for acc, leaf in zip(accessors, leaves):
        slot = _slot(acc, leaf)
        if slot.kind == "state" and leaf is None:
            slot = Slot("fixed", slot.name, slot.index)  # no state for an absent param
        slots.append(slot)
    return Binding(treespec, tuple(slots), tuple(leaves))
