import os
import random
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # golden_maps, helpers

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
