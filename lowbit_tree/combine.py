"""Composing transformations: ``chain``, ``named_chain``, ``partition``."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from .base import GradientTransformation, plan_of
from .tree_utils import broadcast_mask, map_leaves

__all__ = ["chain", "named_chain", "partition", "PartitionState"]


def _link_tag(t: GradientTransformation) -> tuple[str | None, dict]:
    """``(tag, info)``: which fusable link ``t`` is (``"rule"``, ``"lr"``, ``"sr"``, ...), or None."""
    return getattr(t.update, "lowbit_link", (None, {}))


class _FusedSegment(NamedTuple):
    """Which links of a chain run inside its first rule's kernel: links
    ``[start, end)``, the rule at ``rule``; ``flip``, ``l2``, ``decay``, ``lr``,
    ``sr``: the index of each fused link, or None (``sr``: the link that rounds a param
    written in place, :func:`~lowbit_tree.stochastic_rounding` or
    :func:`~lowbit_tree.param_correction`)."""

    start: int
    rule: int
    end: int
    flip: int | None
    l2: int | None
    decay: int | None
    lr: int | None
    sr: int | None


def _fused_segment(transforms) -> _FusedSegment | None:
    """The elementwise links next to the first update rule, in the orders the
    kernel computes them: ``[flip_sign] [add_decayed_weights]`` before it (maximize,
    L2 decay), ``[add_decayed_weights] [scale_by_learning_rate] [stochastic_rounding |
    param_correction]`` after it (decoupled decay, learning rate, the rounding of a param
    written in place). ``identity`` links in between are passed over."""
    tags = [_link_tag(t)[0] for t in transforms]
    rules = [i for i, k in enumerate(tags) if k == "rule"]
    if not rules:
        return None
    r = rules[0]
    found = {}

    def back(j, tag):
        while j >= 0 and tags[j] == "identity":
            j -= 1
        if j >= 0 and tags[j] == tag:
            found["l2" if tag == "decay" else tag] = j
            return j - 1
        return j

    j = back(back(r - 1, "decay"), "flip")
    start = j + 1
    while start < r and tags[start] == "identity":
        start += 1

    def ahead(k, tag, *others):
        m = k
        while m < len(tags) and tags[m] == "identity":
            m += 1
        if m < len(tags) and tags[m] in (tag, *others):
            found[tag] = m
            return m + 1
        return k

    end = ahead(ahead(ahead(r + 1, "decay"), "lr"), "sr", "corr")
    if "sr" in found and found["sr"] != len(tags) - 1:  # fused only as the chain's last link
        end = found.pop("sr")
    return _FusedSegment(start, r, end, found.get("flip"), found.get("l2"), found.get("decay"), found.get("lr"),
                         found.get("sr"))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; the state is the tuple of their states.

    The first update rule (:func:`~lowbit_tree.scale_by_adam`, ``scale_by_lion``,
    ``trace``) runs together with the elementwise links next to it in one kernel
    call (``_fused_segment``): the same float operations as running them
    one after the other, without their passes over memory. The links' states
    advance as if they had run. In the in-place form (``plan``), a chain whose rule
    is fused up to its last link (learning rate, optional stochastic rounding) writes
    the params in the same kernel.
    """
    segment = _fused_segment(transforms)
    last = len(transforms) - 1

    def check(state):
        if len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transformations got a state of length {len(state)}")

    def update(updates, state, params=None, **extra):
        check(state)
        new_states = list(state)
        i = 0
        while i <= last:
            if segment is not None and i == segment.start:
                updates = _run_fused(segment, transforms, updates, state, new_states, params, extra)
                i = segment.end
                continue
            updates, new_states[i] = transforms[i].update(updates, state[i], params, **extra)
            i += 1
        return updates, tuple(new_states)

    def plan(state, params, *, write=False, leaf_offset=0):
        check(state)
        steps = []
        i = 0
        while i <= last:
            if segment is not None and i == segment.start:
                may_write = write and segment.end > last
                steps.extend(_plan_fused(segment, transforms, state, params, may_write, leaf_offset))
                i = segment.end
                continue
            what = f"link {i} of the chain"
            steps.append(plan_of(transforms[i], what)(state[i], params, write=write and i == last,
                                                      leaf_offset=leaf_offset))
            i += 1

        def step(updates: list) -> list:
            for s in steps:
                updates = s(updates)
            return updates

        return step

    return GradientTransformation(_init_chain(transforms), update, plan)


def _init_chain(transforms):
    """``chain``'s init: the links' states, in order."""

    def init(params):
        return tuple(t.init(params) for t in transforms)

    return init


def _info(transforms, i) -> dict:
    return _link_tag(transforms[i])[1]


def _run_fused(segment: _FusedSegment, transforms, updates, state, new_states, params, extra: dict):
    """Run links ``[segment.start, segment.end)`` as one kernel call (the pure form; a stochastic
    rounding link, fused only when params are written in place, runs on its own)."""
    from .rule_builder import Fusion

    lr = None
    if segment.lr is not None:
        lr, new_states[segment.lr] = _info(transforms, segment.lr)["in_update"](state[segment.lr])
    fusion = Fusion(
        maximize=segment.flip is not None,
        l2=None if segment.l2 is None else _info(transforms, segment.l2)["weight_decay"],
        decay=None if segment.decay is None else _info(transforms, segment.decay)["weight_decay"],
        lr=lr,
    )
    fused_update = _info(transforms, segment.rule)["fused_update"]
    updates, new_states[segment.rule] = fused_update(updates, state[segment.rule], params, fusion)
    if segment.sr is not None:
        updates, new_states[segment.sr] = transforms[segment.sr].update(updates, state[segment.sr], params, **extra)
    return updates


def _plan_fused(segment: _FusedSegment, transforms, state, params, may_write: bool, leaf_offset: int) -> list:
    """The steps of links ``[segment.start, segment.end)`` in place: the rule's plan with the links
    fused, then (if params are not written in the kernel) the stochastic-rounding link's own."""
    from .rule_builder import Fusion

    lr = None if segment.lr is None else _info(transforms, segment.lr)["in_plan"](state[segment.lr])
    write = may_write and lr is not None
    sr = correction = None
    if segment.sr is not None and write:
        given = _info(transforms, segment.sr)["in_plan"](state[segment.sr])
        if _link_tag(transforms[segment.sr])[0] == "corr":
            correction = given
        else:
            sr = given
    fusion = Fusion(
        maximize=segment.flip is not None,
        l2=None if segment.l2 is None else _info(transforms, segment.l2)["weight_decay"],
        decay=None if segment.decay is None else _info(transforms, segment.decay)["weight_decay"],
        lr=lr,
        sr_key=sr,
        correction=correction,
    )
    fused_plan = _info(transforms, segment.rule)["fused_plan"]
    steps = [fused_plan(state[segment.rule], params, fusion, write=write, leaf_offset=leaf_offset)]
    if segment.sr is not None and not write:
        steps.append(plan_of(transforms[segment.sr], "the rounding link")(
            state[segment.sr], params, write=False, leaf_offset=leaf_offset))
    return steps


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

    def plan(state, params, *, write=False, leaf_offset=0):
        steps = [plan_of(t, f"named_chain link {n!r}")(state[n], params, write=write and k == len(transforms) - 1,
                                                        leaf_offset=leaf_offset)
                 for k, (n, t) in enumerate(transforms)]

        def step(updates: list) -> list:
            for s in steps:
                updates = s(updates)
            return updates

        return step

    return GradientTransformation(init, update, plan)


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

    def plan(state, params, *, write=False, leaf_offset=0):
        lab = optree.tree_leaves(full_labels(params), none_is_leaf=True)
        steps = [(k, plan_of(t, f"partition {k!r}")(state.inner_states[k], _select(params, full_labels(params), k),
                                                    write=write, leaf_offset=leaf_offset))
                 for k, t in transforms.items()]

        def step(updates: list) -> list:
            out = list(updates)
            for k, s in steps:
                sub = s([u if lb == k else None for u, lb in zip(updates, lab)])
                for i, lb in enumerate(lab):
                    if lb == k:
                        out[i] = sub[i]
            return out

        return step

    return GradientTransformation(init, update, plan)


torch.serialization.add_safe_globals([PartitionState])
