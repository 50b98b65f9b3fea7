"""Writes ``bridge/classes.pyi``, the named classes' typed constructors, from their declarations.

The classes' ``__init__`` is built at import from each :class:`~bridge.classes._ClassDecl`
(``classes.declared_signature``: each argument typed from its declared allowed values and its default),
which static tools cannot run; the stub writes the same signature out, so mypy, pyright and IDEs
see every argument and its type. It is generated, never edited:
``tests/test_typing.py`` fails when it differs from what this module renders.

Regenerate with ``python -m bridge.stub``.
"""
from __future__ import annotations

import inspect
import os
import sys

from . import classes

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "classes.pyi")
COMMAND = "python -m bridge.stub"


def _public_base(cls) -> type:
    """The nearest base of ``cls`` the stub names (the private ones between are left out)."""
    names = set(classes.__all__) | {"TorchOptimizerBase"}
    return next(c for c in cls.__mro__[1:] if c.__name__ in names or c is classes.LowBitOptimizer)


def _init(cls) -> list[str]:
    signature = classes.declared_signature(cls._decl)
    lines = ["    def __init__(", "        self,", "        params: ParamsT,"]
    star = False
    for p in list(signature.parameters.values())[2:]:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            lines.append("        *,")
            star = True
        lines.append(f"        {p.name}: {p.annotation} = {p.default!r},")
    lines.append("    ) -> None: ...")
    return lines


def render() -> str:
    """The stub's text."""
    out = [f"# Generated from bridge/classes.py's declarations by `{COMMAND}`: do not edit.",
           "# tests/test_typing.py fails when it is stale.",
           "from collections.abc import Mapping",
           "",
           "from torch import Tensor",
           "from torch.optim.optimizer import ParamsT",
           "",
           "from .optimizer import LowBitOptimizer",
           "",
           "__all__ = [", *(f"    {n!r}," for n in classes.__all__), "]",
           "",
           "class TorchOptimizerBase(LowBitOptimizer): ..."]
    for name in classes.__all__:
        cls = getattr(classes, name)
        out += ["", f"class {name}({_public_base(cls).__name__}):"]
        out += _init(cls) if "_decl" in cls.__dict__ else ["    ..."]
    return "\n".join(out) + "\n"


def main() -> int:
    text = render()
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {PATH} ({len(text)} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
