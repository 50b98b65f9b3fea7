"""SOAP and SOAP4bit under tensor parallel (ColwiseParallel rows, RowwiseParallel columns,
replicated biases) and FSDP2 + TP on a 2x2 mesh (with one HSDP param): each param stepped whole on
its owner rank (bridge.owner_step), params and states bit for bit the unsharded run's over 6 steps
with an eigenbasis refresh every 2, a step with a NaN on one rank skipped by all; a checkpoint saved on the 2x2 mesh resumes on 1 and 2 ranks.
Multi-process, gloo on CPU (soap_tp_workers.py)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import soap_tp_workers as W

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.mark.slow
def test_soap_tensor_parallel_2_ranks_exact():
    """7 steps, the 4th skipped on both ranks for a NaN in one rank's block (skip_nonfinite)."""
    W.launch(W.exact_worker, 2, (2,), ("tp",), 7, 3)


@pytest.mark.extended
def test_soap_fsdp_plus_tp_2x2_exact_and_resumes_on_1_and_2_ranks(tmp_path):
    """7 steps, the 6th skipped on every rank for a NaN in one rank's block (skip_nonfinite);
    saved after 4 steps on 2x2 (dp, tp), loaded on a 1-rank and a 2-rank TP mesh
    (every owner changes): the loaded states and 3 more steps bit for bit the unsharded run's."""
    W.launch(W.exact_worker, 4, (2, 2), ("dp", "tp"), 7, 5, str(tmp_path), 4)
    W.launch(W.load_worker, 1, (1,), ("tp",), str(tmp_path), 4, 3)
    W.launch(W.load_worker, 2, (2,), ("tp",), str(tmp_path), 4, 3)
