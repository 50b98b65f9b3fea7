"""No module of lowbit_tree or bridge uses another module's private names.

A name with a leading underscore is its module's own: another module that imports it
(``from x import _y``) or reaches it on an object (``opt._init_state(...)``,
``QTensor._trusted(...)``, ``opt._flag = ...``) depends on what its owner is free to change,
and the owner cannot see that it does. What counts, read from each module's ``ast``:

- ``from <our module> import _name`` (absolute or relative);
- ``obj._name`` where ``obj`` is not ``self`` / ``cls`` / ``super()`` / ``type(self)``, and
  ``obj`` is a name imported from another of our modules, or ``_name`` is defined by another of
  our modules and not by this one (a module's functions may use its own classes' privates), or
  the attribute is set or deleted there (setting another object's private state).

Private names of other libraries (``torch._C``, a tensor's ``_version``, a namedtuple's
``_replace``) are theirs to answer for and not counted. ``ALLOWED`` lists the
uses still to remove, each with the file that owns the name and why; the list only shrinks.
"""
from __future__ import annotations

import ast
import os

from test_imports import ROOT, modules

SELFS = ("self", "cls")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_privates(tree: ast.AST) -> set:
    """The private names a module defines: its functions and classes (at any depth), names it
    assigns (module globals, class attributes, imports ``as _x``), and attributes it sets on
    ``self`` / ``cls``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id in SELFS):
            out.add(node.attr)
    return {n for n in out if is_private(n)}


def _import_target(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _is_own_object(node: ast.AST) -> bool:
    """``self``, ``cls``, ``super()``, ``type(self)``: the object's own attributes."""
    if isinstance(node, ast.Name):
        return node.id in SELFS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "super":
            return True
        return node.func.id == "type" and len(node.args) == 1 and _is_own_object(node.args[0])
    return False


def _root(node: ast.AST):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str, module: str, is_package: bool, ours: set) -> list[str]:
    """The uses of other modules' private names in ``source`` (module ``module``), each as
    ``"line: what"``; ``ours``: every private name our modules define
    (:func:`defined_privates`)."""
    tree = ast.parse(source)
    own = defined_privates(tree)
    ours_imported, external = set(), set()  # names bound to our modules' objects / to other libraries
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                (ours_imported if a.name.split(".")[0] in ("lowbit_tree", "bridge") else external).add(
                    a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            target = _import_target(module, is_package, node)
            mine = target.split(".")[0] in ("lowbit_tree", "bridge")
            for a in node.names:
                if mine and is_private(a.name):
                    out.append(f"{node.lineno}: from {target} import {a.name}")
                (ours_imported if mine else external).add(a.asname or a.name)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)) or _is_own_object(node.value):
            continue
        root = _root(node.value)
        if root in external and root not in ours_imported:
            continue  # another library's (torch._C, os._exit)
        foreign_object = isinstance(node.value, ast.Name) and node.value.id in ours_imported
        foreign_name = node.attr in ours and node.attr not in own
        sets = isinstance(node.ctx, (ast.Store, ast.Del))
        if foreign_object or foreign_name or sets:
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(out, key=lambda use: int(use.split(":")[0]))


def all_private_uses() -> dict:
    """``{module path: [use, ...]}`` over lowbit_tree and bridge."""
    trees, sources = {}, {}
    for name, path in modules().items():
        with open(path) as f:
            sources[name] = f.read()
        trees[name] = ast.parse(sources[name])
    ours = set().union(*(defined_privates(t) for t in trees.values()))
    out = {}
    for name, path in modules().items():
        uses = private_uses(sources[name], name, path.endswith("__init__.py"), ours)
        if uses:
            out[os.path.relpath(path, ROOT)] = uses
    return out


# (path, the use without its line number) -> why it is left; none is: every name used across modules is public
ALLOWED: dict = {}


def test_no_module_uses_another_modules_private_names():
    found = {(path, use.split(": ", 1)[1]): use for path, uses in all_private_uses().items() for use in uses}
    new = sorted(f"{path}:{use}" for (path, what), use in found.items() if (path, what) not in ALLOWED)
    assert not new, "private names used across modules (make them public, or keep them in their module):\n" + "\n".join(new)
    gone = sorted(k for k in ALLOWED if k not in found)
    assert not gone, f"allowed uses that are gone: drop them from ALLOWED: {gone}"


PLANTED = '''
import torch
from lowbit_tree.qtensor import QTensor
from .optimizers import _adam_kwargs
from bridge.state_dict import check_groups


class Mine:
    def __init__(self):
        self._cache = {}

    def method(self, opt, other):
        self._cache.clear()
        super()._hook()
        type(self)._hook
        torch._C
        opt._init_state(None, None)
        other._anything = 1
        QTensor._trusted
        return _own(self)


def _own(x):
    return x._cache
'''


def test_the_checker_finds_each_kind_of_planted_use():
    """The checker itself, on a module with one use of each kind among allowed ones: a private
    import (relative), another module's private method, another object's private attribute
    set, a private attribute of a class imported from our modules; not the module's own
    privates, ``self`` / ``super()`` / ``type(self)``, nor torch's."""
    uses = private_uses(PLANTED, "bridge.planted", False, {"_init_state", "_cache", "_adam_kwargs", "_trusted"})
    assert [u.split(": ", 1)[1] for u in uses] == [
        "from bridge.optimizers import _adam_kwargs",
        "opt._init_state",
        "other._anything",
        "QTensor._trusted",
    ], uses
    # and the same module's own use of another module's private name is clean once it is its own
    assert private_uses("def f(opt):\n    return opt._init_state\n", "bridge.x", False, {"_init_state"}) == [
        "2: opt._init_state"]
    assert private_uses("def _init_state():\n    pass\ndef f(o):\n    return o._init_state\n", "bridge.x", False,
                        {"_init_state"}) == []
