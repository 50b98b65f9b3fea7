"""Every random input in the tests is drawn from a seeded source.

conftest.py seeds torch, numpy and ``random`` before each test (a backstop for draws no scan
sees: a module's weight init, dropout). That is not enough: code run in another process
(spawned ranks, torchrun, ``python -c``) has no conftest, and a test living on the fixture's
state changes its data whenever a draw is added above it. So the test files are scanned: each
call that draws random numbers must take a seeded ``generator=`` or follow a global seed call
(``torch.manual_seed``, ``np.random.seed``, ``random.seed``) in its own function or an
enclosing one. Code held in string literals (what tests hand to ``python -c``) is scanned too.
"""
from __future__ import annotations

import ast
import pathlib
import random
import textwrap

import numpy as np
import pytest
import torch

from conftest import SEED

TESTS = pathlib.Path(__file__).resolve().parent

# torch functions that draw from the global generator unless given generator=
TORCH_DRAWS = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
               "bernoulli", "multinomial", "poisson"}
# in-place draws, as tensor methods or torch.nn.init functions
INPLACE_DRAWS = {"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_",
                 "log_normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "orthogonal_", "sparse_"}
# numpy.random constructors: a seeded source when given a seed
NUMPY_SOURCES = {"default_rng", "RandomState", "Generator", "PCG64", "Philox", "SFC64", "MT19937", "SeedSequence"}


def _dotted(node: ast.AST) -> str:
    """``torch.nn.init.normal_`` for the expression naming it ('' for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _seed_kind(call: ast.Call) -> str | None:
    """Which global generator ``call`` seeds, if it is a seed call."""
    name = _dotted(call.func)
    if name in ("torch.manual_seed", "torch.random.manual_seed", "manual_seed"):
        return "torch"
    if name in ("np.random.seed", "numpy.random.seed"):
        return "numpy"
    if name == "random.seed":
        return "random"
    return None


def _draw_kind(call: ast.Call) -> str | None:
    """Which global generator ``call`` draws from when it is not given a seeded source
    ('torch', 'numpy', 'random', 'os'), or None for a call that draws nothing."""
    name = _dotted(call.func)
    head, _, last = name.rpartition(".")
    has_generator = any(k.arg == "generator" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
                        for k in call.keywords)
    if head == "torch" and last in TORCH_DRAWS:
        return None if has_generator else "torch"
    if isinstance(call.func, ast.Attribute) and call.func.attr in INPLACE_DRAWS:
        return None if has_generator else "torch"
    if head == "torch" and last == "Generator":
        return "torch-generator"  # seeded by a .manual_seed on it; see _unseeded
    if head in ("np.random", "numpy.random"):
        if last == "seed":
            return None
        if last in NUMPY_SOURCES:
            return None if (call.args or call.keywords) else "numpy"
        return "numpy"
    if head == "random":
        if last == "seed" or (last == "Random" and call.args):
            return None
        return "random"
    if name in ("os.urandom", "uuid.uuid4") or head == "secrets":
        return "os"
    return None


def _unseeded(tree: ast.AST, where: str, first_line: int = 1) -> list[str]:
    """``where:line: call`` for each draw in ``tree`` not preceded by a seed of its generator
    in its own function or an enclosing one (module-level code is one more scope)."""
    found = []
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

    def visit(scope: ast.AST, inherited: set[str]):
        own, nested = [], []  # this scope's nodes; the functions defined in it
        stack = list(ast.iter_child_nodes(scope))
        while stack:
            node = stack.pop()
            if isinstance(node, functions):
                nested.append(node)
                continue
            own.append(node)
            stack.extend(ast.iter_child_nodes(node))
        calls = [n for n in own if isinstance(n, ast.Call)]
        first_seed = {}  # generator kind -> position of its first seed call in this scope
        for call in calls:
            kind = _seed_kind(call)
            if kind is not None:
                first_seed[kind] = min(first_seed.get(kind, (1 << 60, 0)), (call.lineno, call.col_offset))
        seed_targets = [c.func.value for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "manual_seed"]
        seeded_names = {_dotted(t) for t in seed_targets} - {""}
        for call in calls:
            kind = _draw_kind(call)
            if kind is None:
                continue
            if kind == "torch-generator":  # torch.Generator().manual_seed(s), or g = torch.Generator(); g.manual_seed(s)
                assigned = [t for a in own if isinstance(a, ast.Assign) and a.value is call for t in a.targets]
                if any(call is t for t in seed_targets) or any(_dotted(t) in seeded_names for t in assigned):
                    continue
            elif kind in inherited or first_seed.get(kind, (1 << 60, 0)) < (call.lineno, call.col_offset):
                continue
            found.append(f"{where}:{call.lineno + first_line - 1}: {ast.unparse(call)}")
        for fn in nested:  # a seed in this scope before a def holds for the code in it
            pos = (fn.lineno, fn.col_offset)
            visit(fn, inherited | {k for k, p in first_seed.items() if p < pos})

    visit(tree, set())
    return sorted(found, key=lambda s: int(s.split(":")[1]))


def scan_source(source: str, where: str) -> list[str]:
    """Unseeded draws in a file's code and in the code held in its string literals."""
    tree = ast.parse(source)
    found = _unseeded(tree, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
            try:
                inner = ast.parse(textwrap.dedent(node.value))
            except SyntaxError:
                continue  # prose, not code
            found += _unseeded(inner, f"{where} (code in a string)", node.lineno)
    return found


def test_no_unseeded_random_input_in_the_tests():
    files = sorted(f for f in TESTS.rglob("*.py") if f.name != "test_seeding.py")  # its examples are unseeded
    assert len(files) > 20 and TESTS / "fsdp_workers.py" in files and TESTS / "data" / "make_v1_state_dict.py" in files
    found = [hit for f in files for hit in scan_source(f.read_text(), str(f.relative_to(TESTS)))]
    assert found == [], "random draws with no seeded generator and no seed before them:\n" + "\n".join(found)


def test_each_test_starts_from_the_fixed_seed():
    """conftest's autouse fixture: the global generators are at SEED when a test begins."""
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(SEED)))
    assert np.array_equal(np.random.rand(4), np.random.RandomState(SEED).rand(4))
    assert random.random() == random.Random(SEED).random()


CAUGHT = {
    "torch.randn": "def f():\n    return torch.randn(3)\n",
    "randn_like": "def f(x):\n    return torch.randn_like(x)\n",
    "generator None": "def f():\n    return torch.rand(3, generator=None)\n",
    "unseeded generator": "def f():\n    g = torch.Generator()\n    return torch.randn(3, generator=g)\n",
    "seed after the draw": "def f():\n    x = torch.randn(3)\n    torch.manual_seed(0)\n    return x\n",
    "seed in another function": "def s():\n    torch.manual_seed(0)\ndef f():\n    return torch.randint(0, 5, (3,))\n",
    "numpy global": "def f():\n    return np.random.randn(3)\n",
    "numpy unseeded rng": "def f():\n    return np.random.default_rng().normal(size=3)\n",
    "torch seed for numpy": "def f():\n    torch.manual_seed(0)\n    return np.random.rand(3)\n",
    "random": "def f():\n    return random.random()\n",
    "in-place init": "def f(w):\n    torch.nn.init.normal_(w)\n",
    "tensor method": "def f(w):\n    w.uniform_(-1, 1)\n",
    "os.urandom": "def f():\n    return os.urandom(8)\n",
    "module level": "x = torch.randn(3)\n",
    "code in a string": "CODE = '''\nimport torch\nx = torch.randn(3)\n'''\n",
    "method": "class T:\n    def f(self):\n        return torch.randperm(5)\n",
}
ACCEPTED = {
    "generator": "def f():\n    return torch.randn(3, generator=torch.Generator().manual_seed(0))\n",
    "named generator": "def f():\n    g = torch.Generator()\n    g.manual_seed(1)\n    return torch.randn(3, generator=g)\n",
    "seed before": "def f():\n    torch.manual_seed(0)\n    return [torch.randn(3) for _ in range(2)]\n",
    "seed in the enclosing function": "def f():\n    torch.manual_seed(0)\n    def g():\n        return torch.rand(2)\n    return g()\n",
    "numpy rng": "def f(seed):\n    return np.random.default_rng(seed).normal(size=3)\n",
    "numpy seed": "def f():\n    np.random.seed(0)\n    return np.random.rand(3)\n",
    "random.Random": "def f():\n    return random.Random(0).random()\n",
    "seeded code in a string": "CODE = '''\nimport torch\ntorch.manual_seed(0)\nx = torch.randn(3)\n'''\n",
    "prose": "def f():\n    '''Draws torch.randn(3) values:\n    nothing here runs.'''\n",
}


@pytest.mark.parametrize("case", sorted(CAUGHT))
def test_the_scan_catches_an_unseeded_draw(case):
    assert len(scan_source(CAUGHT[case], "example.py")) == 1, case


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_the_scan_accepts_a_seeded_draw(case):
    assert scan_source(ACCEPTED[case], "example.py") == [], case
