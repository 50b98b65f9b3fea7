"""design.md is true of the code: every path, module, class, function and figure it names exists.

What counts as a name, and how each is checked:

- **The layer map** (design.md's first code block): each entry's files exist under its folder,
  and each word of its description that looks like code (CamelCase, with a ``_``, or ALL_CAPS;
  ``ACRONYMS`` aside) is an attribute of one of the entry's modules or of a class it names, or
  public in its package (for ``cpu.c``: a word of its text). A module of ours that imports an
  absent extra (e.g. Triton) is read from its source instead.
- **Every other backticked span**, by its shape:

  - a path (ends in ``/`` or a file suffix): exists from the root, or under one of ``SEARCH``;
  - ``a.b.c`` whose head is one of our modules or classes, or an alias the docs use (``ALIASES``:
    ``lt``, ``tx``, ``opt``), or another importable module (``torch.lerp``): resolved attribute
    by attribute (a class's members include dataclass fields and ``self.x`` assignments);
  - ``.b``: an attribute of the previous dotted span's head (`GroupPlan.current` / `.run`);
  - a bare ``name``, ``name(...)`` or ``name=value``: defined in the project's code (a module,
    class, function, assignment, parameter, keyword or identifier-like string constant under
    ``CODE``; a word of ``cpu.c``), or in ``EXTERNAL``, each checked in the module it names;
  - ``"text"``: a string constant of the code; ``--flag``: an option the code declares.

  Not names, skipped: spans with any other character (math, expressions, shell), single letters
  (math symbols: ``u``, ``E``, ``R``) and 7 or more hex digits (commits).
- **The ABI's figures** design.md gives (the hyperparameter vector's length, the job row's layout)
  equal ``kernels/spec.py``'s.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import os
import re

import pytest

from lowbit_tree.kernels import spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "design.md")
PACKAGES = ("lowbit_tree", "lowbit_tree.kernels", "bridge")
SEARCH = ("lowbit_tree", "lowbit_tree/kernels", "bridge")
CODE = ("lowbit_tree", "bridge", "tests", "benchmarks", "examples")
C_SOURCE = os.path.join(ROOT, "lowbit_tree", "kernels", "cpu.c")
ALIASES = {"lt": "lowbit_tree", "tx": "lowbit_tree.base:GradientTransformation",
           "opt": "bridge.optimizer:LowBitOptimizer"}
# torch's names that design.md explains ours against and our code does not define: each checked
# where it lives (a name our code defines too, e.g. one it calls with a keyword, needs no entry).
EXTERNAL = {
    "_zeropower_via_newtonschulz": "torch.optim._muon",
    "foreach_reduce": "torch.distributed.fsdp._fully_shard._fsdp_collectives",
    "distribute_tensor": "torch.distributed.tensor",
    "redistribute": "torch.distributed.tensor:DTensor",
    "full_tensor": "torch.distributed.tensor:DTensor",
    "set_optimizer_state_dict": "torch.distributed.checkpoint.state_dict",
    "destroy_process_group": "torch.distributed",
    "isnan": "torch",
}
ACRONYMS = {"ABI", "CUDA", "FP8"}  # words of the map's prose that look like constants
CODE_LIKE = re.compile(r"[A-Z][a-z0-9]+[A-Z]\w*|\w*_\w*|[A-Z][A-Z0-9]{2,}")
IDENT = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"^(\.?{IDENT}(?:\.{IDENT})*)(\((?:\.\.\.|[\w=., ]*)\))?$")
KEYWORD = re.compile(rf"^({IDENT})=[\w.\"]+$")
PATH = re.compile(r"^[\w./-]+(/|\.(py|pyi|c|md|sh|toml|json))$")


def design() -> str:
    with open(DESIGN, encoding="utf-8") as f:
        return f.read()


def map_block(text: str) -> str:
    return text.split("```", 2)[1]


def prose(text: str) -> str:
    """design.md without its fenced blocks."""
    return "".join(text.split("```")[0::2])


def spans(text: str) -> list[str]:
    return [s.strip() for s in re.findall(r"`([^`\n]+)`", prose(text))]


@functools.cache
def defined_names() -> frozenset:
    """Every name the project's code defines (see the module docstring), and cpu.c's words."""
    names = set()
    for top in CODE:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py") or os.path.join(folder, f) == os.path.abspath(__file__):
                    continue
                names.add(f[:-3])
                for node in ast.walk(module_ast(os.path.join(folder, f))):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(node.name)
                    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                        names.add(node.id)
                    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                        names.add(node.attr)
                    elif isinstance(node, ast.arg):
                        names.add(node.arg)
                    elif isinstance(node, ast.keyword) and node.arg:
                        names.add(node.arg)
                    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                        if re.fullmatch(r"-{0,2}[\w-]+", node.value):
                            names.add(node.value)
    return frozenset(names) | c_words()


@functools.cache
def c_words() -> frozenset:
    with open(C_SOURCE, encoding="utf-8") as f:
        return frozenset(re.findall(IDENT, f.read()))


def resolve(dotted: str):
    """The object ``module[:attr.attr]`` names."""
    module, _, attrs = dotted.partition(":")
    obj = importlib.import_module(module)
    for a in filter(None, attrs.split(".")):
        obj = getattr(obj, a)
    return obj


def has_member(obj, name: str) -> bool:
    """``obj.name`` exists: an attribute, or for a class a dataclass field or a ``self.name =``."""
    if isinstance(obj, Unimportable):
        return name in obj.names
    if hasattr(obj, name):
        return True
    if not inspect.isclass(obj):
        return False
    if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True
    for cls in obj.__mro__:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{name}\s*(:[^=\n]+)?=[^=]", source):
            return True
    return False


class Unimportable:
    """A module of ours that imports an absent extra (e.g. Triton): its names, read from its source."""

    def __init__(self, name: str, names: set):
        self.__name__, self.names = name, names


def import_or_read(name: str):
    """The module ``name``; an :class:`Unimportable` where it needs an absent extra; None if none."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        path = os.path.join(ROOT, *name.split(".")) + ".py"
        if name.startswith(e.name or "?") or not os.path.exists(path):
            return None
        return Unimportable(name, file_names(path, []))


def head_object(head: str):
    """The object a dotted span's first word names, or None when it names nothing of ours or importable."""
    if head in ALIASES:
        return resolve(ALIASES[head])
    for pkg in tuple(p + "." for p in PACKAGES) + ("",):  # ours first: `dcp` is bridge.dcp
        if (module := import_or_read(pkg + head)) is not None:
            return module
    for pkg in PACKAGES:
        for name in getattr(importlib.import_module(pkg), "__all__", ()):
            if name == head:
                return getattr(importlib.import_module(pkg), name)
    if head in class_homes():
        return getattr(importlib.import_module(class_homes()[head]), head)
    return None


@functools.cache
def class_homes() -> dict:
    """``{class name: module}`` of the classes our packages define (read, not imported: a module
    that needs an absent extra, e.g. Triton, stays unimported)."""
    out = {}
    for pkg in ("lowbit_tree", "bridge"):
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    for node in module_ast(path).body:
                        if isinstance(node, ast.ClassDef):
                            out.setdefault(node.name, module)
    return out


@functools.cache
def module_ast(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


def path_exists(path: str) -> bool:
    return any(os.path.exists(os.path.join(ROOT, base, path)) for base in ("",) + SEARCH)


def check_bare(name: str) -> str | None:
    """Why the bare ``name`` names nothing, or None."""
    if name in defined_names():
        return None
    if name in EXTERNAL:
        where = EXTERNAL[name]
        return None if has_member(resolve(where), name) else f"{where} has no {name}"
    return "defined nowhere in the code (nor in EXTERNAL)"


def check_dotted(dotted: str, head: str | None) -> tuple[str | None, str | None]:
    """(why ``dotted`` names nothing or None, the head a following ``.x`` span continues)."""
    parts = dotted.split(".")
    if dotted.startswith("."):
        if head is None:
            return f"{dotted}: no dotted span before it to continue", None
        parts = [head] + parts[1:]
    obj = head_object(parts[0])
    if obj is None:
        if len(parts) == 1:
            return check_bare(parts[0]), None
        return f"{parts[0]!r} is no module, class or alias of ours, nor an importable module", None
    for a in parts[1:]:
        if inspect.ismodule(obj) and not hasattr(obj, a) and import_or_read(f"{obj.__name__}.{a}") is not None:
            obj = import_or_read(f"{obj.__name__}.{a}")  # a submodule its package does not import
            continue
        if not has_member(obj, a):
            return f"{getattr(obj, '__name__', obj)} has no {a!r}", parts[0]
        if isinstance(obj, Unimportable):
            break  # its names' own attributes are not read
        obj = getattr(obj, a, None)
    return None, parts[0]


def check_span(span: str, head: str | None) -> tuple[str | None, str | None]:
    """(why ``span`` names nothing or None, the head a following ``.x`` span continues)."""
    if len(span) == 1 or re.fullmatch(r"[0-9a-f]{7,40}", span):
        return None, head
    if PATH.match(span):
        return (None if path_exists(span) else "no such path"), head
    if span.startswith('"') and span.endswith('"') and '"' not in span[1:-1]:
        return (None if span[1:-1] in defined_names() else "no such string constant in the code"), head
    if re.fullmatch(r"--[\w-]+", span):
        return (None if span in defined_names() else "no code declares this option"), head
    if m := KEYWORD.match(span):
        return check_bare(m.group(1)), head
    if m := DOTTED.match(span):
        why, new_head = check_dotted(m.group(1), head)
        return why, new_head if "." in m.group(1) else head
    return None, head  # not a name: math, an expression, a shell line


def map_entries(text: str) -> list[tuple[str, list[str], str]]:
    """(folder, files, description) of each entry of the layer map."""
    out, folders = [], {}
    for line in map_block(text).splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if first.endswith("/"):
            parent = max((i for i in folders if i < indent), default=None)
            folders = {i: f for i, f in folders.items() if i < indent}
            folders[indent] = (folders[parent] + "/" if parent is not None else "") + first.rstrip("/")
            assert os.path.isdir(os.path.join(ROOT, folders[indent])), f"design.md's map names {first}: no such folder"
            continue
        m = re.match(r"\s*((?:[\w]+\.(?:py|pyi|c),? ?)+)\s*(.*)$", line)
        assert m, f"design.md's map: {line.strip()!r} is not 'files  description'"
        folder = folders[max(i for i in folders if i < indent)]
        out.append((folder, [f.strip() for f in m.group(1).split(",") if f.strip()], m.group(2)))
    return out


def expand_suffixes(m: re.Match) -> str:
    """``scale_by_adam / _lion`` -> ``scale_by_adam scale_by_lion``."""
    stem = m.group(0).split(" / ")[0].rpartition("_")[0]
    return " ".join([m.group(0).split(" / ")[0]] + [stem + s for s in m.group(2).split(" / ")[1:]])


def test_the_maps_stay_short():
    """design.md is the map and README.md the front door; more prose goes to docs/guide/."""
    assert os.path.getsize(DESIGN) <= 25_000
    assert os.path.getsize(os.path.join(ROOT, "README.md")) <= 16_000


def file_names(path: str, words: list) -> set:
    """The names a file of the map defines: a module's attributes and those of its classes among
    ``words``; read from its source where it imports an absent extra (e.g. Triton); cpu.c's words."""
    if path.endswith(".c"):
        return set(c_words())
    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] in ("lowbit_tree", "bridge"):
            raise
        names = set()
        for node in module_ast(path).body:
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            names |= {a.asname or a.name.split(".")[0] for a in getattr(node, "names", ()) if hasattr(a, "name")}
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef) and node.name in words:
                names |= {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        return names
    names = set(dir(obj))
    for w in words:
        if inspect.isclass(getattr(obj, w, None)):
            names |= set(dir(getattr(obj, w)))
    return names


def test_every_entry_of_the_layer_map_exists_and_defines_what_it_lists():
    wrong = []
    for folder, files, description in map_entries(design()):
        words = re.findall(IDENT, re.sub(r"(\w+)_\w+((?: / _\w+)+)", expand_suffixes, description))
        defined = set(getattr(importlib.import_module(folder.replace("/", ".")), "__all__", ()))
        for f in files:
            path = os.path.join(ROOT, folder, f)
            if os.path.exists(path):
                defined |= file_names(path, words)
            else:
                wrong.append(f"{folder}/{f}: no such file")
        for w in words:
            if CODE_LIKE.fullmatch(w) and w not in ACRONYMS and w not in defined:
                wrong.append(f"{folder}/{', '.join(files)}: {w!r} is not defined there")
    assert not wrong, "design.md's layer map names what is not in the code:\n" + "\n".join(wrong)


def test_every_backticked_name_exists():
    wrong, head = [], None
    for span in spans(design()):
        why, head = check_span(span, head)
        if why:
            wrong.append(f"`{span}`: {why}")
    assert not wrong, "design.md names what is not in the code:\n" + "\n".join(wrong)


def test_the_abi_figures_are_spec_py_s():
    text = design()
    vector = re.findall(r"the (\d+)-float hyperparameter vector", text)
    row = re.findall(r"(\d+) int64, then (\d+) per state, up to (\d+) states", text)
    assert vector and row, "design.md no longer gives the ABI's figures: drop this test's patterns with them"
    assert {int(n) for n in vector} == {spec.NHYPER}, f"design.md's vector length is not spec.NHYPER ({spec.NHYPER})"
    want = (len(spec.JOB_HEADER), len(spec.STATE_FIELDS), spec.STATE_SLOTS)
    assert {tuple(map(int, r)) for r in row} == {want}, f"design.md's job row is not spec.py's: {want}"


@pytest.mark.parametrize("span, wrong", [
    ("transform._run_rule", True), ("rule_builder.run_rule", False), ("kernels/plan.py", False),
    ("kernels/nothing.py", True), ("KernelPlan.run", False), ("KernelPlan.nothing", True),
    ("no_such_function_anywhere", True), ("torch.lerp", False), ("torch.no_such_op", True),
    ('"8bit_bnb"', False), ('"no_such_format"', True), ("--exhaustive", False), ("--no-such-option", True),
    ("momentum_rank=K", False), ("no_such_argument=1", True), ("isnan", False), ("opt.param_states", False),
    ("tx.no_such_method(...)", True), ("1 - b", False), ("ea30e4d", False),
])
def test_the_checker_tells_a_stale_name_from_a_live_one(span, wrong):
    assert (check_span(span, None)[0] is not None) is wrong


def test_a_continued_span_reads_the_previous_head():
    _, head = check_span("GroupPlan.current", None)
    assert check_span(".run", head)[0] is None
    assert check_span(".no_such_method", head)[0] is not None
    assert check_span(".run", None)[0] is not None
