"""The pure core keeps no hidden state: ``update`` and ``apply_updates`` neither read nor write
module-level mutable state, and what they return depends on their arguments only (not on the
calls before, nor on which tensor objects hold the values)."""
from __future__ import annotations

import collections
import functools
import sys
import types

import pytest
import torch

import lowbit_tree as lt

SHAPES = [(300, 257), (64,), (5, 7), (257, 300)]  # large (once past every size threshold) and small leaves


def _fingerprint(value):
    """What a call could change in one module-level object: a container's entries (by identity),
    a cache's size, an instance's attributes; else the object's identity (a rebinding)."""
    if isinstance(value, functools._lru_cache_wrapper):
        return ("cache", value.cache_info().currsize)
    if isinstance(value, dict):
        return ("dict", tuple((id(k), id(v)) for k, v in value.items()))
    if isinstance(value, (list, collections.deque)):
        return ("seq", tuple(map(id, value)))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(map(id, value)))
    if isinstance(value, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, torch.dtype)):
        return ("id", id(value))
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        return ("obj", id(value), tuple((k, id(v)) for k, v in attrs.items()))
    return ("id", id(value))


def _module_state() -> dict:
    """Every lowbit_tree module's globals, fingerprinted."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "lowbit_tree" or name.startswith("lowbit_tree.")):
            continue
        for k, v in vars(mod).items():
            if k != "__warningregistry__":
                out[(name, k)] = _fingerprint(v)
    return out


def _changed(before: dict, after: dict) -> list:
    return sorted(f"{m}.{k}" for (m, k) in set(before) | set(after) if before.get((m, k)) != after.get((m, k)))


def draw(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    grads = [(torch.randn(s, generator=gen) * 1e-2).to(dtype) for s in SHAPES]
    return params, grads


TXS = {
    "adamw-8bit": lambda: lt.adamw(1e-2, weight_decay=0.1, state_format="8bit", min_quant_size=256),
    "adamw-4bit": lambda: lt.adamw(1e-2, weight_decay=0.1, state_format="4bit", min_quant_size=256),
    "lion-fp32": lambda: lt.lion(1e-3, weight_decay=0.1, state_format="fp32"),
    "sgd-bf16-sr": lambda: lt.chain(lt.sgd(1e-2, momentum=0.9, state_format="8bit", min_quant_size=256),
                                    lt.stochastic_rounding(seed=3)),
    "injected-rmsprop": lambda: lt.inject_hyperparams(lt.rmsprop)(learning_rate=1e-2, momentum=0.9,
                                                                  min_quant_size=256),
}


@pytest.mark.parametrize("name", sorted(TXS))
def test_update_and_apply_updates_touch_no_module_state(name):
    """After a first call has built what a configuration needs once (the C library, code tables:
    constants keyed by format and rule), later steps with other values, counts and tensors leave
    every global of every lowbit_tree module as it was: no container gains or loses an entry, no
    cache grows, no name is rebound. (Before this was so, the sums stash, the buffer pools and the
    hyperparameter memo each changed here.)"""
    dtype = torch.bfloat16 if "bf16" in name else torch.float32
    tx = TXS[name]()
    params, grads = draw(0, dtype)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)  # the first call of this configuration
    params = lt.apply_updates(params, updates)
    for seed in (1, 2):
        _, grads = draw(seed, dtype)
        before = _module_state()
        updates, state = tx.update(grads, state, params)
        assert _changed(before, _module_state()) == [], "update"
        params = lt.apply_updates(params, updates)
        assert _changed(before, _module_state()) == [], "apply_updates"
        lt.apply_updates(params, updates, stochastic_round=True, key=torch.tensor([5, seed]))
        assert _changed(before, _module_state()) == [], "apply_updates(stochastic_round=True)"


def _equal(a, b) -> bool:
    import optree

    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point and x.ndim else x,
                                                  y.view(torch.uint8) if y.dtype.is_floating_point and y.ndim else y)
                                      for x, y in zip(la, lb))


@pytest.mark.parametrize("name", sorted(TXS))
def test_results_depend_on_the_arguments_only(name):
    """One step from the same values gives the same bits whether it runs first, after other steps
    of other trees, or on copies (other tensor objects of equal values); apply_updates called
    twice on one update gives two equal results that share no memory."""
    dtype = torch.bfloat16 if "bf16" in name else torch.float32
    tx = TXS[name]()
    params, grads = draw(7, dtype)
    state = tx.init(params)
    first = tx.update(grads, state, params)
    for seed in (8, 9):  # other calls in between: other values, counts, objects
        p, g = draw(seed, dtype)
        s = tx.init(p)
        for _ in range(2):
            u, s = tx.update(g, s, p)
            p = lt.apply_updates(p, u)
    clone = lambda t: lt.tree_utils.map_leaves(lambda x: x if x is None else x.clone(), t)  # noqa: E731
    again = tx.update(clone(grads), clone(state), clone(params))
    assert _equal(first, again)
    a, b = lt.apply_updates(params, first[0]), lt.apply_updates(params, first[0])
    assert _equal(a, b)
    assert all(x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for x, y in zip(a, b))
    assert _equal(a, lt.apply_updates(clone(params), clone(first[0])))
