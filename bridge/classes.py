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
  param on a device we have no kernels for (:data:`bridge.group_args.FUSED_DEVICES`).
- ``capturable``: accepted; the step never reads a tensor on the host anyway.
- ``differentiable=True``: rejected (quantized states cannot carry autograd history).
- ``maximize``: implemented by every class, as torch.optim does it (the gradient is
  negated before anything else, L2 decay included); it may change between steps.

Every group (the constructor's defaults and each ``param_groups`` entry, also ones
added later) is checked before anything changes: hyperparameters must be numbers or
1-element tensors in torch's ranges, flags booleans; the errors name the argument.

Each class is one declaration (:class:`_ClassDecl`: the alias it runs, torch.optim's arguments in
its order with its defaults, the meanings :data:`lowbit_tree.rules.ARGS` does not give for it);
its constructor, its param group -> alias mapping, its group checks and its docstring's Args
section are derived from it, so the API reference says what every argument does.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from lowbit_tree import alias, rules
from lowbit_tree.base import state_names
from lowbit_tree.moments import FORMAT_ARGUMENTS, RANK1_STATE_FORMATS, check_state_format, state_formats
from lowbit_tree.rule_builder import state_type

from . import group_args
from .optimizer import LowBitOptimizer

__all__ = [
    "Adam", "AdamW", "Lion", "SGD",
    "Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8",
    "Lion8bit", "Lion4bit", "SGD8bit", "AdEMAMix", "AdEMAMix8bit", "AdEMAMix4bit",
    "RMSprop", "RMSprop8bit", "RMSprop4bit", "RMSpropFp8", "Adagrad", "Adagrad8bit", "Adagrad4bit", "AdagradFp8",
    "Adamax", "Adamax8bit", "Adamax4bit", "AdamaxFp8", "Adadelta", "Adadelta8bit", "Adadelta4bit", "AdadeltaFp8",
    "RAdam", "RAdam8bit", "RAdam4bit", "RAdamFp8", "NAdam", "NAdam8bit", "NAdam4bit", "NAdamFp8",
]


class TorchOptimizerBase(LowBitOptimizer):
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
        group_args.check_implementation_args(owner, group, group_args.group_params(param_group))
        if group.get("fused") and any(p.device.type == "meta" for p in group_args.group_params(param_group)):
            self.__dict__["_fused_pending"] = True  # (before __init__ ends): checked at step()
        group_args.check_storage_args(owner, group, state_names(*self._state_types))
        resolved = self._resolve_formats(owner, param_group, group)
        param_group.update(resolved)
        group.update(resolved)
        self._check_group(owner, group)
        if "has_momentum" in self.defaults and "momentum" in param_group and "has_momentum" not in param_group:
            param_group["has_momentum"] = group["momentum"] != 0  # this group's own momentum decides its buffer
        super().add_param_group(param_group)

    PICKLED = LowBitOptimizer.PICKLED + ("_fused_pending",)

    def _check_group(self, owner: str, group: dict) -> None:
        raise NotImplementedError

    def step(self, closure=None):
        """torch.optim's step; ``fused=True`` over params built on the meta device is checked
        here (as torch does), once they have been materialized."""
        if self.__dict__.get("_fused_pending"):
            for group in self.param_groups:
                if group.get("fused"):
                    group_args.check_implementation_args(type(self).__name__, group, group["params"], at_step=True)
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


# ----------------------------------------------------------------------------
# the named classes: one declaration each (_ClassDecl), everything else derived
# ----------------------------------------------------------------------------
def _warmup_steps(owner: str, name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{owner}: {name} must be a positive number of steps (int) or None, got {value!r}")


_CHECKS = {
    "nonneg": lambda owner, name, v: group_args.in_range(owner, name, v, 0.0),
    "unit": lambda owner, name, v: group_args.in_range(owner, name, v, 0.0, 1.0),
    "closed_unit": lambda owner, name, v: group_args.in_range(owner, name, v, 0.0, 1.0, hi_open=False),
    "flag": group_args.flag,
    "flag_or_none": lambda owner, name, v: group_args.flag(owner, name, v, allow_none=True),
    "betas": lambda owner, name, v: group_args.betas(owner, v),
    "betas3": lambda owner, name, v: group_args.betas(owner, v, 3),
    "steps": lambda owner, name, v: _warmup_steps(owner, name, v),
}
"""How a group value is checked, by the name an argument's declaration gives (``Arg.check``)."""

_OPTIONAL = {"rank1_normalization": None, "param_correction": False, "slow_state_format": None}
"""Group keys kept only when given another value than this: a group key that older checkpoints
lack would make DCP's load of them fail ("Missing key ..."); absent, the rule's default holds."""


@dataclasses.dataclass(frozen=True)
class _ClassDecl:
    """A named class's declaration: the core alias it runs, its arguments after ``params`` in
    its torch.optim namesake's order (``(name, default)``; those from ``keyword`` on are
    keyword-only), and what its arguments mean where :data:`lowbit_tree.rules.ARGS` does not
    say it for this class. From it: the constructor (signature, defaults, param-group keys),
    the group's checks, the group -> alias keyword mapping and the docstring's Args section."""

    rule: str
    alias: Any
    args: tuple
    keyword: str
    summary: str
    docs: tuple = ()
    """``((name, Arg), ...)``: this class's meaning of an argument."""
    core: tuple = ()
    """``((group key, alias argument), ...)`` beyond the declared ``Arg.core`` names."""

    def arg(self, name: str) -> rules.Arg:
        return dict(self.docs).get(name) or group_args.BRIDGE_ARGS.get(name) or rules.ARGS[name]


class _GroupKwargs:
    """A param group -> its alias's keyword arguments, as a class's :class:`_ClassDecl` maps them (one
    object per class: its module makes the optimizer remember a group's split)."""

    def __init__(self, decl: _ClassDecl):
        self.pairs = tuple((name, decl.arg(name).core) for name, _ in decl.args if decl.arg(name).core) + decl.core

    def __call__(self, group: dict) -> dict:
        out = {}
        for key, core in self.pairs:
            if key == "betas":
                out.update(zip(("b1", "b2", "b3"), group["betas"]))
            elif key == "maximize":
                out[core] = bool(group.get(key, False))
            elif key in _OPTIONAL:
                out[core] = group.get(key, _OPTIONAL[key])
            else:
                out[core] = group[key]
        return out


_NUMBER = "float | Tensor"  # (as torch.optim: a scheduler, or a user, may give 1-element tensors)


def _annotation(name: str, arg: rules.Arg, default) -> str:
    """An argument's type, from its declaration (:class:`lowbit_tree.rules.Arg`'s ``allowed``)
    and its default: a tuple default is a tuple of numbers of its length (``betas``), as
    torch.optim annotates it; ``None`` allowed or default adds ``| None``."""
    allowed = arg.allowed
    if isinstance(default, tuple):
        out = f"tuple[{', '.join([_NUMBER] * len(default))}]"
    elif "mapping" in allowed:
        out = "str | Mapping[str, str]"
    elif "format name" in allowed:
        out = "str"
    elif "tensor" in allowed:
        out = _NUMBER
    elif "number" in allowed or allowed == "0":
        out = "float"
    elif "int" in allowed:
        out = "int"
    elif "True" in allowed or "False" in allowed:
        out = "bool"
    else:
        raise ValueError(f"bridge.classes: no type for the argument {name!r}, allowed {allowed!r}; say the allowed "
                         "values in the words _annotation reads (number, tensor, int, True/False, format name, "
                         "mapping, None) or teach it the new ones")
    if "None" in allowed or default is None:
        out += " | None"
    return out


def declared_signature(decl: _ClassDecl) -> inspect.Signature:
    """A declared class's constructor signature: ``params``, then the declaration's arguments in
    order with their defaults and types (:func:`_annotation`), keyword-only from ``decl.keyword``
    on. ``bridge/classes.pyi`` writes it out for static tools (:mod:`bridge.stub`)."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD), P("params", P.POSITIONAL_OR_KEYWORD, annotation="ParamsT")]
    kind = P.POSITIONAL_OR_KEYWORD
    for name, default in decl.args:
        if name == decl.keyword:
            kind = P.KEYWORD_ONLY
        params.append(P(name, kind, default=default, annotation=_annotation(name, decl.arg(name), default)))
    return inspect.Signature(params, return_annotation="None")


def _constructor(decl: _ClassDecl):
    """The ``__init__`` a declared class gets: its signature is the declaration's."""
    signature = declared_signature(decl)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        del values["self"]
        self._construct(values.pop("params"), values)

    __init__.__signature__ = signature
    return __init__


class _Declared(TorchOptimizerBase):
    """A named class built from its :class:`_ClassDecl` (``_decl``): its low-bit subclasses
    (``RMSprop8bit``) set only ``_default_format`` and a one-line ``_summary``."""

    _decl: _ClassDecl

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_decl" in cls.__dict__:
            cls.__init__ = _constructor(cls._decl)
            cls._state_types = (state_type(cls._decl.rule),)
        if cls.__dict__.get("__doc__") is None and ("_decl" in cls.__dict__ or "_summary" in cls.__dict__):
            cls.__doc__ = _docstring(cls)  # ours; a user's subclass keeps its own (or inherits ours)

    def _prepare(self, values: dict) -> None:
        """Class-specific constructor values (before the group is made): none by default."""

    def _construct(self, params, values: dict) -> None:
        owner = type(self).__name__
        decl = self._decl
        self._prepare(values)
        for name, _ in decl.args:
            check = decl.arg(name).check
            if check in ("betas", "betas3", "steps"):  # (as torch.optim: a bad pair fails before the params)
                _CHECKS[check](owner, name, values[name])
        defaults = {}
        for name, value in values.items():
            if name == "betas":
                value = tuple(value)
            elif name == "state_format":
                value = self._state_format(value)
            if name in _OPTIONAL and value == _OPTIONAL[name] and type(value) is type(_OPTIONAL[name]):
                continue
            defaults[name] = value
            if name == "momentum" and ("has_momentum", "has_momentum") in decl.core:
                defaults["has_momentum"] = value != 0  # fixed per group: whether a buffer exists
        super().__init__(params, decl.alias, defaults, group_to_kwargs=_GroupKwargs(decl))

    def _check_group(self, owner, group):
        for name, _ in self._decl.args:
            check = self._decl.arg(name).check
            if check is not None and name in group:
                _CHECKS[check](owner, name, group[name])
        self._check_rule(owner, group)

    def _check_rule(self, owner: str, group: dict) -> None:
        """Checks across arguments (beyond each argument's own): none by default."""


# ---------------------------------------------------------------------------- docstrings
def _format_default(cls, name: str, default) -> Any:
    """The default a class's docstring states: what ``None`` stands for where it stands for one."""
    if name == "state_format" and default is None:
        return f'(``{cls._default_format!r}``, the class\'s own)'
    if name == "weight_decay" and default is None:
        return getattr(cls, "_default_wd", 0.0)
    if name == "slow_state_format" and default is None:
        slow = getattr(cls, "_default_slow_format", None)
        return f"(``{slow!r}``)" if slow else "(``None``: ``state_format``'s)"
    return default


_WHEN = {"amsgrad": "``amsgrad=True``", "has_momentum": "``momentum != 0``", "centered": "``centered=True``"}
"""The constructor setting behind each variant that keeps a state, as a docstring says it."""


def _docstring(cls) -> str:
    """The class's summary, its algorithm and its Args (meaning, default, allowed values) from
    its declaration, with its state names: the API reference's text, derived so it cannot drift."""
    decl = getattr(cls, "_decl", None)
    own = cls.__dict__.get("_summary") or (decl.summary if decl is not None else (cls.__doc__ or ""))
    if decl is None:
        return own
    signature = declared_signature(decl)  # the declaration's, whatever __init__ a subclass writes
    names = [n for n in signature.parameters if n not in ("self", "params")]
    example = {state_names(*cls._state_types)[0]: "8bit"}
    docs = {n: decl.arg(n) for n in names}
    if "state_format" in docs:
        a = docs["state_format"]
        docs["state_format"] = dataclasses.replace(a, doc=a.doc.format(example=repr(example)[1:-1]))
    defaults = {n: _format_default(cls, n, signature.parameters[n].default) for n in names}
    states = ", ".join(f"``{s.name}``" + (f" (with {_WHEN[s.when]})" if s.when else "")
                       for s in rules.rule(decl.rule).states)
    return f"{own}\n\nStates (``optimizer.state[p]``): ``step``, {states}.\n\n" + rules.args_section(names, docs, defaults)





# ---------------------------------------------------------------------------- the declarations
_TORCH_IMPL = (("foreach", None), ("maximize", False), ("capturable", False), ("differentiable", False),
               ("fused", None))
_STORAGE = (("state_format", None), ("block_size", None), ("min_quant_size", 4096), ("bf16_stochastic_round", False),
            ("skip_nonfinite", False))
_A = rules.Arg


_DECOUPLED = "Decoupled weight decay: ``p - lr * (update + weight_decay * p)``."
_L2 = "L2 weight decay, added to the gradient before the rule (as torch.optim)."


def _adam_decl(alias_fn, namesake: str, decay: str) -> _ClassDecl:
    return _ClassDecl(
        "adam", alias_fn,
        (("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", None), ("amsgrad", False),
         *_TORCH_IMPL, *_STORAGE, ("rank1_normalization", None), ("param_correction", False)),
        keyword="foreach",
        summary=f"torch.optim.{namesake} (same signature, defaults, state names and math) with ``state_format`` "
                "states (default ``\"fp32\"``).",
        docs=(("betas", _A("betas", "Decay rates of ``exp_avg`` and ``exp_avg_sq`` (bias-corrected).",
                           "a pair of numbers in [0, 1)", "betas", "betas")),
              ("weight_decay", _A("weight_decay", decay, "a number >= 0", "nonneg", "weight_decay"))),
    )


class _AdamBase(_Declared):
    _default_wd = 0.0

    def _prepare(self, values: dict) -> None:
        if values["weight_decay"] is None:
            values["weight_decay"] = self._default_wd

    def _check_rule(self, owner, group):
        if group.get("rank1_normalization") and self._state_formats(group)["exp_avg_sq"] not in RANK1_STATE_FORMATS:
            raise ValueError(
                f"{owner}: rank1_normalization=True is a 4-bit second moment (row and column maxima instead of "
                f"block scales); this group's state_format is {group['state_format']!r}: use state_format='4bit' "
                "(bridge.AdamW4bit / Adam4bit) or 'nf4', or a mapping with 'exp_avg_sq': '4bit'"
            )


class Adam(_AdamBase):
    _decl = _adam_decl(alias.adam, "Adam", _L2)


class AdamW(_AdamBase):
    _decl = _adam_decl(alias.adamw, "AdamW", _DECOUPLED)
    _default_wd = 1e-2


class Adam8bit(Adam):
    _summary = "Adam with 8-bit states (first moment: bitsandbytes' dynamic map; second: zero-free sqrt map)."
    _default_format = "8bit"


class AdamW8bit(AdamW):
    _summary = "AdamW with 8-bit states."
    _default_format = "8bit"


class Adam4bit(Adam):
    _summary = "Adam with 4-bit states (arXiv 2309.01507 maps, block 128)."
    _default_format = "4bit"


class AdamW4bit(AdamW):
    _summary = "AdamW with 4-bit states."
    _default_format = "4bit"


class AdamFp8(Adam):
    _summary = "Adam with float8 e4m3 states (second moment stored as zero-free sqrt)."
    _default_format = "fp8"


class AdamWFp8(AdamW):
    _summary = "AdamW with float8 e4m3 states."
    _default_format = "fp8"


class Lion(_Declared):
    _decl = _ClassDecl(
        "lion", alias.lion,
        (("lr", 1e-4), ("betas", (0.9, 0.99)), ("weight_decay", 0.0), *_TORCH_IMPL, *_STORAGE,
         ("param_correction", False)),
        keyword="foreach",
        summary="Lion (arXiv 2302.06675) with decoupled weight decay; one state, ``exp_avg``.",
        docs=(("betas", _A("betas", "``beta1`` interpolates the gradient and ``exp_avg`` for the update's sign; "
                           "``beta2`` is ``exp_avg``'s decay rate.", "a pair of numbers in [0, 1)", "betas",
                           "betas")),
              ("weight_decay", _A("weight_decay", _DECOUPLED, "a number >= 0", "nonneg", "weight_decay"))),
    )


class Lion8bit(Lion):
    _summary = "Lion with an 8-bit ``exp_avg``."
    _default_format = "8bit"


class Lion4bit(Lion):
    _summary = "Lion with a 4-bit ``exp_avg``."
    _default_format = "4bit"


class AdEMAMix(_Declared):
    _decl = _ClassDecl(
        "ademamix", alias.ademamix,
        (("lr", 1e-3), ("betas", (0.9, 0.999, 0.9999)), ("alpha", 5.0), ("t_alpha", None), ("t_beta3", None),
         ("eps", 1e-8), ("weight_decay", 1e-2), ("maximize", False), *_STORAGE, ("slow_state_format", None),
         ("param_correction", False)),
        keyword="maximize",
        summary="AdEMAMix (arXiv 2409.03137) with bitsandbytes' ``AdEMAMix`` signature and decoupled weight decay: "
                "``p - lr * ((m_hat + alpha * s) / (sqrt(v_hat) + eps) + weight_decay * p)``, with ``s`` the slow "
                "EMA ``exp_avg_slow`` (default ``\"fp32\"`` states).",
        docs=(("betas", _A("betas", "Decay rates of the fast EMA ``exp_avg``, the second moment ``exp_avg_sq`` and "
                           "the slow EMA ``exp_avg_slow``.", "a triple of numbers in [0, 1)", "betas3", "betas")),
              ("alpha", _A("alpha", "Weight of the slow EMA in the update.", "a number >= 0", "nonneg", "alpha")),
              ("t_alpha", _A("t_alpha", "Warm ``alpha`` up linearly over this many steps (``None``: no warm-up).",
                             "a positive int or None", "steps", "t_alpha", static=True)),
              ("t_beta3", _A("t_beta3", "Warm ``betas[2]`` up from ``betas[0]`` over this many steps, on the "
                             "paper's log-log path (``None``: no warm-up).", "a positive int or None", "steps",
                             "t_beta3", static=True)),
              ("weight_decay", _A("weight_decay", _DECOUPLED, "a number >= 0", "nonneg", "weight_decay")),
              ("slow_state_format", _A("slow_state_format", "The slow EMA's own format (its error is multiplied by "
                                       "``alpha``); the same setting as a ``state_format`` mapping's ``exp_avg_slow`` "
                                       "entry.", "a format name or None", None, "slow_state_format", static=True))),
    )
    _default_slow_format = None

    def _prepare(self, values: dict) -> None:
        sf = values["state_format"]
        if values["slow_state_format"] is None and not (isinstance(sf, Mapping) and "exp_avg_slow" in sf):
            values["slow_state_format"] = self._default_slow_format  # the class's, unless the mapping names it

    def _check_rule(self, owner, group):
        try:
            self._state_formats(group)  # slow_state_format: a format name, agreeing with a mapping
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None


class AdEMAMix8bit(AdEMAMix):
    _summary = "AdEMAMix with 8-bit states (both EMAs on the signed dynamic map, v on the zero-free one)."
    _default_format = "8bit"


class AdEMAMix4bit(AdEMAMix):
    _summary = ("AdEMAMix with 4-bit fast EMA and second moment, and an **8-bit slow EMA** by default "
                "(``slow_state_format=\"4bit\"`` for all 4-bit): the slow EMA's error is multiplied by ``alpha`` "
                "(design.md, \"AdEMAMix4bit's slow EMA\", has the measurement behind the default).")
    _default_format = "4bit"
    _default_slow_format = "8bit"


class SGD(_Declared):
    _decl = _ClassDecl(
        "momentum", alias.sgd,
        (("lr", 1e-3), ("momentum", 0.0), ("dampening", 0.0), ("weight_decay", 0.0), ("nesterov", False),
         ("maximize", False), ("foreach", None), ("differentiable", False), ("fused", None), *_STORAGE,
         ("param_correction", False)),
        keyword="maximize",
        summary="torch.optim.SGD (momentum, nesterov, L2 weight decay; dampening 0) with a ``state_format`` "
                "momentum buffer. Whether a group has a buffer is fixed when the group is added (its "
                "``momentum != 0``); the momentum value may change later.",
        docs=(("dampening", _A("dampening", "Dampening of the momentum; only 0 is supported (refused otherwise).",
                               "0", None)),
              ("nesterov", _A("nesterov", "Nesterov momentum (needs ``momentum > 0``).", "True or False", "flag",
                              "nesterov", static=True))),
        core=(("has_momentum", "has_momentum"),),
    )

    def _check_rule(self, owner, group):
        if group_args.as_number(owner, "dampening", group["dampening"]) != 0:
            raise ValueError(f"{owner}: dampening={group['dampening']!r} is not supported; use dampening=0")
        if group["nesterov"] and group_args.as_number(owner, "momentum", group["momentum"]) <= 0:
            raise ValueError(f"{owner}: nesterov=True requires a momentum > 0")


class SGD8bit(SGD):
    _summary = "SGD with an 8-bit momentum buffer."
    _default_format = "8bit"


class RMSprop(_Declared):
    _decl = _ClassDecl(
        "rmsprop", alias.rmsprop,
        (("lr", 1e-2), ("alpha", 0.99), ("eps", 1e-8), ("weight_decay", 0), ("momentum", 0), ("centered", False),
         ("capturable", False), ("foreach", None), ("maximize", False), ("differentiable", False),
         *_STORAGE, ("param_correction", False)),
        keyword="state_format",
        summary="torch.optim.RMSprop (same signature, defaults, state names and math: ``v = alpha*v + (1-alpha)*g*g``, "
                "the update ``g / (sqrt(v) + eps)``, or ``b = momentum*b + g / (sqrt(v) + eps)`` with momentum; "
                "``weight_decay`` is L2 decay added to the gradient) with ``state_format`` states (default "
                "``\"fp32\"``). Whether a group keeps a ``momentum_buffer`` is fixed when the group is added (its "
                "``momentum != 0``), as for SGD; the momentum value may change later.",
        docs=(("momentum", _A("momentum", "Momentum factor; 0 keeps no ``momentum_buffer``.", "a number >= 0",
                              "nonneg", "momentum")),),
        core=(("has_momentum", "has_momentum"),),
    )


class RMSprop8bit(RMSprop):
    _summary = "RMSprop with 8-bit states (``square_avg`` on the zero-free sqrt map, the others on the signed dynamic map)."
    _default_format = "8bit"


class RMSprop4bit(RMSprop):
    _summary = "RMSprop with 4-bit states (arXiv 2309.01507's maps, block 128; ``square_avg`` per block)."
    _default_format = "4bit"


class RMSpropFp8(RMSprop):
    _summary = "RMSprop with float8 e4m3 states (``square_avg`` stored as its zero-free square root)."
    _default_format = "fp8"


class Adagrad(_Declared):
    _decl = _ClassDecl(
        "adagrad", alias.adagrad,
        (("lr", 1e-2), ("lr_decay", 0), ("weight_decay", 0), ("initial_accumulator_value", 0), ("eps", 1e-10),
         ("foreach", None), ("maximize", False), ("differentiable", False), ("fused", None),
         *_STORAGE, ("param_correction", False)),
        keyword="maximize",
        summary="torch.optim.Adagrad (same signature, defaults, state names and math: ``sum = sum + g*g``, the "
                "update ``g / (sqrt(sum) + eps)`` times ``lr / (1 + (t - 1) * lr_decay)`` at step ``t``; "
                "``weight_decay`` is L2 decay added to the gradient) with ``state_format`` states (default "
                "``\"fp32\"``). torch.optim makes the states in its constructor, filled with "
                "``initial_accumulator_value``; here they are made at the first step and that step starts the sum "
                "from ``initial_accumulator_value`` (the values torch's have from then on).",
    )


class Adagrad8bit(Adagrad):
    _summary = "Adagrad with an 8-bit ``sum`` (the zero-free sqrt map)."
    _default_format = "8bit"


class Adagrad4bit(Adagrad):
    _summary = "Adagrad with a 4-bit ``sum`` (arXiv 2309.01507's unsigned linear map, block 128)."
    _default_format = "4bit"


class AdagradFp8(Adagrad):
    _summary = "Adagrad with a float8 e4m3 ``sum`` (stored as its zero-free square root)."
    _default_format = "fp8"


class Adamax(_Declared):
    _decl = _ClassDecl(
        "adamax", alias.adamax,
        (("lr", 2e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0), ("foreach", None),
         ("maximize", False), ("differentiable", False), ("capturable", False), *_STORAGE, ("param_correction", False)),
        keyword="maximize",
        summary="torch.optim.Adamax (same signature, defaults, state names and math: ``exp_inf = max(beta2 * exp_inf, "
                "|g| + eps)``, the update ``lr / (1 - beta1**t) * exp_avg / exp_inf`` at step ``t``; ``weight_decay`` "
                "is L2 decay added to the gradient) with ``state_format`` states (default ``\"fp32\"``).",
        docs=(("betas", _A("betas", "Decay rates of ``exp_avg`` (bias-corrected) and of the infinity norm "
                           "``exp_inf``.", "a pair of numbers in [0, 1)", "betas", "betas")),
              ("eps", _A("eps", "Added to ``|g|`` inside the maximum (as torch.optim.Adamax).", "a number >= 0",
                         "nonneg", "eps"))),
    )


class Adamax8bit(Adamax):
    _summary = "Adamax with 8-bit states (``exp_inf`` on the zero-free sqrt map, ``exp_avg`` on the signed dynamic map)."
    _default_format = "8bit"


class Adamax4bit(Adamax):
    _summary = "Adamax with 4-bit states (arXiv 2309.01507's maps, block 128; ``exp_inf`` per block)."
    _default_format = "4bit"


class AdamaxFp8(Adamax):
    _summary = "Adamax with float8 e4m3 states (``exp_inf`` stored as its zero-free square root)."
    _default_format = "fp8"


class Adadelta(_Declared):
    _decl = _ClassDecl(
        "adadelta", alias.adadelta,
        (("lr", 1.0), ("rho", 0.9), ("eps", 1e-6), ("weight_decay", 0), ("foreach", None), ("capturable", False),
         ("maximize", False), ("differentiable", False), *_STORAGE, ("param_correction", False)),
        keyword="capturable",
        summary="torch.optim.Adadelta (same signature, defaults, state names and math: ``square_avg = rho * "
                "square_avg + (1 - rho) * g*g``, the update ``delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) "
                "* g`` times ``lr``, ``acc_delta = rho * acc_delta + (1 - rho) * delta*delta``; ``weight_decay`` is L2 "
                "decay added to the gradient) with ``state_format`` states (default ``\"fp32\"``).",
        docs=(("eps", _A("eps", "Added inside both square roots, ``sqrt(acc_delta + eps)`` and ``sqrt(square_avg + "
                         "eps)`` (as torch.optim.Adadelta).", "a number >= 0", "nonneg", "eps")),),
    )


class Adadelta8bit(Adadelta):
    _summary = "Adadelta with 8-bit states (both on the zero-free sqrt map)."
    _default_format = "8bit"


class Adadelta4bit(Adadelta):
    _summary = "Adadelta with 4-bit states (arXiv 2309.01507's unsigned linear map, block 128)."
    _default_format = "4bit"


class AdadeltaFp8(Adadelta):
    _summary = "Adadelta with float8 e4m3 states (each stored as its zero-free square root)."
    _default_format = "fp8"


class RAdam(_Declared):
    _decl = _ClassDecl(
        "radam", alias.radam,
        (("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0), ("decoupled_weight_decay", False),
         ("foreach", None), ("maximize", False), ("capturable", False), ("differentiable", False), *_STORAGE,
         ("param_correction", False)),
        keyword="foreach",
        summary="torch.optim.RAdam (same signature, defaults, state names and math: Adam's moments; at step ``t`` the "
                "update ``lr * exp_avg / (1 - beta1**t) * r * sqrt(1 - beta2**t) / (sqrt(exp_avg_sq) + eps)`` once "
                "the variance is tractable (``rho_t > 5``; ``r`` the rectification), else ``lr * exp_avg / (1 - "
                "beta1**t)``) with ``state_format`` states (default ``\"fp32\"``).",
        docs=(("betas", _A("betas", "Decay rates of ``exp_avg`` and ``exp_avg_sq``.", "a pair of numbers in [0, 1)",
                           "betas", "betas")),
              ("eps", _A("eps", "Added to ``sqrt(exp_avg_sq)``, outside the root and before the bias correction (as "
                         "torch.optim.RAdam).", "a number >= 0", "nonneg", "eps"))),
    )


class RAdam8bit(RAdam):
    _summary = "RAdam with 8-bit states (``exp_avg_sq`` on the zero-free sqrt map, ``exp_avg`` on the signed dynamic map)."
    _default_format = "8bit"


class RAdam4bit(RAdam):
    _summary = "RAdam with 4-bit states (arXiv 2309.01507's maps, block 128; ``exp_avg_sq`` per block)."
    _default_format = "4bit"


class RAdamFp8(RAdam):
    _summary = "RAdam with float8 e4m3 states (``exp_avg_sq`` stored as its zero-free square root)."
    _default_format = "fp8"


class NAdam(_Declared):
    _decl = _ClassDecl(
        "nadam", alias.nadam,
        (("lr", 2e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0), ("momentum_decay", 4e-3),
         ("decoupled_weight_decay", False), ("foreach", None), ("maximize", False), ("capturable", False),
         ("differentiable", False), *_STORAGE, ("param_correction", False)),
        keyword="foreach",
        summary="torch.optim.NAdam (same signature, defaults, state names and math: Adam's moments with Nesterov "
                "momentum on a schedule; at step ``t`` the momentum ``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * "
                "momentum_decay))``, ``mu_product`` the product of the momenta so far, and the update ``lr * ((1 - "
                "mu_t) / (1 - mu_product) * grad + mu_{t+1} / (1 - mu_product * mu_{t+1}) * exp_avg) / "
                "(sqrt(exp_avg_sq / (1 - beta2**t)) + eps)``) with ``state_format`` states (default ``\"fp32\"``).",
        docs=(("betas", _A("betas", "Decay rates of ``exp_avg`` and ``exp_avg_sq`` (``beta1`` also scales the "
                           "momentum schedule).", "a pair of numbers in [0, 1)", "betas", "betas")),
              ("eps", _A("eps", "Added to the bias-corrected ``sqrt(exp_avg_sq)``, outside the root (as "
                         "torch.optim.NAdam).", "a number >= 0", "nonneg", "eps"))),
    )


class NAdam8bit(NAdam):
    _summary = "NAdam with 8-bit states (``exp_avg_sq`` on the zero-free sqrt map, ``exp_avg`` on the signed dynamic map)."
    _default_format = "8bit"


class NAdam4bit(NAdam):
    _summary = "NAdam with 4-bit states (arXiv 2309.01507's maps, block 128; ``exp_avg_sq`` per block)."
    _default_format = "4bit"


class NAdamFp8(NAdam):
    _summary = "NAdam with float8 e4m3 states (``exp_avg_sq`` stored as its zero-free square root)."
    _default_format = "fp8"
