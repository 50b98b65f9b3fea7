"""Ready-made optimizers as chains of building blocks (optax's ``alias``).

Each takes ``state_format`` (``"fp32"``, ``"bf16"``, ``"8bit"``, ``"4bit"``, ``"nf4"``,
``"fp8"``, ``"8bit_bnb"``, or a mapping from state names to formats such as
``{"exp_avg": "8bit", "exp_avg_sq": "4bit"}``, the states it leaves out in ``"8bit"``:
:func:`~lowbit_tree.moments.state_formats`), ``block_size`` and ``min_quant_size`` for its
moment states, and ``stochastic_round`` (with ``seed``) to round bfloat16 params
stochastically (see :func:`~lowbit_tree.update.stochastic_rounding`) or ``param_correction``
to keep each bfloat16 / float16 param's master value as the param plus an int8 correction
(:mod:`lowbit_tree.correction`; at most one of the two). The state names are
torch.optim's, as each state class declares them (``ScaleByAdamState.roles``).
"""
from __future__ import annotations

from typing import Any

import torch

from .base import GradientTransformation, ScalarOrSchedule, identity, state_names
from .moments import StateFormat, check_state_format
from .combine import chain
from .transform import (
    TraceState, add_decayed_weights, flip_sign, scale_by_adam, scale_by_ademamix, scale_by_learning_rate,
    scale_by_adadelta, scale_by_adamax, scale_by_lion, scale_by_nadam, scale_by_radam, scale_by_rms, scale_by_rss, trace,
)
from .muon_transform import DEFAULT_NS_COEFFICIENTS, scale_by_muon
from .correction import param_correction as correction_link
from .update import stochastic_rounding

__all__ = ["adam", "adamw", "ademamix", "lion", "muon", "sgd", "rmsprop", "adagrad", "adamax", "adadelta", "radam", "nadam"]


def _is_zero(x) -> bool:
    """Statically zero (a Python number); a tensor may change later, so it is not."""
    return not isinstance(x, torch.Tensor) and not callable(x) and x == 0


def _optimizer(rule: GradientTransformation, learning_rate: ScalarOrSchedule | None, *, before: tuple = (),
               after: tuple = (), maximize: bool = False, stochastic_round: bool, seed: int,
               param_correction: bool) -> GradientTransformation:
    """An optimizer from its recipe, the one shape every alias has: :func:`flip_sign` first for
    ``maximize``, the links ``before`` the rule (L2 decay of the gradient), the rule, the links
    ``after`` it (decoupled decay), :func:`scale_by_learning_rate` (``None``: the rule applies its
    own, as Muon's), and the stochastic-rounding or param-correction link last. One kernel call per
    step when the links sit next to the rule (see :func:`~lowbit_tree.chain`)."""
    if stochastic_round and param_correction:
        raise ValueError("stochastic_round and param_correction are two ways to keep small updates of a "
                         "bfloat16 param; choose one (param_correction keeps a 16-bit-mantissa master value)")
    head = (flip_sign(),) if maximize else ()
    lr = () if learning_rate is None else (scale_by_learning_rate(learning_rate),)
    tail = (stochastic_rounding(seed),) if stochastic_round else ((correction_link(),) if param_correction else ())
    return chain(*head, *before, rule, *after, *lr, *tail)


def _l2(weight_decay) -> tuple:
    """torch.optim's ``weight_decay`` as L2 decay of the gradient: no link when it is the number 0."""
    return () if _is_zero(weight_decay) else (add_decayed_weights(weight_decay),)


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    *,
    weight_decay: float | torch.Tensor = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    rank1_normalization: bool | None = None,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """Adam as torch.optim.Adam: ``chain([flip_sign], [add_decayed_weights], scale_by_adam,
    scale_by_learning_rate)``; ``weight_decay`` is L2 decay added to the gradient
    (after the sign flip of ``maximize``, as torch does)."""
    rule = scale_by_adam(b1, b2, eps, amsgrad=amsgrad, state_format=state_format, block_size=block_size,
                         min_quant_size=min_quant_size, rank1_normalization=rank1_normalization)
    return _optimizer(rule, learning_rate, before=_l2(weight_decay),
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    weight_decay: float | torch.Tensor = 1e-2,
    mask: Any = None,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    rank1_normalization: bool | None = None,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """AdamW with decoupled decay as torch.optim.AdamW: ``p - lr * (adam_update + wd * p)``.

    ``mask``: tree of bools (or ``params -> tree``) choosing the decayed leaves.
    """
    rule = scale_by_adam(b1, b2, eps, amsgrad=amsgrad, state_format=state_format, block_size=block_size,
                         min_quant_size=min_quant_size, rank1_normalization=rank1_normalization)
    return _optimizer(rule, learning_rate, after=(add_decayed_weights(weight_decay, mask),),
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def ademamix(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    b3: float | torch.Tensor = 0.9999,
    alpha: float | torch.Tensor = 5.0,
    eps: float | torch.Tensor = 1e-8,
    weight_decay: float | torch.Tensor = 1e-2,
    mask: Any = None,
    *,
    t_alpha: int | None = None,
    t_beta3: int | None = None,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    slow_state_format: str | None = None,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """AdEMAMix (arXiv 2409.03137) with decoupled decay, as bitsandbytes' ``AdEMAMix``:
    ``p - lr * ((m_hat + alpha * s) / (sqrt(v_hat) + eps) + wd * p)``; ``t_alpha`` and
    ``t_beta3`` warm ``alpha`` and ``b3`` up (``ademamix_warmups``)."""
    rule = scale_by_ademamix(b1, b2, b3, alpha, eps, t_alpha=t_alpha, t_beta3=t_beta3, state_format=state_format,
                             block_size=block_size, min_quant_size=min_quant_size,
                             slow_state_format=slow_state_format)
    return _optimizer(rule, learning_rate, after=(add_decayed_weights(weight_decay, mask),),
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.99,
    weight_decay: float | torch.Tensor = 0.0,
    mask: Any = None,
    *,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """Lion (arXiv 2302.06675) with decoupled decay: ``p - lr * (sign(...) + wd * p)``."""
    rule = scale_by_lion(b1, b2, state_format=state_format, block_size=block_size, min_quant_size=min_quant_size)
    decay = identity() if _is_zero(weight_decay) else add_decayed_weights(weight_decay, mask)  # a slot either way
    return _optimizer(rule, learning_rate, after=(decay,),
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float | torch.Tensor = 0.0,
    nesterov: bool = False,
    weight_decay: float | torch.Tensor = 0.0,
    *,
    has_momentum: bool | None = None,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """SGD as torch.optim.SGD (dampening 0): L2 ``weight_decay`` is added to the
    gradient before momentum; the momentum buffer exists (and is quantized, as a
    first moment) unless ``momentum`` is the number 0, or ``has_momentum`` says whether it does
    (a ``torch.optim`` wrapper decides it once per param group, where the momentum is a tensor)."""
    keep = not _is_zero(momentum) if has_momentum is None else has_momentum
    if nesterov and not keep:
        raise ValueError("nesterov momentum needs momentum > 0")
    check_state_format(state_format, state_names(TraceState))  # checked even when no buffer is kept
    rule = identity() if not keep else trace(momentum, nesterov, state_format=state_format, block_size=block_size,
                                             min_quant_size=min_quant_size)
    l2 = identity() if _is_zero(weight_decay) else add_decayed_weights(weight_decay)  # a slot either way
    return _optimizer(rule, learning_rate, before=(l2,),
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def muon(
    learning_rate: ScalarOrSchedule,
    momentum: float | torch.Tensor = 0.95,
    weight_decay: float | torch.Tensor = 0.1,
    nesterov: bool = True,
    ns_coefficients=DEFAULT_NS_COEFFICIENTS,
    eps: float | torch.Tensor = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    *,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    momentum_rank: int = 0,
    orthogonalize=None,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """Muon as torch.optim.Muon, for 2-D params: :func:`~lowbit_tree.scale_by_muon` with its
    learning rate and decoupled decay (torch's param step: ``p * (1 - lr * wd) - lr * ratio *
    NS(momentum)``). For a whole model, :func:`~lowbit_tree.partition` it with :func:`adamw`
    for the other params (embeddings, norms, biases, head)."""
    rule = scale_by_muon(momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn, learning_rate=learning_rate,
                         weight_decay=weight_decay, state_format=state_format, block_size=block_size,
                         min_quant_size=min_quant_size, momentum_rank=momentum_rank, orthogonalize=orthogonalize)
    return _optimizer(rule, None, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def rmsprop(
    learning_rate: ScalarOrSchedule,
    alpha: float | torch.Tensor = 0.99,
    eps: float | torch.Tensor = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    momentum: float | torch.Tensor = 0.0,
    centered: bool = False,
    *,
    has_momentum: bool | None = None,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """RMSprop as torch.optim.RMSprop: ``chain([flip_sign], [add_decayed_weights],
    scale_by_rms, scale_by_learning_rate)``; ``weight_decay`` is L2 decay added to the gradient.
    States ``square_avg``, ``momentum_buffer`` (when ``momentum`` is not the number 0, or
    ``has_momentum``) and ``grad_avg`` (``centered``)."""
    rule = scale_by_rms(alpha, eps, momentum, centered=centered, has_momentum=has_momentum, state_format=state_format,
                        block_size=block_size, min_quant_size=min_quant_size)
    return _optimizer(rule, learning_rate, before=_l2(weight_decay),
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def _decayed_lr(learning_rate: ScalarOrSchedule, lr_decay):
    """torch.optim.Adagrad's step size: ``lr / (1 + count * lr_decay)`` (``count``: steps taken),
    in float64 as torch computes it; ``learning_rate`` itself when ``lr_decay`` is the number 0."""
    if _is_zero(lr_decay):
        return learning_rate

    def schedule(count):
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        return lr / (1 + count.to(torch.float64) * lr_decay)

    return schedule


def adagrad(
    learning_rate: ScalarOrSchedule,
    lr_decay: float | torch.Tensor = 0.0,
    weight_decay: float | torch.Tensor = 0.0,
    initial_accumulator_value: float | torch.Tensor = 0.0,
    eps: float | torch.Tensor = 1e-10,
    *,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """Adagrad as torch.optim.Adagrad: ``chain([flip_sign], [add_decayed_weights], scale_by_rss,
    scale_by_learning_rate)`` with step ``t`` (from 1) scaled by ``lr / (1 + (t - 1) * lr_decay)``;
    ``weight_decay`` is L2 decay added to the gradient. One state, ``sum``."""
    rule = scale_by_rss(initial_accumulator_value, eps, state_format=state_format, block_size=block_size,
                        min_quant_size=min_quant_size)
    return _optimizer(rule, _decayed_lr(learning_rate, lr_decay), before=_l2(weight_decay),
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def adamax(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    *,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """Adamax as torch.optim.Adamax: ``chain([flip_sign], [add_decayed_weights], scale_by_adamax,
    scale_by_learning_rate)``; ``weight_decay`` is L2 decay added to the gradient. States
    ``exp_avg`` and ``exp_inf``."""
    rule = scale_by_adamax(b1, b2, eps, state_format=state_format, block_size=block_size, min_quant_size=min_quant_size)
    return _optimizer(rule, learning_rate, before=_l2(weight_decay),
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def adadelta(
    learning_rate: ScalarOrSchedule,
    rho: float | torch.Tensor = 0.9,
    eps: float | torch.Tensor = 1e-6,
    weight_decay: float | torch.Tensor = 0.0,
    *,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """Adadelta as torch.optim.Adadelta: ``chain([flip_sign], [add_decayed_weights],
    scale_by_adadelta, scale_by_learning_rate)``; ``weight_decay`` is L2 decay added to the
    gradient. States ``square_avg`` and ``acc_delta``."""
    rule = scale_by_adadelta(rho, eps, state_format=state_format, block_size=block_size, min_quant_size=min_quant_size)
    return _optimizer(rule, learning_rate, before=_l2(weight_decay),
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def radam(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """RAdam as torch.optim.RAdam: ``chain([flip_sign], [add_decayed_weights], scale_by_radam,
    scale_by_learning_rate)`` with L2 decay added to the gradient, or with
    ``decoupled_weight_decay`` the decay after the rule (``p - lr * (update + wd * p)``). States
    ``exp_avg`` and ``exp_avg_sq``."""
    rule = scale_by_radam(b1, b2, eps, state_format=state_format, block_size=block_size,
                          min_quant_size=min_quant_size)
    before, after = ((), (add_decayed_weights(weight_decay),)) if decoupled_weight_decay else (_l2(weight_decay), ())
    return _optimizer(rule, learning_rate, before=before, after=after,
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)


def nadam(
    learning_rate: ScalarOrSchedule,
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    weight_decay: float | torch.Tensor = 0.0,
    momentum_decay: float | torch.Tensor = 4e-3,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    stochastic_round: bool = False,
    param_correction: bool = False,
    seed: int = 0,
) -> GradientTransformation:
    """NAdam as torch.optim.NAdam: ``chain([flip_sign], [add_decayed_weights], scale_by_nadam,
    scale_by_learning_rate)`` with L2 decay added to the gradient, or with
    ``decoupled_weight_decay`` the decay after the rule (``p - lr * (update + wd * p)``). States
    ``exp_avg``, ``exp_avg_sq`` and the scalar ``mu_product``."""
    rule = scale_by_nadam(b1, b2, eps, momentum_decay, state_format=state_format, block_size=block_size,
                          min_quant_size=min_quant_size)
    before, after = ((), (add_decayed_weights(weight_decay),)) if decoupled_weight_decay else (_l2(weight_decay), ())
    return _optimizer(rule, learning_rate, before=before, after=after,
                      maximize=maximize, stochastic_round=stochastic_round, seed=seed, param_correction=param_correction)
