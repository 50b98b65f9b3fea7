"""The bridge is the core: every optimizer class produces, bit for bit, the params
and states of the functional core run (``tx.update`` + ``apply_updates``) on the
same params, gradients and hyperparameters; ``skip_nonfinite`` does not change a
step whose gradients are finite."""
from __future__ import annotations

import optree
import pytest
import torch

import bridge
import lowbit_tree as lt
from lowbit_tree.qtensor import QTensor
from lowbit_tree.rank1 import Rank1QTensor
from lowbit_tree.transform import ScaleByAdamState, ScaleByAdEMAMixState, ScaleByLionState, TraceState

SHAPES = [(64, 300), (7,), (33, 130), (5, 3, 71), (1, 4096)]


def same(a, b) -> bool:
    if isinstance(a, Rank1QTensor):
        return a.shape == b.shape and all(same(getattr(a, k), getattr(b, k)) for k in ("codes", "row_max", "col_max"))
    if isinstance(a, QTensor):
        return same(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and same(a.scale, b.scale)
    if a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.view(bits), b.view(bits))


def _functional(name, kw):
    """The core transformation a bridge class runs (plain Python-float hyperparameters)."""
    lr = kw.get("lr", 1e-3)
    default_betas = {"Lion": (0.9, 0.99), "AdEMAMix": (0.9, 0.999, 0.9999)}.get(name, (0.9, 0.999))
    b1, b2 = kw.get("betas", default_betas)[:2]
    common = dict(state_format=kw["state_format"], block_size=kw.get("block_size"),
                  min_quant_size=kw.get("min_quant_size", 4096), stochastic_round=kw.get("bf16_stochastic_round", False))
    rank1 = dict(rank1_normalization=kw.get("rank1_normalization"))  # None: the format's default, as the bridge
    if name == "AdamW":
        return lt.adamw(lr, b1, b2, kw.get("eps", 1e-8), kw.get("weight_decay", 1e-2), amsgrad=kw.get("amsgrad", False),
                        maximize=kw.get("maximize", False), **common, **rank1)
    if name == "Adam":
        return lt.adam(lr, b1, b2, kw.get("eps", 1e-8), weight_decay=kw.get("weight_decay", 0.0),
                       amsgrad=kw.get("amsgrad", False), maximize=kw.get("maximize", False), **common, **rank1)
    if name == "AdEMAMix":
        b1, b2, b3 = kw.get("betas", (0.9, 0.999, 0.9999))
        return lt.ademamix(lr, b1, b2, b3, kw.get("alpha", 5.0), kw.get("eps", 1e-8), kw.get("weight_decay", 1e-2),
                           t_alpha=kw.get("t_alpha"), t_beta3=kw.get("t_beta3"), maximize=kw.get("maximize", False),
                           slow_state_format=kw.get("slow_state_format"), **common)
    if name == "Lion":
        return lt.lion(lr, b1, b2, kw.get("weight_decay", 0.0), maximize=kw.get("maximize", False), **common)
    return lt.sgd(lr, kw.get("momentum", 0.0), kw.get("nesterov", False), kw.get("weight_decay", 0.0),
                  maximize=kw.get("maximize", False), **common)


def _states(state):
    """{torch name: list of leaves} of a functional state."""
    out = {}
    kinds = (ScaleByAdamState, ScaleByAdEMAMixState, ScaleByLionState, TraceState)
    for node in optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, kinds)):
        if isinstance(node, ScaleByAdamState):
            out["exp_avg"], out["exp_avg_sq"] = node.mu, node.nu
            if node.nu_max is not None:
                out["max_exp_avg_sq"] = node.nu_max
        elif isinstance(node, ScaleByAdEMAMixState):
            out["exp_avg"], out["exp_avg_sq"], out["exp_avg_slow"] = node.mu, node.nu, node.mu_slow
        elif isinstance(node, ScaleByLionState):
            out["exp_avg"] = node.mu
        elif isinstance(node, TraceState):
            out["momentum_buffer"] = node.trace
    return out


CASES = [
    ("AdamW", dict(state_format="8bit", weight_decay=0.1)),
    ("AdamW", dict(state_format="4bit", amsgrad=True)),
    ("AdamW", dict(state_format="fp8", betas=(0.8, 0.95))),
    ("AdamW", dict(state_format="fp32")),
    ("AdamW", dict(state_format="bf16", maximize=True)),
    ("AdamW", dict(state_format="8bit", dtype=torch.bfloat16)),
    ("AdamW", dict(state_format="8bit", dtype=torch.bfloat16, bf16_stochastic_round=True)),
    ("AdamW", dict(state_format="4bit", dtype=torch.float16)),
    ("AdamW", dict(state_format="4bit", rank1_normalization=True, weight_decay=0.1)),
    ("AdamW", dict(state_format="4bit", rank1_normalization=False, weight_decay=0.1)),
    ("Adam", dict(state_format="4bit", rank1_normalization=True, amsgrad=True)),
    ("Adam", dict(state_format="8bit", weight_decay=0.05)),
    ("Adam", dict(state_format="8bit_bnb", amsgrad=True, maximize=True, weight_decay=0.01)),
    ("Lion", dict(state_format="8bit", lr=1e-4, weight_decay=0.1)),
    ("Lion", dict(state_format="4bit", lr=1e-4, dtype=torch.bfloat16, bf16_stochastic_round=True)),
    ("SGD", dict(state_format="8bit", lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    ("SGD", dict(state_format="fp8", lr=1e-2, momentum=0.9, nesterov=True, maximize=True)),
    ("SGD", dict(state_format="fp32", lr=1e-2, momentum=0.0)),
    ("AdEMAMix", dict(state_format="8bit", t_alpha=3, t_beta3=3, weight_decay=0.1)),
    ("AdEMAMix", dict(state_format="4bit", dtype=torch.bfloat16, bf16_stochastic_round=True, alpha=8.0)),
    ("AdEMAMix", dict(state_format="fp8", betas=(0.8, 0.99, 0.999), maximize=True)),
    ("AdEMAMix", dict(state_format="fp32", t_beta3=2)),
    ("AdEMAMix", dict(state_format="4bit", slow_state_format="8bit", t_alpha=2)),
]


@pytest.mark.parametrize("skip_nonfinite", [False, True], ids=["", "skip_nonfinite"])
@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_bridge_equals_functional_core(name, kw, skip_nonfinite):
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.float32)
    gen = torch.Generator().manual_seed(len(name) + len(kw))
    init = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = getattr(bridge, name)(params, min_quant_size=1024, skip_nonfinite=skip_nonfinite, **kw)
    tx = _functional(name, dict(kw, min_quant_size=1024))
    fparams = [t.clone() for t in init]
    state = tx.init(fparams)
    for step in range(4):
        grads = [(torch.randn(s, generator=gen) * 10.0 ** (step - 2)).to(dtype) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        opt.step()
        updates, state = tx.update(grads, state, fparams)
        fparams = lt.apply_updates(fparams, updates)
    for i, (p, q) in enumerate(zip(params, fparams)):
        assert same(p.detach(), q), (name, kw, i)
    for sname, leaves in _states(state).items():
        for i, (p, leaf) in enumerate(zip(params, leaves)):
            live = opt.state[p][sname]
            live = live.record if hasattr(live, "record") else live
            assert same(live, leaf), (name, kw, sname, i)


def test_skip_nonfinite_skips_the_whole_step():
    """One NaN gradient anywhere: no param, state or step count changes."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 100)) for _ in range(2)]
    opt = bridge.AdamW8bit(params, min_quant_size=1024, skip_nonfinite=True)
    for p in params:
        p.grad = torch.randn(64, 100)
    opt.step()
    before = [p.detach().clone() for p in params]
    states = [{k: (v.record.codes.clone(), v.record.scale.clone()) if hasattr(v, "record") else v.clone()
               for k, v in opt.state[p].items()} for p in params]
    params[0].grad = torch.randn(64, 100)
    params[1].grad = torch.full((64, 100), float("nan"))
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    for p, st in zip(params, states):
        assert float(opt.state[p]["step"]) == 1
        for k, v in st.items():
            live = opt.state[p][k]
            if hasattr(live, "record"):
                assert torch.equal(live.record.codes, v[0]) and torch.equal(live.record.scale, v[1])


def test_optimizer_over_a_core_alias_takes_lr_and_schedulers():
    """``LowBitOptimizer(params, lt.adamw, {"learning_rate": ...})``: the group calls it ``lr`` (the
    name torch's LR schedulers read), the alias receives it as ``learning_rate``; with StepLR
    halving it every step, params and states equal the functional run whose injected learning
    rate is set to the same values."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(48, 300))
    grads = [torch.randn(48, 300) for _ in range(4)]
    opt = bridge.LowBitOptimizer([p], lt.adamw, {"learning_rate": 1e-2, "state_format": "8bit"})
    assert opt.param_groups[0]["lr"] == 1e-2 and "learning_rate" not in opt.param_groups[0]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    tx = lt.inject_hyperparams(lt.adamw, hyperparam_dtype=torch.float64)(learning_rate=1e-2, state_format="8bit")
    params = [p.detach().clone()]
    state = tx.init(params)
    for k, g in enumerate(grads):
        p.grad = g.clone()
        opt.step()
        sched.step()
        state.hyperparams["learning_rate"] = torch.tensor(1e-2 * 0.5 ** k, dtype=torch.float64)
        updates, state = tx.update([g.clone()], state, params)
        params = lt.apply_updates(params, updates)
    assert opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 4
    assert same(p.detach(), params[0])
    assert same(opt.state[p]["exp_avg"].record, _states(state)["exp_avg"][0])
