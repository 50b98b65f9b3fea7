"""One declaration per update rule (:class:`RuleDef`) and per argument (:class:`Arg`).

A rule is this declaration plus its per-element math (``kernels/cpu.c``'s ``rule_run`` and
``kernels/torch_backend._rule``, in the order ``kernels/spec.py``'s docstring gives). Everything
else derives from the tables here:

- the kernel side (``kernels/spec.py``): the rule ids (``RULES``), each rule's states, which are
  signed, which variant keeps which state (``StepSpec.nstates`` / ``signed``), which flags are
  variants of which rule, whether the moments are bias-corrected, the hyperparameter vector's
  slots a rule reads;
- the core (``transform.py``): each state class's ``roles`` (:meth:`RuleDef.roles`) and the
  arguments that choose states or code, never injected (:data:`STATIC_ARGS`);
- the bridge (``bridge/classes.py``): each named class's constructor arguments, defaults,
  param-group keys, the alias arguments they become, their checks and the Args section of the
  class's docstring (:data:`ARGS`, ``args_section``), so the API reference says what every
  argument does and cannot drift from the code.

Pure data: no torch, no kernels, no bridge (each of those reads this module).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["StateDef", "RuleDef", "RULE_DEFS", "rule", "Arg", "ARGS", "STATIC_ARGS", "args_section",
           "VARIANT_FLAGS", "SCALAR_STATES"]


# ----------------------------------------------------------------------------
# rules: what crosses the kernel boundary
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StateDef:
    """One per-param state of a rule, in the kernel's slot order."""

    field: str
    """The core state class's field (``ScaleByAdamState.nu``)."""
    name: str
    """torch.optim's name for it: the key in ``optimizer.state[p]`` and state dicts (its role)."""
    signed: bool
    """Whether it is a first moment, stored in signed formats, or a second moment, non-negative and
    stored in the zero-free sqrt formats."""
    when: Optional[str] = None
    """The variant (a ``StepSpec`` flag) that keeps it; ``None``: always kept."""


@dataclasses.dataclass(frozen=True)
class RuleDef:
    """An update rule as the kernels see it.

    ``slots`` maps the rule's own hyperparameters (the building block's argument names) to
    the hyperparameter vector's entries they fill (``kernels.spec.HYPER_NAMES``): RMSprop's
    ``alpha`` is the vector's ``b2``, so its ``1 - alpha`` is ``omb2``."""

    name: str
    states: tuple
    variants: tuple = ()
    slots: tuple = ()
    """``((argument, vector entry), ...)``."""
    bias_correction: bool = False
    """``1/bc1`` and ``1/sqrt(bc2)`` from ``b1``, ``b2`` and the count (Adam's moments)."""
    slow_ema: bool = False
    """``1 - b3`` (AdEMAMix's slow EMA); otherwise the entry is 0."""
    rectified: bool = False
    """Whether the rule is RAdam's variance-rectified step, whose vector holds ``cm`` and ``rect``
    from ``b1``, ``b2`` and the count (``kernels.spec.radam_terms``); otherwise they are 0."""
    scalars: tuple = ()
    """``((field, initial value), ...)``: 0-d float32 states of the whole transformation beside the
    count (NAdam's ``mu_product``), under torch.optim's name ``field``; the core advances them
    each step (``kernels.spec.nadam_terms``) and the bridge keeps them per param as ``step``."""
    torch_name: Optional[str] = None
    """The torch.optim class whose math and state names the rule follows (``None``: none has it)."""
    counted: bool = True
    """Whether the rule's state keeps a step count (torch.optim's ``step``); SGD's momentum keeps none."""

    def kept(self, **variants: bool) -> tuple:
        """The states kept with these variants, in slot order."""
        return tuple(s for s in self.states if s.when is None or variants.get(s.when, False))

    def nstates(self, **variants: bool) -> int:
        return len(self.kept(**variants))

    def signed(self, **variants: bool) -> tuple:
        return tuple(s.signed for s in self.kept(**variants))

    def roles(self, step: Optional[str] = None) -> dict:
        """``{field: torch name}`` of the states (with ``{"count": step}`` first when given): a
        core state class's ``roles``."""
        out = {} if step is None else {"count": step}
        out.update({name: name for name, _ in self.scalars})
        out.update({s.field: s.name for s in self.states})
        return out

    @property
    def state_names(self) -> tuple:
        return tuple(s.name for s in self.states)

    def hyper(self, **values) -> dict:
        """The rule's hyperparameters by vector entry: ``RMSPROP.hyper(alpha=0.99, ...)`` ->
        ``{"b2": 0.99, ...}`` (the arguments ``kernels.step_hyperparams`` takes)."""
        slots = dict(self.slots)
        unknown = set(values) - set(slots)
        if unknown:
            raise TypeError(f"the {self.name} rule has no hyperparameters {sorted(unknown)}; it takes {sorted(slots)}")
        return {slots[k]: v for k, v in values.items()}


_M, _V = True, False  # signed (first moment) / non-negative (second moment)

RULE_DEFS = {
    d.name: d
    for d in (
        RuleDef("adam", (StateDef("mu", "exp_avg", _M), StateDef("nu", "exp_avg_sq", _V),
                         StateDef("nu_max", "max_exp_avg_sq", _V, when="amsgrad")),
                variants=("amsgrad",), slots=(("b1", "b1"), ("b2", "b2"), ("eps", "eps")), bias_correction=True,
                torch_name="Adam"),
        RuleDef("lion", (StateDef("mu", "exp_avg", _M),), slots=(("b1", "b1"), ("b2", "b2"))),
        RuleDef("momentum", (StateDef("trace", "momentum_buffer", _M),), variants=("nesterov",),
                slots=(("momentum", "b1"),), torch_name="SGD", counted=False),
        RuleDef("ademamix", (StateDef("mu", "exp_avg", _M), StateDef("nu", "exp_avg_sq", _V),
                             StateDef("mu_slow", "exp_avg_slow", _M)),
                slots=(("b1", "b1"), ("b2", "b2"), ("eps", "eps"), ("b3", "b3"), ("alpha", "alpha")),
                bias_correction=True, slow_ema=True),
        RuleDef("muon", (StateDef("trace", "momentum_buffer", _M),), variants=("nesterov",),
                slots=(("momentum", "b1"),), torch_name="Muon"),
        # the second moment first: the C kernel's block path (a signed first state) is Adam's
        RuleDef("rmsprop", (StateDef("nu", "square_avg", _V), StateDef("trace", "momentum_buffer", _M, when="has_momentum"),
                            StateDef("mu", "grad_avg", _M, when="centered")),
                variants=("has_momentum", "centered"), slots=(("momentum", "b1"), ("alpha", "b2"), ("eps", "eps")),
                torch_name="RMSprop"),
        RuleDef("adagrad", (StateDef("sum", "sum", _V),),
                slots=(("initial_accumulator_value", "b1"), ("eps", "eps")), torch_name="Adagrad"),
        # the infinity norm first, as rmsprop's second moment (the block path is for a signed first state)
        RuleDef("adamax", (StateDef("nu", "exp_inf", _V), StateDef("mu", "exp_avg", _M)),
                slots=(("b1", "b1"), ("b2", "b2"), ("eps", "eps")), bias_correction=True, torch_name="Adamax"),
        RuleDef("adadelta", (StateDef("nu", "square_avg", _V), StateDef("delta", "acc_delta", _V)),
                slots=(("rho", "b2"), ("eps", "eps")), torch_name="Adadelta"),
        RuleDef("radam", (StateDef("nu", "exp_avg_sq", _V), StateDef("mu", "exp_avg", _M)),
                slots=(("b1", "b1"), ("b2", "b2"), ("eps", "eps")), rectified=True, torch_name="RAdam"),
        RuleDef("nadam", (StateDef("nu", "exp_avg_sq", _V), StateDef("mu", "exp_avg", _M)),
                slots=(("b1", "b1"), ("b2", "b2"), ("eps", "eps")), bias_correction=True,
                scalars=(("mu_product", 1.0),), torch_name="NAdam"),
    )
}
"""Every rule by name, in kernel id order; a rule's id is its position, so new ones are appended."""

SCALAR_STATES = {name: v for d in RULE_DEFS.values() for name, v in d.scalars}
"""The rules' scalar states by torch.optim's name, with their initial values (``{"mu_product": 1.0}``)."""

VARIANT_FLAGS = tuple(dict.fromkeys(v for d in RULE_DEFS.values() for v in d.variants))
"""The flags that choose a rule's variant, each once, ``("amsgrad", "nesterov", ...)``."""


def rule(name: str) -> RuleDef:
    try:
        return RULE_DEFS[name]
    except KeyError:
        raise ValueError(f"rule must be one of {tuple(RULE_DEFS)}, got {name!r}") from None


# ----------------------------------------------------------------------------
# arguments: what a user passes, what it means, what it becomes
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Arg:
    """One constructor argument of the bridge's classes (and its param-group key).

    ``core`` is the alias argument it becomes (``"learning_rate"`` for ``lr``; ``None``: read by
    the bridge alone); ``check`` names how a group's value is checked
    (``bridge.classes._CHECKS``); ``static``: it chooses states or code, so it is passed to
    the core as it is and never injected as a changeable tensor."""

    name: str
    doc: str
    allowed: str
    check: Optional[str] = None
    core: Optional[str] = None
    static: bool = False


def _a(name, doc, allowed, check=None, core=None, static=False) -> Arg:
    return Arg(name, doc, allowed, check, core, static)


ARGS = {
    a.name: a
    for a in (
        _a("lr", "The learning rate (a scheduler may change it between steps).", "a number or 1-element tensor >= 0",
           "nonneg", "learning_rate"),
        _a("eps", "Added to the denominator's square root, outside it (as torch.optim), for numerical stability.",
           "a number >= 0", "nonneg", "eps"),
        _a("weight_decay", "Weight decay.", "a number >= 0", "nonneg", "weight_decay"),
        _a("momentum", "Momentum factor.", "a number in [0, 1)", "unit", "momentum"),
        _a("betas", "Decay rates of the running averages.", "numbers in [0, 1)", "betas", "betas"),
        _a("alpha", "Smoothing constant of the running average of squared gradients (``square_avg``).",
           "a number in [0, 1]", "closed_unit", "alpha"),
        _a("rho", "Decay rate of the running averages ``square_avg`` (of squared gradients) and ``acc_delta`` (of "
           "squared updates).", "a number in [0, 1]", "closed_unit", "rho"),
        _a("momentum_decay", "NAdam's momentum schedule: step ``t``'s momentum is ``beta1 * (1 - 0.5 * 0.96 ** (t * "
           "momentum_decay))``.", "a number >= 0", "nonneg", "momentum_decay"),
        _a("decoupled_weight_decay", "Apply ``weight_decay`` as decoupled decay, ``p - lr * (update + "
           "weight_decay * p)`` (AdamW's), instead of L2 decay added to the gradient.", "True or False", "flag",
           "decoupled_weight_decay", static=True),
        _a("centered", "Normalize by the estimated variance of the gradient: keeps ``grad_avg``, the running average "
           "of the gradient, and divides by ``sqrt(square_avg - grad_avg**2) + eps``.", "True or False", "flag",
           "centered", static=True),
        _a("lr_decay", "Learning-rate decay: step ``t`` (from 1) takes ``lr / (1 + (t - 1) * lr_decay)``.",
           "a number >= 0", "nonneg", "lr_decay"),
        _a("initial_accumulator_value", "The value ``sum`` starts from (torch.optim.Adagrad's). Each step takes "
           "``max(sum, initial_accumulator_value)`` as the running sum: a fresh (zero) state starts from it at "
           "the first step and a stepped one never falls below it (``sum`` only grows), so a fresh state and a "
           "loaded torch.optim one give torch's values; raising it later lifts the sums below it (torch reads it "
           "only when it makes the state).", "a number >= 0", "nonneg", "initial_accumulator_value"),
        _a("amsgrad", "Keep the running maximum of ``exp_avg_sq`` (state ``max_exp_avg_sq``, in the second "
           "moment's format) and normalize by it.", "True or False", "flag", "amsgrad", static=True),
        _a("maximize", "Maximize the objective: the gradient is negated before anything else (L2 decay included), as "
           "torch.optim does; it may change between steps.", "True or False", None, "maximize", static=True),
        _a("state_format", "How the states are stored: ``\"fp32\"``, ``\"bf16\"``, ``\"8bit\"``, ``\"4bit\"``, "
           "``\"nf4\"``, ``\"fp8\"``, ``\"8bit_bnb\"`` (docs/guide/formats.md), or a mapping from this class's state "
           "names to formats, ``{{{example}}}``, the states it leaves out in the class's format. A named low-bit "
           "class takes only its own format or a mapping here; a param group may still name another.",
           "a format name or a mapping of state names to format names", None, "state_format", static=True),
        _a("block_size", "Elements per scale of a quantized state, within a row (``None``: the format's: 256 for "
           "8-bit and FP8, 128 for 4-bit, 32 for ``nf4``). Under tensor parallel it may be reduced so every "
           "shard's columns are whole blocks.", "a positive int or None", None, "block_size", static=True),
        _a("min_quant_size", "Params with fewer elements, and every 1-D param, keep float32 states.",
           "an int >= 0", None, "min_quant_size", static=True),
        _a("bf16_stochastic_round", "Round bfloat16 params stochastically (reproducibly: a hash of seed, step, "
           "param and element) instead of to nearest even.", "True or False", None, "stochastic_round",
           static=True),
        _a("param_correction", "bfloat16 / float16 params keep an int8 correction per element, the rounding error "
           "of their float32 master value, updated with them (``bridge.master_params`` gives the masters). "
           "Refused with ``bf16_stochastic_round=True``.", "True or False", None, "param_correction", static=True),
        _a("rank1_normalization", "Store a 4-bit second moment normalized by its row and column maxima (arXiv "
           "2309.01507) instead of per block. ``None``: the format's choice (on for ``\"4bit\"`` and ``\"nf4\"``); "
           "``True`` needs a 4-bit second moment.", "True, False or None", "flag_or_none",
           "rank1_normalization", static=True),
    )
}
"""Every argument of the classes declared with :data:`ARGS` (``bridge/classes.py``'s ``_ClassDecl``)
that the core takes or that shapes the math; those the bridge reads alone (torch.optim's
``foreach``, ``fused``, ``capturable``, ``differentiable``; ``skip_nonfinite``) are
``bridge.group_args.BRIDGE_ARGS``."""

STATIC_ARGS = frozenset(
    [a.core for a in ARGS.values() if a.static and a.core]
    + ["slow_state_format", "mask", "nesterov", "has_momentum", "seed", "flip_sign", "t_alpha", "t_beta3",
       "ns_steps", "momentum_rank", "ns_coefficients", "adjust_lr_fn", "orthogonalize"]
    + list(VARIANT_FLAGS)
)
"""The core arguments that shape the state or the code, never injected as tensors by
``inject_hyperparams``."""


def _default_text(value) -> str:
    return f"``{value!r}``"


def args_section(params: list, docs: dict, defaults: dict) -> str:
    """A Google-style ``Args:`` section: per argument its meaning, default and allowed values.

    ``params``: the argument names in signature order; ``docs``: ``{name: Arg}``; ``defaults``:
    ``{name: default, or a sentence}`` (a ``str`` that starts with ``"("`` is said as it is)."""
    lines = ["Args:", "  params: an iterable of tensors or param-group dicts (as torch.optim); every argument below "
             "is also a param-group key a group may override."]
    for name in params:
        a = docs[name]
        d = defaults[name]
        default = d[1:-1] if isinstance(d, str) and d.startswith("(") else _default_text(d)
        lines.append(f"  {name}: {a.doc} Default {default}; {a.allowed}.")
    return "\n".join(lines)
