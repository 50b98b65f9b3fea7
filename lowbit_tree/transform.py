"""Building blocks: each returns a :class:`GradientTransformation` (optax's ``transform``).

All arithmetic is float32 whatever the parameter or gradient dtype; updates
come back in the gradient's dtype. Hyperparameters may be Python floats or 0-d
tensors (so :func:`~lowbit_tree.inject_hyperparams` can swap them without
recompiling), and nothing here reads a tensor value on the host.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import moments
from .base import EmptyState, GradientTransformation, ScalarOrSchedule, init_count, scalar_value
from .tree_utils import flatten, map_leaves, map_leaves_n

__all__ = [
    "ScaleByAdamState",
    "ScaleByLionState",
    "TraceState",
    "ScaleByScheduleState",
    "scale_by_adam",
    "adam_leaf_update",
    "amsgrad_leaf_update",
    "scale_by_lion",
    "lion_leaf_update",
    "trace",
    "momentum_leaf_update",
    "add_decayed_weights",
    "scale",
    "scale_by_learning_rate",
    "clip_by_global_norm",
]


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # int32, 0-d: steps taken
    mu: Any  # first moments, shaped like params (QTensor / float tensor leaves)
    nu: Any  # second moments (QTensor / Rank1QTensor / float tensor leaves)
    nu_max: Any  # running max of nu (amsgrad) or None


class ScaleByLionState(NamedTuple):
    count: torch.Tensor
    mu: Any


class TraceState(NamedTuple):
    trace: Any  # the momentum buffer, shaped like params


class ScaleByScheduleState(NamedTuple):
    count: torch.Tensor


def _bias_correction(beta: float | torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``1 - beta**step`` as a 0-d tensor, in float64 where the device has it.

    ``1 - 0.999**1`` loses ~1e-5 relative in float32 (torch.optim computes it in
    Python float64); the 0-d float64 result then enters float32 ops as a scalar.
    """
    dtype = torch.float32 if step.device.type == "mps" else torch.float64
    step = step.to(dtype)
    base = beta.to(dtype) if isinstance(beta, torch.Tensor) else beta
    return 1 - base**step


def adam_leaf_update(g, m_state, v_state, count, b1, b2, eps):
    """One Adam step for one leaf (torch.optim.Adam semantics, ``eps`` outside the sqrt).

    Args:
      g: gradient, any float dtype.
      m_state, v_state: stored first / second moments (QTensor, Rank1QTensor or tensor).
      count: 0-d int tensor, steps taken before this one.
      b1, b2, eps: floats or 0-d tensors.
    Returns:
      ``(update, m_state, v_state)``: the update in ``g.dtype`` (to be scaled by
      ``-lr``) and the new moments, stored like the old ones.
    """
    gf = g.float()
    m = b1 * moments.load(m_state) + (1 - b1) * gf
    v = b2 * moments.load(v_state) + (1 - b2) * gf * gf
    step = count + 1
    bc1, bc2 = _bias_correction(b1, step), _bias_correction(b2, step)
    denom = v.sqrt() / bc2.sqrt() + eps
    update = (m / denom) / bc1
    return update.to(g.dtype), moments.store(m, m_state), moments.store(v, v_state)


def amsgrad_leaf_update(g, m_state, v_state, vmax_state, count, b1, b2, eps):
    """Adam with AMSGrad (torch semantics: the max of the raw second moments)."""
    gf = g.float()
    m = b1 * moments.load(m_state) + (1 - b1) * gf
    v = b2 * moments.load(v_state) + (1 - b2) * gf * gf
    vmax = torch.maximum(moments.load(vmax_state), v)
    step = count + 1
    bc1, bc2 = _bias_correction(b1, step), _bias_correction(b2, step)
    update = (m / (vmax.sqrt() / bc2.sqrt() + eps)) / bc1
    return (
        update.to(g.dtype),
        moments.store(m, m_state),
        moments.store(v, v_state),
        moments.store(vmax, vmax_state),
    )


def scale_by_adam(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    *,
    amsgrad: bool = False,
    state_format: str = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    rank1_normalization: bool = False,
) -> GradientTransformation:
    """Rescale updates by Adam's ``m_hat / (sqrt(v_hat) + eps)``.

    Args:
      b1, b2: decay rates of the first and second moments.
      eps: added to ``sqrt(v_hat)`` (outside the square root, as torch.optim.Adam).
      amsgrad: keep the running maximum of ``v`` (state ``nu_max``, stored like ``nu``).
      state_format: ``"fp32"``, ``"bf16"`` (all leaves), or a quantized format
        (``"8bit"``, ``"4bit"``, ``"fp8"``, ``"8bit_bnb"``; see
        ``lowbit_tree.STATE_FORMATS``) for leaves that pass :func:`should_quantize`.
      block_size: block size of quantized leaves (``None``: the format's default).
      min_quant_size: smaller (or 1-D) leaves keep a float32 state.
      rank1_normalization: with ``"4bit"``, store ``nu`` as a
        :class:`~lowbit_tree.moments.Rank1QTensor` (arXiv 2309.01507).
    Returns:
      A transformation with state :class:`ScaleByAdamState`.
    """
    moments.check_state_format(state_format)
    if rank1_normalization and state_format != "4bit":
        raise ValueError(f"rank1_normalization needs state_format='4bit', got {state_format!r}")

    def moment(signed):
        return lambda p: moments.init_moment(
            p, state_format, signed=signed, block_size=block_size, min_quant_size=min_quant_size,
            rank1=rank1_normalization,
        )

    def init(params):
        mu = map_leaves(moment(True), params)
        nu = map_leaves(moment(False), params)
        nu_max = map_leaves(moment(False), params) if amsgrad else None
        return ScaleByAdamState(init_count(params), mu, nu, nu_max)

    def update(updates, state, params=None, **extra):
        count = state.count
        if amsgrad:
            def leaf(g, m, v, vmax):
                if g is None:
                    return None, m, v, vmax
                return amsgrad_leaf_update(g, m, v, vmax, count, b1, b2, eps)

            updates, mu, nu, nu_max = map_leaves_n(4, leaf, updates, state.mu, state.nu, state.nu_max)
        else:
            def leaf(g, m, v):
                if g is None:
                    return None, m, v
                return adam_leaf_update(g, m, v, count, b1, b2, eps)

            updates, mu, nu = map_leaves_n(3, leaf, updates, state.mu, state.nu)
            nu_max = None
        return updates, ScaleByAdamState(count + 1, mu, nu, nu_max)

    return GradientTransformation(init, update)


def lion_leaf_update(g, m_state, b1, b2):
    """One Lion step for one leaf: ``sign(b1*m + (1-b1)*g)``; ``m <- b2*m + (1-b2)*g``."""
    gf = g.float()
    m = moments.load(m_state)
    update = torch.sign(b1 * m + (1 - b1) * gf)
    m = b2 * m + (1 - b2) * gf
    return update.to(g.dtype), moments.store(m, m_state)


def scale_by_lion(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.99,
    *,
    state_format: str = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """Lion's sign update (arXiv 2302.06675); one state, the momentum (signed format)."""
    moments.check_state_format(state_format)

    def init(params):
        mu = map_leaves(
            lambda p: moments.init_moment(p, state_format, signed=True, block_size=block_size, min_quant_size=min_quant_size),
            params,
        )
        return ScaleByLionState(init_count(params), mu)

    def update(updates, state, params=None, **extra):
        def leaf(g, m):
            return (None, m) if g is None else lion_leaf_update(g, m, b1, b2)

        updates, mu = map_leaves_n(2, leaf, updates, state.mu)
        return updates, ScaleByLionState(state.count + 1, mu)

    return GradientTransformation(init, update)


def momentum_leaf_update(g, buf_state, momentum, nesterov: bool):
    """torch.optim.SGD momentum (dampening 0): ``buf <- momentum*buf + g``."""
    gf = g.float()
    buf = momentum * moments.load(buf_state) + gf
    update = gf + momentum * buf if nesterov else buf
    return update.to(g.dtype), moments.store(buf, buf_state)


def trace(
    momentum: float | torch.Tensor,
    nesterov: bool = False,
    *,
    state_format: str = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """Heavy-ball (or Nesterov) momentum as in torch.optim.SGD with ``dampening=0``.

    A zero buffer reproduces torch's first step (``buf = g``). The buffer is a
    first moment: signed format when quantized.
    """
    moments.check_state_format(state_format)

    def init(params):
        buf = map_leaves(
            lambda p: moments.init_moment(p, state_format, signed=True, block_size=block_size, min_quant_size=min_quant_size),
            params,
        )
        return TraceState(buf)

    def update(updates, state, params=None, **extra):
        def leaf(g, b):
            return (None, b) if g is None else momentum_leaf_update(g, b, momentum, nesterov)

        updates, buf = map_leaves_n(2, leaf, updates, state.trace)
        return updates, TraceState(buf)

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float | torch.Tensor = 0.0, mask: Any = None) -> GradientTransformation:
    """``update + weight_decay * param`` (decoupled decay once scaled by ``-lr``).

    Args:
      weight_decay: float or 0-d tensor.
      mask: optional tree of Python bools (or ``params -> tree``) selecting the
        leaves to decay; see :func:`~lowbit_tree.masked`.
    """

    def init(params):
        return EmptyState()

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")

        def leaf(u, p):
            if u is None:
                return None
            return (u.float() + weight_decay * p.float()).to(u.dtype)

        return map_leaves(leaf, updates, params), state

    tx = GradientTransformation(init, update)
    if mask is not None:
        from .wrappers import masked

        return masked(tx, mask)
    return tx


def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Multiply updates by a constant (float or 0-d tensor)."""

    def init(params):
        return EmptyState()

    def update(updates, state, params=None, **extra):
        return map_leaves(lambda u: None if u is None else (u.float() * step_size).to(u.dtype), updates), state

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (``+`` with ``flip_sign=False``).

    ``learning_rate`` is a float, a 0-d tensor, or a schedule ``count -> lr``
    evaluated with torch ops on the count's device; the count is this
    transformation's own state (:class:`ScaleByScheduleState`).
    """

    def init(params):
        return ScaleByScheduleState(init_count(params))

    def update(updates, state, params=None, **extra):
        lr = scalar_value(learning_rate, state.count)
        factor = -lr if flip_sign else lr
        new = map_leaves(lambda u: None if u is None else (u.float() * factor).to(u.dtype), updates)
        return new, ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update)


def clip_by_global_norm(max_norm: float | torch.Tensor) -> GradientTransformation:
    """Scale all updates by ``max_norm / max(global_norm, max_norm)`` (no host sync).

    The global norm is the float32 l2 norm over all leaves; a NaN/inf norm
    propagates into the updates (as torch's ``clip_grad_norm_`` does).
    """

    def init(params):
        return EmptyState()

    def update(updates, state, params=None, **extra):
        leaves = [u for u in flatten(updates)[0] if u is not None]
        if not leaves:
            return updates, state
        sq = torch.stack([u.float().square().sum() for u in leaves])
        norm = sq.sum().sqrt()
        factor = max_norm / torch.clamp(norm, min=max_norm)
        return map_leaves(lambda u: None if u is None else (u.float() * factor).to(u.dtype), updates), state

    return GradientTransformation(init, update)


torch.serialization.add_safe_globals([ScaleByAdamState, ScaleByLionState, TraceState, ScaleByScheduleState])
