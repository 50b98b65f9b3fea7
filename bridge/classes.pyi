# Generated from bridge/classes.py's declarations by `python -m bridge.stub`: do not edit.
# tests/test_typing.py fails when it is stale.
from collections.abc import Mapping

from torch import Tensor
from torch.optim.optimizer import ParamsT

from .optimizer import LowBitOptimizer

__all__ = [
    'Adam',
    'AdamW',
    'Lion',
    'SGD',
    'Adam8bit',
    'AdamW8bit',
    'Adam4bit',
    'AdamW4bit',
    'AdamFp8',
    'AdamWFp8',
    'Lion8bit',
    'Lion4bit',
    'SGD8bit',
    'AdEMAMix',
    'AdEMAMix8bit',
    'AdEMAMix4bit',
    'RMSprop',
    'RMSprop8bit',
    'RMSprop4bit',
    'RMSpropFp8',
    'Adagrad',
    'Adagrad8bit',
    'Adagrad4bit',
    'AdagradFp8',
    'Adamax',
    'Adamax8bit',
    'Adamax4bit',
    'AdamaxFp8',
    'Adadelta',
    'Adadelta8bit',
    'Adadelta4bit',
    'AdadeltaFp8',
    'RAdam',
    'RAdam8bit',
    'RAdam4bit',
    'RAdamFp8',
    'NAdam',
    'NAdam8bit',
    'NAdam4bit',
    'NAdamFp8',
]

class TorchOptimizerBase(LowBitOptimizer): ...

class Adam(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.001,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-08,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        rank1_normalization: bool | None = None,
        param_correction: bool = False,
    ) -> None: ...

class AdamW(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.001,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-08,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        rank1_normalization: bool | None = None,
        param_correction: bool = False,
    ) -> None: ...

class Lion(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.0001,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        param_correction: bool = False,
    ) -> None: ...

class SGD(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.001,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        param_correction: bool = False,
    ) -> None: ...

class Adam8bit(Adam):
    ...

class AdamW8bit(AdamW):
    ...

class Adam4bit(Adam):
    ...

class AdamW4bit(AdamW):
    ...

class AdamFp8(Adam):
    ...

class AdamWFp8(AdamW):
    ...

class Lion8bit(Lion):
    ...

class Lion4bit(Lion):
    ...

class SGD8bit(SGD):
    ...

class AdEMAMix(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.001,
        betas: tuple[float | Tensor, float | Tensor, float | Tensor] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-08,
        weight_decay: float = 0.01,
        *,
        maximize: bool = False,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        slow_state_format: str | None = None,
        param_correction: bool = False,
    ) -> None: ...

class AdEMAMix8bit(AdEMAMix):
    ...

class AdEMAMix4bit(AdEMAMix):
    ...

class RMSprop(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.01,
        alpha: float = 0.99,
        eps: float = 1e-08,
        weight_decay: float = 0,
        momentum: float = 0,
        centered: bool = False,
        capturable: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        *,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        param_correction: bool = False,
    ) -> None: ...

class RMSprop8bit(RMSprop):
    ...

class RMSprop4bit(RMSprop):
    ...

class RMSpropFp8(RMSprop):
    ...

class Adagrad(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.01,
        lr_decay: float = 0,
        weight_decay: float = 0,
        initial_accumulator_value: float = 0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        param_correction: bool = False,
    ) -> None: ...

class Adagrad8bit(Adagrad):
    ...

class Adagrad4bit(Adagrad):
    ...

class AdagradFp8(Adagrad):
    ...

class Adamax(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.002,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-08,
        weight_decay: float = 0,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        param_correction: bool = False,
    ) -> None: ...

class Adamax8bit(Adamax):
    ...

class Adamax4bit(Adamax):
    ...

class AdamaxFp8(Adamax):
    ...

class Adadelta(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1.0,
        rho: float = 0.9,
        eps: float = 1e-06,
        weight_decay: float = 0,
        foreach: bool | None = None,
        *,
        capturable: bool = False,
        maximize: bool = False,
        differentiable: bool = False,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        param_correction: bool = False,
    ) -> None: ...

class Adadelta8bit(Adadelta):
    ...

class Adadelta4bit(Adadelta):
    ...

class AdadeltaFp8(Adadelta):
    ...

class RAdam(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.001,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-08,
        weight_decay: float = 0,
        decoupled_weight_decay: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        param_correction: bool = False,
    ) -> None: ...

class RAdam8bit(RAdam):
    ...

class RAdam4bit(RAdam):
    ...

class RAdamFp8(RAdam):
    ...

class NAdam(TorchOptimizerBase):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.002,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-08,
        weight_decay: float = 0,
        momentum_decay: float = 0.004,
        decoupled_weight_decay: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        state_format: str | Mapping[str, str] | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        bf16_stochastic_round: bool = False,
        skip_nonfinite: bool = False,
        param_correction: bool = False,
    ) -> None: ...

class NAdam8bit(NAdam):
    ...

class NAdam4bit(NAdam):
    ...

class NAdamFp8(NAdam):
    ...
