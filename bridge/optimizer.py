"""``LowBitOptimizer``: any lowbit_tree transformation as a ``torch.optim.Optimizer``.

The optimizer holds no arithmetic. Each ``step()`` goes down the layers once:
per param group (and per distinct step count within it), a :class:`bridge.group_plan.GroupPlan`
built once binds the core state tree of the group's params to the live states
(:mod:`bridge.state_tree`) and holds the transformation's in-place form (``tx.plan``);
a step sets this step's numbers and runs it: one kernel call that updates params and
states in place. The same transformation run through ``tx.update`` + ``apply_updates``
gives the same bits.

Static choices (state format, block size, quantize-or-not) are fixed when a
param's state is created, from the *global* param shape, and never recomputed.
Numeric hyperparameters (lr, betas, eps, weight decay, momentum) are read from
the param group at every step, as Python floats or 0-d tensors, and enter the
core as 0-d float64 tensors (``inject_hyperparams``), so a scheduler can change
them at any time without rebuilding anything.
"""
from __future__ import annotations

import inspect
import numbers
import operator
from typing import Any, Callable, Iterable

import torch

import lowbit_tree as lt
from lowbit_tree.moments import check_state_format
from lowbit_tree.rules import STATIC_ARGS
from lowbit_tree.wrappers import inject_hyperparams

from . import report
from .collectives import all_ranks_finite
from .distributed import is_dtensor, local_grad, to_local
from .param_states import SCALARS, ParamStates
from .group_plan import GroupPlan
from .report import StateReportRow  # noqa: F401  (re-exported: bridge.optimizer.StateReportRow)
from .state_dict import STATE_DICT_VERSION, STATIC_KEYS, VERSION_KEY, export_torch, load_into, save_state_dict  # noqa: F401  (re-exported)

__all__ = ["LowBitOptimizer", "STATE_DICT_VERSION", "StateReportRow"]


# ----------------------------------------------------------------------------
# the optimizer
# ----------------------------------------------------------------------------
def _mutable(values: tuple) -> tuple:
    """The positions of the group values that can change in place (a ``state_format`` mapping;
    not the params list): a remembered split holds only while they read the same."""
    return tuple(i for i, v in enumerate(values) if isinstance(v, (dict, set)) or (
        isinstance(v, list) and not (v and isinstance(v[0], torch.Tensor))))


class LowBitOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` running a lowbit_tree transformation per parameter.

    Args:
      params: iterable of tensors or param-group dicts (as torch.optim).
      transform_factory: a function of keyword arguments returning a
        ``lowbit_tree.GradientTransformation`` (e.g. ``lowbit_tree.adamw``).
      defaults: default group options. Keys that are parameters of
        ``transform_factory`` (after ``group_to_kwargs``) are passed to it:
        numbers and 0-d tensors as injected (changeable) hyperparameters,
        everything else as static arguments.
      group_to_kwargs: maps a param group to the factory's keyword arguments
        (default: the group entries whose names the factory accepts).
      group_to_kwargs_pure: whether ``group_to_kwargs`` reads the group alone (default
        True): its result is then remembered while the group's values are the same objects
        (a scheduler's new ``lr`` is a new one), so a step does not split the group again;
        False calls it at every step (one that reads more than the group).

    The per-param states (layouts, creation, live records) are ``param_states``, a
    ``bridge.param_states.ParamStates``.

    Extra group options understood by every LowBitOptimizer:
      skip_nonfinite (bool, default False): if any gradient of the step is
        NaN/inf, leave every param and state of the step unchanged: one flag per
        step, read on the host (free on CPU, one device sync on CUDA, as
        GradScaler's). (Without it, a non-finite gradient
        poisons only the blocks of its own parameter's state.)
    """

    def __init__(
        self,
        params: Iterable,
        transform_factory: Callable[..., lt.base.GradientTransformation],
        defaults: dict,
        *,
        group_to_kwargs: Callable[[dict], dict] | None = None,
        group_to_kwargs_pure: bool = True,
    ):
        self._factory = transform_factory
        self._group_to_kwargs = group_to_kwargs or self._default_group_to_kwargs
        self._pure_kwargs = bool(group_to_kwargs_pure)
        self.steps_in_backward = None  # the bridge.StepInBackward whose hooks step this optimizer, if any
        self._clear_caches()
        defaults = dict(defaults)
        if "learning_rate" in defaults and "lr" not in defaults and self._takes_learning_rate():
            defaults["lr"] = defaults.pop("learning_rate")  # the name LR schedulers read
        defaults.setdefault("skip_nonfinite", False)
        super().__init__(params, defaults)

    # -- copies and pickles ------------------------------------------------------
    _whole_steps = False
    """Whether a sharded param is stepped whole on one process (SOAP), not shard by shard
    (:class:`bridge.param_states.ParamStates`' ``whole_steps``)."""

    PICKLED = ("_factory", "_group_to_kwargs", "_pure_kwargs")
    """Attributes beyond torch.optim's (defaults, state, param_groups) that a copy or a pickle
    keeps; the caches are rebuilt on the first step."""

    def _clear_caches(self) -> None:
        self._transforms: dict = {}  # the static key of _transform_of -> the transformation
        # id(group) -> (group, its values, the positions of its _mutable ones, their repr, _transform's result)
        self._split_cache: dict = {}
        self.param_states = ParamStates(self._transform, type(self).__name__, whole_steps=self._whole_steps)
        # (the group's offset among all params, positions stepped) -> (static key, GroupPlan): the
        # whole group's plan of step() and, beside it, one per param stepped alone (step_param);
        # a plan checks that it still holds (GroupPlan.current) before it runs
        self._plans: dict = {}
        self._positions = None  # (the groups it was made from, {id(param): (group, offset, index)})

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for k in self.PICKLED:
            if k in self.__dict__:
                state[k] = self.__dict__[k]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_pure_kwargs", True)
        self.steps_in_backward = None
        self._clear_caches()

    # -- param groups ---------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if self.steps_in_backward is not None:
            raise RuntimeError(
                f"{type(self).__name__}.add_param_group: the steps run in backward (bridge.step_in_backward) and the "
                "new params would have no hook, so they would never step; handle.remove(), add the group, then "
                "call step_in_backward again"
            )
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                p = p[1]  # a (name, param) pair: torch keeps the names as the group's param_names
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{type(self).__name__}: params must be tensors, got {type(p).__name__}")
            if p.is_complex():
                raise ValueError(
                    f"{type(self).__name__}: complex parameter of shape {tuple(p.shape)} is not supported; "
                    "optimize torch.view_as_real(param) instead"
                )
            if not p.is_floating_point():
                raise ValueError(f"{type(self).__name__}: parameter of dtype {p.dtype} is not a floating-point tensor")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "state_format" in group:  # a name, or a mapping whose state names the factory checks
            check_state_format(group["state_format"])
        bs = group.get("block_size")
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
            raise ValueError(f"block_size must be a positive int or None, got {bs!r}")

    def state_formats(self, group: dict) -> dict | None:
        """``{state name: format}`` of the states a param of ``group`` keeps, where the optimizer
        knows its rule's states (the named classes); ``None`` for a factory's own states (state
        dicts then compare ``state_format`` values as they are)."""
        return self._state_formats(group)

    def _state_formats(self, group: dict) -> dict | None:
        """:meth:`state_formats`, as a subclass says it (the named classes override this)."""
        return None

    def factory_takes(self, name: str) -> bool:
        """Whether the transformation factory takes the keyword argument ``name``."""
        return name in inspect.signature(self._factory).parameters

    def _takes_learning_rate(self) -> bool:
        accepted = inspect.signature(self._factory).parameters
        return "learning_rate" in accepted and "lr" not in accepted

    def _default_group_to_kwargs(self, group: dict) -> dict:
        """The group entries the factory accepts. A group's ``lr`` (torch.optim's name, which LR
        schedulers read and write) reaches a factory that names it ``learning_rate`` (the core's
        aliases) under that name."""
        accepted = inspect.signature(self._factory).parameters
        out = {k: v for k, v in group.items() if k in accepted}
        if "lr" in group and self._takes_learning_rate():
            out["learning_rate"] = group["lr"]
        return out

    def _split(self, group: dict) -> tuple[dict, dict]:
        """(static kwargs, numeric kwargs) for a group's factory call."""
        static, numeric = {}, {}
        for k, v in self._group_to_kwargs(group).items():
            if isinstance(v, bool) or v is None or isinstance(v, str):
                static[k] = v
            elif isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1):
                if k in STATIC_ARGS:  # numbers that choose shapes or code
                    static[k] = v
                else:
                    numeric[k] = v
            else:
                static[k] = v
        return static, numeric

    def _transform(self, group: dict):
        """(the group's transformation, its static key, its numeric kwargs). Remembered per group
        while the group's values are the same objects (a scheduler's new ``lr`` is a new one), so
        a step in backward, one call per param, does not split the group again each time; not for
        a ``group_to_kwargs`` declared impure (``group_to_kwargs_pure=False``)."""
        if self._pure_kwargs:
            values = tuple(group.values())
            hit = self._split_cache.get(id(group))
            if (hit is not None and hit[0] is group and len(hit[1]) == len(values)
                    and all(map(operator.is_, hit[1], values)) and repr([values[i] for i in hit[2]]) == hit[3]):
                return hit[4]
            found = self._transform_of(group)
            mutable = _mutable(values)
            self._split_cache[id(group)] = (group, values, mutable, repr([values[i] for i in mutable]), found)
            return found
        return self._transform_of(group)

    def _transform_of(self, group: dict):
        static, numeric = self._split(group)
        key = (tuple(sorted((k, repr(v)) for k, v in static.items())), tuple(sorted(numeric)))
        tx = self._transforms.get(key)
        if tx is None:
            tx = inject_hyperparams(self._factory, hyperparam_dtype=torch.float64)(**static, **{k: 0.0 for k in numeric})
            self._transforms[key] = tx
        return tx, key, numeric

    # -- step -------------------------------------------------------------------
    def _all_finite(self) -> bool | None:
        """Whether every gradient of this step is finite (None if no group asks).

        Read on the host: free for CPU tensors, one device sync on CUDA (like
        GradScaler's). Under FSDP2 all ranks agree (an all-reduce of the flag)."""
        for group in self.param_groups:  # (a loop, not any(...): no call on a step that does not ask)
            if group.get("skip_nonfinite"):
                break
        else:
            return None
        flags = []
        device = None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = local_grad(p)
                    device = g.device
                    flags.append(torch.isfinite(g).all() if g.numel() else torch.ones((), dtype=torch.bool, device=g.device))
        if not flags:
            return None
        ok = torch.stack([f.to(device) for f in flags]).all()
        if any(is_dtensor(p) for group in self.param_groups for p in group["params"]):
            return all_ranks_finite(ok)
        return bool(ok)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform one optimization step (``closure`` re-evaluates the loss, as torch.optim).

        While :func:`bridge.step_in_backward`'s hooks are on, the steps have run in backward and
        this steps nothing: it ends the iteration (:meth:`bridge.StepInBackward.end_iteration`)."""
        if self.steps_in_backward is not None:  # the steps ran in backward: this only ends the iteration
            return self.steps_in_backward.end_iteration(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        finite = self._all_finite()
        offset = 0  # a param's position in the optimizer: its leaf index for stochastic rounding
        for group in self.param_groups:
            params = group["params"]
            if not (group.get("skip_nonfinite") and finite is False):
                self._step_group(group, params, offset)
            offset += len(params)
        return loss

    def step_param(self, p: torch.Tensor) -> None:
        """The step of param ``p`` alone, with the bits ``step()`` gives it (its group's
        hyperparameters, its position among all the params as stochastic rounding's key),
        through a plan of its own: what :func:`bridge.step_in_backward` runs in each hook."""
        group, offset, i = self._position(p)
        if group.get("skip_nonfinite"):
            raise RuntimeError(
                f"{type(self).__name__}: a param group with skip_nonfinite=True cannot step one param at a time "
                "(it skips the whole step when any gradient is non-finite, which needs every gradient at once)"
            )
        self._step_group(group, group["params"], offset, only=i)

    def _position(self, p) -> tuple:
        """(group, offset of the group's first param among all params, index in the group) of ``p``."""
        made_from = tuple((id(g), id(g["params"]), len(g["params"])) for g in self.param_groups)
        if self._positions is None or self._positions[0] != made_from:
            where, offset = {}, 0
            for g in self.param_groups:
                for i, q in enumerate(g["params"]):
                    where[id(q)] = (g, offset, i)
                offset += len(g["params"])
            self._positions = (made_from, where)
        hit = self._positions[1].get(id(p))
        if hit is None:
            raise ValueError(f"{type(self).__name__}: the param of shape {tuple(p.shape)} is not in this optimizer")
        return hit

    def _step_group(self, group: dict, params: list, offset: int, only: int | None = None) -> None:
        """One group: its params with gradients (or only the one at position ``only``), batched
        by step count (torch.optim keeps one per param), each batch one in-place core step
        through its :class:`GroupPlan`, cached per group and positions stepped. A cached plan
        reads the gradients itself: the step goes optimizer -> plan -> core, once."""
        tx, key, numeric = self._transform(group)
        present = []
        for i in range(len(params)) if only is None else (only,):
            g = params[i].grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (param of shape "
                    f"{tuple(params[i].shape)}); use a dense embedding (sparse=False)"
                )
            present.append(i)
        present = tuple(present)
        seed = int(group.get("seed", 0))
        hit = self._plans.get((offset, present))
        if hit is not None and hit[0] == key and hit[1].current(self.state, params, present):
            hit[1].run(numeric, seed)
            return
        self._build_and_run(group, params, present, offset, tx, key, numeric, seed)

    def _build_and_run(self, group: dict, params: list, present: tuple, offset: int, tx, key, numeric: dict,
                       seed: int) -> None:
        """:meth:`_step_group` without a current plan: the states created (or checked), the
        params batched by step count, one :class:`GroupPlan` per batch (remembered when there is
        one batch), each run."""
        states = self.param_states
        grads: list = [None] * len(params)
        batches: dict = {}
        for i in present:
            p = params[i]
            grads[i] = local_grad(p)
            if grads[i].shape != to_local(p).shape:
                raise RuntimeError(f"gradient shape {tuple(grads[i].shape)} does not match param shape "
                                   f"{tuple(to_local(p).shape)}")
            st = self.state[p]
            if len(st) == 0:
                st.update(states.create(p, group))
            else:
                states.check(p, group, st)
            # by step count and rule scalars (a param that missed steps has its own mu_product)
            batches.setdefault(tuple(float(st[k]) for k in SCALARS if k in st), []).append(i)
        what = f"{type(self).__name__}'s transformation ({getattr(self._factory, '__name__', 'factory')})"
        for batch in batches.values():
            batch = tuple(batch)
            live: list = [None] * len(params)
            for i in batch:
                live[i] = states.live(params[i], self.state[params[i]])
            plan = GroupPlan(self.state, tx, states.binding(group, params, batch), params, batch, live, numeric,
                             offset, what)
            if len(batches) == 1:
                self._plans[(offset, present)] = (key, plan)
            plan.run(numeric, seed, [g if i in batch else None for i, g in enumerate(grads)])

    # -- introspection ------------------------------------------------------------
    def state_report(self) -> list[StateReportRow]:
        """Each param's states (local shapes and bytes): :func:`bridge.report.state_report`."""
        return report.state_report(self)

    def state_bytes(self) -> int:
        """Bytes of this process's states: :func:`bridge.report.state_bytes`."""
        return report.state_bytes(self)

    def training_bytes(self) -> report.TrainingBytes:
        """Params + gradients + states of the whole model (a collective under FSDP2):
        ``bridge.report.training_bytes``."""
        return report.training_bytes(self)

    def format_state_report(self) -> str:
        """Table and totals (per rank and whole model under FSDP2, a collective there), then the
        training state per param: :func:`bridge.report.format_state_report`."""
        return report.format_state_report(self)

    # -- state dict -----------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim's layout and state names; a quantized state is a nested dict of plain
        tensors ``{"codes": uint8, "scale": float32}`` (see ``bridge/state_dict.py``)."""
        return save_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from ``state_dict()`` (any device, any FSDP world size), or a
        plain ``torch.optim.Adam/AdamW/SGD/Muon`` one (its fp32 states are quantized into this
        optimizer's formats; SGD and Muon keep no step count, ours starts at 0). A state dict of another version, state format or block size
        is rejected with an error naming what differs."""
        load_into(self, state_dict)

    def torch_state_dict(self) -> dict:
        """This optimizer's state as a plain torch.optim state dict with dequantized float32
        moments (e.g. to resume with ``torch.optim.AdamW``)."""
        return export_torch(self)
