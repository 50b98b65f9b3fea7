"""Sphinx configuration: the user guide (Markdown, MyST) and the API reference (autodoc).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (what .ci/run runs).
"""
import os
import sys
import types

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)  # document this checkout's lowbit_tree and bridge, not an installed copy

project = "lowbit-tree"
author = "the lowbit-tree authors"
copyright = "2026, the lowbit-tree authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"description": "Low-bit optimizer states for PyTorch", "page_width": "1100px"}

myst_heading_anchors = 3  # README-style links to section titles (#choose-a-format)
suppress_warnings = ["myst.header"]  # results.md and design.md start at level-2 sections under an h1

autodoc_member_order = "bysource"  # a module's __all__ order
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# A reference to a missing page, section or object of ours fails the build; names from torch,
# optree, numpy and the standard library cannot be resolved without network access to their
# inventories, so those are let through.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|optree|numpy|np|typing|collections|dataclasses|enum|types|abc|ctypes|argparse)(\..*)?"),
    (r"py:.*", r"(Tensor|Any|Callable|Optional|Sequence|Iterable|Mapping|NamedTuple|PyTree|DTensor|Placement|"
               r"DeviceMesh|ProcessGroup|Module|Optimizer|Path|ParamsT|StateDict)"),
    (r"py:class", r"(int|float|str|bool|dict|list|tuple|object|None|bytes|type)"),
    # the Protocol types of GradientTransformation's two fields
    (r"py:class", r"(lowbit_tree\.base\.)?(InitFn|UpdateFn)"),
    # LowBitOptimizer's report methods name the module functions behind them (bridge/optimizer.py)
    (r"py:func", r"bridge\.report\.(state_report|state_bytes|format_state_report)"),
]


def _public(module) -> set[str]:
    return {n for n in dir(module) if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)}


def _check_api(app, env):
    """Every public name of lowbit_tree and bridge is in its __all__, and every name in __all__
    has an entry in the API reference (else a warning, an error under -W)."""
    from sphinx.util import logging

    import bridge
    import lowbit_tree

    log = logging.getLogger("lowbit_tree.api")
    documented = set(env.get_domain("py").objects)
    for mod in (lowbit_tree, bridge):
        for name in sorted(_public(mod) - set(mod.__all__) - {"STATE_DICT_VERSION"} - {"__version__"}):
            log.warning(f"{mod.__name__}.{name} is public but not in {mod.__name__}.__all__")
        for name in mod.__all__:
            if f"{mod.__name__}.{name}" not in documented:
                log.warning(f"{mod.__name__}.{name} is in __all__ but not in the API reference")


def setup(app):
    app.connect("env-check-consistency", _check_api)
