"""Schedules against the closed-form formulas (Python math, float64)."""
import math

import pytest
import torch

from lowbit_tree.schedule import (
    constant_schedule,
    cosine_decay_schedule,
    join_schedules,
    linear_schedule,
    warmup_cosine_decay_schedule,
)


def values(schedule, steps):
    return [schedule(torch.tensor(t, dtype=torch.int32)) for t in steps]


def check(schedule, formula, steps=range(0, 130)):
    for t, v in zip(steps, values(schedule, steps)):
        assert v.dtype == torch.float32 and v.shape == ()
        assert v.item() == pytest.approx(formula(t), rel=1e-6, abs=1e-9), t


def test_constant():
    check(constant_schedule(0.3), lambda t: 0.3)


def test_linear():
    check(linear_schedule(1.0, 0.1, 50, transition_begin=10),
          lambda t: 1.0 + (0.1 - 1.0) * min(max(t - 10, 0), 50) / 50)
    check(linear_schedule(0.5, 0.0, 0), lambda t: 0.5)


def test_cosine_decay():
    check(cosine_decay_schedule(2.0, 100, alpha=0.1),
          lambda t: 2.0 * (0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 100) / 100)) + 0.1))


def test_warmup_cosine_decay():
    def formula(t):
        if t < 10:
            return 0.0 + (1e-3 - 0.0) * t / 10
        k = min(t - 10, 90)
        return 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * k / 90))

    check(warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100, end_value=1e-4), formula)


def test_join():
    s = join_schedules([constant_schedule(1.0), linear_schedule(2.0, 0.0, 10), constant_schedule(5.0)], [5, 20])
    check(s, lambda t: 1.0 if t < 5 else (2.0 - 2.0 * min(t - 5, 10) / 10 if t < 20 else 5.0), steps=range(30))


def test_schedule_in_learning_rate_needs_no_host_sync():
    from lowbit_tree.transform import scale_by_learning_rate

    tx = scale_by_learning_rate(linear_schedule(1.0, 0.0, 4))
    u = {"w": torch.ones(2)}
    s = tx.init(u)
    seen = []
    for _ in range(5):
        out, s = tx.update(u, s)
        seen.append(out["w"][0].item())
    assert seen == [-1.0, -0.75, -0.5, -0.25, 0.0]
    assert s.count.dtype == torch.int32 and s.count.item() == 5
