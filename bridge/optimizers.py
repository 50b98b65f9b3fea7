"""Named optimizers with torch.optim / torchao-compatible signatures.

Each is a :class:`~bridge.optimizer.LowBitOptimizer` over a chain of core
building blocks; the math lives in ``lowbit_tree``. Every param group may
override ``state_format`` (``"fp32"``, ``"bf16"``, ``"8bit"``, ``"4bit"``, ``"nf4"``,
``"fp8"``, ``"8bit_bnb"``), ``block_size`` and ``min_quant_size``.

``state_format`` may also be a mapping from the optimizer's torch.optim state names to formats,
``{"exp_avg": "8bit", "exp_avg_sq": "4bit"}``: the states it names take those formats, the others
the class's own (``"fp32"`` for ``AdamW``, ``"8bit"`` for ``AdamW8bit``, ...), in the constructor
and in a param group alike (a group's ``state_format`` replaces the constructor's as a whole, as
any group option does). The names are those the core's state classes declare
(:func:`lowbit_tree.base.state_names`); any other is refused, naming the valid ones. Each group
keeps the whole mapping, every state of its rule named, so its ``param_groups`` entry and state
dicts say each state's format.

torch.optim's implementation arguments are accepted, because frameworks pass them
blindly (torchtitan puts ``fused`` and ``foreach`` in every param group), and kept in
the param groups as torch does:

- ``foreach`` / ``fused``: choose nothing. The step is always ours and always fused:
  one kernel call per group (and step count) for every class, param dtype and state
  format (the core's transition, :func:`lowbit_tree.step_`). As in torch,
  ``fused=True`` with ``foreach=True`` is an error, and so is ``fused=True`` for a
  param on a device we have no kernels for (:data:`FUSED_DEVICES`).
- ``capturable``: accepted; the step never reads a tensor on the host anyway.
- ``differentiable=True``: rejected (quantized states cannot carry autograd history).
- ``maximize``: implemented by every class, as torch.optim does it (the gradient is
  negated before anything else, L2 decay included); it may change between steps.

Every group (the constructor's defaults and each ``param_groups`` entry, also ones
added later) is checked before anything changes: hyperparameters must be numbers or
1-element tensors in torch's ranges, flags booleans; the errors name the argument.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from lowbit_tree import alias
from lowbit_tree.base import state_names
from lowbit_tree.moments import FORMAT_ARGUMENTS, RANK1_STATE_FORMATS, check_state_format, state_formats
from lowbit_tree.transform import ScaleByAdamState, ScaleByAdEMAMixState, ScaleByLionState, TraceState

from .optimizer import LowBitOptimizer

__all__ = [
    "Adam", "AdamW", "Lion", "SGD",
    "Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8",
    "Lion8bit", "Lion4bit", "SGD8bit", "AdEMAMix", "AdEMAMix8bit", "AdEMAMix4bit",
]


FUSED_DEVICES = ("cpu", "cuda")
"""Device types with our fused kernels (native C on CPU, compiled torch on CUDA)."""


# ----------------------------------------------------------------------------
# argument checks: run on each param group before it is added
# ----------------------------------------------------------------------------
def _value(owner: str, name: str, value) -> float:
    """A hyperparameter as a float, for range checks: a real number or a 1-element tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{owner}: Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = f"; pass a number, e.g. {name}=float({value!r})" if isinstance(value, str) else ""
        raise TypeError(f"{owner}: {name} must be a number or a 1-element tensor, got {type(value).__name__} {value!r}{hint}")
    return float(value)


def _in_range(owner: str, name: str, value, lo: float, hi: float = math.inf, hi_open: bool = True) -> None:
    """``lo <= value < hi`` (``<= hi`` if not ``hi_open``), finite; NaN fails too."""
    x = _value(owner, name, value)
    ok = lo <= x and (x < hi if hi_open else x <= hi) and math.isfinite(x)
    if not ok:
        interval = f"in [{lo}, {hi}{')' if hi_open else ']'}" if math.isfinite(hi) else f"finite and >= {lo}"
        raise ValueError(f"{owner}: invalid {name} value {value!r}: must be {interval}")


def _flag(owner: str, name: str, value, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        allowed = "True, False or None" if allow_none else "True or False"
        raise TypeError(f"{owner}: {name} must be {allowed}, got {type(value).__name__} {value!r}")


def _betas(owner: str, betas, n: int = 2) -> None:
    """``betas`` is a sequence of ``n`` numbers in [0, 1) (a pair for Adam / Lion, a triple for AdEMAMix)."""
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != n:
        what = "a pair (beta1, beta2)" if n == 2 else "a triple (beta1, beta2, beta3)"
        raise ValueError(f"{owner}: betas must be {what}, got {betas!r}")
    for i, b in enumerate(betas):
        _in_range(owner, f"betas[{i}]", b, 0.0, 1.0)


def _check_implementation_args(owner: str, group: dict, params: list, at_step: bool = False) -> None:
    """torch.optim's foreach / fused / capturable / differentiable / maximize (module docstring)."""
    for name in ("foreach", "fused"):
        _flag(owner, name, group.get(name), allow_none=True)
    _flag(owner, "capturable", group.get("capturable", False))
    _flag(owner, "differentiable", group.get("differentiable", False))
    _flag(owner, "maximize", group.get("maximize", False))
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
            if p.device.type not in FUSED_DEVICES:
                raise RuntimeError(
                    f"{owner}: `fused=True` requires all the params to be on supported devices: {list(FUSED_DEVICES)} "
                    f"but a param of shape {tuple(p.shape)} is on {p.device.type}; pass fused=None"
                )


def _check_storage_args(owner: str, group: dict, names: tuple) -> None:
    try:
        check_state_format(group["state_format"], names)
    except ValueError as e:
        raise ValueError(f"{owner}: {e}") from None
    bs = group["block_size"]
    if bs is not None and (isinstance(bs, bool) or not isinstance(bs, numbers.Integral) or bs < 1):
        raise ValueError(f"{owner}: block_size must be a positive int or None, got {bs!r}")
    _flag(owner, "bf16_stochastic_round", group["bf16_stochastic_round"])
    _flag(owner, "param_correction", group.get("param_correction", False))
    if group["bf16_stochastic_round"] and group.get("param_correction", False):
        raise ValueError(f"{owner}: bf16_stochastic_round=True and param_correction=True both keep small updates of a "
                         "bfloat16 param; choose one (param_correction keeps a 16-bit-mantissa master value)")
    _flag(owner, "skip_nonfinite", group["skip_nonfinite"])
    mqs = group["min_quant_size"]
    if isinstance(mqs, bool) or not isinstance(mqs, numbers.Integral) or mqs < 0:
        raise ValueError(f"{owner}: min_quant_size must be an int >= 0, got {mqs!r}")


def _with_correction(defaults: dict, param_correction) -> None:
    """``param_correction`` as a group option, only when asked for: a group key older checkpoints
    lack would make DCP's load of them fail (as ``rank1_normalization``)."""
    if param_correction is not False:
        defaults["param_correction"] = param_correction


def _group_params(param_group: dict) -> list:
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    return [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]  # (name, param) pairs


class _TorchOptimizer(LowBitOptimizer):
    """The named optimizers' common part: every param group is checked (``_check_group``)
    before it is added, the constructor's defaults included."""

    _default_format = "fp32"
    _state_types: tuple = ()
    """The core state classes of this optimizer's rules: their roles name its states."""

    def _group_state_types(self, group: dict) -> tuple:
        """The state classes of ``group``'s rule (Muon: by ``use_muon``)."""
        return self._state_types

    def _default_formats(self, names: tuple) -> dict:
        """The class's format for each state a ``state_format`` mapping leaves out."""
        return dict.fromkeys(names, self._default_format)

    def _state_formats(self, group: dict) -> dict:
        """``{state name: format}`` for every state of ``group``'s rule, from its ``state_format``
        (a name, or a mapping checked against every state this optimizer keeps) and the
        arguments that set one state (``slow_state_format``); a ValueError names what is wrong."""
        names = state_names(*self._group_state_types(group))
        sf = group["state_format"]
        if isinstance(sf, Mapping):
            check_state_format(sf, state_names(*self._state_types))
            sf = {k: v for k, v in sf.items() if k in names}  # Muon: a mapping names both kinds' states
        arguments = {arg: group.get(arg) for state, arg in FORMAT_ARGUMENTS.items() if state in names}
        return state_formats(sf, names, default=self._default_formats(names), **arguments)

    def _resolve_formats(self, owner: str, param_group: dict, group: dict) -> dict:
        """The entries a group with a ``state_format`` mapping stores: the whole mapping (every
        state of its rule), and ``slow_state_format`` agreeing with it. A group's own setting of a
        state (mapping entry or argument) replaces the constructor's other spelling of it; both
        spellings in one place must agree."""
        sf = group["state_format"]
        if not isinstance(sf, Mapping):
            return {}
        values = dict(group, state_format=dict(sf))
        for state, arg in FORMAT_ARGUMENTS.items():
            own_arg, own_sf = arg in param_group, "state_format" in param_group
            if own_arg and not own_sf:
                values["state_format"].pop(state, None)
            elif own_sf and not own_arg and state in sf:
                values[arg] = None
        try:
            formats = self._state_formats(values)
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None
        out = {"state_format": formats}
        out.update({arg: formats[state] for state, arg in FORMAT_ARGUMENTS.items()
                    if state in formats and group.get(arg) is not None})
        return out

    def add_param_group(self, param_group: dict) -> None:
        param_group = dict(param_group)
        params = param_group["params"]
        if not isinstance(params, torch.Tensor):
            param_group["params"] = params = list(params)  # a generator is read once, here
        group = {**self.defaults, **param_group}
        owner = type(self).__name__
        _check_implementation_args(owner, group, _group_params(param_group))
        if group.get("fused") and any(p.device.type == "meta" for p in _group_params(param_group)):
            self.__dict__["_fused_pending"] = True  # (before __init__ ends): checked at step()
        _check_storage_args(owner, group, state_names(*self._state_types))
        resolved = self._resolve_formats(owner, param_group, group)
        param_group.update(resolved)
        group.update(resolved)
        self._check_group(owner, group)
        if "has_momentum" in self.defaults and "momentum" in param_group and "has_momentum" not in param_group:
            param_group["has_momentum"] = group["momentum"] != 0  # this group's own momentum decides its buffer
        super().add_param_group(param_group)

    _PICKLED = LowBitOptimizer._PICKLED + ("_fused_pending",)

    def _check_group(self, owner: str, group: dict) -> None:
        raise NotImplementedError

    def step(self, closure=None):
        """torch.optim's step; ``fused=True`` over params built on the meta device is checked
        here (as torch does), once they have been materialized."""
        if self.__dict__.get("_fused_pending"):
            for group in self.param_groups:
                if group.get("fused"):
                    _check_implementation_args(type(self).__name__, group, group["params"], at_step=True)
            self._fused_pending = False
        return super().step(closure)

    @classmethod
    def _state_format(cls, state_format):
        """The constructor's ``state_format``: a low-bit named class takes its own format, or a
        mapping for the states to keep otherwise (the rest keep the class's format)."""
        if isinstance(state_format, Mapping):
            return dict(state_format)  # checked, and completed per group, by add_param_group
        if state_format is None or cls._default_format == "fp32" or state_format == cls._default_format:
            return state_format or cls._default_format
        base = next(c for c in cls.__mro__ if c._default_format == "fp32")
        raise ValueError(
            f"{cls.__name__} stores {cls._default_format!r} states; state_format={state_format!r} conflicts with it: use "
            f"bridge.{base.__name__}(params, state_format={state_format!r}) (a param group may still override "
            "state_format for its own params), or a mapping for the states to store otherwise, e.g. "
            f"{cls.__name__}(params, state_format={{{state_names(*cls._state_types)[0]!r}: {state_format!r}}})"
        )


def adam_l2(learning_rate, b1, b2, eps, weight_decay, *, amsgrad=False, maximize=False, state_format="8bit",
            block_size=None, min_quant_size=4096, stochastic_round=False, rank1_normalization=None,
            param_correction=False):
    """torch.optim.Adam: L2 ``weight_decay`` added to the gradient before the moments."""
    return alias.adam(learning_rate, b1, b2, eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                      state_format=state_format, block_size=block_size, min_quant_size=min_quant_size,
                      stochastic_round=stochastic_round, rank1_normalization=rank1_normalization,
                      param_correction=param_correction)


def adamw_decoupled(learning_rate, b1, b2, eps, weight_decay, *, amsgrad=False, maximize=False, state_format="8bit",
                    block_size=None, min_quant_size=4096, stochastic_round=False, rank1_normalization=None,
                    param_correction=False):
    """torch.optim.AdamW: decoupled decay, ``p - lr * (adam + wd * p)``."""
    return alias.adamw(learning_rate, b1, b2, eps, weight_decay, amsgrad=amsgrad, maximize=maximize,
                       state_format=state_format, block_size=block_size, min_quant_size=min_quant_size,
                       stochastic_round=stochastic_round, rank1_normalization=rank1_normalization,
                       param_correction=param_correction)


def lion_decoupled(learning_rate, b1, b2, weight_decay, *, maximize=False, state_format="8bit", block_size=None,
                   min_quant_size=4096, stochastic_round=False, param_correction=False):
    return alias.lion(learning_rate, b1, b2, weight_decay, maximize=maximize, state_format=state_format,
                      block_size=block_size, min_quant_size=min_quant_size, stochastic_round=stochastic_round,
                      param_correction=param_correction)


def sgd_momentum(learning_rate, momentum, weight_decay, *, has_momentum=False, nesterov=False, maximize=False,
                 state_format="8bit", block_size=None, min_quant_size=4096, stochastic_round=False,
                 param_correction=False):
    """torch.optim.SGD (dampening 0). ``has_momentum`` (static) decides whether a buffer exists."""
    return alias.sgd(learning_rate, momentum if has_momentum else 0.0, nesterov, weight_decay, maximize=maximize,
                     state_format=state_format, block_size=block_size, min_quant_size=min_quant_size,
                     stochastic_round=stochastic_round, param_correction=param_correction)


def _adam_kwargs(group):
    b1, b2 = group["betas"]
    return dict(learning_rate=group["lr"], b1=b1, b2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                amsgrad=group["amsgrad"], maximize=bool(group.get("maximize", False)),
                state_format=group["state_format"], block_size=group["block_size"],
                min_quant_size=group["min_quant_size"], stochastic_round=group["bf16_stochastic_round"],
                param_correction=group.get("param_correction", False),
                rank1_normalization=group.get("rank1_normalization"))


class _AdamBase(_TorchOptimizer):
    _factory_fn = None
    _default_wd = 0.0
    _state_types = (ScaleByAdamState,)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 state_format=None, block_size=None, min_quant_size=4096, bf16_stochastic_round=False,
                 skip_nonfinite=False, rank1_normalization=None, param_correction=False):
        weight_decay = self._default_wd if weight_decay is None else weight_decay
        _betas(type(self).__name__, betas)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                        fused=fused, state_format=self._state_format(state_format), block_size=block_size,
                        min_quant_size=min_quant_size, bf16_stochastic_round=bf16_stochastic_round,
                        skip_nonfinite=skip_nonfinite)
        if rank1_normalization is not None:
            # only when given: a group key that older checkpoints lack would make DCP's load of
            # them fail ("Missing key ... rank1_normalization"); absent, the format decides
            # (lowbit_tree.moments.default_rank1: rank-1 for "4bit")
            defaults["rank1_normalization"] = rank1_normalization
        _with_correction(defaults, param_correction)
        super().__init__(params, type(self)._factory_fn, defaults, group_to_kwargs=_adam_kwargs)

    def _check_group(self, owner, group):
        _in_range(owner, "lr", group["lr"], 0.0)
        _betas(owner, group["betas"])
        _in_range(owner, "eps", group["eps"], 0.0)
        _in_range(owner, "weight_decay", group["weight_decay"], 0.0)
        _flag(owner, "amsgrad", group["amsgrad"])
        _flag(owner, "rank1_normalization", group.get("rank1_normalization"), allow_none=True)
        if group.get("rank1_normalization") and self._state_formats(group)["exp_avg_sq"] not in RANK1_STATE_FORMATS:
            raise ValueError(
                f"{owner}: rank1_normalization=True is a 4-bit second moment (row and column maxima instead of "
                f"block scales); this group's state_format is {group['state_format']!r}: use state_format='4bit' "
                "(bridge.AdamW4bit / Adam4bit) or 'nf4', or a mapping with 'exp_avg_sq': '4bit'"
            )


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
                maximize=bool(group.get("maximize", False)),
                state_format=group["state_format"], block_size=group["block_size"],
                min_quant_size=group["min_quant_size"], stochastic_round=group["bf16_stochastic_round"],
                param_correction=group.get("param_correction", False))


class Lion(_TorchOptimizer):
    """Lion (arXiv 2302.06675) with decoupled weight decay; one state, ``exp_avg``."""

    _state_types = (ScaleByLionState,)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, foreach=None, maximize=False,
                 capturable=False, differentiable=False, fused=None, state_format=None, block_size=None,
                 min_quant_size=4096, bf16_stochastic_round=False, skip_nonfinite=False, param_correction=False):
        _betas(type(self).__name__, betas)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=foreach, maximize=maximize,
                        capturable=capturable, differentiable=differentiable, fused=fused,
                        state_format=self._state_format(state_format), block_size=block_size,
                        min_quant_size=min_quant_size, bf16_stochastic_round=bf16_stochastic_round,
                        skip_nonfinite=skip_nonfinite)
        _with_correction(defaults, param_correction)
        super().__init__(params, lion_decoupled, defaults, group_to_kwargs=_lion_kwargs)

    def _check_group(self, owner, group):
        _in_range(owner, "lr", group["lr"], 0.0)
        _betas(owner, group["betas"])
        _in_range(owner, "weight_decay", group["weight_decay"], 0.0)


class Lion8bit(Lion):
    _default_format = "8bit"


class Lion4bit(Lion):
    _default_format = "4bit"


def ademamix_decoupled(learning_rate, b1, b2, b3, alpha, eps, weight_decay, *, t_alpha=None, t_beta3=None,
                       maximize=False, state_format="8bit", block_size=None, min_quant_size=4096,
                       slow_state_format=None, stochastic_round=False, param_correction=False):
    """bitsandbytes' AdEMAMix: decoupled decay, ``p - lr * (ademamix + wd * p)``."""
    return alias.ademamix(learning_rate, b1, b2, b3, alpha, eps, weight_decay, t_alpha=t_alpha, t_beta3=t_beta3,
                          maximize=maximize, state_format=state_format, block_size=block_size,
                          min_quant_size=min_quant_size, slow_state_format=slow_state_format,
                          stochastic_round=stochastic_round, param_correction=param_correction)


def _ademamix_kwargs(group):
    b1, b2, b3 = group["betas"]
    return dict(learning_rate=group["lr"], b1=b1, b2=b2, b3=b3, alpha=group["alpha"], eps=group["eps"],
                weight_decay=group["weight_decay"], t_alpha=group["t_alpha"], t_beta3=group["t_beta3"],
                maximize=bool(group.get("maximize", False)), state_format=group["state_format"],
                block_size=group["block_size"], min_quant_size=group["min_quant_size"],
                slow_state_format=group.get("slow_state_format"), stochastic_round=group["bf16_stochastic_round"],
                param_correction=group.get("param_correction", False))


def _warmup_steps(owner: str, name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{owner}: {name} must be a positive number of steps (int) or None, got {value!r}")


class AdEMAMix(_TorchOptimizer):
    """AdEMAMix (arXiv 2409.03137) with bitsandbytes' ``AdEMAMix`` signature and decoupled
    weight decay; states ``exp_avg`` (fast EMA), ``exp_avg_sq`` and ``exp_avg_slow`` (the
    slow EMA, rate ``betas[2]``, weight ``alpha``), default ``"fp32"``. ``t_alpha`` /
    ``t_beta3`` warm ``alpha`` and ``betas[2]`` up over that many steps. ``slow_state_format``
    stores the slow EMA in its own format (default: ``state_format``; AdEMAMix4bit: ``"8bit"``)."""

    _default_slow_format = None
    _state_types = (ScaleByAdEMAMixState,)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None, eps=1e-8,
                 weight_decay=1e-2, *, maximize=False, state_format=None, block_size=None, min_quant_size=4096,
                 bf16_stochastic_round=False, skip_nonfinite=False, slow_state_format=None, param_correction=False):
        owner = type(self).__name__
        if slow_state_format is None and not (isinstance(state_format, Mapping) and "exp_avg_slow" in state_format):
            slow_state_format = self._default_slow_format  # the class's, unless the mapping names the slow EMA
        _betas(owner, betas, 3)
        _warmup_steps(owner, "t_alpha", t_alpha)
        _warmup_steps(owner, "t_beta3", t_beta3)
        defaults = dict(lr=lr, betas=tuple(betas), alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                        weight_decay=weight_decay, maximize=maximize, state_format=self._state_format(state_format),
                        block_size=block_size, min_quant_size=min_quant_size,
                        bf16_stochastic_round=bf16_stochastic_round, skip_nonfinite=skip_nonfinite)
        if slow_state_format is not None:  # a group key only when asked for (older checkpoints lack it)
            defaults["slow_state_format"] = slow_state_format
        _with_correction(defaults, param_correction)
        super().__init__(params, ademamix_decoupled, defaults, group_to_kwargs=_ademamix_kwargs)

    def _check_group(self, owner, group):
        _in_range(owner, "lr", group["lr"], 0.0)
        _betas(owner, group["betas"], 3)
        _in_range(owner, "alpha", group["alpha"], 0.0)
        _in_range(owner, "eps", group["eps"], 0.0)
        _in_range(owner, "weight_decay", group["weight_decay"], 0.0)
        _warmup_steps(owner, "t_alpha", group["t_alpha"])
        _warmup_steps(owner, "t_beta3", group["t_beta3"])
        try:
            self._state_formats(group)  # slow_state_format: a format name, agreeing with a mapping
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None


class AdEMAMix8bit(AdEMAMix):
    """AdEMAMix with 8-bit states (both EMAs on the signed dynamic map, v on the zero-free one)."""

    _default_format = "8bit"


class AdEMAMix4bit(AdEMAMix):
    """AdEMAMix with 4-bit fast EMA and second moment, and an **8-bit slow EMA** by default
    (``slow_state_format="4bit"`` for all 4-bit): the slow EMA's error is multiplied by
    ``alpha`` (design.md, "AdEMAMix4bit's slow EMA", has the measurement behind the default)."""

    _default_format = "4bit"
    _default_slow_format = "8bit"


def _sgd_kwargs(group):
    return dict(learning_rate=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"],
                has_momentum=group["has_momentum"], nesterov=group["nesterov"],
                maximize=bool(group.get("maximize", False)), state_format=group["state_format"],
                block_size=group["block_size"], min_quant_size=group["min_quant_size"],
                stochastic_round=group["bf16_stochastic_round"],
                param_correction=group.get("param_correction", False))


class SGD(_TorchOptimizer):
    """torch.optim.SGD (momentum, nesterov, L2 weight decay; dampening 0) with a
    ``state_format`` momentum buffer. Whether a group has a buffer is fixed when the
    group is added (its ``momentum != 0``); the momentum value may change later."""

    _state_types = (TraceState,)

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, state_format=None, block_size=None,
                 min_quant_size=4096, bf16_stochastic_round=False, skip_nonfinite=False, param_correction=False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        has_momentum=momentum != 0, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused, state_format=self._state_format(state_format), block_size=block_size,
                        min_quant_size=min_quant_size, bf16_stochastic_round=bf16_stochastic_round,
                        skip_nonfinite=skip_nonfinite)
        _with_correction(defaults, param_correction)
        super().__init__(params, sgd_momentum, defaults, group_to_kwargs=_sgd_kwargs)

    def _check_group(self, owner, group):
        _in_range(owner, "lr", group["lr"], 0.0)
        _in_range(owner, "momentum", group["momentum"], 0.0, 1.0)
        _in_range(owner, "weight_decay", group["weight_decay"], 0.0)
        _flag(owner, "nesterov", group["nesterov"])
        if _value(owner, "dampening", group["dampening"]) != 0:
            raise ValueError(f"{owner}: dampening={group['dampening']!r} is not supported; use dampening=0")
        if group["nesterov"] and _value(owner, "momentum", group["momentum"]) <= 0:
            raise ValueError(f"{owner}: nesterov=True requires a momentum > 0")


class SGD8bit(SGD):
    _default_format = "8bit"
