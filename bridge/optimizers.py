"""Named optimizers with torch.optim / torchao-compatible signatures.

Each is a :class:`~bridge.optimizer.LowBitOptimizer` over a chain of core
building blocks; the math lives in ``lowbit_tree``. Every param group may
override ``state_format`` (``"fp32"``, ``"bf16"``, ``"8bit"``, ``"4bit"``,
``"fp8"``, ``"8bit_bnb"``), ``block_size`` and ``min_quant_size``.
"""
from __future__ import annotations

import torch

from lowbit_tree import alias
from lowbit_tree.base import GradientTransformation
from lowbit_tree.combine import chain
from lowbit_tree.transform import add_decayed_weights, scale_by_adam, scale_by_learning_rate
from lowbit_tree.update import stochastic_rounding

from .optimizer import LowBitOptimizer

__all__ = [
    "Adam", "AdamW", "Lion", "SGD",
    "Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8",
    "Lion8bit", "Lion4bit", "SGD8bit",
]


def _check(lr, eps=None, betas=None, weight_decay=None):
    if not isinstance(lr, torch.Tensor) and not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps is not None and not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if betas is not None:
        for i, b in enumerate(betas):
            if not isinstance(b, torch.Tensor) and not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if weight_decay is not None and not isinstance(weight_decay, torch.Tensor) and not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _finish(txs, stochastic_round: bool) -> GradientTransformation:
    return chain(*txs, stochastic_rounding(0)) if stochastic_round else chain(*txs)


def adam_l2(learning_rate, b1, b2, eps, weight_decay, *, amsgrad=False, state_format="8bit", block_size=None,
            min_quant_size=4096, stochastic_round=False):
    """torch.optim.Adam: L2 ``weight_decay`` added to the gradient before the moments."""
    return _finish(
        [
            add_decayed_weights(weight_decay),
            scale_by_adam(b1, b2, eps, amsgrad=amsgrad, state_format=state_format, block_size=block_size,
                          min_quant_size=min_quant_size),
            scale_by_learning_rate(learning_rate),
        ],
        stochastic_round,
    )


def adamw_decoupled(learning_rate, b1, b2, eps, weight_decay, *, amsgrad=False, state_format="8bit", block_size=None,
                    min_quant_size=4096, stochastic_round=False):
    """torch.optim.AdamW: decoupled decay, ``p - lr * (adam + wd * p)``."""
    return alias.adamw(learning_rate, b1, b2, eps, weight_decay, amsgrad=amsgrad, state_format=state_format,
                          block_size=block_size, min_quant_size=min_quant_size, stochastic_round=stochastic_round)


def lion_decoupled(learning_rate, b1, b2, weight_decay, *, state_format="8bit", block_size=None, min_quant_size=4096,
                   stochastic_round=False):
    return alias.lion(learning_rate, b1, b2, weight_decay, state_format=state_format, block_size=block_size,
                         min_quant_size=min_quant_size, stochastic_round=stochastic_round)


def sgd_momentum(learning_rate, momentum, weight_decay, *, has_momentum=False, nesterov=False, state_format="8bit",
                 block_size=None, min_quant_size=4096, stochastic_round=False):
    """torch.optim.SGD (dampening 0). ``has_momentum`` (static) decides whether a buffer exists."""
    return alias.sgd(learning_rate, momentum if has_momentum else 0.0, nesterov, weight_decay,
                        state_format=state_format, block_size=block_size, min_quant_size=min_quant_size,
                        stochastic_round=stochastic_round)


def _adam_kwargs(group):
    b1, b2 = group["betas"]
    return dict(learning_rate=group["lr"], b1=b1, b2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                amsgrad=group["amsgrad"], state_format=group["state_format"], block_size=group["block_size"],
                min_quant_size=group["min_quant_size"], stochastic_round=group["bf16_stochastic_round"])


class _AdamBase(LowBitOptimizer):
    _factory_fn = None
    _default_format = "fp32"
    _default_wd = 0.0

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None, amsgrad=False, *,
                 state_format=None, block_size=None, min_quant_size=4096, bf16_stochastic_round=False,
                 skip_nonfinite=False):
        weight_decay = self._default_wd if weight_decay is None else weight_decay
        _check(lr, eps, betas, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        state_format=state_format or self._default_format, block_size=block_size,
                        min_quant_size=min_quant_size, bf16_stochastic_round=bf16_stochastic_round,
                        skip_nonfinite=skip_nonfinite)
        super().__init__(params, type(self)._factory_fn, defaults, group_to_kwargs=_adam_kwargs)


class Adam(_AdamBase):
    """torch.optim.Adam (L2 weight decay) with ``state_format`` states (default ``"fp32"``)."""

    _factory_fn = staticmethod(adam_l2)


class AdamW(_AdamBase):
    """torch.optim.AdamW (decoupled decay, default 1e-2) with ``state_format`` states (default ``"fp32"``)."""

    _factory_fn = staticmethod(adamw_decoupled)
    _default_wd = 1e-2


class Adam8bit(Adam):
    """Adam with 8-bit states (first moment: bitsandbytes' dynamic map; second: zero-free sqrt map)."""

    _default_format = "8bit"


class AdamW8bit(AdamW):
    """AdamW with 8-bit states."""

    _default_format = "8bit"


class Adam4bit(Adam):
    """Adam with 4-bit states (arXiv 2309.01507 maps, block 128)."""

    _default_format = "4bit"


class AdamW4bit(AdamW):
    """AdamW with 4-bit states."""

    _default_format = "4bit"


class AdamFp8(Adam):
    """Adam with float8 e4m3 states (second moment stored as zero-free sqrt)."""

    _default_format = "fp8"


class AdamWFp8(AdamW):
    """AdamW with float8 e4m3 states."""

    _default_format = "fp8"


def _lion_kwargs(group):
    b1, b2 = group["betas"]
    return dict(learning_rate=group["lr"], b1=b1, b2=b2, weight_decay=group["weight_decay"],
                state_format=group["state_format"], block_size=group["block_size"],
                min_quant_size=group["min_quant_size"], stochastic_round=group["bf16_stochastic_round"])


class Lion(LowBitOptimizer):
    """Lion (arXiv 2302.06675) with decoupled weight decay; one state, ``exp_avg``."""

    _default_format = "fp32"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, state_format=None, block_size=None,
                 min_quant_size=4096, bf16_stochastic_round=False, skip_nonfinite=False):
        _check(lr, None, betas, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                        state_format=state_format or self._default_format, block_size=block_size,
                        min_quant_size=min_quant_size, bf16_stochastic_round=bf16_stochastic_round,
                        skip_nonfinite=skip_nonfinite)
        super().__init__(params, lion_decoupled, defaults, group_to_kwargs=_lion_kwargs)


class Lion8bit(Lion):
    _default_format = "8bit"


class Lion4bit(Lion):
    _default_format = "4bit"


def _sgd_kwargs(group):
    return dict(learning_rate=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"],
                has_momentum=group["has_momentum"], nesterov=group["nesterov"], state_format=group["state_format"],
                block_size=group["block_size"], min_quant_size=group["min_quant_size"],
                stochastic_round=group["bf16_stochastic_round"])


class SGD(LowBitOptimizer):
    """torch.optim.SGD (momentum, nesterov, L2 weight decay; dampening 0) with a
    ``state_format`` momentum buffer. Whether a buffer exists is fixed at
    construction (``momentum != 0``); the momentum value may change later."""

    _default_format = "fp32"

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 state_format=None, block_size=None, min_quant_size=4096, bf16_stochastic_round=False,
                 skip_nonfinite=False):
        _check(lr, None, None, weight_decay)
        if dampening != 0:
            raise ValueError("dampening != 0 is not supported; use dampening=0")
        if momentum < 0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum requires a momentum")
        defaults = dict(lr=lr, momentum=momentum, dampening=0.0, weight_decay=weight_decay, nesterov=nesterov,
                        has_momentum=momentum != 0, state_format=state_format or self._default_format,
                        block_size=block_size, min_quant_size=min_quant_size,
                        bf16_stochastic_round=bf16_stochastic_round, skip_nonfinite=skip_nonfinite)
        super().__init__(params, sgd_momentum, defaults, group_to_kwargs=_sgd_kwargs)


class SGD8bit(SGD):
    _default_format = "8bit"
