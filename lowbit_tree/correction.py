"""A low-precision param with an 8-bit correction: a 24-bit master weight in 3 bytes.

A bfloat16 param ``p`` (or float16) keeps, beside it, ``c``: int8, one per element, the
rounding error of the float32 master value against ``p`` in units of ``scale(p) = ulp(p) / 256``:

    master = float(p) + c * scale(p)            (exact in float32)

A step computes ``x = master + u`` in float32 (one rounding), stores ``p' = x`` rounded to
nearest even in ``p``'s dtype and ``c' = rint((x - float(p')) / scale(p'))`` (the difference
and the division by a power of two are exact). ``c'`` is at most 128 in magnitude; where it
would be +128, ``p'`` is the neighbour above instead (also a nearest value of ``x`` within
1/512 ulp) and ``c'`` is computed against it, so ``c'`` fits in int8 and every ``x`` with 16
significant bits near ``p'`` is kept exactly (:func:`split_master`). So the master keeps 16
significant bits instead of bfloat16's 8 (float16: 19 instead of 11), and an update below
half an ulp of ``p`` accumulates in ``c`` instead of vanishing (FlashOptim, arXiv 2602.23349,
stores the same kind of correction).

``ulp(p)`` is ``2**(E - m)`` for ``p``'s binade ``E`` (``m``: 7 mantissa bits for bfloat16,
10 for float16), with ``E`` at least the dtype's smallest normal exponent (zeros and
subnormals share the smallest spacing). Non-finite results keep ``c' = 0``.

:func:`param_correction` is the chain's last link that keeps ``c`` (its state,
:class:`ParamCorrectionState`, ``torch.optim`` name ``"param_correction"``); fused into a
rule's kernel when params are written in place (:func:`~lowbit_tree.step_`, the bridge), it
costs one byte read and written per element. :func:`master_weights` and :func:`from_master`
convert to and from float32 master values (export; loading a float32 checkpoint).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .base import GradientTransformation
from .tree_utils import flatten, map_leaves

__all__ = [
    "CORRECTED_DTYPES",
    "ParamCorrectionState",
    "param_correction",
    "correction_scale",
    "master_value",
    "split_master",
    "master_weights",
    "from_master",
]

CORRECTED_DTYPES = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}
"""Param dtypes that take a correction: ``dtype -> (mantissa bits, smallest normal exponent)``."""

CORRECTION_DTYPE = torch.int8
STEPS = 256  # corrections per ulp: c counts 1/256ths of an ulp


def correction_scale(p: torch.Tensor) -> torch.Tensor:
    """float32 ``ulp(p) / 256`` per element of a bfloat16 / float16 ``p``, built from its
    exponent bits (exact on every backend; the native kernel builds the same bits)."""
    mant, emin = CORRECTED_DTYPES[p.dtype]
    bits = p.float().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127  # float32's exponent field: p's binade (0 for zeros and subnormals)
    e = torch.clamp(e, min=emin)
    biased = e - mant - 8 + 127  # 2 ** (e - mant - 8) as a float32: biased exponent >= 1, or subnormal below
    normal = biased.clamp(min=1) << 23
    sub = torch.ones_like(biased) << (biased + 22).clamp(min=0, max=22)
    return torch.where(biased >= 1, normal, sub).view(torch.float32)


def master_value(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The float32 master value ``float(p) + c * scale(p)`` (exact)."""
    return p.float() + c.float() * correction_scale(p)


def split_master(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` -> ``(p, c)``: ``p`` a nearest value of ``x`` in ``dtype``, ``c`` the int8
    rest. ``p`` is ``x`` rounded to nearest even, except where the rest would be 128 (``x``
    within 1/512 ulp below the midpoint above ``p``, or on it): there ``p`` is the neighbour
    above and the rest -128 or so, which int8 holds, so every ``x`` within 16 significant
    bits of ``p`` comes back exactly."""
    p = x.to(dtype)
    c = torch.round((x - p.float()) / correction_scale(p))  # exact difference, exact division
    bits = p.view(torch.int16)
    # the neighbour above (x > p where c would be 128): one more in magnitude for p >= +0, one less below
    up = torch.where(bits >= 0, bits + 1, torch.where(bits == -32768, torch.ones_like(bits), bits - 1))
    above = up.view(dtype)
    move = (c > 127) & torch.isfinite(p) & torch.isfinite(above)  # an overflow stays one
    p = torch.where(move, above, p)
    c = torch.where(move, torch.round((x - p.float()) / correction_scale(p)), c)
    c = torch.where(torch.isfinite(p), c.clamp(-128, 127), torch.zeros_like(c))
    return p, c.to(CORRECTION_DTYPE)


class ParamCorrectionState(NamedTuple):
    correction: Any  # int8 per element of each bfloat16 / float16 param; None for other params

    roles = {"correction": "param_correction"}


def _zeros(p):
    if p is None or p.dtype not in CORRECTED_DTYPES:
        return None
    return torch.zeros(p.shape, dtype=CORRECTION_DTYPE, device=p.device)


def param_correction() -> GradientTransformation:
    """Last link of a chain: keep each bfloat16 / float16 param's float32 master value as the
    param plus an int8 correction (module docstring); other params pass through.

    Its update turns ``u`` into ``p' - p``, where ``p'`` is the next stored param, so that
    :func:`~lowbit_tree.apply_updates` (round to nearest) lands on ``p'`` exactly (the
    difference of two nearby values of ``p``'s dtype is exact in float32; a jump past a
    factor of 2^16 rounds once more); the new corrections are its next state. In place
    (``plan``, and fused into a rule's kernel by :func:`~lowbit_tree.chain`) it writes
    ``p'`` and ``c'`` directly.
    """

    def init(params):
        return ParamCorrectionState(map_leaves(_zeros, params))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("param_correction needs params: call update(updates, state, params)")
        leaves, treespec = flatten(params)
        ups, cs = treespec.flatten_up_to(updates), treespec.flatten_up_to(state.correction)
        out, new = [], []
        for p, u, c in zip(leaves, ups, cs):
            if p is None or u is None or c is None:
                out.append(u)
                new.append(c)
                continue
            target, c2 = split_master(master_value(p, c) + u.float(), p.dtype)
            out.append(target.float() - p.float())
            new.append(c2)
        return treespec.unflatten(out), ParamCorrectionState(treespec.unflatten(new))

    def plan(state, params, *, write=False, leaf_offset=0):
        leaves, treespec = flatten(params)
        cs = treespec.flatten_up_to(state.correction)

        def step(updates: list) -> list:
            out = []
            for p, u, c in zip(leaves, updates, cs):
                if p is None or u is None or c is None:
                    out.append(u)
                    continue
                target, c2 = split_master(master_value(p, c) + u.float(), p.dtype)
                c.copy_(c2)
                if write:
                    p.copy_(target)
                    out.append(None)
                else:
                    out.append(target.float() - p.float())
            return out

        return step

    def in_plan(state):  # in a chain's plan: the corrections the rule's kernel reads and writes
        return state.correction

    update.lowbit_link = ("corr", {"in_plan": in_plan})
    return GradientTransformation(init, update, plan)


def master_weights(params: Any, state: ParamCorrectionState) -> Any:
    """The float32 master values of ``params`` under ``state`` (params without a correction:
    their float32 value)."""
    return map_leaves(lambda p, c: None if p is None else (p.float() if c is None else master_value(p, c)),
                      params, state.correction)


def from_master(master: Any, dtypes: Any) -> tuple[Any, ParamCorrectionState]:
    """float32 master values -> ``(params in dtypes, their ParamCorrectionState)``: e.g. to
    start bfloat16 training with a correction from a float32 checkpoint. ``dtypes``: a tree
    of dtypes (or one dtype) shaped like ``master``."""
    leaves, treespec = flatten(master)
    ds = [dtypes] * len(leaves) if isinstance(dtypes, torch.dtype) else treespec.flatten_up_to(dtypes)
    ps, cs = [], []
    for x, d in zip(leaves, ds):
        if x is None:
            ps.append(None)
            cs.append(None)
        elif d in CORRECTED_DTYPES:
            p, c = split_master(x.float(), d)
            ps.append(p)
            cs.append(c)
        else:
            ps.append(x.to(d))
            cs.append(None)
    return treespec.unflatten(ps), ParamCorrectionState(treespec.unflatten(cs))


torch.serialization.add_safe_globals([ParamCorrectionState])
