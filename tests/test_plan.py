"""The step as a plan built once.

The in-place form (``tx.plan`` / ``lowbit_tree.step_``) gives the bits of the pure ``update``
+ ``apply_updates`` for every alias and combinator; ``inject_hyperparams`` calls its factory
once; the bridge builds a group's plan once and rebuilds it only when something it holds
changes; a transformation without an in-place form is refused; a step of ``AdamW8bit``
crosses few modules; the compiled backend compiles one graph per static combination.
"""
from __future__ import annotations

import copy
import sys

import optree
import pytest
import torch

import bridge
import lowbit_tree as lt
from bridge import group_plan as bridge_plan
from lowbit_tree.kernels import plan as kernel_plan

from test_bridge_is_core import same


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (64, 96), "b": (7,), "x": (33, 130), "e": (0, 5), "z": (5, 3, 71)}
    return {k: (torch.randn(s, generator=g) * 0.3).to(dtype) for k, s in shapes.items()}


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    out = {k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in params.items()}
    out["b"] = None if step % 3 == 1 else out["b"]  # a leaf without a gradient now and then
    return out


def _leaves(tree):
    return optree.tree_leaves(tree, none_is_leaf=True, is_leaf=lt.records.is_record)


def _same_tree(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if x is None or y is None:
            if (x is None) != (y is None):
                return False
        elif lt.records.is_record(x):
            for part in lt.records.kind_of(x).parts:
                a, b = getattr(x, part.name), getattr(y, part.name)
                if a is None:
                    continue
                if a.dtype == torch.float8_e4m3fn:
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                if not same(a, b):
                    return False
        elif isinstance(x, torch.Tensor):
            if not (same(x, y) if x.is_floating_point() else torch.equal(x, y)):
                return False
    return True


def _schedule(count):
    return 1e-2 * (0.9 ** count.double())


TXS = {
    "adamw_8bit": lambda: lt.adamw(1e-2, state_format="8bit", min_quant_size=64),
    "adam_4bit_rank1_l2": lambda: lt.adam(1e-2, weight_decay=0.1, state_format="4bit", min_quant_size=64),
    "adamw_fp32_schedule_maximize": lambda: lt.adamw(_schedule, maximize=True, state_format="fp32"),
    "adam_amsgrad_fp8": lambda: lt.adam(1e-2, amsgrad=True, state_format="fp8", min_quant_size=64),
    "lion_8bit": lambda: lt.lion(1e-3, state_format="8bit", min_quant_size=64),
    "sgd_nesterov_8bit": lambda: lt.sgd(1e-2, 0.9, nesterov=True, weight_decay=0.01, state_format="8bit",
                                        min_quant_size=64),
    "ademamix_warmups": lambda: lt.ademamix(1e-2, t_alpha=5, t_beta3=5, state_format="8bit", min_quant_size=64),
    "clip_then_adamw": lambda: lt.chain(lt.clip_by_global_norm(1.0), lt.adamw(1e-2, min_quant_size=64)),
    "masked_decay": lambda: lt.adamw(1e-2, mask={"w": True, "b": False, "x": True, "e": True, "z": False},
                                     min_quant_size=64),
    "partition": lambda: lt.partition({"q": lt.adamw(1e-2, min_quant_size=64), "f": lt.sgd(1e-2, 0.9,
                                                                                           state_format="fp32")},
                                      {"w": "q", "b": "f", "x": "q", "e": "f", "z": "q"}),
    "named_chain": lambda: lt.named_chain(("clip", lt.clip_by_global_norm(0.5)),
                                          ("opt", lt.lion(1e-3, min_quant_size=64))),
    "inject": lambda: lt.inject_hyperparams(lt.adamw)(learning_rate=1e-2, weight_decay=0.05, min_quant_size=64),
    "inject_schedule": lambda: lt.inject_hyperparams(lt.adamw)(learning_rate=_schedule, min_quant_size=64),
}


@pytest.mark.parametrize("name", sorted(TXS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_step_gives_the_bits_of_update_and_apply_updates(name, dtype):
    """``step_`` (the plan, in place) == ``update`` + ``apply_updates`` over 4 steps, params and
    states bit for bit; the pure path leaves its inputs untouched."""
    tx = TXS[name]()
    pure = _params(dtype)
    inplace = {k: v.clone() for k, v in pure.items()}
    state_pure = tx.init(pure)
    state_inplace = copy.deepcopy(state_pure)
    for step in range(4):
        grads = _grads(pure, step)
        old, before = state_pure, copy.deepcopy(state_pure)
        updates, state_pure = tx.update(grads, state_pure, pure)
        assert _same_tree(old, before)  # the pure update left its input state as it was
        pure = lt.apply_updates(pure, updates)
        returned = lt.step_(tx, grads, state_inplace, inplace)
        assert returned is state_inplace
        assert _same_tree(pure, inplace), f"{name}: params differ at step {step}"
        assert _same_tree(state_pure, state_inplace), f"{name}: states differ at step {step}"


def test_stochastic_rounding_in_place_equals_pure_with_leaf_offset():
    """bf16 params with stochastic rounding: the plan fused into the kernel draws the bits of the
    pure chain's rounding link; ``leaf_offset`` shifts every leaf's key as the pure path's index
    would (the bridge's params of later groups)."""
    tx = lt.adamw(1e-3, stochastic_round=True, seed=7, min_quant_size=64)
    for offset in (0, 5):
        pure = _params(torch.bfloat16)
        inplace = {k: v.clone() for k, v in pure.items()}
        padded = {**{f"a{i}": None for i in range(offset)}, **pure}  # offset leaves before: flatten order
        state_pure = tx.init(padded)
        state_inplace = tx.init(inplace)
        for step in range(3):
            grads = _grads(pure, step)
            updates, state_pure = tx.update({**{f"a{i}": None for i in range(offset)}, **grads}, state_pure, padded)
            padded = lt.apply_updates(padded, updates)
            lt.step_(tx, grads, state_inplace, inplace, leaf_offset=offset)
        assert _same_tree({k: padded[k] for k in pure}, inplace)


def test_inject_hyperparams_calls_the_factory_once_per_state_and_plan_not_per_step():
    """A loop that keeps its state's hyperparameter tensors (writing new values into them) runs the
    transformation built for the first state: no factory call a step; another state's init and
    its plan build their own (each reads its own state's tensors)."""
    calls = []

    def factory(learning_rate, weight_decay=0.0, state_format="8bit"):
        calls.append(1)
        return lt.adamw(learning_rate, weight_decay=weight_decay, state_format=state_format, min_quant_size=64)

    tx = lt.inject_hyperparams(factory)(learning_rate=1e-2, weight_decay=0.1)
    params = _params()
    state = tx.init(params)
    for step in range(5):
        state.hyperparams["learning_rate"].fill_(1e-2 / (step + 1))
        _, state = tx.update(_grads(params, step), state, params)
    assert len(calls) == 1
    inplace = {k: v.clone() for k, v in params.items()}
    st2 = tx.init(inplace)
    step = tx.plan(st2, inplace, write=True)
    assert len(calls) == 3  # one for st2's init, one for its plan
    for s in range(5):
        st2.hyperparams["weight_decay"].fill_(0.01 * s)
        lt.update.apply_rest_(_leaves(inplace), step(_leaves(_grads(inplace, s))))
    assert len(calls) == 3  # none per step


def test_changing_a_hyperparameter_changes_the_step_not_the_plan():
    """A learning rate written into the injected state between planned steps is the one the next
    step uses: the same bits as a transformation built with that value."""
    params = _params()
    a = {k: v.clone() for k, v in params.items()}
    tx = lt.inject_hyperparams(lt.adamw)(learning_rate=1e-2, min_quant_size=64)
    st = tx.init(a)
    run = tx.plan(st, a, write=True)
    b = {k: v.clone() for k, v in params.items()}
    st_b = lt.adamw(1e-2, min_quant_size=64).init(b)
    for step, lr in enumerate((1e-2, 3e-3, 5e-2)):
        st.hyperparams["learning_rate"].fill_(lr)
        lt.update.apply_rest_(_leaves(a), run(_leaves(_grads(a, step))))
        ref = lt.adamw(lr, min_quant_size=64)
        st_b = lt.step_(ref, _grads(b, step), st_b, b)
    assert _same_tree(a, b)


def test_a_transformation_without_an_in_place_form_is_refused_by_the_bridge_then_wrapped():
    def factory(learning_rate):
        inner = lt.scale_by_adam(state_format="fp32")
        lr = lt.scale_by_learning_rate(learning_rate)
        chained = lt.chain(inner, lr)
        return lt.GradientTransformation(chained.init, chained.update)  # no plan

    p = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    p.grad = torch.ones_like(p)
    opt = bridge.LowBitOptimizer([p], factory, dict(lr=1e-2))
    with pytest.raises(TypeError, match=r"in_place\(tx\)"):
        opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = torch.ones_like(q)
    opt = bridge.LowBitOptimizer([q], lambda learning_rate: lt.in_place(factory(learning_rate)), dict(lr=1e-2))
    r = torch.nn.Parameter(p.detach().clone())
    r.grad = torch.ones_like(r)
    ref = bridge.LowBitOptimizer([r], lambda learning_rate: lt.adam(learning_rate, state_format="fp32"),
                                 dict(lr=1e-2))
    for _ in range(3):
        opt.step()
        ref.step()
    assert same(q.detach(), r.detach())
    assert same(opt.state[q]["exp_avg"], ref.state[r]["exp_avg"])


def test_a_state_field_without_a_declared_role_is_refused():
    from typing import Any, NamedTuple

    class Undeclared(NamedTuple):
        buf: Any

    def factory(learning_rate):
        def init(params):
            return Undeclared(lt.tree_utils.map_leaves(lambda p: torch.zeros_like(p), params))

        def update(updates, state, params=None):
            return lt.tree_utils.map_leaves(lambda u: -learning_rate * u, updates), state

        return lt.in_place(lt.GradientTransformation(init, update))

    p = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
    p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match="Undeclared.*no declared role"):
        bridge.LowBitOptimizer([p], factory, dict(lr=1e-2)).step()


def _count_builds(monkeypatch):
    counts = {"group": 0, "rows": 0}
    group_init, build = bridge_plan.GroupPlan.__init__, kernel_plan.KernelPlan._build

    def counting_init(self, *a, **k):
        counts["group"] += 1
        group_init(self, *a, **k)

    def counting_build(self, *a, **k):
        counts["rows"] += 1
        build(self, *a, **k)

    monkeypatch.setattr(bridge_plan.GroupPlan, "__init__", counting_init)
    monkeypatch.setattr(kernel_plan.KernelPlan, "_build", counting_build)
    return counts


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def _train(model, opt, steps, start=0, hook=None):
    for s in range(start, start + steps):
        x = torch.randn(8, 40, generator=torch.Generator().manual_seed(s))
        model(x).square().mean().backward()
        if hook:
            hook(s)
        opt.step()
        opt.zero_grad()


@pytest.mark.skipif(not lt.kernels.native.available(), reason="needs the native kernel")
def test_the_bridge_builds_a_group_plan_once_and_rebuilds_it_when_something_it_holds_changes(monkeypatch):
    counts = _count_builds(monkeypatch)
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-2, min_quant_size=64)
    ref = bridge.AdamW8bit(ref_model.parameters(), lr=1e-2, min_quant_size=64)

    def lr_schedule(s):
        for o in (opt, ref):
            o.param_groups[0]["lr"] = 1e-2 / (s + 1)

    _train(model, opt, 6, hook=lr_schedule)
    assert counts == {"group": 1, "rows": 1}  # six steps, new gradients and learning rates: one plan
    # a param's storage replaced: the rows follow it (nothing stale is read)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    _train(model, opt, 1, start=6)
    assert counts["rows"] == 2 and counts["group"] == 1
    # a loaded state dict: the plan is rebuilt over the loaded states
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(model, opt, 1, start=7)
    assert counts["group"] == 2
    # a step count changed in place: rebuilt, and the count is honoured
    for st in opt.state.values():
        st["step"].fill_(float(st["step"]))
    _train(model, opt, 1, start=8)
    assert counts["group"] == 3
    _train(ref_model, ref, 6, hook=lr_schedule)
    _train(ref_model, ref, 3, start=6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert same(p.detach(), q.detach())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][name], ref.state[q][name])
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == 9


def test_step_counts_are_views_advanced_together_and_save_as_plain_tensors(tmp_path):
    model = _model()
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-2, min_quant_size=64)
    _train(model, opt, 3)
    steps = [st["step"] for st in opt.state.values()]
    assert all(s.shape == () and float(s) == 3 for s in steps)
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    loaded = torch.load(tmp_path / "o.pt", weights_only=True)
    assert [float(st["step"]) for st in loaded["state"].values()] == [3.0] * len(steps)
    # one param without a gradient for a step: its count stays, the others advance
    p0 = next(iter(model.parameters()))
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(9))
    model(x).square().mean().backward()
    p0.grad = None
    opt.step()
    assert float(opt.state[p0]["step"]) == 3
    assert all(float(opt.state[p]["step"]) == 4 for p in list(model.parameters())[1:])


def test_a_step_of_adamw8bit_crosses_few_modules_and_the_core_never_calls_the_bridge():
    """The walk design.md describes: optimizer -> plan -> core (inject, chain, rule) -> kernel
    plan -> native kernel. Every module of ours entered during one step is listed."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = bridge.AdamW8bit(ps, lr=1e-3, min_quant_size=1)
    opt.step()
    edges = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_back is not None:
            callee, caller = frame.f_globals.get("__name__", ""), frame.f_back.f_globals.get("__name__", "")
            if callee.startswith(("bridge", "lowbit_tree")) and callee != caller:
                edges.add((caller, callee))

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    modules = {callee for _, callee in edges}
    assert not any(a.startswith("lowbit_tree") and b.startswith("bridge") for a, b in edges)
    expected = {"bridge.classes", "bridge.optimizer", "bridge.distributed", "bridge.group_plan", "lowbit_tree.wrappers",
                "lowbit_tree.combine", "lowbit_tree.rule_builder", "lowbit_tree.transform", "lowbit_tree.kernels.spec",
                "lowbit_tree.kernels.plan", "lowbit_tree.kernels.native"}
    assert modules <= expected, sorted(modules - expected)
    assert len(modules) <= 11


def _compiled_graphs_then_native_bits(monkeypatch, first_shapes, second_shapes):
    """AdamW8bit on the compiled backend: two steps on params of ``first_shapes``, then one on
    new params of ``second_shapes``. Returns dynamo's graph count after the first and after
    the second optimizer; checks the first params and states against the native (or eager)
    backend bit for bit."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()  # (other tests of this process compiled before)
    monkeypatch.setenv("LOWBIT_TREE_BACKEND", "compiled")
    g = torch.Generator().manual_seed(0)

    def params(shapes):
        return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]

    def step(ps, seed):
        gg = torch.Generator().manual_seed(seed)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gg)

    first = params(first_shapes)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = bridge.AdamW8bit(first, lr=1e-2, min_quant_size=1)
    for s in range(2):
        step(first, s)
        opt.step()
    graphs = counters["stats"]["unique_graphs"]
    second = params(second_shapes)
    opt2 = bridge.AdamW8bit(second, lr=1e-3, min_quant_size=1)
    step(second, 5)
    opt2.step()
    after = counters["stats"]["unique_graphs"]
    monkeypatch.setenv("LOWBIT_TREE_BACKEND", "native" if lt.kernels.native.available() else "eager")
    ref_opt = bridge.AdamW8bit(ref, lr=1e-2, min_quant_size=1)
    for s in range(2):
        step(ref, s)
        ref_opt.step()
    for p, q in zip(first, ref):
        assert same(p.detach(), q.detach())
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][name], ref_opt.state[q][name])
    return graphs, after


@pytest.mark.slow
def test_compiled_backend_compiles_one_graph_per_static_combination(monkeypatch):
    """LOWBIT_TREE_BACKEND=compiled: 9 params of 3 shapes (5 calls, the last filled up with a
    scratch leaf) compile one graph; new params of new shapes with the same formats compile
    nothing; the result equals the native backend's bit for bit."""
    graphs, after = _compiled_graphs_then_native_bits(
        monkeypatch, [(16, 16), (32, 8), (8, 24)] * 3, [(24, 12), (40, 4), (12, 12), (20, 20)] * 2 + [(4, 36)])
    assert graphs == 1
    assert after == graphs  # new shapes, new params: nothing compiled


@pytest.mark.slow
def test_compiled_backend_compiles_one_graph_per_shape_class(monkeypatch):
    """Shapes dynamo would specialize on (rows of one block, 1-D params with float32 states)
    each get one graph, whatever their order among the params, and new shapes of those
    classes compile nothing (before shape classes, calls mixing classes compiled a graph per
    pattern). Single rows with quantized states step eagerly (``torch_backend.compiles``)."""
    first = [(16, 16), (4, 300), (300,), (1, 64), (8, 24), (4, 600), (10,), (1, 40), (6, 20)]
    second = [(3, 513), (12, 20), (77,), (1, 100), (2, 1000), (5, 5), (33,), (1, 7)]
    graphs, after = _compiled_graphs_then_native_bits(monkeypatch, first, second)
    kinds_q = (("q", "dynamic8", 256), ("q", "dynamic8_sqrt", 256))
    assert {lt.kernels.torch_backend.shape_class(s, kinds_q) for s in first if len(s) == 2 and s[0] > 1} == {
        ((False, False), ((True,), (True,))), ((False, False), ((False,), (False,)))}
    assert graphs == 3  # two classes of quantized 2-D leaves, one of 1-D leaves (float32 states)
    assert after == graphs
