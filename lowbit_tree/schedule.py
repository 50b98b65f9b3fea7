"""Schedules ``count -> value`` in torch ops (no host sync; float32 0-d results).

``count`` is a 0-d integer tensor (the step counter a transformation keeps);
the result lives on its device. Formulas follow optax's schedules.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .base import Schedule

__all__ = [
    "constant_schedule",
    "linear_schedule",
    "polynomial_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
    "join_schedules",
]


def _steps(count: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count).to(torch.float32)


def constant_schedule(value: float) -> Schedule:
    return lambda count: torch.full((), value, dtype=torch.float32, device=torch.as_tensor(count).device)


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """``(init - end) * (1 - t/transition_steps)**power + end``, ``t`` clipped to ``[0, transition_steps]``
    after subtracting ``transition_begin``. ``transition_steps <= 0`` gives ``init_value`` throughout."""
    if transition_steps <= 0:
        return constant_schedule(init_value)

    def schedule(count):
        t = torch.clamp(_steps(count) - transition_begin, 0, transition_steps)
        frac = 1 - t / transition_steps
        return (init_value - end_value) * frac**power + end_value

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Linear from ``init_value`` to ``end_value`` over ``transition_steps`` (then constant)."""
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0) -> Schedule:
    """``init * ((1 - alpha) * (0.5 * (1 + cos(pi * t / decay_steps)))**exponent + alpha)``, ``t <= decay_steps``."""
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be positive, got {decay_steps}")

    def schedule(count):
        t = torch.clamp(_steps(count), max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i+1]`` from step ``boundaries[i]`` on, called with ``count - boundaries[i]``."""
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(f"need len(schedules) - 1 boundaries, got {len(schedules)} schedules and {len(boundaries)} boundaries")

    def schedule(count):
        count = torch.as_tensor(count)
        out = schedules[0](count)
        for boundary, sched in zip(boundaries, schedules[1:]):
            out = torch.where(count < boundary, out, sched(count - boundary))
        return out

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup ``init -> peak`` over ``warmup_steps``, then cosine decay to
    ``end_value`` reached at step ``decay_steps`` (which counts the warmup, as in optax)."""
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            cosine_decay_schedule(peak_value, max(decay_steps - warmup_steps, 1), alpha, exponent),
        ],
        [warmup_steps],
    )
