"""Every public rule of ``lowbit_tree`` is made by the one declared-rule builder
(``rule_builder.declared_rule``) from its ``RuleDef`` (one builder for every rule).

The rules are found by introspection, never listed: every function in ``lowbit_tree.__all__``
that returns a :class:`~lowbit_tree.GradientTransformation` (combinators, which take
transformations, are left out: their rules are their arguments') is called and its state made;
a state whose ``roles`` are a declared rule's (``RuleDef.roles``) marks a rule. The rules still
built by hand are :data:`HAND_BUILT`, and the test holds that list to exactly the hand-built set,
so it fails both when a new hand-built rule appears and when one is converted without the list
being updated.
"""
import inspect

import pytest
import torch

import lowbit_tree
from lowbit_tree import rule_builder, rules, transform
from lowbit_tree.base import GradientTransformation

HAND_BUILT: set = set()
"""The public rules not (yet) made by the builder, each with what the builder lacks for it."""

EXAMPLE_ARGS = {"learning_rate": 1e-2, "momentum": 0.9, "step_size": 0.5, "max_norm": 1.0}
"""A value for each required argument of a public transformation (by argument name)."""


def made_by_builder(tx: GradientTransformation) -> bool:
    """Whether ``tx`` is a rule that ``rule_builder.declared_rule`` built: the builder marks its
    ``init`` with the declaration it built from (``lowbit_rule``)."""
    return isinstance(getattr(tx.init, "lowbit_rule", None), rules.RuleDef)


def _rule_of(state):
    """The declared rule whose states ``state`` holds (``None``: not a rule's state)."""
    roles = getattr(type(state), "roles", None)
    if not isinstance(roles, dict):
        return None
    own = {k: v for k, v in roles.items() if k != "count"}
    return next((d.name for d in rules.RULE_DEFS.values() if d.roles() == own), None)


def _rule_states(state) -> list:
    """The rule states inside ``state`` (a chain's tuple of link states, nested)."""
    if _rule_of(state) is not None:
        return [state]
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return [s for part in state for s in _rule_states(part)]
    return []


def _is_combinator(fn) -> bool:
    return any("GradientTransformation" in str(p.annotation) for p in inspect.signature(fn).parameters.values())


def _public_transformations() -> dict:
    """``{name: transformation}`` for every public function of lowbit_tree returning one."""
    out = {}
    for name in lowbit_tree.__all__:
        fn = getattr(lowbit_tree, name)
        if not inspect.isfunction(fn) or _is_combinator(fn):
            continue
        sig = inspect.signature(fn)
        if sig.return_annotation not in ("GradientTransformation", GradientTransformation):
            continue
        required = [p.name for p in sig.parameters.values() if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        missing = [p for p in required if p not in EXAMPLE_ARGS]
        assert not missing, f"lowbit_tree.{name} needs {missing}: give them a value in EXAMPLE_ARGS"
        out[name] = fn(**{p: EXAMPLE_ARGS[p] for p in required})
    return out


PARAMS = {"w": torch.zeros(16, 8)}  # 2-D: Muon takes matrices only


@pytest.fixture(scope="module")
def public():
    return {name: (tx, tx.init(PARAMS)) for name, tx in _public_transformations().items()}


def test_the_walk_finds_every_declared_rule(public):
    """Every declared rule's states are made by some public building block the walk reaches (a walk
    that found none would pass everything)."""
    found = {frozenset(type(state).roles.items()) - {("count", lowbit_tree.STEP)}
             for _, state in public.values() if _rule_of(state) is not None}
    for d in rules.RULE_DEFS.values():
        assert frozenset(d.roles().items()) in found, f"no public building block makes the {d.name} rule's states"


def test_every_rule_is_built_by_the_builder_or_a_listed_exception(public):
    rules_by_name = {name: tx for name, (tx, state) in public.items() if _rule_of(state) is not None}
    hand_built = {name for name, tx in rules_by_name.items() if not made_by_builder(tx)}
    for name, tx in rules_by_name.items():
        if made_by_builder(tx):  # the mark names the rule whose states the builder made
            roles = {k: v for k, v in type(public[name][1]).roles.items() if k != "count"}
            assert tx.init.lowbit_rule.roles() == roles, name  # momentum's and muon's states share roles
    assert hand_built - HAND_BUILT == set(), (
        f"{sorted(hand_built - HAND_BUILT)} build their rule by hand: build it with rule_builder.declared_rule "
        f"from its RuleDef")
    assert HAND_BUILT - hand_built == set(), (
        f"{sorted(HAND_BUILT - hand_built)} are built by the builder now (or are gone): take them out of HAND_BUILT")


def test_aliases_take_their_rules_from_the_public_blocks(public):
    """A chain's rule (an alias's) is one a public building block makes: no alias builds a rule
    of its own."""
    block_types = {type(state) for _, (_, state) in public.items() if _rule_of(state) is not None}
    for name, (_, state) in public.items():
        if _rule_of(state) is not None:
            continue
        for s in _rule_states(state):
            assert type(s) in block_types, f"lowbit_tree.{name} holds a {type(s).__name__} no building block makes"


def test_made_by_builder_tells_the_two_apart():
    """The mark can fail: a rule put together by hand from the same parts is not the builder's."""
    built = rule_builder.declared_rule("lion", transform.ScaleByLionState, {}, dict(b1=0.9, b2=0.99),
                                     state_format="fp32", block_size=None, min_quant_size=4096)
    assert made_by_builder(built)

    def init(params):
        return transform.ScaleByLionState(torch.zeros((), dtype=torch.int32), params)

    by_hand = rule_builder.rule_transformation(transform.kernels.StepSpec("lion"), lambda s: (s.mu,),
                                   lambda s, new: s._replace(count=s.count + 1, mu=new[0]), dict(b1=0.9, b2=0.99),
                                   lambda s: s.count, init)
    assert not made_by_builder(by_hand)


def test_a_staged_rule_is_the_builders_and_refuses_a_count_dependent_vector():
    """``staged_rule`` marks its ``init`` as the builder does, runs the stage around the kernel
    (here a stage that doubles the kernel's update of a plain momentum rule: SGD's first step is
    ``u = g``), and refuses a rule whose vector depends on the count (Adam's bias correction),
    which a stage's kernel call does not pass."""
    def after(updates, out, new, context, params, count, inplace, offset):
        return [2 * u for u in out], new

    stage = rule_builder.RuleStage(lambda p, record: record, lambda updates, trees: (updates, trees, None), after)
    tx = rule_builder.staged_rule("momentum", transform.TraceState, {}, dict(momentum=0.9), stage, state_format="fp32",
                               block_size=None, min_quant_size=4096)
    assert made_by_builder(tx) and tx.init.lowbit_rule.name == "momentum"
    g = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    (u,), state = tx.update([g], tx.init([torch.zeros(4, 3)]))
    torch.testing.assert_close(u, 2 * g, rtol=0, atol=0)
    torch.testing.assert_close(state.trace[0], g, rtol=0, atol=0)
    with pytest.raises(TypeError, match="count"):
        rule_builder.staged_rule("adam", transform.ScaleByAdamState, {}, dict(b1=0.9, b2=0.999, eps=1e-8), stage,
                              state_format="fp32", block_size=None, min_quant_size=4096)
