"""The optimizer step inside the backward pass (:func:`step_in_backward`): each param steps as
soon as its gradient is final, and the gradient is freed at once, so the gradients of all the
params never exist together.

Where the hook sits: ``Tensor.register_post_accumulate_grad_hook`` on every param. Autograd
calls it once per backward, after the last contribution has been added to ``p.grad`` (a param
used twice, tied weights, steps once). Under FSDP2 the params are the sharded DTensors, which
autograd never reaches (it differentiates the unsharded params FSDP2 all-gathers); FSDP2 calls
the sharded params' post-accumulate-grad hooks itself, in ``foreach_reduce``
(``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``), right after it has set
``p.grad`` to the unit's reduce-scattered (and, under HSDP, all-reduced) gradient shard. So the
same hook is the right one in both cases, and no FSDP2 API is needed. A unit whose gradients are
not reduced (``set_requires_gradient_sync(False)``) calls no hook: FSDP2's own accumulation
steps once, in the backward that reduces.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .optimizer import LowBitOptimizer

__all__ = ["step_in_backward", "StepInBackward"]


class StepInBackward:
    """The hooks :func:`step_in_backward` registered: one per param of ``params``.

    While they are on, ``opt.step()`` does not step (the steps ran in backward): it ends the
    iteration, checking that no param holds a gradient the hooks did not consume. Also a
    context manager: ``with bridge.step_in_backward(model, opt): ...`` removes them on exit.
    """

    def __init__(self, opt: LowBitOptimizer, params: list):
        self.opt = opt
        self.params = params
        self._stepped: set = set()  # ids of the params stepped since the last opt.step()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]
        opt.steps_in_backward = self

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if id(p) in self._stepped:
            raise RuntimeError(
                f"step_in_backward: a second backward reached the param of shape {tuple(p.shape)} before "
                "opt.step(): each backward steps every param it reaches, and gradients are not accumulated "
                "over backward passes. Call opt.step() after each backward (it does not step again; it ends "
                "the iteration), or handle.remove() to accumulate gradients and step with opt.step(). This "
                "backward's gradients are left in .grad: opt.zero_grad() drops them"
            )
        self.opt.step_param(p)
        self._stepped.add(id(p))
        p.grad = None

    def end_iteration(self, closure=None) -> None:
        """What ``opt.step()`` does while the hooks are on: no step; raises if a closure is given
        (its backward would step every param again) or if a param holds a gradient (one the hooks
        did not step: set by hand, or from a backward that failed)."""
        if closure is not None:
            raise RuntimeError(
                "step_in_backward: opt.step(closure) is refused while the steps run in backward (the closure's "
                "backward would step every param a second time); call handle.remove() to use a closure"
            )
        left = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        if left:
            raise RuntimeError(
                f"step_in_backward: {len(left)} param(s) hold a gradient that no backward hook stepped (the first "
                f"of shape {tuple(left[0].shape)}): the steps run in backward, and opt.step() steps nothing while "
                "the hooks are on; set gradients by backward(), or call handle.remove() and step with opt.step(). "
                "opt.zero_grad() drops them (a refused second backward leaves its gradients there)"
            )
        self._stepped.clear()

    def remove(self) -> None:
        """Unregister the hooks; ``opt.step()`` steps again. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stepped.clear()
        if self.opt.steps_in_backward is self:
            self.opt.steps_in_backward = None

    def __enter__(self) -> "StepInBackward":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def step_in_backward(model_or_params: torch.nn.Module | Iterable[torch.Tensor], opt: LowBitOptimizer, *,
                     per_param_transform: bool = False) -> StepInBackward:
    """Run each param's optimizer step inside the backward pass, as soon as its gradient is
    final, then free the gradient (``p.grad = None``).

    The gradients of all the params then never exist at once: at any moment the live
    gradients are those of the params autograd has reached and the hooks have not yet
    stepped (under FSDP2, the sharded gradients of one unit). A param's step is the one
    ``opt.step()`` would give it, bit for bit: its group's hyperparameters as they are when
    the hook runs, its own step count, its position among all the optimizer's params as the
    key of ``bf16_stochastic_round``.

    Usage::

        handle = bridge.step_in_backward(model, opt)
        for batch in data:
            model(batch).backward()  # every param steps here
            opt.step()               # steps nothing: ends the iteration
            scheduler.step()         # LR schedulers work as usual
        handle.remove()              # back to ordinary steps

    How: a ``Tensor.register_post_accumulate_grad_hook`` hook on each param, run by autograd
    once per backward after the param's gradient is complete. Under FSDP2 pass the model
    after ``fully_shard``: FSDP2 calls the sharded params' hooks itself, after each unit's
    reduce-scatter, with the sharded gradient in ``p.grad`` (``bridge/in_backward.py`` says
    where in FSDP2).

    ``opt.step()`` while the hooks are on does not step: it ends the iteration. It raises if
    a param holds a gradient no hook stepped, or if given a closure. Every backward steps
    each param it reaches once; a second backward that reaches a param before ``opt.step()``
    raises, so gradient accumulation over several backward passes is refused (it would need
    every gradient kept until the last pass, which is what this removes). Under FSDP2,
    ``model.set_requires_gradient_sync(False)`` on the passes before the last accumulates in
    FSDP2's unsharded gradients and steps once, in the backward that reduces.

    Refused here, before any hook is registered (``ValueError``): a param that does not
    require grad or is not in ``opt``; a param of ``opt`` that requires grad but is not among
    the params given (it would never step); a param group with ``skip_nonfinite=True`` (it
    skips the whole step when any gradient is non-finite: that needs every gradient at
    once); a plain :class:`LowBitOptimizer` over a transformation of your own, unless
    ``per_param_transform=True`` says it treats each param on its own (a chain with
    ``lowbit_tree.clip_by_global_norm`` does not: stepped one param at a time, it would clip
    each param by its own norm). A second handle on the same optimizer raises
    ``RuntimeError``.

    Not detectable, so documented: global gradient clipping between backward and step
    (``torch.nn.utils.clip_grad_norm_``) finds no gradient there, every one having been
    used and freed. ``torch.amp.GradScaler`` does not combine: the params step on the
    scaled gradients before ``scaler.step(opt)`` could unscale them (bfloat16 autocast needs
    no scaler). A param the backward still reads after its own gradient is final (through a
    ``.detach()``d use) is read after its step. Under reentrant activation checkpointing
    (``torch.utils.checkpoint(..., use_reentrant=True)``) each checkpointed segment runs a
    backward of its own: a weight used both inside and outside a segment (tied embeddings)
    gets its hook in the segment's, on part of its gradient, and the rest raises as a second
    backward; ``use_reentrant=False`` runs one backward. ``DistributedDataParallel`` is
    refused: it averages gradients after these hooks, so replicas would step on their own. Hooks of ``opt``
    (``register_step_pre_hook`` and the like) run around ``opt.step()``, which steps nothing
    here.

    Args:
      model_or_params: an ``nn.Module`` (its ``parameters()``) or an iterable of params.
      opt: the optimizer of those params, a :class:`LowBitOptimizer`.
      per_param_transform: for a plain :class:`LowBitOptimizer` (not one of the named
        classes), the promise that its transformation updates each param from that param's
        gradient and state alone.

    Returns:
      The :class:`StepInBackward` handle; ``handle.remove()`` unregisters the hooks.
    """
    if not isinstance(opt, LowBitOptimizer):
        raise TypeError(f"step_in_backward takes a bridge.LowBitOptimizer, got {type(opt).__name__}")
    if opt.steps_in_backward is not None:
        raise RuntimeError("step_in_backward: this optimizer already steps in backward; remove() that handle first")
    from .classes import TorchOptimizerBase

    name = type(opt).__name__
    if not isinstance(opt, TorchOptimizerBase) and not per_param_transform:
        raise ValueError(
            f"step_in_backward: {name} runs a transformation of your own, and stepped one param at a time it "
            "must treat each param on its own (lowbit_tree.clip_by_global_norm, for one, does not); pass "
            "per_param_transform=True if it does"
        )
    given = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    params, seen = [], set()
    for p in given:
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if not params:
        raise ValueError("step_in_backward: no params given")
    if isinstance(model_or_params, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            "step_in_backward: DistributedDataParallel averages gradients after the params' post-accumulate-grad "
            "hooks have run, so each replica would step on its own gradient and the replicas would drift apart; "
            "shard with FSDP2 (fully_shard), whose hooks run after the reduce-scatter, or step with opt.step()"
        )
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    for p in params:
        if id(p) not in in_opt:
            raise ValueError(
                f"step_in_backward: the param of shape {tuple(p.shape)} is not in {name}; give the optimizer's "
                "params only (with frozen params left out of it: [p for p in model.parameters() if p.requires_grad])"
            )
        if not p.requires_grad:
            raise ValueError(
                f"step_in_backward: the param of shape {tuple(p.shape)} does not require grad, so no backward "
                "reaches it; leave it out (e.g. [p for p in model.parameters() if p.requires_grad])"
            )
    for g in opt.param_groups:
        if g.get("skip_nonfinite"):
            raise ValueError(
                "step_in_backward: a param group has skip_nonfinite=True, which skips the whole step when any "
                "gradient is non-finite and so needs every gradient at once; steps in backward cannot honour it"
            )
        for p in g["params"]:
            if p.requires_grad and id(p) not in seen:
                raise ValueError(
                    f"step_in_backward: {name}'s param of shape {tuple(p.shape)} is not among the params given, "
                    "so it would never step (opt.step() steps nothing while the hooks are on); give every param "
                    "of the optimizer"
                )
    return StepInBackward(opt, params)
