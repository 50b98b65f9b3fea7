"""Loading the repository's scripts (``benchmarks/``, ``.ci/``, ``examples/``), which are not
packages, as modules for the tests that check them."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(path, name: str | None = None) -> ModuleType:
    """The module of the script at ``path`` (absolute, or relative to the repository root), run
    afresh: a test may patch its globals without reaching another test's copy."""
    path = Path(path) if Path(path).is_absolute() else ROOT / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
