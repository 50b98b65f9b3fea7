"""A rule declared in a table of this test alone reaches every place derived from the declaration,
with no other edit: the core's state class (``rule_builder.state_type``), a bridge class's
constructor arguments and its state names, and the triton backend's refusal (the kernel has no
branch for it). It has no kernel math, so what is checked is what is derived, not a step.

The declaration goes into ``lowbit_tree.rules.RULE_DEFS`` before the rest of the package is
imported (a fresh interpreter: ``rules.py`` is pure data, run first on its own), as if it had
been written there."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent('''
    import importlib.util, json, sys

    found = importlib.util.find_spec("lowbit_tree")
    package = importlib.util.module_from_spec(found)
    sys.modules["lowbit_tree"] = package
    import lowbit_tree.rules as rules  # rules.py alone: the package's __init__ has not run

    # the test-only table: a rule and its class, declared as rules.py and bridge/classes.py declare theirs
    rules.RULE_DEFS["probe"] = rules.RuleDef(
        "probe", (rules.StateDef("mu", "exp_avg", True), rules.StateDef("nu", "exp_avg_sq", False)),
        slots=(("b1", "b1"), ("b2", "b2"), ("eps", "eps")))
    found.loader.exec_module(package)  # now the rest, which derives from RULE_DEFS

    import inspect
    import lowbit_tree as lt
    import bridge
    from bridge import classes
    from lowbit_tree.rule_builder import state_type

    cls = type("Probe", (classes._Declared,), {"_decl": classes._ClassDecl(
        "probe", lt.adamw, (("lr", 1e-3), ("betas", (0.9, 0.99)), ("eps", 1e-8), *classes._STORAGE), keyword="state_format",
        summary="A rule declared by a test.")})
    T = state_type("probe")
    out = {"fields": list(T._fields), "roles": T.roles, "same": state_type("probe") is T,
           "class_states": [t.__name__ for t in cls._state_types],
           "signature": list(inspect.signature(cls.__init__).parameters),
           "doc_has_states": "``exp_avg``, ``exp_avg_sq``" in cls.__doc__,
           "kernel_rules": list(lt.kernels.RULES)}
    if "--triton" in sys.argv:
        from lowbit_tree.kernels import triton_backend, triton_step
        from lowbit_tree.kernels.spec import StepSpec
        out["triton_rules"] = list(triton_step.TRITON_RULES)
        try:
            triton_backend.run_step(StepSpec("probe"), None, [])
        except NotImplementedError as e:
            out["refusal"] = str(e)
    print(json.dumps(out))
''')


def _probe(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_declared_rule_reaches_the_state_class_and_the_constructor():
    out = _probe()
    assert "probe" in out["kernel_rules"]
    assert out["fields"] == ["count", "mu", "nu"] and out["same"]
    assert out["roles"] == {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq"}
    assert out["class_states"] == ["ScaleProbeState"]
    assert out["signature"][:5] == ["self", "params", "lr", "betas", "eps"] and "state_format" in out["signature"]
    assert out["doc_has_states"]


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton extra")
def test_a_declared_rule_without_a_kernel_branch_is_refused_by_the_triton_backend_by_name():
    out = _probe("--triton")
    assert "probe" not in out["triton_rules"] and "adam" in out["triton_rules"]
    assert out["refusal"] == ("the triton backend has no kernel for the probe rule; the backends that have it: "
                              "native, compiled, eager (LOWBIT_TREE_BACKEND)")


def test_a_state_class_whose_fields_are_not_its_rules_is_refused():
    from typing import Any, NamedTuple

    from lowbit_tree.rule_builder import rule_state

    with pytest.raises(TypeError, match="fields .* are not the adam rule's"):
        @rule_state("adam")
        class Wrong(NamedTuple):
            count: Any
            nu: Any
            mu: Any
            nu_max: Any


def test_one_reader_of_the_backend_variable():
    """``LOWBIT_TREE_BACKEND`` is read by ``kernels/setting.py`` alone (``backend_setting``)."""
    readers = [str(p.relative_to(ROOT)) for d in ("lowbit_tree", "bridge") for p in (ROOT / d).rglob("*.py")
               if "environ" in (text := p.read_text()) and "LOWBIT_TREE_BACKEND" in text
               and any("environ" in line and "LOWBIT_TREE_BACKEND" in line for line in text.splitlines())]
    assert readers == ["lowbit_tree/kernels/setting.py"]
