"""A user's subclass of any public optimizer class, with an ``__init__`` of its own, works as
with torch.optim: the class statement succeeds, the subclass steps as its parent does (same
params, same states, bit for bit), and a docstring of its own is kept.

The classes are found by introspection (every ``torch.optim.Optimizer`` subclass ``bridge``
exports), so a new class is covered without being listed here."""
import inspect

import pytest
import torch

import bridge
from lowbit_tree import alias

PUBLIC = sorted((getattr(bridge, n) for n in bridge.__all__
                 if inspect.isclass(getattr(bridge, n)) and issubclass(getattr(bridge, n), torch.optim.Optimizer)),
                key=lambda c: c.__name__)

BASE_ARGS = {bridge.LowBitOptimizer: dict(transform_factory=alias.adamw,
                                          defaults=dict(learning_rate=1e-2, state_format="8bit", min_quant_size=0))}
"""Arguments beyond ``params`` a class needs (the base built from a transformation); the named
classes take their defaults, with quantized states even on this tiny model."""


def _args(cls) -> dict:
    return dict(BASE_ARGS.get(cls, dict(min_quant_size=0)))


def _styles(cls) -> dict:
    """``{style: (subclass, the parent's arguments the subclass's call amounts to, what the
    instance must have)}``, the subclass made by a class statement of each style."""

    class ArgsKwargs(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    class KwargsOnly(cls):
        """A user's own docstring."""

        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)

    class ExtraNamed(cls):
        def __init__(self, params, tag="run-1", *, log_every=10, **kwargs):
            self.tag, self.log_every = tag, log_every  # consumed before the parent sees the rest
            super().__init__(params, **kwargs)

    out = {"*args, **kwargs": (ArgsKwargs, {}, {}),
           "**kwargs": (KwargsOnly, {}, {}),
           "extra named": (ExtraNamed, {}, {"tag": "run-2", "log_every": 3})}
    if "lr" in inspect.signature(cls).parameters:
        class ChangedDefault(cls):
            def __init__(self, params, lr=0.05, **kwargs):
                super().__init__(params, lr=lr, **kwargs)

        out["changed default lr"] = (ChangedDefault, {"lr": 0.05}, {})
    return out


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(24, 16, bias=False)  # 2-D only: Muon's groups take matrices


def _step(opt, model):
    model.zero_grad()
    torch.manual_seed(1)
    model(torch.randn(4, 24)).square().mean().backward()
    opt.step()


def _states(opt) -> dict:
    params = [p for g in opt.param_groups for p in g["params"]]
    return {(i, k): v.clone() for i, p in enumerate(params) for k, v in opt.state[p].items()}


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_a_subclass_with_its_own_init_steps_as_its_parent(cls):
    assert len(PUBLIC) >= 28, [c.__name__ for c in PUBLIC]
    for style, (sub, parent_extra, instance_extra) in _styles(cls).items():
        model, ref_model = _model(), _model()
        before = model.weight.detach().clone()
        opt = sub(model.parameters(), **instance_extra, **_args(cls))
        ref = cls(ref_model.parameters(), **_args(cls), **parent_extra)
        for _ in range(2):  # SOAP's first step only builds its preconditioner
            _step(opt, model)
            _step(ref, ref_model)
        assert not torch.equal(model.weight, before), f"{cls.__name__}, {style}: the params did not move"
        assert torch.equal(model.weight, ref_model.weight), f"{cls.__name__}, {style}: the params differ from the parent's"
        mine, theirs = _states(opt), _states(ref)
        assert mine.keys() == theirs.keys() and mine, f"{cls.__name__}, {style}: states {sorted(mine)} vs {sorted(theirs)}"
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), f"{cls.__name__}, {style}: state {key} differs from the parent's"
        drop = lambda g: {k: v for k, v in g.items() if k != "params"}  # noqa: E731
        assert [drop(g) for g in opt.param_groups] == [drop(g) for g in ref.param_groups], (cls.__name__, style)
        for name, value in instance_extra.items():
            assert getattr(opt, name) == value


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda c: c.__name__)
def test_a_subclass_keeps_its_own_docstring_or_inherits_the_parents(cls):
    styles = _styles(cls)
    assert styles["**kwargs"][0].__doc__ == "A user's own docstring."
    plain = styles["*args, **kwargs"][0]
    assert plain.__doc__ is None and inspect.getdoc(plain) == inspect.getdoc(cls)
