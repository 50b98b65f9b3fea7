"""The import graph of lowbit_tree and bridge has no cycle, and every module imports alone.

The graph holds every import statement of every module, those inside functions included (a
cycle hidden in a function still ties two modules together); a submodule importing its own
package is not an edge back (the package's ``__init__`` is what imports it)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("lowbit_tree", "bridge")


def modules() -> dict:
    """``{dotted name: path}`` of every module of the two packages."""
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def _targets(name: str, is_package: bool, node, known: dict) -> list:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    base = name if is_package else name.rpartition(".")[0]
    if node.level:
        parts = base.split(".")
        base = ".".join(parts[: len(parts) - (node.level - 1)])
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module
    out = []
    for alias in node.names:
        if f"{target}.{alias.name}" in known:
            out.append(f"{target}.{alias.name}")  # a submodule
        elif target in known:
            out.append(target)
    return out


def import_graph() -> dict:
    known = modules()
    graph = {}
    for name, path in known.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        is_package = path.endswith("__init__.py")
        graph[name] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                       for t in _targets(name, is_package, node, known)
                       if t != name and not name.startswith(t + ".")}
    return graph


def find_cycles(graph: dict) -> list:
    cycles, done, path = [], set(), []

    def visit(n):
        if n in path:
            cycles.append(path[path.index(n):] + [n])
            return
        if n in done:
            return
        path.append(n)
        for m in sorted(graph.get(n, ())):
            visit(m)
        path.pop()
        done.add(n)

    for n in sorted(graph):
        visit(n)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = import_graph()
    assert "lowbit_tree.records" in graph and graph["lowbit_tree.update"], "the graph was read"
    assert find_cycles(graph) == []


def test_the_core_never_imports_the_bridge():
    graph = import_graph()
    assert not [(n, m) for n, deps in graph.items() if n.startswith("lowbit_tree") for m in deps
                if m.startswith("bridge")]


# A fresh interpreter imports the third-party packages once, then forks a child per module, which
# imports that module alone (none of ours is loaded before the fork): the check of a fresh
# interpreter per module, without paying torch's import each time (~3 s of CPU a module).
IMPORT_EACH_ALONE = r"""
import os, sys, traceback
import numpy, optree, torch  # noqa: F401  (third-party only: none of our modules)
import torch._dynamo, torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.tensor  # noqa: F401,E401
assert not [m for m in sys.modules if m.split(".")[0] in ("lowbit_tree", "bridge")]
failed = []
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            code = 0
        except BaseException:
            os.write(w, traceback.format_exc()[-2000:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        err = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append((name, status, err))
print(repr(failed))
"""


NEEDS_PACKAGE = {"lowbit_tree.kernels.triton_step": "triton", "lowbit_tree.kernels.triton_backend": "triton",
                 "lowbit_tree.kernels.triton_quant": "triton"}
"""Modules that need an extra's package (the ``triton`` extra's): where it is missing they must fail
with exactly that package missing (the core itself never imports them without it)."""


@pytest.mark.slow  # ~10 s of CPU
def test_every_module_imports_alone():
    import importlib.util

    names = sorted(n for n in modules() if not n.endswith("__main__"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH_ALONE, *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    missing = {m: pkg for m, pkg in NEEDS_PACKAGE.items() if importlib.util.find_spec(pkg) is None}
    assert sorted(f[0] for f in failed) == sorted(missing), done.stdout[-3000:]
    for name, _, err in failed:
        assert f"No module named '{missing[name]}'" in err, err


@pytest.mark.slow
def test_a_module_that_does_not_import_alone_is_reported(tmp_path):
    (tmp_path / "needs_a_sibling.py").write_text("import not_a_module_anywhere\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH_ALONE, "json", "needs_a_sibling"], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "needs_a_sibling" in done.stdout and "not_a_module_anywhere" in done.stdout and "'json'" not in done.stdout
