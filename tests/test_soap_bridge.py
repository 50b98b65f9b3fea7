"""bridge.SOAP / SOAP8bit / SOAP4bit: the same bits as the functional core, every state a tensor,
state-dict round trips (weights_only), skip_nonfinite, refusals by name."""
from __future__ import annotations

import functools
import io

import pytest
import torch

import bridge
import lowbit_tree as lt

CLASSES = {"fp32": (bridge.SOAP, dict()), "8bit": (bridge.SOAP8bit, dict(state_format="8bit", precond_format="8bit")),
           "4bit": (bridge.SOAP4bit, dict(state_format={"exp_avg": "nf4", "exp_avg_sq": "8bit"}, precond_format="4bit"))}
SHAPES = [(40, 72), (72,), (8, 20), (6, 3, 4)]
OPTS = dict(lr=0.01, precondition_frequency=3, max_precond_dim=64, min_quant_size=256)


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]


def _train(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("fmt", list(CLASSES))
def test_the_class_steps_as_the_functional_core(fmt):
    cls, kw = CLASSES[fmt]
    params = _params()
    opt = cls(params, **OPTS)
    grads = _grads(8)
    _train(opt, params, grads)
    ref = [p.detach().clone() for p in _params()]
    tx = lt.soap(OPTS["lr"], precondition_frequency=3, max_precond_dim=64, min_quant_size=256, **kw)
    state = tx.init(ref)
    for gs in grads:
        upd, state = tx.update(gs, state, ref)
        ref = lt.apply_updates(ref, upd)
    for p, r in zip(params, ref):
        assert torch.equal(p.detach(), r)
    for p in params:
        values = opt.state[p]
        assert all(isinstance(v, torch.Tensor) for v in values.values())
        assert int(values["step"]) == 8 and int(values["soap_step"]) == 8
    names = set(opt.state[params[0]])
    assert names == {"step", "soap_step", "precond_failures", "exp_avg", "exp_avg_sq", "eigenbasis_0",
                     "eigenvalues_0", "coupling_0"}  # 72 > max_precond_dim: dimension 1 keeps its coordinates
    if fmt != "fp32":
        assert isinstance(opt.state[params[0]]["eigenbasis_0"], bridge.QState)
    rows = opt.soap_report()
    assert [r.rotated for r in rows] == [(True, False), (False,), (True, True), (True, True, True)]
    assert opt.state_report()[-1].nbytes > 0


@pytest.mark.parametrize("fmt", list(CLASSES))
def test_a_state_dict_round_trip_resumes_bit_for_bit(fmt):
    cls, _ = CLASSES[fmt]
    grads = _grads(10)
    params = _params()
    opt = cls(params, **OPTS)
    _train(opt, params, grads)
    resumed = _params()
    first = cls(resumed, **OPTS)
    _train(first, resumed, grads[:5])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    again = cls(resumed, **OPTS)
    again.load_state_dict(torch.load(buf, weights_only=True))
    _train(again, resumed, grads[5:])
    for p, q in zip(params, resumed):
        assert torch.equal(p.detach(), q.detach())


def test_a_state_dict_of_another_format_is_refused_before_anything_changes():
    params = _params()
    opt = bridge.SOAP8bit(params, **OPTS)
    _train(opt, params, _grads(2))
    other = bridge.SOAP(params, **OPTS)
    _train(other, params, _grads(1))
    before = {k: v.clone() for k, v in other.state[params[0]].items()}
    with pytest.raises(ValueError, match="state_format='8bit'"):
        other.load_state_dict(opt.state_dict())
    assert all(torch.equal(before[k], v) for k, v in other.state[params[0]].items())
    sd = other.state_dict()
    sd["state"][0]["eigenbasis_0"] = sd["state"][0]["eigenbasis_0"][:-1]
    with pytest.raises(ValueError, match="param 0's eigenbasis_0"):
        other.load_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in other.state[params[0]].items())


def test_skip_nonfinite_skips_the_whole_step():
    params = _params()
    opt = bridge.SOAP(params, skip_nonfinite=True, **OPTS)
    grads = _grads(3)
    _train(opt, params, grads[:2])
    before = [p.detach().clone() for p in params]
    states = {k: v.clone() for k, v in opt.state[params[2]].items()}
    bad = [g.clone() for g in grads[2]]
    bad[3][0, 0, 0] = float("inf")
    _train(opt, params, [bad])
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(torch.equal(states[k], v) for k, v in opt.state[params[2]].items())


@pytest.mark.parametrize("kw,name", [(dict(merge_dims=True), "merge_dims"), (dict(precond_format="2bit"), "precond_format"),
                                     (dict(precondition_frequency=0), "precondition_frequency"),
                                     (dict(lr=-1.0), "lr")])
def test_bad_arguments_are_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=f"SOAP.*{name}"):
        bridge.SOAP(_params(), **kw)


@pytest.mark.parametrize("betas,words", [((1.2, 0.95), r"invalid betas\[0\] value 1.2: must be in \[0.0, 1.0\)"),
                                         ((0.9, -0.1), r"invalid betas\[1\] value -0.1"),
                                         ((0.9, float("nan")), r"invalid betas\[1\] value nan"),
                                         ((0.9, 0.95, 0.99), r"betas must be a pair \(beta1, beta2\)"),
                                         ((0.9,), r"betas must be a pair"), (0.9, r"betas must be a pair")])
@pytest.mark.parametrize("cls", [bridge.SOAP, bridge.SOAP4bit])
def test_bad_betas_are_refused_naming_betas(cls, betas, words):
    """``betas``, not the core's ``b1`` / ``b2``, in the constructor and in ``add_param_group``
    (which then leaves the optimizer's groups as they were)."""
    with pytest.raises(ValueError, match=f"^{cls.__name__}: {words}"):
        cls(_params(), betas=betas)
    params = _params()
    opt = cls(params[:1])
    with pytest.raises(ValueError, match=f"^{cls.__name__}: {words}"):
        opt.add_param_group({"params": params[1:], "betas": betas})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name", ["SOAP8bit", "SOAP4bit"])
def test_a_checkpoint_written_by_the_earlier_soap_class_loads_and_steps_on(name):
    """tests/data/soap_state_dict.pt was written by commit 4c0ebd4's SOAP classes, which kept their own
    state dict (tests/data/make_soap_state_dict.py, one thread); loaded here, two more steps of the same
    gradients land on the params that code reached, bit for bit (the second refreshes the bases)."""
    import os

    torch.set_num_threads(1)
    data = torch.load(os.path.join(os.path.dirname(__file__), "data", "soap_state_dict.pt"), weights_only=True)[name]
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in data["params"].items()}
    opt = getattr(bridge, name)(list(ps.values()), lr=0.5, precondition_frequency=2, precondition_1d=True,
                                min_quant_size=64)
    opt.load_state_dict(data["saved"])
    assert opt.param_groups[0]["lr"] == 1e-2  # the saved hyperparameters, as torch.optim restores them
    for step in data["grads"]:
        for k, p in ps.items():
            p.grad = step[k].clone()
        opt.step()
    for k, p in ps.items():
        assert torch.equal(p.detach(), data["params_after"][k]), k
    assert int(opt.state[ps["w"]]["soap_step"]) == data["soap_step_after"]


def test_the_transformation_and_the_plan_are_built_once_over_20_steps(monkeypatch):
    """20 steps, the learning rate changed at each (a scheduler's new number): the group's
    transformation (calls of its factory, ``bridge.soap.soap_of_group``) and its plan
    (``GroupPlan``) are built in the first step and never again; a changed weight decay is
    injected too (nothing built); a changed ``precondition_frequency`` (static) builds both once
    more, and so does a loaded state dict (new state objects) the plan."""
    import bridge.optimizer
    import bridge.soap

    built = {"transform": 0, "plan": 0}
    factory, group_plan = bridge.soap.soap_of_group, bridge.optimizer.GroupPlan

    @functools.wraps(factory)  # (its signature: the optimizer reads which arguments it takes)
    def counted_factory(*args, **kwargs):
        built["transform"] += 1
        return factory(*args, **kwargs)

    class CountedPlan(group_plan):
        def __init__(self, *args, **kwargs):
            built["plan"] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(bridge.soap, "soap_of_group", counted_factory)
    monkeypatch.setattr(bridge.optimizer, "GroupPlan", CountedPlan)
    cls, _ = CLASSES["8bit"]
    params = _params()
    opt = cls(params, **OPTS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    seen = []
    for gs in _grads(20):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        sched.step()
        seen.append(dict(built))
    assert seen[0]["plan"] == 1 and seen[0]["transform"] >= 1
    assert all(s == seen[0] for s in seen), seen  # nothing built after the first step
    opt.param_groups[0]["weight_decay"] = 0.02
    _train(opt, params, _grads(2, seed=3))
    assert built == seen[0]
    opt.param_groups[0]["precondition_frequency"] = 4
    _train(opt, params, _grads(2, seed=3))
    assert built["plan"] == 2 and built["transform"] > seen[0]["transform"]
    again = dict(built)
    opt.load_state_dict(opt.state_dict())
    _train(opt, params, _grads(2, seed=4))
    assert built["plan"] == again["plan"] + 1


@pytest.mark.parametrize("fmt", list(CLASSES))
def test_a_step_reads_no_tensor_on_the_host(fmt, monkeypatch):
    """After the first step (which builds the plans, reading each count once), 20 steps with
    refreshes every 3 run with ``Tensor.item``, ``__int__`` and ``__bool__`` raising: no host sync
    in a step (``skip_nonfinite`` off). The same steps with them working give the same bits."""
    cls, _ = CLASSES[fmt]
    runs = []
    for patched in (False, True):
        params = _params()
        opt = cls(params, **OPTS)
        grads = _grads(21)
        _train(opt, params, grads[:1])
        with monkeypatch.context() as m:
            if patched:
                def refuse(self, *args, **kwargs):
                    raise AssertionError("a host read of a tensor in a SOAP step")

                for name in ("item", "__int__", "__bool__"):
                    m.setattr(torch.Tensor, name, refuse)
            _train(opt, params, grads[1:])
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    with pytest.raises(AssertionError, match="host read"):  # the patch can fail: a read does raise
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "__int__", refuse)
            int(torch.zeros(()))


def test_steps_in_backward_are_the_steps_of_step():
    """As a LowBitOptimizer, SOAP steps each param inside the backward pass
    (``bridge.step_in_backward``: each param's plan over the group's list, the others absent) with
    the bits of ``step()``, refreshes included."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 4))

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    a, b = model(), model()
    kw = dict(precondition_frequency=2, min_quant_size=16)
    opt_a, opt_b = bridge.SOAP8bit(a.parameters(), **kw), bridge.SOAP8bit(b.parameters(), **kw)
    bridge.step_in_backward(b, opt_b, per_param_transform=True)
    for _ in range(5):
        a(x).square().mean().backward()
        opt_a.step()
        opt_a.zero_grad()
        b(x).square().mean().backward()
        opt_b.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert int(opt_b.state[b[0].weight]["soap_step"]) == 5
