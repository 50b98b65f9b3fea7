"""Every rule a bridge class runs is made by the one declared-rule builder.

The classes are found by introspection, never listed: every public class of ``bridge.__all__``
that is a ``torch.optim.Optimizer`` is constructed on a small 2-D param (and a 1-D one where it
takes it) and stepped once; its groups' transformations are walked (through the closures of
their functions and the containers those hold) to every link that keeps state of its own (a
link holding no other link, whose state class's ``roles`` name a state beside the count): each must carry the builder's
mark, ``lowbit_rule`` on its ``init`` (``test_builder.made_by_builder``), for the declared rule
whose states it keeps. The classes whose step is not a declared rule are :data:`NOT_BUILT`,
held to exactly the set the walk finds, both ways.
"""
import inspect

import pytest
import torch

import bridge
from lowbit_tree import chain, rule_builder, transform
from lowbit_tree.base import STEP, GradientTransformation
from test_builder import made_by_builder

NOT_BUILT = {
    # SOAP's step is Adam in the preconditioner's eigenbasis, in torch code (lowbit_tree.soap_transform):
    # rotations and eigenbasis refreshes around the moments. Its moment update could be a RuleStage
    # around a kernel rule only with a rule of its own (eps added before the bias correction, not
    # Adam's), which lowbit_tree.kernels does not have yet
    "SOAP": "Adam in an eigenbasis, torch code, not an elementwise declared rule",
    "SOAP8bit": "SOAP with 8-bit moments (the same step)",
    "SOAP4bit": "SOAP with 4-bit moments (the same step)",
}
"""The public bridge classes whose per-param state is not kept by a builder-made rule, each with why."""

EXAMPLE_ARGS = {"momentum": 0.9}
"""Values for arguments whose default runs no rule (SGD's momentum 0 keeps no state)."""

ONE_D_GROUP = {"use_muon": False}
"""A param group's keys that take a 1-D param in a class whose default group is for matrices only."""


def _classes() -> dict:
    out = {}
    for name in bridge.__all__:
        cls = getattr(bridge, name)
        if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not bridge.LowBitOptimizer:
            out[name] = cls
    return out


def _transformations(opt) -> list:
    """The transformation of each of ``opt``'s param groups."""
    if isinstance(opt, bridge.LowBitOptimizer):
        return [opt._transform(g)[0] for g in opt.param_groups]
    tx_of = getattr(type(opt), "_tx", None)
    assert tx_of is not None, f"{type(opt).__name__}: the test cannot find its groups' transformations"
    return [tx_of(g) for g in opt.param_groups]


def _links(tx: GradientTransformation) -> list:
    """Every transformation reachable from ``tx`` through its functions' closures."""
    out, seen, stack = [], set(), [tx]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, torch.Tensor):
            continue
        seen.add(id(o))
        if isinstance(o, GradientTransformation):
            out.append(o)
            stack.extend(o)
        elif inspect.isfunction(o):
            stack.extend(c.cell_contents for c in (o.__closure__ or ()))
            if hasattr(o, "lowbit_inner"):  # inject_hyperparams builds its factory's transformation per call
                stack.append(o.lowbit_inner())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    return out


def rule_links(opt, params) -> list:
    """``[(link, its state's roles without the count)]`` for every link of ``opt``'s
    transformations that keeps state of its own (not a combinator: it holds no other link)."""
    out = []
    for tx in _transformations(opt):
        for link in _links(tx):
            if len(_links(link)) > 1:  # chain, inject_hyperparams: the rules are their parts
                continue
            roles = getattr(type(link.init(params)), "roles", None)
            own = {k: v for k, v in roles.items() if v != STEP} if isinstance(roles, dict) else {}
            if own:
                out.append((link, own))
    return out


def built_by_builder(opt, params) -> bool:
    """Whether ``opt`` runs a rule and every rule it runs is the builder's, for the states it keeps."""
    links = rule_links(opt, params)
    return bool(links) and all(made_by_builder(t) and t.init.lowbit_rule.roles() == own for t, own in links)


def _stepped(cls):
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))
    sig = inspect.signature(cls)
    kwargs = {k: v for k, v in EXAMPLE_ARGS.items() if k in sig.parameters}
    try:
        opt = cls([w, b], **kwargs)
    except ValueError:  # matrices only in its default group: a 1-D param goes in a group of its own
        one_d = {k: v for k, v in ONE_D_GROUP.items() if k in cls([w], **kwargs).defaults}
        assert one_d, f"{cls.__name__} takes no 1-D param: say in ONE_D_GROUP which group would"
        opt = cls([{"params": [w]}, {"params": [b], **one_d}], **kwargs)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_every_bridge_class_runs_builder_rules_or_is_a_listed_exception():
    classes = _classes()
    assert len(classes) > 10, "the walk found almost no classes"
    params = {"w": torch.zeros(16, 8)}
    not_built = {name for name, cls in classes.items() if not built_by_builder(_stepped(cls), params)}
    assert not_built - set(NOT_BUILT) == set(), (
        f"{sorted(not_built - set(NOT_BUILT))} run a rule the builder did not make (or none): build it with "
        "rule_builder.declared_rule from its RuleDef, or list the class in NOT_BUILT with why")
    assert set(NOT_BUILT) - not_built == set(), (
        f"{sorted(set(NOT_BUILT) - not_built)} run builder rules only now (or are gone): take them out of NOT_BUILT")


@pytest.mark.parametrize("by_hand", [False, True])
def test_the_check_tells_a_hand_built_rule(by_hand):
    """The check can fail: an optimizer whose Lion rule is put together by hand from the
    builder's parts is not the builder's; the same optimizer with the builder's Lion is."""
    def lion(learning_rate=1e-3):
        if by_hand:
            def init(params):
                return transform.ScaleByLionState(torch.zeros((), dtype=torch.int32), params)

            rule = rule_builder.rule_transformation(transform.kernels.StepSpec("lion"), lambda s: (s.mu,),
                                        lambda s, new: s._replace(count=s.count + 1, mu=new[0]),
                                        dict(b1=0.9, b2=0.99), lambda s: s.count, init)
        else:
            rule = transform.scale_by_lion(state_format="fp32")
        return chain(rule, transform.scale_by_learning_rate(learning_rate))

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    opt = bridge.LowBitOptimizer([w], lion, dict(lr=1e-3))
    w.grad = torch.randn_like(w)
    opt.step()
    params = {"w": torch.zeros(16, 8)}
    assert [own for _, own in rule_links(opt, params)] == [{"mu": "exp_avg"}]
    assert built_by_builder(opt, params) is not by_hand
