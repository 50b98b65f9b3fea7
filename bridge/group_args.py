"""A param group's arguments checked with torch.optim's ranges and wording, before the group is
added: hyperparameters are numbers or 1-element tensors in range, flags booleans, torch.optim's
implementation arguments (``foreach``, ``fused``, ``capturable``, ``differentiable``,
``maximize``) as torch accepts them, and the storage arguments (``state_format``, ``block_size``,
``min_quant_size``, ...). Every error names the class and the argument."""
from __future__ import annotations

import math
import numbers

import torch

from lowbit_tree.moments import check_state_format
from lowbit_tree.rules import Arg

__all__ = ["BRIDGE_ARGS", "FUSED_DEVICES", "as_number", "in_range", "flag", "betas", "check_implementation_args",
           "check_storage_args", "group_params"]

BRIDGE_ARGS = {
    a.name: a
    for a in (
        Arg("foreach", "Chooses nothing: the step is always one fused kernel call per param group; kept in the param "
            "groups as torch does (frameworks pass it blindly).", "True, False or None"),
        Arg("fused", "As ``foreach``; ``fused=True`` with ``foreach=True`` raises, and so does ``fused=True`` for a "
            "param on a device without our kernels (CPU and CUDA have them).", "True, False or None"),
        Arg("capturable", "Accepted; the step reads no tensor on the host (except with ``skip_nonfinite``).",
            "True or False"),
        Arg("differentiable", "``True`` is refused: quantized states cannot carry autograd history.", "False"),
        Arg("skip_nonfinite", "Skip the whole step (params, states, step counts) when any gradient of it is NaN or "
            "infinite (one flag a step, read on the host).", "True or False"),
    )
}
"""The classes' arguments the bridge reads alone (the core never sees them): torch.optim's
implementation switches and ``skip_nonfinite``. The rest are :data:`lowbit_tree.rules.ARGS`."""

FUSED_DEVICES = ("cpu", "cuda")
"""Device types with our fused kernels (native C on CPU, compiled torch on CUDA)."""


def as_number(owner: str, name: str, value) -> float:
    """A hyperparameter as a float, for range checks: a real number or a 1-element tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{owner}: Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = f"; pass a number, e.g. {name}=float({value!r})" if isinstance(value, str) else ""
        raise TypeError(f"{owner}: {name} must be a number or a 1-element tensor, got {type(value).__name__} {value!r}{hint}")
    return float(value)


def in_range(owner: str, name: str, value, lo: float, hi: float = math.inf, hi_open: bool = True) -> None:
    """``lo <= value < hi`` (``<= hi`` if not ``hi_open``), finite; NaN fails too."""
    x = as_number(owner, name, value)
    ok = lo <= x and (x < hi if hi_open else x <= hi) and math.isfinite(x)
    if not ok:
        interval = f"in [{lo}, {hi}{')' if hi_open else ']'}" if math.isfinite(hi) else f"finite and >= {lo}"
        raise ValueError(f"{owner}: invalid {name} value {value!r}: must be {interval}")


def flag(owner: str, name: str, value, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        allowed = "True, False or None" if allow_none else "True or False"
        raise TypeError(f"{owner}: {name} must be {allowed}, got {type(value).__name__} {value!r}")


def betas(owner: str, values, n: int = 2) -> None:
    """``betas`` is a sequence of ``n`` numbers in [0, 1) (a pair for Adam / Lion, a triple for AdEMAMix)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != n:
        what = "a pair (beta1, beta2)" if n == 2 else "a triple (beta1, beta2, beta3)"
        raise ValueError(f"{owner}: betas must be {what}, got {values!r}")
    for i, b in enumerate(values):
        in_range(owner, f"betas[{i}]", b, 0.0, 1.0)


def check_implementation_args(owner: str, group: dict, params: list, at_step: bool = False) -> None:
    """torch.optim's foreach / fused / capturable / differentiable / maximize (module docstring)."""
    for name in ("foreach", "fused"):
        flag(owner, name, group.get(name), allow_none=True)
    flag(owner, "capturable", group.get("capturable", False))
    flag(owner, "differentiable", group.get("differentiable", False))
    flag(owner, "maximize", group.get("maximize", False))
    if group.get("differentiable"):
        raise ValueError(
            f"{owner}: differentiable=True is not supported: quantized states cannot carry autograd history "
            "through the step; use torch.optim's optimizer for differentiable optimization"
        )
    if group.get("fused") and group.get("foreach"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")  # torch's words
    if group.get("fused"):
        for p in params:
            if p.device.type == "meta" and not at_step:
                continue  # built before materialization, as torch allows: checked again at step()
            if p.device.type not in FUSED_DEVICES or not torch.is_floating_point(p):
                raise RuntimeError(  # torch.optim's words first: code matching torch's message keeps working
                    f"{owner}: `fused=True` requires all the params to be floating point Tensors of supported "
                    f"devices: {list(FUSED_DEVICES)} but {p.dtype} and {p.device.type}: a param of shape "
                    f"{tuple(p.shape)} is on {p.device.type}; pass fused=None"
                )


def check_storage_args(owner: str, group: dict, names: tuple) -> None:
    try:
        check_state_format(group["state_format"], names)
    except ValueError as e:
        raise ValueError(f"{owner}: {e}") from None
    bs = group["block_size"]
    if bs is not None and (isinstance(bs, bool) or not isinstance(bs, numbers.Integral) or bs < 1):
        raise ValueError(f"{owner}: block_size must be a positive int or None, got {bs!r}")
    flag(owner, "bf16_stochastic_round", group["bf16_stochastic_round"])
    flag(owner, "param_correction", group.get("param_correction", False))
    if group["bf16_stochastic_round"] and group.get("param_correction", False):
        raise ValueError(f"{owner}: bf16_stochastic_round=True and param_correction=True both keep small updates of a "
                         "bfloat16 param; choose one (param_correction keeps a 16-bit-mantissa master value)")
    flag(owner, "skip_nonfinite", group["skip_nonfinite"])
    mqs = group["min_quant_size"]
    if isinstance(mqs, bool) or not isinstance(mqs, numbers.Integral) or mqs < 0:
        raise ValueError(f"{owner}: min_quant_size must be an int >= 0, got {mqs!r}")


def group_params(param_group: dict) -> list:
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    return [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]  # (name, param) pairs


