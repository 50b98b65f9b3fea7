import os
import random
import re
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # golden_maps, helpers

# Triton decides at import whether @triton.jit functions run under its interpreter, and any test
# module may import it first (torch's compile stack does): without a GPU, the triton tests'
# CPU tensors need the interpreter, so it is set before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _device_params():
    params = [pytest.param("cpu", id="cpu")]
    params.append(
        pytest.param(
            "cuda",
            id="cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
        )
    )
    return params


SEED = 0


@pytest.fixture(autouse=True)
def _fixed_seed():
    """Each test starts from the same global generator states (torch, numpy, ``random``),
    whichever xdist worker runs it and whatever ran there before. Explicit draws seed
    themselves too (tests/test_seeding.py checks that); this covers the draws no scan sees,
    such as a module's weight init."""
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    random.seed(SEED)


@pytest.fixture(params=_device_params())
def device(request):
    return torch.device(request.param)


# ----------------------------------------------------------------------------- optional extras

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _extras() -> dict[str, list[str]]:
    """pyproject.toml's optional-dependencies, extra -> distribution names: the one list of what
    each extra brings, read where it is declared (tests/test_ci.py checks the markers)."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the installed project's metadata says the same
        import importlib.metadata

        out: dict[str, list[str]] = {}
        for line in importlib.metadata.requires("lowbit-tree") or []:
            req = Requirement(line)
            for extra in re.findall(r'extra == "([^"]+)"', str(req.marker or "")):
                out.setdefault(extra, []).append(req.name)
        return out
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["optional-dependencies"]
    return {extra: [Requirement(r).name for r in reqs] for extra, reqs in deps.items()}


EXTRAS = _extras()
"""Tests that need an extra carry a marker of the extra's name (``@pytest.mark.parity``): they skip,
naming the extra, where any of its packages is missing. The README's test command installs only
``test``; CI installs the others afterwards and runs the marked tests again."""
EXTRA_MARKERS = ("parity", "clients", "demo", "bench", "docs", "triton")


def missing_distributions(extra: str) -> list[str]:
    import importlib.metadata

    missing = []
    for dist in EXTRAS[extra]:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true",
                     help="run the tests marked exhaustive (every float32 input through a kernel: minutes of CPU "
                          "each); CI runs them, the README's test command leaves them out")
    parser.addoption("--extended", action="store_true",
                     help="run the tests marked extended (long multi-process or many-case runs beyond the "
                          "README's 10-minute test command); CI runs them")


def pytest_collection_modifyitems(config, items):
    exhaustive = config.getoption("--exhaustive")
    extended = config.getoption("--extended")
    for item in items:
        if item.get_closest_marker("extended") is not None and not extended:
            item.add_marker(pytest.mark.skip(reason="beyond the README test command's time: run with --extended "
                                                    "(CI does)"))
        if item.get_closest_marker("exhaustive") is not None and not exhaustive:
            item.add_marker(pytest.mark.skip(reason="every-float check, minutes of CPU: run with --exhaustive "
                                                    "(CI does)"))
        for extra in EXTRA_MARKERS:
            if item.get_closest_marker(extra) is None:
                continue
            missing = missing_distributions(extra)
            if missing:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs the `{extra}` extra ({', '.join(missing)} not installed): "
                           f"pip install -e \".[{extra}]\""))


# One intra-op thread per test process: the suite runs under pytest-xdist on a
# 2-core machine, and oversubscribed OpenMP threads make small ops 10-100x slower.
torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n``, work stealing instead of xdist's default ``load``: an idle worker takes
    half of another's queue. ``load`` hands out tests in collection order, and on 2 workers
    the multi-process tests near the end of it kept one worker busy for minutes while the
    other idled. A ``--dist`` other than the default is left alone."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None
