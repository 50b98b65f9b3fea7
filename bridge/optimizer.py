"""``LowBitOptimizer``: any lowbit_tree transformation as a ``torch.optim.Optimizer``.

The optimizer is a shell. Each ``step()`` rebuilds, per parameter, the core
state pytree of that parameter from ``self.state[p]`` (torch names: ``step``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``) and the
group's current hyperparameters, runs the transformation's pure ``update`` on
plain local tensors, and writes the results back in place (params and state
storage keep their identity, as torch.optim users expect).

Static choices (state format, block size, quantize-or-not) are fixed when a
param's state is created, from the *global* param shape, and never recomputed.
Numeric hyperparameters (lr, betas, eps, weight decay, momentum) are read from
the param group at every step, as Python floats or 0-d tensors, and enter the
core as 0-d float32 tensors (``inject_hyperparams``), so a scheduler can change
them at any time.
"""
from __future__ import annotations

import inspect
import math
import numbers
import os
from typing import Any, Callable, Iterable

import torch
from torch.optim.adam import adam as _torch_adam  # functional multi-tensor Adam(W)

import lowbit_tree as lt
from lowbit_tree import QTensor, kernels, kernels_cpu
from lowbit_tree.moments import check_state_format
from lowbit_tree.update import apply_updates
from lowbit_tree.wrappers import inject_hyperparams

from . import report
from .distributed import is_dtensor, row_dtensor, to_local, wrap_like
from .qstate import QState
from .report import StateReportRow  # noqa: F401  (re-exported: bridge.optimizer.StateReportRow)

__all__ = ["LowBitOptimizer", "STATE_DICT_VERSION", "StateReportRow"]

STATE_DICT_VERSION = 1
"""Version of the layout ``state_dict()`` writes; ``load_state_dict`` checks it."""

VERSION_KEY = "lowbit_tree_version"

# core state field -> torch.optim state name
STATE_NAMES = {
    "mu": "exp_avg",
    "nu": "exp_avg_sq",
    "nu_max": "max_exp_avg_sq",
    "trace": "momentum_buffer",
}

# group keys that shape the state: fixed per param, compared on load
STATIC_KEYS = ("state_format", "block_size", "min_quant_size", "amsgrad", "nesterov", "has_momentum", "bf16_stochastic_round")


# ----------------------------------------------------------------------------
# walking core state trees by field name
# ----------------------------------------------------------------------------
def _is_record(x) -> bool:
    return isinstance(x, QTensor) or type(x).__name__ == "Rank1QTensor"


def _walk(tree, path=()):
    """Yield ``(path, leaf)`` for every leaf; NamedTuple fields are named by field."""
    if tree is None:
        return
    if _is_record(tree) or isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):
        for f in tree._fields:
            yield from _walk(getattr(tree, f), path + (f,))
    elif isinstance(tree, (tuple, list)):
        for i, x in enumerate(tree):
            yield from _walk(x, path + (i,))
    elif isinstance(tree, dict):
        for k in sorted(tree):
            yield from _walk(tree[k], path + (k,))
    else:
        yield path, tree


def _rebuild(tree, fn, path=()):
    """``tree`` with every leaf replaced by ``fn(path, leaf)``."""
    if tree is None:
        return None
    if _is_record(tree) or isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*[_rebuild(getattr(tree, f), fn, path + (f,)) for f in tree._fields])
    if isinstance(tree, (tuple, list)):
        return type(tree)(_rebuild(x, fn, path + (i,)) for i, x in enumerate(tree))
    if isinstance(tree, dict):
        return {k: _rebuild(v, fn, path + (k,)) for k, v in tree.items()}
    return fn(path, tree)


def _kind(path) -> str:
    """What a leaf at ``path`` is: 'hyper', 'count', 'seed' or a torch state name."""
    if "hyperparams" in path:
        return "hyper"
    named = [p for p in path if isinstance(p, str)]
    last = named[-1] if named else ""
    if last == "count":
        return "count"
    if last == "seed":
        return "seed"
    for p in reversed(named):
        if p in STATE_NAMES:
            return STATE_NAMES[p]
    return "/".join(str(p) for p in path)


def _float_tensor(value, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------
# the optimizer
# ----------------------------------------------------------------------------
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

    Extra group options understood by every LowBitOptimizer:
      skip_nonfinite (bool, default False): if any gradient of the step is
        NaN/inf, leave every param and state of the step unchanged, decided on
        the device without a host sync. (Without it, a non-finite gradient
        poisons only the blocks of its own parameter's state.)
    """

    _fused_adam: str | None = None
    """``"adamw"`` (decoupled decay) or ``"adam"`` in subclasses whose transformation is
    exactly that Adam: lets ``step`` use the fused kernel (see ``_fused_adam_step``)."""

    def __init__(
        self,
        params: Iterable,
        transform_factory: Callable[..., lt.base.GradientTransformation],
        defaults: dict,
        *,
        group_to_kwargs: Callable[[dict], dict] | None = None,
    ):
        self._factory = transform_factory
        self._group_to_kwargs = group_to_kwargs or self._default_group_to_kwargs
        self._transforms: dict = {}
        self._templates: dict = {}
        defaults = dict(defaults)
        defaults.setdefault("skip_nonfinite", False)
        super().__init__(params, defaults)

    # -- param groups ---------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
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
        if "state_format" in group:
            check_state_format(group["state_format"])
        bs = group.get("block_size")
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
            raise ValueError(f"block_size must be a positive int or None, got {bs!r}")

    def _default_group_to_kwargs(self, group: dict) -> dict:
        accepted = inspect.signature(self._factory).parameters
        return {k: v for k, v in group.items() if k in accepted}

    def _split(self, group: dict) -> tuple[dict, dict]:
        """(static kwargs, numeric kwargs) for a group's factory call."""
        static, numeric = {}, {}
        for k, v in self._group_to_kwargs(group).items():
            if isinstance(v, bool) or v is None or isinstance(v, str):
                static[k] = v
            elif isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1):
                if k in ("block_size", "min_quant_size", "seed"):
                    static[k] = v
                else:
                    numeric[k] = v
            else:
                static[k] = v
        return static, numeric

    def _transform(self, group: dict):
        static, numeric = self._split(group)
        key = (tuple(sorted((k, repr(v)) for k, v in static.items())), tuple(sorted(numeric)))
        tx = self._transforms.get(key)
        if tx is None:
            tx = inject_hyperparams(self._factory)(**static, **{k: 0.0 for k in numeric})
            self._transforms[key] = tx
        return tx, key, numeric

    # -- per-param state ------------------------------------------------------
    def _template(self, p, group):
        """tx.init on a meta tensor of the *global* shape: fixes formats and block sizes."""
        tx, key, _ = self._transform(group)
        cache_key = (id(p), key)
        tmpl = self._templates.get(cache_key)
        if tmpl is None:
            meta = torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")
            tmpl = tx.init(meta)
            self._templates[cache_key] = tmpl
        return tmpl

    def _init_state(self, p, group) -> dict:
        tmpl = self._template(p, group)
        local = to_local(p)
        st: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float32, device=local.device)}
        for path, leaf in _walk(tmpl):
            kind = _kind(path)
            if kind in ("hyper", "count", "seed"):
                continue
            if isinstance(leaf, QTensor):
                q = QState(lt.zeros(tuple(local.shape), leaf.format, leaf.block_size, device=local.device))
                st[kind] = wrap_like(q, p)
            elif _is_record(leaf):
                if is_dtensor(p):
                    raise ValueError(
                        "rank-1 normalized 4-bit states need column maxima over all rows; they are not "
                        "supported under FSDP2 sharding (use rank1_normalization=False)"
                    )
                st[kind] = _Rank1Holder(type(leaf).__module__, leaf, local)
            elif isinstance(leaf, torch.Tensor):
                if tuple(leaf.shape) == tuple(p.shape):
                    st[kind] = wrap_like(torch.zeros(local.shape, dtype=leaf.dtype, device=local.device), p)
                else:
                    st[kind] = torch.zeros(leaf.shape, dtype=leaf.dtype, device=local.device)
        return st

    def _core_state(self, p, st, group, hyper: dict, seed: int):
        tmpl = self._template(p, group)
        local = to_local(p)
        step = st["step"]

        def leaf(path, t):
            kind = _kind(path)
            if kind == "hyper":
                return hyper[path[-1]]
            if kind == "count":
                return step.to(device=local.device, dtype=t.dtype)
            if kind == "seed":
                return torch.tensor(seed, dtype=t.dtype, device=local.device)
            value = st[kind]
            if isinstance(value, _Rank1Holder):
                return value.record
            value = to_local(value)
            return value.record if isinstance(value, QState) else value

        return _rebuild(tmpl, leaf)

    def _write_back(self, st, new_tree, ok) -> None:
        for path, leaf in _walk(new_tree):
            kind = _kind(path)
            if kind in ("hyper", "count", "seed"):
                continue
            target = st[kind]
            if isinstance(target, _Rank1Holder):
                target.record = leaf if ok is None else _where_tree(ok, leaf, target.record)
                continue
            target = to_local(target)
            if isinstance(target, QState):
                codes, scale = leaf.codes, leaf.scale
                if ok is not None:
                    codes = _where(ok, codes, target.codes)
                    scale = torch.where(ok, scale, target.scale)
                target.codes.copy_(codes)
                target.scale.copy_(scale)
            else:
                target.copy_(leaf if ok is None else torch.where(ok, leaf, target))

    # -- step -------------------------------------------------------------------
    def _all_finite(self) -> torch.Tensor | None:
        """On-device flag: every gradient of this step is finite (or None if no group asks)."""
        if not any(g.get("skip_nonfinite") for g in self.param_groups):
            return None
        flags = []
        device = None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = to_local(p.grad)
                    device = g.device
                    flags.append(torch.isfinite(g).all() if g.numel() else torch.ones((), dtype=torch.bool, device=g.device))
        if not flags:
            return None
        ok = torch.stack([f.to(device) for f in flags]).all()
        if any(is_dtensor(p) for group in self.param_groups for p in group["params"]):
            import torch.distributed as dist

            flag = ok.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = flag.bool()
        return ok

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Perform one optimization step (``closure`` re-evaluates the loss, as torch.optim)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ok_all = self._all_finite()
        index = 0  # the param's position in the optimizer: its stochastic-rounding seed
        for group in self.param_groups:
            tx, _, numeric = self._transform(group)
            ok = ok_all if group.get("skip_nonfinite") else None
            hyper_cache: dict = {}  # device -> injected hyperparameters (core path)
            fused_hyper: dict = {}  # step count -> fused kernel's hyperparameter vector (CPU)
            plain: dict = {}  # device -> (params, grads, exp_avgs, exp_avg_sqs, steps) for torch's multi-tensor Adam
            fused: list = []  # the fused kernel's steps, run together after the loop
            fp32_native: list = []  # fp32-state params stepped by the native CPU kernel
            fast = ok is None and self._fast_group(group)
            native_fp32 = fast and self._native_fp32(group)
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients (param of shape "
                        f"{tuple(p.shape)}); use a dense embedding (sparse=False)"
                    )
                local = to_local(p)
                grad = to_local(p.grad)
                if grad.shape != local.shape:
                    raise RuntimeError(f"gradient shape {tuple(grad.shape)} does not match param shape {tuple(local.shape)}")
                st = self.state[p]
                if len(st) == 0:
                    st.update(self._init_state(p, group))
                path = self._fast_path(group, local, st) if fast else None
                if path == "fused":
                    fused.append(self._fused_adam_item(group, local, grad, st, fused_hyper))
                    continue
                if path == "fp32" and native_fp32 and local.is_cpu:
                    fp32_native.append(self._fused_adam_item(group, local, grad, st, fused_hyper, quantized=False))
                    continue
                if path == "fp32":
                    lists = plain.setdefault(local.device, ([], [], [], [], []))
                    for lst, t in zip(lists, (local, grad, st["exp_avg"], st["exp_avg_sq"], st["step"])):
                        lst.append(to_local(t))
                    continue
                dev = local.device
                if dev not in hyper_cache:
                    hyper_cache[dev] = {k: _float_tensor(v, dev) for k, v in numeric.items()}
                tree = self._core_state(p, st, group, hyper_cache[dev], index - 1)
                updates, new_tree = tx.update(grad, tree, local)
                new_param = apply_updates(local, updates)
                local.copy_(new_param if ok is None else torch.where(ok, new_param, local))
                self._write_back(st, new_tree, ok)
                st["step"].add_(1 if ok is None else ok.to(torch.float32))
            for device, lists in plain.items():
                self._fp32_adam_steps(group, device, *lists)
            if fused or fp32_native:
                self._fused_adam_steps(fused, fp32_native)
        return loss

    # -- fast paths ---------------------------------------------------------------------
    def _fast_group(self, group) -> bool:
        """Whether a group's Adam(W) params may take a fast path this step: an Adam(W)
        subclass, no amsgrad, no stochastic rounding. ``LOWBIT_TREE_FUSED=0`` turns the
        fast paths off: every step then runs the core's transformation instead."""
        return (
            self._fused_adam is not None
            and os.environ.get("LOWBIT_TREE_FUSED", "1") != "0"
            and not group.get("amsgrad")
            and not group.get("bf16_stochastic_round")
        )

    def _fast_path(self, group, local, st) -> str | None:
        """For a param of a fast group: ``"fused"`` (float32 param, both moments quantized;
        for Adam's L2 decay only with weight_decay == 0), ``"fp32"`` (float32 param and
        plain float32 moments: small tensors or ``state_format="fp32"``), else None."""
        if (local.dtype is not torch.float32 or len(st) != 3
                or "step" not in st or "exp_avg" not in st or "exp_avg_sq" not in st):
            return None
        m, v = to_local(st["exp_avg"]), to_local(st["exp_avg_sq"])
        if isinstance(m, QState) and isinstance(v, QState):
            wd = group.get("weight_decay", 0.0)
            if self._fused_adam == "adam" and (isinstance(wd, torch.Tensor) or wd != 0):
                return None
            return "fused"
        if all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in (m, v)):
            return "fp32"
        return None

    def _native_fp32(self, group) -> bool:
        """Whether a fast group's fp32-state CPU params are stepped by the native
        kernel (:func:`lowbit_tree.kernels.adam_step_fp32_`): when the native kernels
        are built, for AdamW and for Adam without weight decay (Adam's L2 decay, and
        params on other devices, go through torch's multi-tensor Adam)."""
        if not kernels_cpu.available():
            return False
        wd = group.get("weight_decay", 0.0)
        return self._fused_adam == "adamw" or not (isinstance(wd, torch.Tensor) or wd != 0)

    def _fp32_adam_steps(self, group, device, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        """One ``torch.optim.adam.adam(foreach=True)`` call for a group's fp32-state params
        that the native kernel does not take (other devices, Adam's L2 decay):
        per-param Python overhead of the core path dominated models with many small
        tensors (norms, biases). Same math as torch.optim.Adam/AdamW by construction."""
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        if device.type == "cpu":  # non-capturable foreach takes Python numbers (no sync on CPU)
            b1, b2, lr, wd, eps = (float(x) for x in (b1, b2, lr, wd, eps))
        _torch_adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=True, capturable=device.type != "cpu", differentiable=False, fused=None,
            grad_scale=None, found_inf=None, has_complex=False,
            decoupled_weight_decay=self._fused_adam == "adamw", amsgrad=False,
            beta1=b1, beta2=b2, lr=lr, weight_decay=float(wd), eps=float(eps), maximize=False,
        )

    def _fused_adam_item(self, group, local, grad, st, cache: dict, quantized: bool = True) -> tuple:
        """One param's arguments for :func:`lowbit_tree.kernels.adam_step_quantized_`
        (Adam(W) in one pass per block: dequantize, update, requantize, write param
        and codes in place). Same math as the core's ``scale_by_adam ->
        add_decayed_weights -> scale_by_learning_rate`` (tested to agree; codes are
        bit-identical to the reference quantizer of the moments it computes)."""
        m, v = to_local(st["exp_avg"]), to_local(st["exp_avg_sq"])
        step = st["step"]
        # on CPU, params sharing a step count share one hyperparameter vector (no sync to read it)
        key = float(step) if step.device.type == "cpu" else None
        hyper = cache.get(key) if key is not None else None
        if hyper is None:
            b1, b2 = (float(b) for b in group["betas"])
            wd = group.get("weight_decay", 0.0) if self._fused_adam == "adamw" else 0.0
            hyper = kernels.adam_hyperparams(  # a CPU count as a number: ~0.2 ms less than the tensor path
                count=step if key is None else key, lr=group["lr"], b1=b1, b2=b2, eps=float(group["eps"]),
                weight_decay=float(wd), device=local.device,
            )
            if key is not None:
                cache[key] = hyper
        if not quantized:  # plain float32 moments: adam_step_fp32_'s step
            return (local, grad, m, v, hyper, step)
        return (local, grad, m.codes, m.scale, v.codes, v.scale, m.format, v.format, (m.block_size, v.block_size),
                hyper, step)

    @staticmethod
    def _fused_adam_steps(quantized: list, fp32: list) -> None:
        """All of a group's fused steps, quantized and float32-moment ones, in one
        kernel call (one parallel region on CPU)."""
        kernels.adam_steps_([it[:-1] for it in quantized], [it[:-1] for it in fp32])
        steps = [it[-1] for it in quantized] + [it[-1] for it in fp32]
        by_device: dict = {}
        for s in steps:
            by_device.setdefault(s.device, []).append(s)
        for lst in by_device.values():
            torch._foreach_add_(lst, 1)

    # -- introspection ------------------------------------------------------------
    def state_report(self) -> list[StateReportRow]:
        """Each param's states (local shapes and bytes): :func:`bridge.report.state_report`."""
        return report.state_report(self)

    def state_bytes(self) -> int:
        """Bytes of this process's states: :func:`bridge.report.state_bytes`."""
        return report.state_bytes(self)

    def format_state_report(self) -> str:
        """Table and totals (per rank and whole model under FSDP2, a collective there):
        :func:`bridge.report.format_state_report`."""
        return report.format_state_report(self)

    # -- state dict -----------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim layout; each quantized state ``name`` appears as two plain tensors
        ``name::codes`` (uint8; fp8 codes as their uint8 bit pattern) and ``name::scale``
        (float32), row-sharded DTensors under FSDP2. Groups carry the format version."""
        sd = super().state_dict()
        for gi, group in enumerate(sd["param_groups"]):
            group[VERSION_KEY] = STATE_DICT_VERSION
        params = [p for g in self.param_groups for p in g["params"]]
        new_state = {}
        for idx, st in sd["state"].items():
            p = params[idx]
            out = {}
            for name, v in st.items():
                local = to_local(v)
                if isinstance(local, QState):
                    codes = local.codes.view(torch.uint8) if local.is_float8 else local.codes
                    out[f"{name}::codes"] = row_dtensor(codes, p, codes.shape[1])
                    out[f"{name}::scale"] = row_dtensor(local.scale, p, local.scale.shape[1])
                elif isinstance(local, _Rank1Holder):
                    for k, t in local.tensors().items():
                        out[f"{name}::{k}"] = t
                else:
                    out[name] = v
            new_state[idx] = out
        sd["state"] = new_state
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from ``state_dict()`` (any device, any FSDP world size), or a
        plain ``torch.optim.Adam/AdamW/SGD`` one (its fp32 states are quantized into this
        optimizer's formats). A state dict of another version, state format or block size
        is rejected with an error naming what differs."""
        from .state_dict import load_into

        load_into(self, state_dict)

    def torch_state_dict(self) -> dict:
        """This optimizer's state as a plain torch.optim state dict with dequantized float32
        moments (e.g. to resume with ``torch.optim.AdamW``)."""
        from .state_dict import export_torch

        return export_torch(self)


def _where(ok, new, old):
    if new.dtype == torch.float8_e4m3fn:
        return torch.where(ok, new.view(torch.uint8), old.view(torch.uint8)).view(torch.float8_e4m3fn)
    return torch.where(ok, new, old)


def _where_tree(ok, new, old):
    import optree

    return optree.tree_map(lambda a, b: _where(ok, a, b), new, old)


class _Rank1Holder:
    """Holds a (non-sharded) rank-1 normalized record in ``state[p]``.

    The record has no row-sharded layout (its column maxima span all rows), so it
    is kept as a plain record rather than a QState.
    """

    def __init__(self, module, template, local):
        from lowbit_tree.moments import rank1_zeros

        self.record = rank1_zeros(tuple(local.shape), device=local.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict:
        r = self.record
        return {"codes": r.codes, "row_max": r.row_max, "col_max": r.col_max}
