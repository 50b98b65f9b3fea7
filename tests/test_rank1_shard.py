"""bridge.rank1_shard in one process: the maxima's reduction keeps NaN (gloo's MAX alone would
drop it) and leaves values exact; unsharded params get no reduction. (Sharded runs: the FSDP2 and
TP tests, ``test_rank1_fsdp_exact_at_1_2_3_ranks``.)"""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from bridge.rank1_shard import Rank1Reduce, rank1_reduce


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_max_keeps_nan_and_values(one_rank_group):
    red = Rank1Reduce.__new__(Rank1Reduce)
    red.sent = 0
    t = torch.tensor([0.0, 3.5, float("nan"), 1e-30, float("inf")])
    got = red._max(t.clone(), one_rank_group)
    assert torch.isnan(got[2]) and torch.equal(got[[0, 1, 3, 4]], t[[0, 1, 3, 4]])
    assert red.sent == 2 * 4 * t.numel()


def test_unsharded_param_has_no_reduce():
    p = torch.zeros(4, 6)
    assert rank1_reduce(p, p) is None
