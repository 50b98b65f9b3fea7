"""FSDP2 + distributed checkpoint, multi-process (gloo on CPU; 1-3 spawned ranks).

Each test launches a few processes running a worker from ``fsdp_workers.py`` (a tiny
transformer: per-block ``fully_shard`` plus the root; weights that shard unevenly and,
on 3 ranks, emptily). A failure on any rank fails the test; the process-group timeout
(60 s) turns a hang into a failure.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import fsdp_workers as W

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]


def test_fsdp_parity_offload_bf16_and_errors():
    """Acceptance 1, 3, 7, 8, 10 and the failure rules, on 2 ranks:
    - AdamW 8-bit / 4-bit / FP8, 6 steps: losses, params and every gathered state
      (codes, scales) equal the unsharded run with all-reduced gradients, bit for bit;
    - every state the global rule quantizes is quantized on every (uneven) shard;
    - CPUOffloadPolicy(pin_memory=False): same, states on the params' device;
    - bf16 params with stochastic rounding;
    - an unsupported op and rank-1 normalization raise on every rank."""
    W.launch(W.parity_all_worker, 2)
