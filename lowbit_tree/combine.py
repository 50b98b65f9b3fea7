"""Composing transformations: ``chain``, ``named_chain``, ``partition``."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from .base import GradientTransformation
from .tree_utils import broadcast_mask, map_leaves

__all__ = ["chain", "named_chain", "partition", "PartitionState"]


def _kind(t: GradientTransformation) -> tuple[str | None, dict]:
    return getattr(t.update, "lowbit_link", (None, {}))


class _Plan(NamedTuple):
    """Which links of a chain run inside its first rule's kernel: links
    ``[start, end)``, the rule at ``rule``; ``flip``, ``l2``, ``decay``, ``lr``,
    ``sr``: the index of each fused link, or None."""

    start: int
    rule: int
    end: int
    flip: int | None
    l2: int | None
    decay: int | None
    lr: int | None
    sr: int | None


def _fusion_plan(transforms) -> _Plan | None:
    """The elementwise links next to the first update rule, in the orders the
    kernel computes them: ``[flip_sign] [add_decayed_weights]`` before it (maximize,
    L2 decay), ``[add_decayed_weights] [scale_by_learning_rate] [stochastic_rounding]``
    after it (decoupled decay, learning rate, bf16 rounding of a param written in
    place). ``identity`` links in between are passed over."""
    kinds = [_kind(t)[0] for t in transforms]
    rules = [i for i, k in enumerate(kinds) if k == "rule"]
    if not rules:
        return None
    r = rules[0]
    found = {}

    def back(j, kind):
        while j >= 0 and kinds[j] == "identity":
            j -= 1
        if j >= 0 and kinds[j] == kind:
            found["l2" if kind == "decay" else kind] = j
            return j - 1
        return j

    j = back(back(r - 1, "decay"), "flip")
    start = j + 1
    while start < r and kinds[start] == "identity":
        start += 1

    def ahead(k, kind):
        m = k
        while m < len(kinds) and kinds[m] == "identity":
            m += 1
        if m < len(kinds) and kinds[m] == kind:
            found[kind] = m
            return m + 1
        return k

    end = ahead(ahead(ahead(r + 1, "decay"), "lr"), "sr")
    if "sr" in found and found["sr"] != len(kinds) - 1:  # fused only as the chain's last link
        end = found.pop("sr")
    return _Plan(start, r, end, found.get("flip"), found.get("l2"), found.get("decay"), found.get("lr"), found.get("sr"))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; the state is the tuple of their states.

    The first update rule (:func:`~lowbit_tree.scale_by_adam`, ``scale_by_lion``,
    ``trace``) runs together with the elementwise links next to it in one kernel
    call (``_fusion_plan``): the same float operations as running them
    one after the other, without their passes over memory. The links' states
    advance as if they had run.
    """
    plan = _fusion_plan(transforms)

    def update(updates, state, params=None, **extra):
        if len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transformations got a state of length {len(state)}")
        write = extra.pop("_write_params", False)
        new_states = list(state)
        last = len(transforms) - 1
        i = 0
        while i <= last:
            if plan is not None and i == plan.start:
                updates, i = _run_fused(plan, transforms, updates, state, new_states, params, write and plan.end > last,
                                        extra)
                continue
            t = transforms[i]
            link_extra = dict(extra, _write_params=True) if write and i == last else extra
            updates, new_states[i] = t.update(updates, state[i], params, **link_extra)
            i += 1
        return updates, tuple(new_states)

    return GradientTransformation(_init_chain(transforms), update)


def _init_chain(transforms):
    """``chain``'s init: the links' states, in order."""

    def init(params):
        return tuple(t.init(params) for t in transforms)

    return init


def _run_fused(plan: _Plan, transforms, updates, state, new_states, params, may_write: bool, extra: dict):
    """Run links ``[plan.start, plan.end)`` as one kernel call; returns ``(updates, plan.end)``."""
    from .transform import Fusion

    def info(i):
        return _kind(transforms[i])[1]

    lr = None
    if plan.lr is not None:
        lr, new_states[plan.lr] = info(plan.lr)["fused"](state[plan.lr])
    write = may_write and lr is not None and params is not None
    sr_key = None
    if plan.sr is not None and write:
        sr_key, new_states[plan.sr] = info(plan.sr)["fused"](state[plan.sr])
    fusion = Fusion(
        maximize=plan.flip is not None,
        l2=None if plan.l2 is None else info(plan.l2)["weight_decay"],
        decay=None if plan.decay is None else info(plan.decay)["weight_decay"],
        lr=lr,
        sr_key=sr_key,
        leaf_offset=extra.get("_leaf_offset", 0),
    )
    rule_extra = dict(extra, _fusion=fusion, _write_params=write)
    updates, new_states[plan.rule] = transforms[plan.rule].update(updates, state[plan.rule], params, **rule_extra)
    if plan.sr is not None and not write:  # not fused after all: the link runs on its own
        updates, new_states[plan.sr] = transforms[plan.sr].update(updates, state[plan.sr], params, **extra)
    return updates, plan.end


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
