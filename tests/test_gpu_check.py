"""benchmarks/gpu_check.sh --dry-run: lists what it would measure (each measurement of the GPU
check: the triton backend's tests and bits on CUDA, step times against torch fused AdamW, the
compiled backend, torchao, bitsandbytes and FlashOptim, first-step times, the offline install
from a wheels folder), runs nothing, and marks the CUDA steps as skipped where there is no CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(tmp_path, *args):
    res = tmp_path / "results"
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", *args, str(res)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert not res.exists()  # nothing ran, nothing written
    return r


@pytest.mark.extended  # two interpreters start (torch imported in each): seconds, beyond the README command
def test_gpu_check_dry_run_lists_each_measurement_and_runs_none(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("optree-0.20.0-cp312-cp312-manylinux_2_28_x86_64.whl", "lowbit_tree-0.1.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    r = _dry_run(tmp_path, "--wheels", str(wheels))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    steps = [line for line in lines if line.startswith("-- ")]
    commands = [line[5:] for line in lines if line.startswith("   $ ")]
    assert len(steps) == len(commands) >= 12
    install = [c for c in commands if "pip install" in c]
    assert len(install) == 1 and "--no-index" in install[0] and "lowbit-tree" in install[0] and "optree" in install[0]
    triton_gpu = [c for c in commands if "TRITON_INTERPRET=0" in c]
    assert triton_gpu and "matches_native" in triton_gpu[0] and "test_backend_choice.py" in triton_gpu[0]
    timed = " ".join(c for c in commands if "step_time.py" in c)
    for impl in ("torch-fused ", "bridge-8bit ", "torchao-8bit", "bnb-8bit", "flashoptim-bf16c",
                 "LOWBIT_TREE_BACKEND=compiled", "--case a", "--case b", "--case c"):
        assert impl in timed, impl
    first = " ".join(c for c in commands if "step_overhead.py" in c)
    assert "triton-8bit" in first and "compiled-8bit" in first
    assert any("triton_compile.py" in c for c in commands)
    if not torch.cuda.is_available():
        on_gpu = sum("--device cuda" in c or "TRITON_INTERPRET=0" in c or "-m cuda" in c for c in commands)
        assert r.stdout.count("skipped: no CUDA device") == on_gpu >= 11


@pytest.mark.extended
def test_gpu_check_names_the_fix_for_a_missing_wheels_folder(tmp_path):
    r = _dry_run(tmp_path, "--wheels", str(tmp_path / "none"))
    assert r.returncode == 2 and "gpu_wheels.sh" in r.stderr
