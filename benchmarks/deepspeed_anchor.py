"""DeepSpeed's CPU Adam (``deepspeed.ops.adam.DeepSpeedCPUAdam``, fp32 states) as a timed
anchor: the step ZeRO-Offload runs on the host, which a low-bit CPU step has to beat.

DeepSpeed is optional (the ``bench`` extra). Its C++ op (``csrc/adam/cpu_adam*.cpp``, built by
``torch.utils.cpp_extension`` with ``-march=native`` and the widest SIMD the build finds) compiles
on first use, about two minutes on 2 cores, into ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``); later processes load it from there. :func:`build_op` builds or loads
it before any timed step and says which, so the build never lands in a step time.

torch guards a build with a ``lock`` file in the op's folder and waits, without limit, while it
exists; a build that was killed (a timeout, a stopped job) leaves it behind. :func:`build_op`
refuses a lock older than :data:`STALE_LOCK_S` with the path to delete, instead of waiting forever.

On a CPU-only torch DeepSpeed's accelerator auto-detection ends at its CPU accelerator with a
warning; we ask for it (``DS_ACCELERATOR=cpu``) unless the caller chose one: the step timed here
runs on the host either way.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

STALE_LOCK_S = 1800.0  # a build takes about two minutes on 2 cores; a lock this old outlived its build
INSTALL_HINT = 'deepspeed not installed: it is in the `bench` extra (pip install -e ".[bench]")'


class OpBuild(NamedTuple):
    """How the cpu_adam op got into this process: ``seconds`` to build or load it, ``cached``
    whether a build from an earlier process was loaded, ``path`` the shared library."""

    seconds: float
    cached: bool
    path: str


def version() -> str | None:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_reason() -> str | None:
    """None when deepspeed is installed, else the sentence that says so and how to install it."""
    return None if version() else INSTALL_HINT


def _builder():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import CPUAdamBuilder

    return CPUAdamBuilder()


def _built_library(builder) -> str:
    from torch.utils.cpp_extension import _get_build_directory

    return os.path.join(_get_build_directory(builder.name, verbose=False), f"{builder.name}.so")


def op_cached() -> bool:
    """Whether an earlier process built the op into this process's extensions folder (loading it
    then takes a second, not minutes)."""
    return missing_reason() is None and os.path.exists(_built_library(_builder()))


def _refuse_stale_lock(lock: str, now: float | None = None) -> None:
    try:
        age = (time.time() if now is None else now) - os.path.getmtime(lock)
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        raise RuntimeError(f"DeepSpeed's cpu_adam build is locked by {lock}, left {age / 60:.0f} minutes ago by "
                           "a build that did not finish (torch would wait for it forever): delete that file if "
                           "no build is running, or point TORCH_EXTENSIONS_DIR at an empty folder")


def build_op() -> OpBuild:
    """Builds (first use) or loads DeepSpeed's cpu_adam op; raises when deepspeed is missing or
    the build fails (a C++ compiler, ninja and the Python headers are needed)."""
    reason = missing_reason()
    if reason:
        raise RuntimeError(reason)
    builder = _builder()
    path = _built_library(builder)
    _refuse_stale_lock(os.path.join(os.path.dirname(path), "lock"))
    cached = os.path.exists(path)
    t0 = time.perf_counter()
    builder.load(verbose=False)
    return OpBuild(time.perf_counter() - t0, cached, path)


def fresh_build_seconds(timeout_s: float = 900.0) -> float:
    """The op's first build, timed in a fresh process with an empty extensions folder (what a
    user's first ``DeepSpeedCPUAdam`` costs)."""
    code = ("import time, os; os.environ.setdefault('DS_ACCELERATOR', 'cpu');"
            "from deepspeed.ops.op_builder import CPUAdamBuilder; t = time.perf_counter();"
            "CPUAdamBuilder().load(verbose=False); print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TORCH_EXTENSIONS_DIR": folder},
                              capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"DeepSpeed's cpu_adam op did not build: {done.stderr.strip()[-600:]}")
    return float(done.stdout.split()[-1])


def make_optimizer(params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
    """``DeepSpeedCPUAdam`` in AdamW mode with fp32 states (its defaults: ``adamw_mode=True``,
    ``fp32_optimizer_states=True``), whatever the params' dtype."""
    build_op()  # a no-op once loaded; raises with the reason when it cannot be
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True,
                            fp32_optimizer_states=True)
