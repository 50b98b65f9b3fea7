"""benchmarks/gpu_check.sh --dry-run: lists what it would measure, runs nothing, and marks the CUDA
steps as skipped where there is no CUDA device."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.extended  # two interpreters start (torch imported in each): seconds, beyond the README command
def test_gpu_check_dry_run_lists_its_steps_and_runs_none(tmp_path):
    res = tmp_path / "results"
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", str(res)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stdout.splitlines() if line.startswith("-- ")]
    commands = [line for line in r.stdout.splitlines() if line.startswith("   $ ")]
    assert len(steps) == len(commands) >= 9
    assert any("triton_compile.py" in c for c in commands) and any("step_time.py" in c for c in commands)
    if not torch.cuda.is_available():
        on_gpu = sum("--device cuda" in c or "TRITON_INTERPRET=0" in c for c in commands)
        assert r.stdout.count("skipped: no CUDA device") == on_gpu >= 7
    assert not res.exists()  # nothing ran, nothing written
