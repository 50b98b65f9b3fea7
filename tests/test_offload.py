"""FSDP2 with ``CPUOffloadPolicy``: every optimizer family bit for bit equal to the same run without
offload, DCP saved at 2 ranks and resumed at 1, and each rank's step on the one thread torchrun
gives it (gloo on CPU; workers in ``offload_workers.py``; the guide is docs/guide/offload.md).

On a CPU-only machine ``CPUOffloadPolicy(pin_memory=False)`` keeps what it would keep on the
host anyway: these tests check that the offload path (FSDP2's host copies of the gradient shards,
its post-accumulate-grad hooks, DCP of host-resident DTensors) changes no bit, not the
device-to-host transfers of an accelerator.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import fsdp_workers as W
import offload_workers as O

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]


def test_offload_equals_no_offload_for_every_family():
    """At 2 ranks, one launch: AdamW8bit, AdamW4bit (rank-1 second moments), AdamWFp8, Lion8bit,
    SGD8bit, AdEMAMix8bit, Muon (8-bit and low-rank 4-bit momentum, Newton-Schulz on owner ranks),
    per-state formats, param_correction with bfloat16 params (8-bit and 4-bit), and AdamW8bit under
    FSDP2's bfloat16 mixed precision, 4 steps on each rank's own batches: losses, params and every
    gathered state of the offloaded model equal the non-offloaded one's bit for bit. Then
    step_in_backward for every family the step-in-backward tests cover, offloaded, against
    opt.step() without offload. Last, each rank's host bytes per param (param shards, gradient
    shards, every part of every state) equal docs/guide/offload.md's count for torch's AdamW,
    AdamW8bit, and AdamW8bit / AdamW4bit with param_correction."""
    W.launch(O.parity_worker, 2)


def test_offload_dcp_saved_at_2_ranks_resumes_at_1(tmp_path):
    """Every family of the parity test, offloaded: ``dcp.save`` at 2 ranks after 3 steps, 3 more
    steps (the uninterrupted run); a fresh offloaded model at 1 rank loads the checkpoint and
    takes the same 3 steps: params and states equal the uninterrupted run's, and a plain unsharded
    optimizer's after 6 steps, bit for bit (mesh-independent gradients)."""
    W.launch(O.dcp_worker, 2, "save", str(tmp_path))
    W.launch(O.dcp_worker, 1, "load", str(tmp_path))


def test_two_ranks_one_thread_each_under_torchrun():
    """``torchrun --nproc_per_node 2`` with ``OMP_NUM_THREADS=1``: each rank's offloaded step runs
    on its calling thread alone (CPU time of the other threads under 5%), and with 2 threads rank
    0's step does use a second one (the control)."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(here, "offload_workers.py"), "threads"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr.count("1 thread: other threads") == 2, done.stderr
