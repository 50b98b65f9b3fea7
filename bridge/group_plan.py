"""A param group's step, built once: the core's in-place plan over the group's live states.

:class:`GroupPlan` binds the core state tree of the group's params with gradients to their
states in ``optimizer.state`` (:mod:`bridge.state_tree`), builds the transformation's in-place
form once (``tx.plan``: :class:`lowbit_tree.base.GradientTransformation`), and keeps what a
step has to set: the injected hyperparameters, the step counts and seeds of the state tree.
A step then checks that nothing it holds has been replaced, writes this step's numbers and
calls the plan. The optimizer keeps one plan per group and positions stepped: the whole
group's for ``step()`` and, beside it, one per param for the steps in backward
(:func:`bridge.step_in_backward`), whose tree is still the whole group's list (``None``
elsewhere), so a leaf's index, stochastic rounding's key, is the same in both.

Step counts: torch.optim keeps one ``step`` tensor per param; a plan's params share one
count (they are batched by it), so their ``step`` tensors become 0-d views of one tensor
of the plan, and one ``add_`` advances them all. A rule's scalar states (NAdam's
``mu_product``, :data:`bridge.param_states.SCALARS`) are held the same way: the batch's params
share one value (they are batched by it), each param's tensor a view of one tensor of the
plan, filled from the state tree's scalar after each step. A ``step`` or scalar tensor
replaced (a loaded state dict) or changed in place (its version counter moves) rebuilds the plan.
"""
from __future__ import annotations

import torch

from lowbit_tree.base import plan_of
from lowbit_tree.update import apply_rest_

from .distributed import local_grad, to_local
from .param_states import SCALARS

__all__ = ["GroupPlan"]


class GroupPlan:
    """The in-place step of one param group over the params at positions ``present`` (those
    with gradients), all at one step count.

    Args:
      state: the optimizer's ``state`` (param -> its state dict) now.
      tx: the group's transformation (its in-place form ``tx.plan`` is built here).
      binding: the group's state-tree binding for ``present``
        (:meth:`bridge.param_states.ParamStates.binding`).
      params: the group's params (all of them: a leaf's index is its position).
      present: the positions stepped.
      live: per position, the param's live records (:meth:`bridge.param_states.ParamStates.live`),
        ``None`` where not stepped.
      numeric: the injected hyperparameters' names (and this step's values).
      offset: the group's first param's position among all the optimizer's params.
      what: the transformation's name, for error messages.
    """

    def __init__(self, state, tx, binding, params: list, present: tuple, live: list, numeric: dict, offset: int,
                 what: str):
        self.present = present
        self.params = [params[i] for i in present]
        self.locals = [to_local(p) for p in self.params]  # a plain param is its own local tensor
        self.dtypes = [p.dtype for p in self.params]  # a module cast in place keeps the param object
        self.states = [state[p] for p in self.params]
        self.held = [tuple(v for k, v in st.items() if k not in SCALARS) for st in self.states]
        self.hyper = {k: torch.zeros((), dtype=torch.float64, device="cpu") for k in numeric}
        tree, self.counts, self.seeds, self.scalars = binding.tree(live, self.hyper)
        self.count = int(float(self.states[0]["step"])) if self.states else 0
        # one tensor of step counts; each param's "step" a view of it (module docstring)
        self.step_values = torch.full((len(self.params),), float(self.count), dtype=torch.float32, device="cpu")
        self.views = [self.step_values[k] for k in range(len(self.params))]
        for st, v in zip(self.states, self.views):
            st["step"] = v
        self.version = self.step_values._version
        # each rule scalar: the tree's tensor, and one tensor of the params' values (their views)
        self.scalar_rows = []
        for name, t in self.scalars:
            t.copy_(self.states[0][name].detach().to("cpu", torch.float32).reshape(()))
            row = t.expand(len(self.params)).clone()
            for k, st in enumerate(self.states):
                st[name] = row[k]
            self.scalar_rows.append([name, t, row, [row[k] for k in range(len(self.params))], row._version])
        self.numbers: dict = {}  # the Python numbers last written into self.hyper
        for c in self.counts:
            c.fill_(self.count)
        self.seed = None
        stepped = set(present)
        self.all_locals = [to_local(p) if i in stepped else None for i, p in enumerate(params)]
        self.core_plan = plan_of(tx, what)(tree, self.all_locals, write=True, leaf_offset=offset)
        self.size = len(params)

    def current(self, state, params: list, present: tuple) -> bool:
        """Whether this plan still holds over the optimizer's ``state`` (a loaded state dict
        replaces it): the same params with gradients at the same positions (in the same dtypes),
        the same state objects, step counts untouched since the last step. (Loops, not
        generators: a step calls nothing here.)"""
        if present != self.present or len(params) != self.size or self.step_values._version != self.version:
            return False
        for name, _, row, views, version in self.scalar_rows:
            if row._version != version:
                return False
            for st, view in zip(self.states, views):
                if st.get(name) is not view:
                    return False
        for i, p, local, st, held, view, dtype in zip(self.present, self.params, self.locals, self.states, self.held,
                                                      self.views, self.dtypes):
            if params[i] is not p or state.get(p) is not st or st.get("step") is not view or p.dtype != dtype:
                return False
            if local is not p and to_local(p) is not local:  # a DTensor's local shard replaced
                return False
            if len(st) != len(held) + 1 + len(self.scalar_rows):
                return False
            k = 0
            for name, v in st.items():
                if name not in SCALARS:
                    if v is not held[k]:
                        return False
                    k += 1
        return True

    def run(self, numeric: dict, seed: int, grads: list | None = None) -> None:
        """One step: this step's hyperparameters (those that changed) into the state tree, then
        the plan, which advances the tree's counts; an update the plan did not write into the
        params (a transformation that writes none) is added to them. ``grads``: the local
        gradients by position (``None`` where not stepped), read from the params if not given."""
        if grads is None:
            grads = [None] * self.size
            for i, p, local in zip(self.present, self.params, self.locals):
                grads[i] = p.grad if local is p else local_grad(p)
        for k, v in numeric.items():
            if isinstance(v, torch.Tensor):
                self.hyper[k].copy_(v.detach().reshape(()))
                self.numbers.pop(k, None)
            elif self.numbers.get(k) != v:  # a number written already is not written again
                self.hyper[k].fill_(float(v))
                self.numbers[k] = v
        if seed != self.seed:
            for s in self.seeds:
                s.fill_(seed)
            self.seed = seed
        rest = self.core_plan(grads)  # advances the state tree's counts itself
        self.step_values.add_(1)
        self.version = self.step_values._version
        for held in self.scalar_rows:  # the tree's scalars, advanced by the plan, to the params' views
            held[2].copy_(held[1].expand_as(held[2]))
            held[4] = held[2]._version
        self.count += 1
        for i in self.present:
            if rest[i] is not None:  # what the plan left to add (a transformation that writes no params)
                apply_rest_(self.all_locals, rest)
                break
