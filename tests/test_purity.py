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


def draw(seed, dtype=torch.float32, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-2).to(dtype) for s in shapes]
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


# ----------------------------------------------------------------------------- one transformation, two callers

def _injected_adamw():
    return lt.inject_hyperparams(lt.adamw)(learning_rate=1e-2, weight_decay=0.1, state_format="8bit",
                                           min_quant_size=256)


def _caller(tx, seed: int, lr: float | None, shape=(64, 64)):
    """One caller's params, gradients and state; ``lr``: a learning rate written into its own state
    (``None``: the one the transformation was made with, in the tensors ``init`` made)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=gen)]
    grads = [[torch.randn(shape, generator=gen) * 1e-2] for _ in range(4)]  # a tree a step, cycled
    state = tx.init(params)
    if lr is None:
        return params, grads, state
    return params, grads, state._replace(hyperparams={**state.hyperparams, "learning_rate": torch.tensor(lr)})


def _run(tx, params, grads, state, steps: int):
    for i in range(steps):
        updates, state = tx.update(grads[i % len(grads)], state, params)
        params = lt.apply_updates(params, updates)
    return params


def test_a_call_in_the_middle_of_another_changes_neither(monkeypatch):
    """optax's transformations may be shared by callers running at once; so may ours. The
    interleaving is forced, not left to thread timing: the first time call A (learning rate 1e-2)
    reaches the kernel step (``rule_builder.run_rule``, after its hyperparameters are in hand), call B
    (learning rate 1e-4, its own params and state) runs to its end, then A goes on. Each caller's
    params must be those of its run alone, bit for bit: a transformation that keeps the
    hyperparameters where each call writes them (one set per device) gives A the rate of B. A's state is the first one made (the transformation kept
    for its tensors runs it), B's has a learning rate of its own (built for each of its calls)."""
    from lowbit_tree import rule_builder

    tx = _injected_adamw()
    a, b = _caller(tx, 0, None), _caller(tx, 1, 1e-4)  # A: the first state, its init's tensors (1e-2)
    alone_a, alone_b = _run(tx, *a, 3), _run(tx, *b, 3)
    step_rule = rule_builder.run_rule
    pending = [lambda: _run(tx, *b, 3)]  # B, run once, inside A's first step
    done = []

    def run_rule(*args, **kwargs):
        if pending:
            done.append(pending.pop()())
        return step_rule(*args, **kwargs)

    monkeypatch.setattr(rule_builder, "run_rule", run_rule)
    together_a = _run(tx, *a, 3)
    assert done, "the hook never ran: the step no longer goes through rule_builder.run_rule"
    assert _equal(done[0], alone_b), "B, run inside A's step"
    assert _equal(together_a, alone_a), "A, with B run inside its step"


def test_two_threads_on_one_transformation_match_their_runs_alone():
    """The same with real threads (the native kernel lets the GIL go while it runs, so the two
    callers' steps overlap): one injected 8-bit AdamW, two threads, each its own params, state
    and learning rate (1e-2 and 1e-4), each thread's params bit for bit those of its run alone.
    The forced interleaving above is the deterministic check; this one is the scenario itself."""
    import threading

    tx = _injected_adamw()
    callers = [_caller(tx, 0, None, (128, 128)), _caller(tx, 1, 1e-4, (128, 128))]  # 1e-2, 1e-4
    alone = [_run(tx, *c, 100) for c in callers]
    out = [None, None]
    start = threading.Barrier(2)

    def work(i):
        start.wait()
        out[i] = _run(tx, *callers[i], 100)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns often, inside a call too
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert _equal(out[0], alone[0]), "the thread with learning rate 1e-2"
    assert _equal(out[1], alone[1]), "the thread with learning rate 1e-4"


# ----------------------------------------------------------------------------- what a transformation closes over

def _builders() -> dict:
    """Every function ``lowbit_tree`` exports that builds a transformation (its return annotation
    names ``GradientTransformation``: the transformations and ``inject_hyperparams``' factory of
    them), found by introspection so that a new one is walked without an edit here."""
    import inspect

    out = {}
    for name in lt.__all__:
        obj = getattr(lt, name)
        if inspect.isfunction(obj) and "GradientTransformation" in str(inspect.signature(obj).return_annotation):
            out[name] = obj
    return out


def _inner():
    return lt.chain(lt.trace(0.9, state_format="8bit", min_quant_size=256), lt.scale(-1e-2))


# representative values of the arguments a builder requires, by parameter name; a builder with
# a required argument not named here fails the walk, which names it
REQUIRED = {
    "learning_rate": 1e-2,
    "momentum": 0.9,
    "step_size": 0.5,
    "max_norm": 1.0,
    "transforms": lambda builder: {"named_chain": (("rule", _inner()), ("scale", lt.scale(0.5))),
                                   "partition": {"a": _inner(), "b": lt.sgd(1e-3)}}.get(builder, (_inner(), lt.scale(0.5))),
    "labels": lambda builder: ["a", "b", "a", "b"],
    "inner": lambda builder: _inner(),
    "mask": lambda builder: [True, False, True, True],
    "tx": lambda builder: _inner(),
    "factory": lambda builder: lt.adamw,  # inject_hyperparams: see _build
}
# optional arguments given where a builder takes them: quantized states on the large leaves
OPTIONAL = {"state_format": "8bit", "min_quant_size": 256}


def _build(name: str, builder, inject=False):
    """``builder`` called with representative arguments; ``inject``: through ``inject_hyperparams``,
    every numeric argument (the required ones and the numbers left at their defaults) injected."""
    import inspect

    args, kwargs = [], {}
    for p in inspect.signature(builder).parameters.values():
        if p.default is p.empty and p.kind is not p.VAR_KEYWORD:
            if p.name not in REQUIRED:
                raise AssertionError(f"{name}'s required argument {p.name!r} has no representative value: add one "
                                     "to REQUIRED in tests/test_purity.py")
            value = REQUIRED[p.name]
            value = value(name) if callable(value) else value
            if p.kind is p.VAR_POSITIONAL:
                args.extend(value)
            elif p.kind is p.POSITIONAL_ONLY:
                args.append(value)
            else:
                kwargs[p.name] = value
        elif p.name in OPTIONAL:
            kwargs[p.name] = OPTIONAL[p.name]
        elif inject and isinstance(p.default, float):
            kwargs[p.name] = p.default
    if name == "inject_hyperparams":  # a factory of transformations: inject one (adamw's numbers)
        return _build("adamw", lt.adamw, inject=True)
    if inject:
        if not any(isinstance(v, float) for v in kwargs.values()):
            pytest.skip(f"{name} takes no number to inject")
        return lt.inject_hyperparams(builder)(*args, **kwargs)
    return builder(*args, **kwargs)


def _reachable(root) -> dict:
    """What a transformation holds, by the path that reaches it, fingerprinted: the cells of its
    functions' closures, their defaults and attributes, recursively through nested functions,
    ``functools.partial``, bound methods, containers and this package's objects. A tensor by its
    identity and bytes, a container by its entries, an object of this package by its
    attributes; anything else by its identity. Module globals are the other test's."""
    import array

    out: dict = {}
    seen: set = set()

    def ours(x) -> bool:
        return (getattr(type(x), "__module__", "") or "").startswith("lowbit_tree")

    def visit(x, path: str):
        if isinstance(x, (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, type,
                          types.ModuleType)):
            out[path] = ("value", x if not isinstance(x, (type, types.ModuleType)) else id(x))
            return
        if id(x) in seen:
            out[path] = ("again", id(x))
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            data = x.detach().cpu().reshape(-1)
            out[path] = ("tensor", id(x), x.dtype, tuple(x.shape),
                         tuple(data.view(torch.uint8).tolist()) if x.numel() and data.is_contiguous() else tuple())
        elif isinstance(x, array.array):
            out[path] = ("array", id(x), x.tobytes())
        elif isinstance(x, dict):
            out[path] = ("dict", id(x), tuple(map(id, x)))
            for k, v in x.items():
                visit(v, f"{path}[{k!r}]")
        elif isinstance(x, (list, tuple, set, frozenset, collections.deque)):
            items = sorted(x, key=id) if isinstance(x, (set, frozenset)) else list(x)
            out[path] = (type(x).__name__, id(x), len(items))
            for i, v in enumerate(items):
                visit(v, f"{path}[{i}]")
        elif isinstance(x, functools.partial):
            out[path] = ("partial", id(x))
            visit(x.func, f"{path}.func")
            visit(x.args, f"{path}.args")
            visit(x.keywords, f"{path}.keywords")
        elif isinstance(x, types.MethodType):
            out[path] = ("method", id(x))
            visit(x.__func__, f"{path}.__func__")
            visit(x.__self__, f"{path}.__self__")
        elif isinstance(x, types.FunctionType):
            out[path] = ("function", id(x))
            if not x.__module__.startswith(("lowbit_tree", __name__)):
                return
            for name, cell in zip(x.__code__.co_freevars, x.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # not yet bound
                    value = "<empty cell>"
                visit(value, f"{path}<{x.__qualname__}>.{name}")
            visit(x.__defaults__, f"{path}.__defaults__")
            visit(x.__kwdefaults__, f"{path}.__kwdefaults__")
            attributes(vars(x), f"{path}.__dict__")
        elif ours(x):
            attrs = dict(vars(x)) if hasattr(x, "__dict__") else {}
            for slot in getattr(type(x), "__slots__", ()):
                if hasattr(x, slot):
                    attrs[slot] = getattr(x, slot)
            out[path] = ("object", id(x), type(x).__qualname__)
            attributes(attrs, path)
        else:
            out[path] = ("id", id(x))

    def attributes(attrs: dict, path: str):  # an object's attributes: by name (the dict is not the object)
        out[f"{path}:names"] = tuple(attrs)
        for k, v in attrs.items():
            visit(v, f"{path}.{k}")

    visit(root, "tx")
    return out


def _other_caller(state):
    """``state`` with every injected hyperparameter set to another value (a second caller's; a
    zero stays zero, as a zero weight decay may be what lets a rule go without a learning rate)."""
    if isinstance(state, lt.InjectHyperparamsState):
        return state._replace(hyperparams={k: v * 0.5 for k, v in state.hyperparams.items()},
                              inner_state=_other_caller(state.inner_state))
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*map(_other_caller, state))
    if isinstance(state, (tuple, list)):
        return type(state)(map(_other_caller, state))
    if isinstance(state, dict):
        return {k: _other_caller(v) for k, v in state.items()}
    return state


WALKED = sorted(_builders())
WALK_SHAPES = [(300, 257), (16, 16), (5, 7), (257, 300)]  # matrices, so that Muon takes every leaf


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "injected"])
@pytest.mark.parametrize("name", WALKED)
def test_what_a_transformation_closes_over_stays_as_it_was(name, inject):
    """A transformation's closures hold what it was built with, never what a call leaves behind:
    after a first call (which may fill a memo of what that structure needs, such as the job rows
    of a tree of these shapes), a second caller's call (other params, state and hyperparameter
    values, the same structure) and the first's again leave every tensor reachable from the
    closures bit for bit as it was and every container and object with the same entries. A
    transformation that wrote its call's hyperparameters into tensors it closes over shows here
    as a changed tensor."""
    builder = _builders()[name]
    if inject and name == "inject_hyperparams":
        pytest.skip("inject_hyperparams is walked injected in its own row")
    tx = _build(name, builder, inject=inject)
    params, grads = draw(0, shapes=WALK_SHAPES)
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    before = _reachable(tx)
    p2, g2 = draw(1, shapes=WALK_SHAPES)
    other = _other_caller(tx.init(p2))
    for caller, (p, g, s) in (("a second caller", (p2, g2, other)), ("the first caller again", (params, grads, state))):
        tx.update(g, s, p)
        after = _reachable(tx)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        assert changed == [], f"{name}: a call of {caller} changed what the transformation holds: {changed[:8]}"


def test_the_walk_sees_what_a_call_writes_into_a_closure():
    """The walk above can fail: a transformation that writes its call's learning rate into a
    tensor it closes over, or appends to a list it closes over, shows as changed, and one that
    only reads what it closes over does not."""

    def toy(writes: bool) -> lt.GradientTransformation:
        lr, seen = torch.zeros(()), []

        def init(params):
            return lt.EmptyState()

        def update(updates, state, params=None, **extra):
            if writes:
                lr.fill_(float(len(seen)) + 1.0)
                seen.append(1)
            return [u * lr for u in updates], state

        return lt.GradientTransformation(init, update)

    for writes in (False, True):
        tx = toy(writes)
        before = _reachable(tx)
        tx.update([torch.ones(2)], tx.init(None))
        after = _reachable(tx)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        assert bool(changed) is writes, changed
        if writes:
            assert any(k.endswith(".lr") for k in changed) and any(".seen" in k for k in changed), changed
