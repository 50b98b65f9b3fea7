"""What one step computes (the update rule, its fused links, its hyperparameter vector) and the
layout that carries it to the C kernel.

A :class:`StepSpec` is static (it chooses the code); the hyperparameters are one
float32 vector per step (:func:`step_hyperparams`), the same for every backend.
Per element, in float32 and in this order (cpu.c and torch_backend.py implement
exactly these operations; design.md, "Update rules"):

- prologue: ``g = -g`` (``maximize``); ``g = g + l2 * p`` (``l2``: an L2-decay link
  before the rule, torch.optim.Adam / SGD ``weight_decay``)
- rule ``adam``: ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*(g*g)``; with
  ``amsgrad`` ``w = max(w, v)`` and the root below is of ``w``;
  ``u = (m * (1/bc1)) / (sqrt(v) * (1/sqrt(bc2)) + eps)``
- rule ``lion``: ``u = sign(b1*m + (1-b1)*g)`` (0 for 0 and NaN); ``m = b2*m + (1-b2)*g``
- rule ``momentum``: ``b = mu*b + g``; ``u = b``, or ``g + mu*b`` with ``nesterov``
- rule ``muon`` (the momentum of torch.optim.Muon, before Newton-Schulz): ``b = lerp(b, g, 1-mu)``;
  ``u = b``, or ``lerp(g, b, mu)`` with ``nesterov``; ``lerp(a, c, w)`` is torch.lerp's float32
  result, one rounding: ``fma(w, c - a, a)`` if ``|w| < 0.5``, else ``fma(w - 1, c - a, c)``
- rule ``ademamix`` (arXiv 2409.03137): ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*(g*g)``;
  ``s = b3*s + (1-b3)*g``; ``u = (m * (1/bc1) + alpha * s) / (sqrt(v) * (1/sqrt(bc2)) + eps)``
- rule ``rmsprop`` (torch.optim.RMSprop; ``b1`` its momentum, ``b2`` its alpha): ``v = b2*v +
  (1-b2)*(g*g)``; with ``centered`` ``a = lerp(a, g, 1-b2)`` and ``d = sqrt(v - a*a) + eps``, else
  ``d = sqrt(v) + eps``; with ``has_momentum`` ``b = b1*b + g/d``, ``u = b``, else ``u = g/d``
- rule ``adagrad`` (torch.optim.Adagrad; ``b1`` its initial_accumulator_value): ``s = max(s, b1) +
  g*g`` (``max`` NaN if ``s`` is: the first step lifts a zero state to the initial value, later ones
  change nothing, as ``s >= b1`` once stepped); ``u = g / (sqrt(s) + eps)`` (the learning-rate
  decay is the ``lr`` link's schedule)
- rule ``adamax`` (torch.optim.Adamax; states ``(e, m)``): ``e = max(b2*e, |g| + eps)`` (NaN if either
  is, as torch.maximum); ``m = b1*m + (1-b1)*g``; ``u = (m * (1/bc1)) / e``
- rule ``adadelta`` (torch.optim.Adadelta; ``b2`` its rho; states ``(v, a)``): ``v = b2*v + (1-b2)*(g*g)``;
  ``u = (sqrt(a + eps) / sqrt(v + eps)) * g``; ``a = b2*a + (1-b2)*(u*u)`` (``a`` of the old value first)
- rule ``radam`` (torch.optim.RAdam; states ``(v, m)``): ``v = b2*v + (1-b2)*(g*g)``; ``m = b1*m + (1-b1)*g``;
  ``u = (m * cm) / (sqrt(v) + eps)`` if ``rect`` (is not 0), else ``u = m * cm`` (:func:`radam_terms`)
- rule ``nadam`` (torch.optim.NAdam; states ``(v, m)``): ``v = b2*v + (1-b2)*(g*g)``; ``m = b1*m + (1-b1)*g``;
  ``u = (cg*g + cm*m) / (sqrt(v) * (1/sqrt(bc2)) + eps)`` (:func:`nadam_terms`)
- epilogue: ``u = u + wd * p`` (``decay``: a decoupled-decay link after the rule);
  ``u = (-lr) * u`` (``lr``: a learning-rate link)
- output: ``u`` as a float32 update, or the param ``p + u`` rounded once to its
  dtype (nearest even; bfloat16 optionally stochastically), or with a correction ``c``
  (:mod:`lowbit_tree.correction`, bfloat16 / float16 params): ``x = (p + c * scale(p)) + u``
  rounded to nearest even into ``p'``, and ``c' = rint((x - p') / scale(p'))`` clamped to
  ``[-128, 127]`` (0 where ``p'`` is not finite); ``scale`` is ``correction_scale``'s bits.

What crosses the kernel boundary is defined here once: the rule ids (:data:`RULES`), the
hyperparameter vector's names (:data:`HYPER_NAMES`), the flag bits (:data:`FLAGS`), the dtype
ids (:data:`DTYPES`), the rank-1 marker and the job row's layout (:data:`JOB_HEADER`,
:data:`STATE_FIELDS`, :data:`STATE_SLOTS`). ``native.py`` builds its job rows from these
tuples and generates the C header ``cpu.c`` is compiled with (``native.abi_header``), so a
field added here moves every index on both sides at once.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import NamedTuple, Optional

import torch

from ..rules import RULE_DEFS, VARIANT_FLAGS

__all__ = [
    "RULES", "RULE_IDS", "StepSpec", "HYPER_NAMES", "NHYPER", "Hyper", "step_hyperparams", "radam_terms", "nadam_terms", "FLAGS", "flag_bits",
    "DTYPES", "DTYPE_IDS", "RANK1_BLOCK", "JOB_HEADER", "STATE_FIELDS", "STATE_SLOTS", "JOB_ROW", "job_row_index",
    "INSTANCES", "instances", "StepLeaf",
]

RULES = tuple(RULE_DEFS)
"""The update rules (:data:`lowbit_tree.rules.RULE_DEFS`); a rule's id across the kernel boundary is
its index here."""
RULE_IDS = {rule: i for i, rule in enumerate(RULES)}

HYPER_NAMES = ("b1", "omb1", "b2", "omb2", "rbc1", "rsbc2", "eps", "lr", "wd", "l2", "b3", "omb3", "alpha", "cm",
               "rect", "cg")
"""The hyperparameter vector, in order: ``b1`` (the momentum of momentum, muon and rmsprop;
adagrad's initial accumulator value), ``1-b1``, ``b2`` (rmsprop's alpha), ``1-b2``, ``1/bc1``, ``1/sqrt(bc2)``, ``eps``, ``lr``, ``wd`` (decoupled decay), ``l2``
(L2 decay), ``b3``, ``1-b3``, ``alpha`` (these three: ademamix's slow EMA and its weight, 0
for the other rules), ``cm`` and ``rect`` (radam's first-moment factor and whether the update is
divided by the root this step: :func:`radam_terms`; nadam's first-moment factor), ``cg`` (nadam's
gradient factor: :func:`nadam_terms`; 0 for the other rules); which entry holds which of a rule's hyperparameters is the rule's declaration
(:attr:`lowbit_tree.rules.RuleDef.slots`). Every backend reads the vector by these names: the C kernel as
``hyper[LBT_H_<NAME>]`` (its header is generated from this tuple), the torch backend through
:class:`Hyper`."""
NHYPER = len(HYPER_NAMES)

Hyper = collections.namedtuple("Hyper", HYPER_NAMES)
"""The entries of one hyperparameter vector by name: ``Hyper(*hyper.unbind(0)).rbc1``."""

FLAGS = ("maximize", "l2", "decay", "lr") + VARIANT_FLAGS + ("write_param", "stochastic", "param_correction", "maxima",
                                                           "new_param")
"""A job's flag bits: flag ``FLAGS[i]`` is bit ``1 << i``. ``write_param``: the output is the
param itself, updated in place (else a float32 update); ``new_param`` (never with
``write_param``): besides the update, ``p + u`` rounded once to the param's dtype goes to the
row's ``pout`` (what ``apply_updates`` would compute, in the same pass); ``stochastic``: a bfloat16 param is
rounded stochastically; ``param_correction`` (with ``write_param``, never with ``stochastic``): the
bfloat16 / float16 param is written from its corrected master value and its int8 correction
(the row's ``corr``) with it; ``maxima``: the job only computes the row and column maxima of
its rank-1 states' new values (``rmax_new``, ``cmax_new``) and writes nothing else, the first
of a rank-1 step's two jobs; the others are :class:`StepSpec`'s fields (the rules' variants:
:data:`lowbit_tree.rules.VARIANT_FLAGS`)."""

DTYPES = (("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16))
"""The param, gradient and plain-state dtypes the C kernel reads and writes, as (name, dtype);
a dtype's id is its index."""
DTYPE_IDS = {dt: i for i, (_, dt) in enumerate(DTYPES)}

RANK1_BLOCK = -1
"""The block size a job's state carries when it is a rank-1 record."""

JOB_HEADER = ("rows", "R", "p", "g", "out", "pout", "rule", "flags", "pdt", "gdt", "hyper", "sr_hash", "corr", "nstates")
"""The job row's header, one int64 each, in order: the leaf's ``(rows, R)`` view; the
addresses of param (0 when the step needs none), gradient, output and new param (0 without
the ``new_param`` flag); the rule id
(:data:`RULES`), flag bits (:data:`FLAGS`), param and gradient dtype ids (:data:`DTYPES`); the
address of the float32 hyperparameter vector; the stochastic-rounding key's hash; the address
of the param's int8 correction, read and written in place (0 without the ``param_correction`` flag); the
number of states. cpu.c's ``lbt_job`` declares these fields with C types and checks at build time that
each sits at ``8 * index`` (its header is generated from this tuple)."""

STATE_FIELDS = ("in", "out", "scale_in", "scale_out", "f", "bs", "rmax_new", "cmax_new")
"""One state slot of a job row, one int64 each, in order: source and destination (codes or
plain values; the same address in place), scales (or a rank-1 record's row and column maxima)
in and out, the format struct's address (0: plain values), the block size (plain: the dtype id;
:data:`RANK1_BLOCK`: a rank-1 record), and a rank-1 record's new row and column maxima: where a
``maxima`` job writes them, and what the step job that follows encodes with (completed across
shards in between)."""

STATE_SLOTS = 3
"""State slots in a job row (unused ones are zeros)."""

JOB_ROW = len(JOB_HEADER) + STATE_SLOTS * len(STATE_FIELDS)
"""int64 entries of one job row."""


_BLOCK_PATHS = ((0, 0), (1, 0), (2, 0), (1, 1), (2, 1))
_PLAIN = ((0, 0),)
_ALL_EPILOGUES = (0, 1, 2, 3, 4)
_L2_EPILOGUES = (0, 1, 3)

INSTANCES = {
    "adam": ((0, _BLOCK_PATHS, _ALL_EPILOGUES), (1, _BLOCK_PATHS, (0, 1, 2))),
    "lion": ((None, _PLAIN, _ALL_EPILOGUES),),
    "ademamix": ((None, _BLOCK_PATHS, _ALL_EPILOGUES),),
    "momentum": ((None, _PLAIN, _L2_EPILOGUES),),
    "muon": ((None, _PLAIN, (0,)),),
    "rmsprop": ((None, _PLAIN, _L2_EPILOGUES),),
    "adagrad": ((None, _PLAIN, _L2_EPILOGUES),),
    "adamax": ((None, _PLAIN, _L2_EPILOGUES),),
    "adadelta": ((None, _PLAIN, _L2_EPILOGUES),),
    "radam": ((None, _PLAIN, (0, 1, 3, 2, 4)),),
    "nadam": ((None, _PLAIN, (0, 1, 3, 2, 4)),),
}
"""Which of cpu.c's ``rule_run`` combinations are compiled, per rule (a build choice: the others
run EPW 0 and ``epilogue_pass``): ``((VAR or None: every declared variant, ((TR, DEC), ...),
(EPW, ...)), ...)``, TR the second moments' storage transform, DEC states decoded from 8-bit
codes in the loop, EPW the fused epilogue (cpu.c's ``rule_run``). The generated header's
``LBT_ALL_RULES`` is :func:`instances`, in this order."""


def instances() -> list[tuple[str, int, int, int, int]]:
    """``[(rule, VAR, TR, DEC, EPW)]`` from :data:`INSTANCES`, each declared rule and variant
    (``VAR`` 0 .. ``2**len(RuleDef.variants) - 1``) covered; a ValueError naming a rule or
    variant the table misses or has beyond the declaration."""
    if set(INSTANCES) != set(RULES):
        raise ValueError(f"spec.INSTANCES' rules {sorted(INSTANCES)} are not the declared {sorted(RULES)}")
    out = []
    for rule in RULES:
        declared = range(2 ** len(RULE_DEFS[rule].variants))
        covered = [(v, paths, epilogues) for var, paths, epilogues in INSTANCES[rule]
                   for v in (declared if var is None else (var,))]
        if sorted(v for v, _, _ in covered) != list(declared):
            raise ValueError(f"spec.INSTANCES[{rule!r}] covers variants {[v for v, _, _ in covered]}; the rule "
                             f"declares {list(declared)}, each once")
        out.extend((rule, v, tr, dec, epw) for v, paths, epilogues in covered for tr, dec in paths for epw in epilogues)
    return out


def job_row_index(field: str, slot: Optional[int] = None) -> int:
    """The position of a header field (``slot=None``) or of state ``slot``'s field in a job row."""
    if slot is None:
        return JOB_HEADER.index(field)
    if not 0 <= slot < STATE_SLOTS:
        raise ValueError(f"state slot {slot} is not in range({STATE_SLOTS})")
    return len(JOB_HEADER) + slot * len(STATE_FIELDS) + STATE_FIELDS.index(field)


def flag_bits(**flags: bool) -> int:
    """The flag word with the named :data:`FLAGS` set: ``flag_bits(decay=True, lr=True)``."""
    unknown = set(flags) - set(FLAGS)
    if unknown:
        raise ValueError(f"unknown flags {sorted(unknown)}; the flags are {FLAGS}")
    return sum(1 << i for i, name in enumerate(FLAGS) if flags.get(name))


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The static part of a step. ``rule`` is one of :data:`RULES`; the variant flags
    (``amsgrad``, ``nesterov``, ``has_momentum``, ``centered``: :data:`lowbit_tree.rules.VARIANT_FLAGS`)
    choose a rule's variant, each allowed for the rules that declare it; ``maximize``, ``l2``,
    ``decay`` and ``lr`` say which fused links run around the rule."""

    rule: str
    amsgrad: bool = False
    nesterov: bool = False
    has_momentum: bool = False
    centered: bool = False
    maximize: bool = False
    l2: bool = False
    decay: bool = False
    lr: bool = False

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        for flag in VARIANT_FLAGS:
            owners = [d.name for d in RULE_DEFS.values() if flag in d.variants]
            if getattr(self, flag) and self.rule not in owners:
                rules = " and ".join(owners)
                raise ValueError(f"{flag} is a variant of the {rules} rule{'s' if len(owners) > 1 else ''}")

    @property
    def variants(self) -> dict:
        """``{flag: value}`` of the rule's own variant flags."""
        return {flag: getattr(self, flag) for flag in RULE_DEFS[self.rule].variants}

    @property
    def variant(self) -> int:
        """The kernels' variant number: bit ``i`` set where the rule's ``i``-th declared variant
        flag is (C computes the same from a job's flags: the header's ``LBT_JOB_VARIANT``)."""
        return sum(1 << i for i, on in enumerate(self.variants.values()) if on)

    # (read from the declaration's data, not its methods: a step never enters lowbit_tree.rules)
    @property
    def nstates(self) -> int:
        """States per leaf, those the rule declares (:attr:`lowbit_tree.rules.RuleDef.states`) and
        its variants keep."""
        return len(self.signed)

    @property
    def signed(self) -> tuple[bool, ...]:
        """Whether each state is signed (a first moment) or not (second moments), in the
        declaration's order."""
        return tuple(s.signed for s in RULE_DEFS[self.rule].states if s.when is None or getattr(self, s.when))

    @property
    def needs_param(self) -> bool:
        return self.l2 or self.decay


def radam_terms(t, b1, b2, host: bool = True):
    """RAdam's ``(cm, rect)`` at step ``t`` (from 1), as torch.optim.RAdam computes its terms in
    float64: with ``rho_inf = 2 / (1 - b2) - 1`` and ``rho_t = rho_inf - 2 t b2**t / (1 - b2**t)``,
    the update is rectified when ``rho_t > 5``: ``cm = r * sqrt(1 - b2**t) / (1 - b1**t)``, ``r`` the
    rectification ``sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))``, and
    ``rect = 1``; otherwise ``cm = 1 / (1 - b1**t)`` and ``rect = 0`` (the update is the
    bias-corrected first moment). ``host``: Python floats; else float64 tensors (``torch.where``, no
    host sync)."""
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * t * b2**t / bc2
    if host:
        if rho_t > 5:
            r = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            return r * math.sqrt(bc2) / bc1, 1.0
        return 1 / bc1, 0.0
    ok = rho_t > 5
    r2 = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
    r = torch.where(ok, r2, torch.ones_like(r2)).sqrt()  # (the other branch's root may be of a negative)
    return torch.where(ok, r * bc2.sqrt() / bc1, 1 / bc1), ok.to(torch.float64)


def nadam_terms(t: int, b1: float, momentum_decay: float, mu_product: torch.Tensor):
    """NAdam's ``(cg, cm, mu_product')`` at step ``t`` (from 1), as torch.optim.NAdam computes them:
    the momentum ``mu_t = b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))`` in float64,
    ``mu_product' = mu_product * mu_t`` as torch's float32 0-d tensor product (``mu_product``: the
    product of the earlier steps' ``mu``, a float32 0-d tensor, not changed), then from its value
    ``cg = (1 - mu_t) / (1 - mu_product')`` (the gradient's factor) and ``cm = mu_{t+1} / (1 -
    mu_product' * mu_{t+1})`` (the first moment's), float64 Python numbers the vector rounds once."""
    mu = b1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay)))
    mu_next = b1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * momentum_decay)))
    new = mu_product * mu
    mp = float(new)
    return (1.0 - mu) / (1.0 - mp), mu_next / (1.0 - mp * mu_next), new


def step_hyperparams(
    spec: StepSpec,
    *,
    count=0,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    lr=0.0,
    weight_decay=0.0,
    l2=0.0,
    b3=0.0,
    alpha=0.0,
    cg=0.0,
    cm=0.0,
    device=None,
) -> torch.Tensor:
    """The float32 hyperparameter vector of one step: :data:`HYPER_NAMES`' entries in order.

    ``1-b1``, ``1-b2`` and the bias corrections ``1/bc1``, ``1/sqrt(bc2)`` (``bc = 1 -
    b**(count+1)``, adam only) are computed in float64 from the values as given (a
    Python float, or a tensor's value: a float32 tensor's is its float32 value) and
    rounded once, like every other entry. So a Python float and a float64 0-d
    tensor of the same value give the same bits (what the bridge passes), and the
    bias corrections lose nothing to float32 (``1 - 0.999`` in float32 is off by
    1e-5 relative). ``count`` (steps already taken) and the values may be Python
    numbers or 0-d tensors; tensors on a GPU are combined with tensor ops on their
    device (no host sync). Which of its hyperparameters a rule puts in which entry is its
    declaration's (:attr:`lowbit_tree.rules.RuleDef.slots`: for momentum and muon ``b1`` is the
    momentum). ``lr`` is the factor's negative: the update is scaled by ``-lr``. ``b3`` and
    ``alpha`` (ademamix's slow EMA rate and weight, this step's values after their warm-up) are 0
    for the others. ``cg`` and ``cm`` (nadam's factors, :func:`nadam_terms`: Python numbers) are
    0 for the others; radam's ``cm`` comes from :func:`radam_terms`.
    """
    values = (count, b1, b2, eps, lr, weight_decay, l2, b3, alpha)
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    declared = RULE_DEFS[spec.rule]
    adam = declared.bias_correction  # bias-corrected moments
    if tensors and not torch.compiler.is_compiling() and all(t.device.type == "cpu" for t in tensors):
        # CPU values cost nothing to read: the host path (same bits as the tensor path)
        count, b1, b2, eps, lr, weight_decay, l2, b3, alpha = (
            (int(v) if v is count else float(v)) if isinstance(v, torch.Tensor) else v for v in values
        )
        tensors = []
    if not tensors:
        b1f, b2f = float(b1), float(b2)
        c = int(count) + 1
        rbc1 = 1.0 / (1.0 - b1f**c) if adam else 0.0
        rsbc2 = 1.0 / math.sqrt(1.0 - b2f**c) if adam else 0.0
        b3f = float(b3)
        cm, rect = radam_terms(c, b1f, b2f) if declared.rectified else (float(cm), 0.0)
        vals = Hyper(b1=b1f, omb1=1.0 - b1f, b2=b2f, omb2=1.0 - b2f, rbc1=rbc1, rsbc2=rsbc2, eps=float(eps),
                     lr=float(lr), wd=float(weight_decay), l2=float(l2), b3=b3f,
                     omb3=1.0 - b3f if declared.slow_ema else 0.0, alpha=float(alpha), cm=cm, rect=rect,
                     cg=float(cg))
        return torch.tensor(list(vals), dtype=torch.float32, device="cpu" if device is None else device)
    dev = device if device is not None else tensors[0].device

    def f64(v):
        return torch.as_tensor(v, device=dev).to(torch.float64).reshape(1)

    b1t, b2t = f64(b1), f64(b2)
    one = torch.ones(1, dtype=torch.float64, device=dev)
    if adam:
        c = torch.as_tensor(count, device=dev).to(torch.float64).reshape(1) + 1
        rbc1 = 1 / (1 - torch.pow(b1t, c))
        rsbc2 = (1 - torch.pow(b2t, c)).rsqrt()
    else:
        rbc1 = rsbc2 = torch.zeros(1, dtype=torch.float64, device=dev)
    b3t = f64(b3)
    zero = torch.zeros(1, dtype=torch.float64, device=dev)
    omb3 = one - b3t if declared.slow_ema else zero
    if declared.rectified:
        t = torch.as_tensor(count, device=dev).to(torch.float64).reshape(1) + 1
        cm, rect = radam_terms(t, b1t, b2t, host=False)
    else:
        cm, rect = f64(cm), zero
    parts = Hyper(b1=b1t, omb1=one - b1t, b2=b2t, omb2=one - b2t, rbc1=rbc1, rsbc2=rsbc2, eps=f64(eps), lr=f64(lr),
                  wd=f64(weight_decay), l2=f64(l2), b3=b3t, omb3=omb3, alpha=f64(alpha), cm=cm, rect=rect,
                  cg=f64(cg))
    return torch.cat(list(parts)).to(torch.float32)


class StepLeaf(NamedTuple):
    """One leaf of a step: its param (``None`` where the step needs none), its
    gradient, its states (QTensor / Rank1QTensor records or plain float tensors,
    in the rule's order), and, for stochastic rounding of a bfloat16 param, its
    index in its tree (the rounding key is per call)."""

    param: Optional[torch.Tensor]
    grad: torch.Tensor
    states: tuple
    index: int = 0
    correction: Optional[torch.Tensor] = None  # int8 rounding error of a param written in place (lowbit_tree.correction)
