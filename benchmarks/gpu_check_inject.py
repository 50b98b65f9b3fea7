"""The test hooks of benchmarks/gpu_check.py, as a pytest plugin its pytest steps load
(``-p gpu_check_inject``) when ``GPU_CHECK_INJECT`` is set (comma-separated):

  bits   after every step of the Triton backend (``lowbit_tree.kernels.run_step`` with
         ``backend="triton"``, or on CUDA tensors), one bit of the first leaf's first state is
         flipped: a bit mismatch the GPU-vs-CPU comparisons must catch;
  skip   the native C kernel reported unavailable: the tests that compare against it skip, as they
         would on a machine without a C compiler;
  hang   every test sleeps an hour before it runs: the step runs past its budget.

tests/test_gpu_check.py checks that each ends the device script's run non-zero."""
from __future__ import annotations

import os
import time

import torch


def _flip(x) -> bool:
    """Flips the lowest bit of the first element of ``x`` (a tensor or a record's codes)."""
    t = getattr(x, "codes", x)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return False
    flat = t.view(-1)
    if t.dtype.is_floating_point:
        flat = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    flat[:1] ^= 1
    return True


def pytest_configure(config):
    kinds = set(filter(None, os.environ.get("GPU_CHECK_INJECT", "").split(",")))
    unknown = kinds - {"bits", "skip", "hang"}
    if unknown:
        raise ValueError(f"GPU_CHECK_INJECT: unknown {sorted(unknown)} (bits, skip, hang)")
    from lowbit_tree import kernels
    from lowbit_tree.kernels import native

    if "skip" in kinds:
        native.available = lambda: False
    if "bits" in kinds:
        real = kernels.run_step

        def run_step(spec, hyper, leaves, **kw):
            outs, news = real(spec, hyper, leaves, **kw)
            if kw.get("backend") == "triton" or (leaves and leaves[0].grad.device.type == "cuda"):
                for x in [s for leaf in news for s in leaf] + list(outs):
                    if _flip(x):
                        break
            return outs, news

        kernels.run_step = run_step


def pytest_runtest_call(item):
    if "hang" in os.environ.get("GPU_CHECK_INJECT", "").split(","):
        time.sleep(3600)
