"""Writes ``bridge/classes.pyi``, the named classes' typed constructors, from their declarations.

The classes' ``__init__`` is built at import from each :class:`~bridge.classes._Spec`
(``classes._signature``), which static tools cannot run; the stub writes the same signature out,
each argument annotated from its declared allowed values (:func:`annotation`) and its default, so
mypy, pyright and IDEs see every argument. It is generated, never edited:
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

_NUMBER = "float | Tensor"  # (as torch.optim: a scheduler, or a user, may give 1-element tensors)


def annotation(name: str, arg, default) -> str:
    """The type of an argument, from its declaration (:class:`lowbit_tree.rules.Arg`'s ``allowed``)
    and its default: a tuple default is a tuple of numbers of its length (``betas``), as
    torch.optim annotates it; ``None`` allowed or default adds ``| None``."""
    allowed = arg.allowed
    if isinstance(default, tuple):
        out = f"tuple[{', '.join([_NUMBER] * len(default))}]"
    elif "mapping" in allowed:
        out = "str | Mapping[str, str]"
    elif "format name" in allowed:
        out = "str"
    elif "tensor" in allowed:
        out = _NUMBER
    elif "number" in allowed or allowed == "0":
        out = "float"
    elif "int" in allowed:
        out = "int"
    elif "True" in allowed or "False" in allowed:
        out = "bool"
    else:
        raise ValueError(f"bridge.stub.annotation: no type for {name!r}, allowed {allowed!r}; say the allowed values "
                         "with the words it reads (number, tensor, int, True/False, format name, mapping, None) or "
                         "extend it")
    if "None" in allowed or default is None:
        out += " | None"
    return out


def _public_base(cls) -> type:
    """The nearest base of ``cls`` the stub names (the private ones between are left out)."""
    names = set(classes.__all__) | {"TorchOptimizerBase"}
    return next(c for c in cls.__mro__[1:] if c.__name__ in names or c is classes.LowBitOptimizer)


def _init(cls) -> list[str]:
    spec = cls._spec
    signature = classes._signature(spec)
    lines = ["    def __init__(", "        self,", "        params: ParamsT,"]
    star = False
    for p in list(signature.parameters.values())[2:]:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            lines.append("        *,")
            star = True
        lines.append(f"        {p.name}: {annotation(p.name, spec.arg(p.name), p.default)} = {p.default!r},")
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
        out += _init(cls) if "_spec" in cls.__dict__ else ["    ..."]
    return "\n".join(out) + "\n"


def main() -> int:
    text = render()
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {PATH} ({len(text)} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
