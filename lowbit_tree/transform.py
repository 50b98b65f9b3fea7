"""Building blocks: each returns a :class:`GradientTransformation` (optax's ``transform``).

The update rules (:func:`scale_by_adam`, :func:`scale_by_ademamix`, :func:`scale_by_lion`, :func:`trace`,
:func:`scale_by_rms`, :func:`scale_by_rss`, :func:`scale_by_adamax`, :func:`scale_by_adadelta`, :func:`scale_by_radam`, :func:`scale_by_nadam`; each declared once in :mod:`lowbit_tree.rules`)
each run one step of :mod:`lowbit_tree.kernels` over all leaves of the tree (the
native C kernel on CPU, compiled torch elsewhere: the same bits). The
elementwise links (:func:`flip_sign`, :func:`add_decayed_weights`,
:func:`scale_by_learning_rate`) are fused into that step when a
:func:`~lowbit_tree.chain` puts them next to a rule, and otherwise do the same
float32 operations on their own.

All arithmetic is float32 whatever the parameter or gradient dtype, and updates
are float32 (a low-precision param is rounded once, by
:func:`~lowbit_tree.apply_updates`). Hyperparameters may be Python floats or 0-d
tensors (so :func:`~lowbit_tree.inject_hyperparams` can swap them without
rebuilding anything).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import torch

from . import kernels, moments, rules
from .base import (STEP, EmptyState, GradientTransformation, ScalarOrSchedule, init_count, plan_from_update,
                   scalar_value)
from .kernels.pure_rows import PureRows
from .moments import StateFormat
from .tree_utils import flatten, map_leaves

__all__ = [
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByAdEMAMixState",
    "TraceState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByAdamaxState",
    "ScaleByAdadeltaState",
    "ScaleByRAdamState",
    "ScaleByNAdamState",
    "ScaleByScheduleState",
    "Fusion",
    "scale_by_adam",
    "scale_by_lion",
    "scale_by_ademamix",
    "trace",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_adamax",
    "scale_by_adadelta",
    "scale_by_radam",
    "scale_by_nadam",
    "flip_sign",
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

    roles = rules.rule("adam").roles(STEP)


class ScaleByLionState(NamedTuple):
    count: torch.Tensor
    mu: Any

    roles = rules.rule("lion").roles(STEP)


class ScaleByAdEMAMixState(NamedTuple):
    count: torch.Tensor
    mu: Any  # the fast EMA of the gradient (bias-corrected in the update)
    nu: Any  # the second moment
    mu_slow: Any  # the slow EMA (rate b3, weight alpha; not bias-corrected)

    roles = rules.rule("ademamix").roles(STEP)


class TraceState(NamedTuple):
    trace: Any  # the momentum buffer, shaped like params

    roles = rules.rule("momentum").roles()


class ScaleByRmsState(NamedTuple):
    count: torch.Tensor
    nu: Any  # the running average of squared gradients (torch.optim.RMSprop's square_avg)
    trace: Any  # the momentum buffer (has_momentum) or None
    mu: Any  # the running average of gradients (centered) or None

    roles = rules.rule("rmsprop").roles(STEP)


class ScaleByRssState(NamedTuple):
    count: torch.Tensor
    sum: Any  # the running sum of squared gradients (torch.optim.Adagrad's sum)

    roles = rules.rule("adagrad").roles(STEP)


class ScaleByAdamaxState(NamedTuple):
    count: torch.Tensor
    nu: Any  # the exponentially weighted infinity norm (torch.optim.Adamax's exp_inf)
    mu: Any  # the first moment (exp_avg)

    roles = rules.rule("adamax").roles(STEP)


class ScaleByAdadeltaState(NamedTuple):
    count: torch.Tensor
    nu: Any  # the running average of squared gradients (torch.optim.Adadelta's square_avg)
    delta: Any  # the running average of squared updates (acc_delta)

    roles = rules.rule("adadelta").roles(STEP)


class ScaleByRAdamState(NamedTuple):
    count: torch.Tensor
    nu: Any  # the second moment (torch.optim.RAdam's exp_avg_sq)
    mu: Any  # the first moment (exp_avg)

    roles = rules.rule("radam").roles(STEP)


class ScaleByNAdamState(NamedTuple):
    count: torch.Tensor
    mu_product: torch.Tensor  # float32, 0-d: the product of the steps' momenta (torch.optim.NAdam's)
    nu: Any  # the second moment (exp_avg_sq)
    mu: Any  # the first moment (exp_avg)

    roles = rules.rule("nadam").roles(STEP)


class ScaleByScheduleState(NamedTuple):
    count: torch.Tensor

    roles = {"count": STEP}


class Fusion(NamedTuple):
    """The links around a rule that :func:`~lowbit_tree.chain` runs inside the
    rule's kernel (``None``: no such link): ``maximize`` (a :func:`flip_sign`
    before), ``l2`` (an :func:`add_decayed_weights` before: L2 decay of the
    gradient), ``decay`` (one after: decoupled decay), ``lr`` (the learning-rate
    factor's negative, from :func:`scale_by_learning_rate`), ``sr_key`` (a final
    :func:`~lowbit_tree.stochastic_rounding` when params are written in place),
    ``correction`` (a final :func:`~lowbit_tree.param_correction` when params are written
    in place: its tree of int8 corrections, read and written by the kernel).

    In a rule's ``update`` these are this step's values. In its plan, ``lr`` and
    ``sr_key`` are functions of no argument, called once a step: each returns that
    step's value and advances its link's state in place."""

    maximize: bool = False
    l2: Any = None
    decay: Any = None
    lr: Any = None
    sr_key: Any = None
    correction: Any = None


def _fused_spec(spec: kernels.StepSpec, fusion: Fusion) -> kernels.StepSpec:
    return dataclasses.replace(spec, maximize=fusion.maximize, l2=fusion.l2 is not None,
                               decay=fusion.decay is not None, lr=fusion.lr is not None)


def _hyper(spec, rule_hyper: dict, count, fusion: Fusion, lr, device) -> torch.Tensor:
    """This step's hyperparameter vector (:func:`~lowbit_tree.kernels.step_hyperparams`), from
    its arguments only (built every call: about 12 us on the host, nothing remembered)."""
    values = dict(rule_hyper, count=count, lr=0.0 if lr is None else lr,
                  weight_decay=0.0 if fusion.decay is None else fusion.decay,
                  l2=0.0 if fusion.l2 is None else fusion.l2)
    return kernels.step_hyperparams(spec, **values, device=device)


def run_rule(spec: kernels.StepSpec, rule_hyper: dict, updates, state_trees: tuple, params, count, fusion: Fusion,
              *, inplace: bool = False, leaf_offset: int = 0, rows: PureRows | None = None):
    """One rule's pure step on a tree (``inplace``: the states' tensors are overwritten, for
    a plan that could not hold the leaves fixed): every leaf with a gradient goes to the
    kernels in one call, with the ``fusion``'s links; ``rows``: the caller's job rows, reused
    while the tree keeps its structure (:class:`~lowbit_tree.kernels.pure_rows.PureRows`).
    Returns ``(updates, new state trees)``."""
    spec = _fused_spec(spec, fusion)
    g_leaves, treespec = flatten(updates)
    per_state = [treespec.flatten_up_to(t) for t in state_trees]
    p_leaves = treespec.flatten_up_to(params) if params is not None else [None] * len(g_leaves)
    if spec.needs_param and params is None:
        raise ValueError("add_decayed_weights needs params: call update(updates, state, params)")
    leaves, where = [], []
    for i, g in enumerate(g_leaves):
        if g is None:
            continue
        leaves.append(kernels.StepLeaf(p_leaves[i], g, tuple(s[i] for s in per_state), leaf_offset + i))
        where.append(i)
    if not leaves:
        return updates, state_trees
    hyper = _hyper(spec, rule_hyper, count, fusion, fusion.lr, leaves[0].grad.device)
    done = rows.run(spec, hyper, leaves) if rows is not None and not inplace else None
    outs, news = done if done is not None else kernels.run_step(spec, hyper, leaves, inplace=inplace)
    new_updates = list(g_leaves)
    new_states = [list(s) for s in per_state]
    for k, i in enumerate(where):
        new_updates[i] = outs[k]
        for j in range(len(state_trees)):
            new_states[j][i] = news[k][j]
    return treespec.unflatten(new_updates), tuple(treespec.unflatten(s) for s in new_states)


class _RulePlan:
    """A rule's in-place step over fixed leaves (the rule's plan): the kernel plan of its
    leaves (:class:`~lowbit_tree.kernels.plan.KernelPlan`), built once; a call computes this
    step's hyperparameter vector and runs it. Params are written in place when ``write`` and
    a learning rate is fused."""

    def __init__(self, spec, rule_hyper, state_trees: tuple, count, params, fusion: Fusion, write: bool,
                 leaf_offset: int, scalars: tuple | None = None):
        from .kernels.plan import KernelPlan

        if params is None:
            raise ValueError("a rule's plan needs the params tree (plan(state, params))")
        self.spec = spec = _fused_spec(spec, fusion)
        self.rule_hyper, self.count, self.fusion, self.scalars = rule_hyper, count, fusion, scalars
        p_leaves, treespec = flatten(params)
        per_state = [treespec.flatten_up_to(t) for t in state_trees]
        self.where = [i for i, p in enumerate(p_leaves) if all(s[i] is not None for s in per_state)]
        self.write = bool(write and spec.lr)
        corrections = None
        if fusion.correction is not None and self.write:
            c_leaves = treespec.flatten_up_to(fusion.correction)
            corrections = [c_leaves[i] for i in self.where]
        self.kernel = KernelPlan(spec, [p_leaves[i] for i in self.where],
                                 [tuple(s[i] for s in per_state) for i in self.where],
                                 [leaf_offset + i for i in self.where], write=self.write, corrections=corrections)

    def __call__(self, updates: list) -> list:
        fusion, count = self.fusion, self.count
        lr = fusion.lr() if fusion.lr is not None else None
        sr_key = fusion.sr_key() if (fusion.sr_key is not None and self.write) else None
        grads = [updates[i] for i in self.where]
        out = list(updates)
        device = next((g.device for g in grads if g is not None), None)
        if self.scalars is not None:  # advanced with the count (their new values written in place)
            rule_hyper, new = self.rule_hyper(0 if count is None else count, self.scalars)
            for s, v in zip(self.scalars, new):
                s.copy_(v)
        else:
            rule_hyper = self.rule_hyper(count) if callable(self.rule_hyper) else self.rule_hyper
        if device is not None:
            hyper = _hyper(self.spec, rule_hyper, 0 if count is None else count, fusion, lr, device)
            for i, u in zip(self.where, self.kernel.run(grads, hyper, sr_key)):
                out[i] = u
        if count is not None:
            count.add_(1)
        return out


def _rule_link(spec: kernels.StepSpec, trees_of, rebuild, rule_hyper, count_of, init,
               scalars_of=None) -> GradientTransformation:
    """A rule as a transformation: its pure ``update``, its ``plan``, and the fused forms
    :func:`~lowbit_tree.chain` calls with the links around it (``trees_of(state)``: the
    rule's state trees in its order; ``rebuild(state, new trees)``: the next state;
    ``rule_hyper(count)`` or a dict: this step's rule hyperparameters; ``count_of(state)``:
    its step count tensor, or ``None``). A rule with scalar states (:attr:`RuleDef.scalars
    <lowbit_tree.rules.RuleDef.scalars>`) gives ``scalars_of(state)``, their tensors; its
    ``rule_hyper(count, scalars)`` returns this step's hyperparameters and the scalars' next
    values, and its ``rebuild(state, new trees, new scalars)``."""

    pure_rows = PureRows()  # the pure step's job rows, built once per structure of the tree

    def hyper_at(count):
        return rule_hyper(count) if callable(rule_hyper) else rule_hyper

    def fused_update(updates, state, params, fusion: Fusion):
        count = count_of(state)
        count = 0 if count is None else count
        if scalars_of is None:
            hyper, extra = hyper_at(count), None
        else:
            hyper, extra = rule_hyper(count, scalars_of(state))
        updates, new = run_rule(spec, hyper, updates, trees_of(state), params, count, fusion, rows=pure_rows)
        return updates, (rebuild(state, new) if scalars_of is None else rebuild(state, new, extra))

    def update(updates, state, params=None, **extra):
        return fused_update(updates, state, params, Fusion())

    def fused_plan(state, params, fusion: Fusion, *, write: bool = False, leaf_offset: int = 0):
        return _RulePlan(spec, rule_hyper, trees_of(state), count_of(state), params, fusion, write, leaf_offset,
                         None if scalars_of is None else scalars_of(state))

    def plan(state, params, *, write=False, leaf_offset=0):
        return fused_plan(state, params, Fusion(), write=write, leaf_offset=leaf_offset)

    update.lowbit_link = ("rule", {"fused_update": fused_update, "fused_plan": fused_plan, "pure_rows": pure_rows})
    return GradientTransformation(init, update, plan)


def _count(state):
    return state.count


def _no_count(state):
    return None


def _link(update, tag: str, **info):
    """Mark ``update`` as a link :func:`~lowbit_tree.chain` may fuse into a rule's kernel (``tag``:
    which link it is, as ``combine._link_tag`` reads it)."""
    update.lowbit_link = (tag, info)
    return update


def scale_by_adam(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    *,
    amsgrad: bool = False,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    rank1_normalization: bool | None = None,
) -> GradientTransformation:
    """Rescale updates by Adam's ``m_hat / (sqrt(v_hat) + eps)``.

    Args:
      b1, b2: decay rates of the first and second moments.
      eps: added to ``sqrt(v_hat)`` (outside the square root, as torch.optim.Adam).
      amsgrad: keep the running maximum of ``v`` (state ``nu_max``, ``"max_exp_avg_sq"``).
      state_format: ``"fp32"``, ``"bf16"`` (all leaves), or a quantized format
        (``"8bit"``, ``"4bit"``, ``"nf4"``, ``"fp8"``, ``"8bit_bnb"``; see
        ``lowbit_tree.STATE_FORMATS``) for leaves that pass :func:`should_quantize`; or a
        mapping from the states' torch.optim names (``"exp_avg"``: ``mu``, ``"exp_avg_sq"``:
        ``nu``, ``"max_exp_avg_sq"``: ``nu_max``) to formats, e.g. ``{"exp_avg": "8bit",
        "exp_avg_sq": "4bit"}``; a state it leaves out is ``"8bit"``
        (:func:`~lowbit_tree.moments.state_formats`).
      block_size: block size of quantized leaves (``None``: each format's default).
      min_quant_size: smaller (or 1-D) leaves keep a float32 state.
      rank1_normalization: store a ``"4bit"`` / ``"nf4"`` second moment (``nu``, ``nu_max``) as a
        :class:`~lowbit_tree.Rank1QTensor` (arXiv 2309.01507: each element normalized
        by its row's and column's maxima) instead of per block. ``None`` (default): the
        format's choice, ``lowbit_tree.moments.default_rank1`` (``True`` for the 4-bit formats,
        chosen by measurement: design.md, "The 4-bit default"); ``True`` needs ``nu`` in 4 bits.
    Returns:
      A transformation with state :class:`ScaleByAdamState`.
    """
    return _declared_rule("adam", ScaleByAdamState, dict(amsgrad=amsgrad), dict(b1=b1, b2=b2, eps=eps),
                          state_format=state_format, block_size=block_size, min_quant_size=min_quant_size,
                          rank1_normalization=rank1_normalization)


def scale_by_lion(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.99,
    *,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """Lion's sign update (arXiv 2302.06675); one state, the momentum (signed format).
    ``state_format``: as :func:`scale_by_adam`; the state's name is ``"exp_avg"``."""
    return _declared_rule("lion", ScaleByLionState, {}, dict(b1=b1, b2=b2), state_format=state_format,
                          block_size=block_size, min_quant_size=min_quant_size)


def ademamix_warmups(count, b1, b3, alpha, t_alpha: int | None, t_beta3: int | None):
    """This step's ``(b3, alpha)`` after AdEMAMix's warm-ups (arXiv 2409.03137, as
    bitsandbytes): ``alpha * min(1, step / t_alpha)`` and ``b3`` rising from ``b1`` on
    a log-log path, ``min(exp(ln b1 ln b3 / ((1 - s) ln b3 + s ln b1)), b3)``,
    ``s = step / t_beta3``; ``step = count + 1``. In float64 (on the host when the count
    is a Python number or a CPU tensor, else with tensor ops on its device)."""
    if not t_alpha and not t_beta3:
        return b3, alpha
    tensors = [v for v in (count, b1, b3, alpha) if isinstance(v, torch.Tensor)]
    if not tensors or (not torch.compiler.is_compiling() and all(t.device.type == "cpu" for t in tensors)):
        step, b1f, b3f, af = int(count) + 1, float(b1), float(b3), float(alpha)
        if t_alpha:
            af = min(step * af / t_alpha, af)
        if t_beta3:
            ln1, ln3, sc = math.log(b1f), math.log(b3f), step / t_beta3
            b3f = min(math.exp((ln1 * ln3) / ((1 - sc) * ln3 + sc * ln1)), b3f)
        return b3f, af
    dev = tensors[0].device

    def f64(v):
        return torch.as_tensor(v, device=dev).to(torch.float64)

    step = f64(count) + 1
    b1t, b3t, at = f64(b1), f64(b3), f64(alpha)
    if t_alpha:
        at = torch.minimum(step * at / t_alpha, at)
    if t_beta3:
        ln1, ln3, sc = torch.log(b1t), torch.log(b3t), step / t_beta3
        b3t = torch.minimum(torch.exp((ln1 * ln3) / ((1 - sc) * ln3 + sc * ln1)), b3t)
    return b3t, at


def scale_by_ademamix(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    b3: float | torch.Tensor = 0.9999,
    alpha: float | torch.Tensor = 5.0,
    eps: float | torch.Tensor = 1e-8,
    *,
    t_alpha: int | None = None,
    t_beta3: int | None = None,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    slow_state_format: str | None = None,
) -> GradientTransformation:
    """AdEMAMix (arXiv 2409.03137): Adam's fast EMA ``m`` and second moment ``v`` plus a
    slow EMA ``s`` of rate ``b3`` weighted by ``alpha``:
    ``u = (m_hat + alpha * s) / (sqrt(v_hat) + eps)``.

    Args:
      t_alpha, t_beta3: warm-up lengths in steps of ``alpha`` and ``b3``
        (``ademamix_warmups``); ``None``: no warm-up.
      state_format, block_size, min_quant_size: as :func:`scale_by_adam`; both EMAs
        take the signed format, ``v`` the second-moment one. A mapping's names are
        ``"exp_avg"`` (``m``), ``"exp_avg_sq"`` (``v``) and ``"exp_avg_slow"`` (``s``).
      slow_state_format: the slow EMA's format if not ``state_format`` (its error is
        weighted by ``alpha``: with 4-bit states, an 8-bit slow EMA recovers most of the
        loss 4-bit costs: docs/results.md, "Convergence"). It is the ``"exp_avg_slow"`` entry:
        with a mapping that leaves the slow EMA out it sets it, and a mapping that names it with
        another format is refused. Its block size is that format's default unless ``block_size``
        is given.
    Returns:
      A transformation with state :class:`ScaleByAdEMAMixState`.
    """
    for name, t in (("t_alpha", t_alpha), ("t_beta3", t_beta3)):
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"{name} must be a positive int (steps) or None, got {t!r}")

    def rule_hyper(count):
        b3_t, alpha_t = ademamix_warmups(count, b1, b3, alpha, t_alpha, t_beta3)
        return dict(b1=b1, b2=b2, eps=eps, b3=b3_t, alpha=alpha_t)

    return _declared_rule("ademamix", ScaleByAdEMAMixState, {}, rule_hyper, state_format=state_format,
                          block_size=block_size, min_quant_size=min_quant_size,
                          format_args=dict(slow_state_format=slow_state_format))


def trace(
    momentum: float | torch.Tensor,
    nesterov: bool = False,
    *,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """Heavy-ball (or Nesterov) momentum as in torch.optim.SGD with ``dampening=0``.

    A zero buffer reproduces torch's first step (``buf = g``). The buffer is a
    first moment: signed format when quantized. ``state_format``: as
    :func:`scale_by_adam`; the state's name is ``"momentum_buffer"``.
    """
    return _declared_rule("momentum", TraceState, dict(nesterov=nesterov), dict(momentum=momentum),
                          state_format=state_format, block_size=block_size, min_quant_size=min_quant_size)


class RuleStage(NamedTuple):
    """What a rule's transformation does around its kernel step when that is not all of it
    (Muon: Newton-Schulz after the kernel, low-rank buffers around it): ``leaf(param, record)``
    is a state leaf from the builder's record of it (``moments.init_moment``'s); ``before(updates,
    trees) -> (the kernel's updates, its state trees, context)``; ``after(updates, kernel updates,
    new trees, context, params, count, inplace, leaf_offset) -> (updates, new trees)``. The
    builder makes the state, runs the kernel between the two and advances the count; a staged
    rule is not fused into a chain's kernel (its update is not elementwise)."""

    leaf: Callable
    before: Callable
    after: Callable


def staged_rule(name: str, state_type: type, variants: dict, rule_hyper: dict, stage: RuleStage, *,
                state_format: StateFormat, block_size: int | None, min_quant_size: int) -> GradientTransformation:
    """The builder's rule ``name`` with a :class:`RuleStage` around its kernel step (the arguments
    as ``_declared_rule``'s; the rule's vector does not depend on the count)."""
    return _declared_rule(name, state_type, variants, rule_hyper, state_format=state_format, block_size=block_size,
                          min_quant_size=min_quant_size, stage=stage)


def _staged_link(spec: kernels.StepSpec, stage: RuleStage, hyper: dict, trees_of, rebuild, count_of,
                 init) -> GradientTransformation:
    """A rule with a stage as a transformation: ``stage.before``, the kernel step (``run_rule``),
    ``stage.after``; its plan runs the same in place and advances the count."""

    def step(updates, state, params, inplace: bool, offset: int):
        grads, trees, context = stage.before(updates, trees_of(state))
        out, new = run_rule(spec, hyper, grads, trees, None, 0, Fusion(), inplace=inplace, leaf_offset=offset)
        return stage.after(updates, out, new, context, params, count_of(state), inplace, offset)

    def update(updates, state, params=None, **extra):
        out, new = step(updates, state, params, False, 0)
        return out, rebuild(state, new)

    def plan(state, params, *, write=False, leaf_offset=0):
        treespec = flatten(params)[1]
        count = count_of(state)

        def run(updates: list) -> list:
            out, _ = step(treespec.unflatten(list(updates)), state, params, True, leaf_offset)
            if count is not None:
                count.add_(1)
            return treespec.flatten_up_to(out)

        return run

    return GradientTransformation(init, update, plan)


def _declared_rule(name: str, state_type: type, variants: dict, rule_hyper, *, state_format: StateFormat,
                   block_size: int | None, min_quant_size: int, advance=None, rank1_normalization: bool | None = False,
                   format_args: dict | None = None, stage: RuleStage | None = None) -> GradientTransformation:
    """A rule whose states are all its declaration says (:data:`lowbit_tree.rules.RULE_DEFS`): each
    kept state made by ``moments.init_moment`` in its format and signedness, the others ``None``;
    ``state_type`` has a ``count`` (unless the rule keeps none: :class:`TraceState`, as
    torch.optim.SGD), one field per declared scalar (a 0-d float32 tensor, its initial value)
    and one per declared state.

    ``rule_hyper``: the rule's hyperparameters by argument name, a dict or a function of the
    count returning one (AdEMAMix's warm-ups). A rule with scalars gives ``advance(count,
    scalars)``: this step's vector entries beyond ``rule_hyper`` and the scalars' next values.
    ``rank1_normalization``: as :func:`scale_by_adam` (``False``: no rank-1 records, the rule
    does not offer them); ``format_args``: ``moments.state_formats``' arguments beside
    ``state_format`` (``slow_state_format``); ``stage``: a :class:`RuleStage` around the kernel
    step (:func:`staged_rule`). The transformation's ``init`` carries the declaration as
    ``lowbit_rule``: the builder's mark."""
    declared = rules.rule(name)
    formats = moments.state_formats(state_format, declared.state_names, **(format_args or {}))
    kept = declared.kept(**variants)
    counted = "count" in state_type.__annotations__  # a NamedTuple's fields
    if declared.scalars and not counted:
        raise TypeError(f"{state_type.__name__} needs a count: the {name} rule's scalars advance with it")
    second = next((s.name for s in declared.states if not s.signed), None)
    if rank1_normalization is not False:  # True needs a 4-bit second moment
        moments.resolve_rank1(rank1_normalization, formats[second])

    def moment(s):
        rank1 = rank1_normalization is not False and moments.default_rank1(formats[s.name])
        def make(p):
            record = moments.init_moment(p, formats[s.name], signed=s.signed, block_size=block_size,
                                         min_quant_size=min_quant_size, rank1=rank1)
            return record if stage is None else stage.leaf(p, record)

        return make

    def init(params):
        trees = {s.field: map_leaves(moment(s), params) if s in kept else None for s in declared.states}
        if not counted:
            return state_type(**trees)
        count = init_count(params)
        scalars = {f: torch.full((), v, dtype=torch.float32, device=count.device) for f, v in declared.scalars}
        return state_type(count=count, **scalars, **trees)

    init.lowbit_rule = declared

    def trees_of(state):
        return tuple(getattr(state, s.field) for s in kept)

    def rebuild(state, new, scalars=()):
        step = {"count": state.count + 1} if counted else {}
        # Built field by field, not with state._replace: torch 2.11's dynamo hands back a
        # zero-length namedtuple from a _replace whose result leaves a torch.compile'd region
        # (tests/test_wrappers.py::test_changing_lr_does_not_recompile; torch 2.13 and 2.14 do not).
        fields = state._asdict()
        fields.update(step, **{s.field: t for s, t in zip(kept, new)},
                      **{f: v for (f, _), v in zip(declared.scalars, scalars)})
        return type(state)(**fields)

    spec = kernels.StepSpec(name, **variants)
    count_of = _count if counted else _no_count
    if callable(rule_hyper):
        def hyper(count):
            return declared.hyper(**rule_hyper(count))
    else:
        hyper = declared.hyper(**rule_hyper)
    if stage is not None:
        if callable(hyper) or declared.scalars or declared.bias_correction or declared.rectified:
            raise TypeError(f"the {name} rule's vector depends on the count: a staged rule's may not")
        return _staged_link(spec, stage, hyper, trees_of, rebuild, count_of, init)
    if not declared.scalars:
        return _rule_link(spec, trees_of, rebuild, hyper, count_of, init)

    def hyper_and_scalars(count, scalars):
        extra, new = advance(count, scalars)
        return dict(hyper(count) if callable(hyper) else hyper, **extra), new

    return _rule_link(spec, trees_of, rebuild, hyper_and_scalars, count_of, init,
                      scalars_of=lambda state: tuple(getattr(state, f) for f, _ in declared.scalars))


def scale_by_rms(
    alpha: float | torch.Tensor = 0.99,
    eps: float | torch.Tensor = 1e-8,
    momentum: float | torch.Tensor = 0.0,
    *,
    centered: bool = False,
    has_momentum: bool | None = None,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """torch.optim.RMSprop's rule: ``v = alpha*v + (1-alpha)*g*g``, ``d = sqrt(v) + eps``
    (``centered``: ``a = lerp(a, g, 1-alpha)``, ``d = sqrt(v - a*a) + eps``), the update ``g / d``,
    or with momentum ``b = momentum*b + g/d`` and the update ``b``.

    Args:
      alpha: smoothing constant of ``v`` (state ``nu``, torch's ``"square_avg"``; a second moment).
      eps: added to the root, outside it.
      momentum: momentum factor of the buffer ``trace`` (``"momentum_buffer"``).
      centered: keep ``mu`` (``"grad_avg"``), the running average of the gradient, and normalize
        by the estimated variance.
      has_momentum: whether the momentum buffer exists (``None``: ``momentum`` is not the number
        0, as torch.optim.RMSprop decides it; a tensor ``momentum`` keeps one).
      state_format, block_size, min_quant_size: as :func:`scale_by_adam`; a mapping's names are
        ``"square_avg"``, ``"momentum_buffer"`` and ``"grad_avg"``.
    Returns:
      A transformation with state :class:`ScaleByRmsState`.
    """
    if has_momentum is None:
        has_momentum = isinstance(momentum, torch.Tensor) or momentum != 0
    return _declared_rule("rmsprop", ScaleByRmsState, dict(has_momentum=has_momentum, centered=centered),
                          dict(momentum=momentum, alpha=alpha, eps=eps), state_format=state_format,
                          block_size=block_size, min_quant_size=min_quant_size)


def scale_by_rss(
    initial_accumulator_value: float | torch.Tensor = 0.0,
    eps: float | torch.Tensor = 1e-10,
    *,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """torch.optim.Adagrad's rule: ``s = s + g*g`` (the root of the running sum of squares),
    the update ``g / (sqrt(s) + eps)``.

    Args:
      initial_accumulator_value: the value ``s`` (state ``sum``, torch's ``"sum"``; a second
        moment) starts from. The state is made as zeros, like every state, and the step takes
        ``max(s, initial_accumulator_value)``: the first step lifts it, later ones change
        nothing (``s`` only grows), so a loaded torch.optim state gives torch's values too.
      eps: added to the root, outside it.
      state_format, block_size, min_quant_size: as :func:`scale_by_adam`; the state's name is
        ``"sum"``.
    Returns:
      A transformation with state :class:`ScaleByRssState`.
    """
    return _declared_rule("adagrad", ScaleByRssState, {}, dict(initial_accumulator_value=initial_accumulator_value,
                                                               eps=eps),
                          state_format=state_format, block_size=block_size, min_quant_size=min_quant_size)


def scale_by_adamax(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    *,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """torch.optim.Adamax's rule: ``e = max(b2*e, |g| + eps)``, ``m = b1*m + (1-b1)*g``, the update
    ``(m / (1 - b1**t)) / e`` at step ``t``.

    Args:
      b1: decay rate of the first moment ``mu`` (torch's ``"exp_avg"``; bias-corrected).
      b2: decay rate of the infinity norm ``nu`` (``"exp_inf"``; non-negative, stored as a second
        moment).
      eps: added to ``|g|`` inside the maximum (as torch.optim.Adamax).
      state_format, block_size, min_quant_size: as :func:`scale_by_adam`; a mapping's names are
        ``"exp_avg"`` and ``"exp_inf"``.
    Returns:
      A transformation with state :class:`ScaleByAdamaxState`.
    """
    return _declared_rule("adamax", ScaleByAdamaxState, {}, dict(b1=b1, b2=b2, eps=eps), state_format=state_format,
                          block_size=block_size, min_quant_size=min_quant_size)


def scale_by_adadelta(
    rho: float | torch.Tensor = 0.9,
    eps: float | torch.Tensor = 1e-6,
    *,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """torch.optim.Adadelta's rule: ``v = rho*v + (1-rho)*g*g``, the update
    ``u = sqrt(a + eps) / sqrt(v + eps) * g``, then ``a = rho*a + (1-rho)*u*u``.

    Args:
      rho: decay rate of ``nu`` (torch's ``"square_avg"``) and ``delta`` (``"acc_delta"``), both
        non-negative (second moments).
      eps: added inside both square roots (as torch.optim.Adadelta).
      state_format, block_size, min_quant_size: as :func:`scale_by_adam`; a mapping's names are
        ``"square_avg"`` and ``"acc_delta"``.
    Returns:
      A transformation with state :class:`ScaleByAdadeltaState`.
    """
    return _declared_rule("adadelta", ScaleByAdadeltaState, {}, dict(rho=rho, eps=eps), state_format=state_format,
                          block_size=block_size, min_quant_size=min_quant_size)


def scale_by_radam(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    *,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """torch.optim.RAdam's rule (arXiv 1908.03265): Adam's moments; at step ``t`` the update is
    ``m / (1 - b1**t) * r * sqrt(1 - b2**t) / (sqrt(v) + eps)`` once the variance is tractable
    (``rho_t > 5``, ``r`` the rectification), else the bias-corrected ``m / (1 - b1**t)``
    (``lowbit_tree.kernels.spec.radam_terms``, per step in float64).

    Args:
      b1, b2: decay rates of ``mu`` (torch's ``"exp_avg"``) and ``nu`` (``"exp_avg_sq"``).
      eps: added to ``sqrt(v)``, outside the root and before the bias correction (as
        torch.optim.RAdam).
      state_format, block_size, min_quant_size: as :func:`scale_by_adam`; a mapping's names are
        ``"exp_avg"`` and ``"exp_avg_sq"``.
    Returns:
      A transformation with state :class:`ScaleByRAdamState`.
    """
    return _declared_rule("radam", ScaleByRAdamState, {}, dict(b1=b1, b2=b2, eps=eps), state_format=state_format,
                          block_size=block_size, min_quant_size=min_quant_size)


def scale_by_nadam(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    momentum_decay: float | torch.Tensor = 4e-3,
    *,
    state_format: StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """torch.optim.NAdam's rule (Dozat 2016, with its momentum schedule): Adam's moments; at step
    ``t`` the momentum ``mu_t = b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))``, the state's
    ``mu_product`` times ``mu_t``, and the update ``((1 - mu_t) / (1 - mu_product) * g +
    mu_{t+1} / (1 - mu_product * mu_{t+1}) * m) / (sqrt(v / (1 - b2**t)) + eps)``
    (``lowbit_tree.kernels.spec.nadam_terms``: the factors per step in float64, the product in
    float32 as torch's).

    Args:
      b1, b2: decay rates of ``mu`` (torch's ``"exp_avg"``) and ``nu`` (``"exp_avg_sq"``).
      eps: added to the bias-corrected ``sqrt(v)``, outside the root.
      momentum_decay: the momentum schedule's rate.
      state_format, block_size, min_quant_size: as :func:`scale_by_adam`; a mapping's names are
        ``"exp_avg"`` and ``"exp_avg_sq"``.
    Returns:
      A transformation with state :class:`ScaleByNAdamState`.
    """
    def advance(count, scalars):
        cg, cm, mu_product = kernels.spec.nadam_terms(int(count) + 1, float(b1), float(momentum_decay), scalars[0])
        return dict(cg=cg, cm=cm), (mu_product,)

    return _declared_rule("nadam", ScaleByNAdamState, {}, dict(b1=b1, b2=b2, eps=eps), state_format=state_format,
                          block_size=block_size, min_quant_size=min_quant_size, advance=advance)


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
            return None if u is None else u.float() + weight_decay * p.float()

        return map_leaves(leaf, updates, params), state

    tx = GradientTransformation(init, _link(update, "decay", weight_decay=weight_decay), plan_from_update(update))
    if mask is not None:
        from .wrappers import masked

        return masked(tx, mask)
    return tx


def flip_sign() -> GradientTransformation:
    """Negate the updates (torch.optim's ``maximize``: ascend instead of descend).

    Before a rule it is fused into the rule's kernel (the gradient is negated
    before anything else, L2 decay included, as torch.optim does)."""

    def init(params):
        return EmptyState()

    def update(updates, state, params=None, **extra):
        return map_leaves(lambda u: None if u is None else -u.float(), updates), state

    return GradientTransformation(init, _link(update, "flip"), plan_from_update(update))


def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Multiply updates by a constant (float or 0-d tensor)."""

    def init(params):
        return EmptyState()

    def update(updates, state, params=None, **extra):
        return map_leaves(lambda u: None if u is None else u.float() * step_size, updates), state

    return GradientTransformation(init, update, plan_from_update(update))


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
        new = map_leaves(lambda u: None if u is None else u.float() * factor, updates)
        return new, ScaleByScheduleState(state.count + 1)

    def in_update(state):  # in a chain's update: (the kernel's lr: the factor's negative, the link's new state)
        lr = scalar_value(learning_rate, state.count)
        return (lr if flip_sign else -lr), ScaleByScheduleState(state.count + 1)

    def in_plan(state):  # in a chain's plan: a function giving each step's kernel lr, advancing the count in place
        def value():
            lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
            state.count.add_(1)
            return lr if flip_sign else -lr

        return value

    return GradientTransformation(init, _link(update, "lr", in_update=in_update, in_plan=in_plan), plan_from_update(update))


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
        return map_leaves(lambda u: None if u is None else u.float() * factor, updates), state

    return GradientTransformation(init, update, plan_from_update(update))


torch.serialization.add_safe_globals([ScaleByAdamState, ScaleByLionState, ScaleByAdEMAMixState, TraceState,
                                      ScaleByRmsState, ScaleByRssState, ScaleByAdamaxState, ScaleByAdadeltaState,
                                      ScaleByRAdamState, ScaleByNAdamState, ScaleByScheduleState])
