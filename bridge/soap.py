"""``bridge.SOAP``, ``SOAP8bit``, ``SOAP4bit``: the reference SOAP optimizer's signature over
:func:`lowbit_tree.scale_by_soap`, a :class:`~bridge.LowBitOptimizer` like every other class.

Each param's states live in ``optimizer.state[p]`` under the names the core's state declares
(``ScaleBySoapState.roles``), every value a tensor:

- ``step`` (float32, 0-d, torch's), ``soap_step`` (int32: gradients seen), ``precond_failures``
  (int32: refreshes that kept an old basis);
- ``exp_avg``, ``exp_avg_sq``: shaped like the param (a :class:`~bridge.QState` when quantized);
- per rotated dimension ``d``: ``eigenbasis_d`` and ``coupling_d`` (``(n, n)``, float32 or a
  QState of a block record) and ``eigenvalues_d`` (float32 ``(n,)``): per-dimension roles
  (``"eigenbasis_{dim}"``), whose shapes the layouts keep (:class:`bridge.param_states.ParamStates`).

The step, state dict, load (with its checks), report, finiteness check and DCP path are
``LowBitOptimizer``'s: one :class:`~bridge.group_plan.GroupPlan` per group, built once, runs the
core's in-place plan (the group's transformation built once; ``lr`` and the betas, ``eps``,
``weight_decay`` and ``shampoo_beta`` injected, so a scheduler changes them without a rebuild).

A DTensor param (FSDP2, tensor parallel, both, HSDP: any ``Shard`` / ``Replicate`` placements on a
1-D mesh or a 2-D mesh over all processes) is stepped whole (``whole_steps``): every state but the
0-d counters is a DTensor on its mesh (:mod:`bridge.soap_states`: the moments placed like the
param, the factors by rows), so ``full_tensor()`` gives the one-process state. It has an owner
rank, :func:`bridge.owner_step.owner_rank` of its index over all groups (on a 1-D mesh: that index
modulo the mesh size): :class:`OwnerStep`, the core's ``whole_step``, gathers every rank's blocks
of the param, its gradient and its states to the owner, which alone runs the unsharded step and
scatters each rank its block of the update (in the param's dtype, to add) and of the new states:
the same bits as one process. ``state_dict()`` holds the DTensors (every param's states, zeros
for one not stepped yet), so DCP reshards them at any world size.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lowbit_tree import moments
from lowbit_tree.soap_transform import ScaleBySoapState, SoapLeafReport, scale_by_soap, soap_report

from . import group_args, owner_step, report, soap_states
from .distributed import is_dtensor, local_grad, to_local
from .optimizer import LowBitOptimizer
from .qstate import QState

__all__ = ["SOAP", "SOAP8bit", "SOAP4bit", "SOAP4BIT_STATE_FORMAT", "OwnerStep", "soap_of_group"]

_PER_DIM = ("eigenbasis", "eigenvalues", "coupling")
_GATHER = "SOAP's gather of a param's and its gradient's blocks to the owner"
_GATHER_STATES = "SOAP's gather of a param's states' blocks to the owner"
_SCATTER = "SOAP's scatter of the update's blocks from the owner"
_SENT = ("gather", "scatter", "state_gather", "state_scatter")
_REMEDY = "place it on a 1-D mesh or on a mesh over all processes"
_OPTIONS = ("precondition_frequency", "max_precond_dim", "precondition_1d", "normalize_grads", "data_format",
            "precond_format", "bjorck_steps", "state_format", "block_size", "min_quant_size")
"""Group options that reach the core unchanged (static: changing one builds the group's
transformation again)."""


def _unwrap(value):
    value = to_local(value)
    return value.record if isinstance(value, QState) else value


def _unsupported_sharding(p) -> str:
    """Why a param's sharding is not supported (empty if it is): ``Shard`` and ``Replicate``
    placements (FSDP2, tensor parallel, both, HSDP) on a 1-D mesh or a 2-D mesh over all
    processes."""
    if not is_dtensor(p):
        return ""
    placements = tuple(p.placements)
    mesh = p.device_mesh
    if mesh.ndim > 2 or not all(pl.is_replicate() or pl.is_shard() or type(pl).__name__ == "_StridedShard"
                                for pl in placements):
        return (f"placed {placements} on a {mesh.ndim}-D mesh: only Shard and Replicate placements on a 1-D or "
                "2-D mesh are implemented (FSDP2, tensor parallel, both, HSDP)")
    if mesh.ndim == 2 and mesh.mesh.numel() != dist.get_world_size():
        return (f"placed {placements} on a {tuple(mesh.shape)} mesh over {mesh.mesh.numel()} of "
                f"{dist.get_world_size()} processes: a 2-D mesh must span every process; {_REMEDY}")
    return ""


def _leaf(state: dict) -> tuple:
    """One param's states (``optimizer.state[p]``'s names, whole or local) as the core's leaf
    ``(steps, exp_avg, exp_avg_sq, bases, eigenvalues, couplings, failures)`` (records sharing the
    states' storage; ``None`` for a dimension that is not rotated)."""
    ndim = to_local(state["exp_avg"]).ndim
    per_dim = [tuple(_unwrap(state[f"{name}_{d}"]) if f"{name}_{d}" in state else None for d in range(ndim))
               for name in _PER_DIM]
    return (state["soap_step"], _unwrap(state["exp_avg"]), _unwrap(state["exp_avg_sq"]), *per_dim,
            state["precond_failures"])


def soap_of_group(learning_rate, b1, b2, eps, weight_decay, shampoo_beta, options: dict):
    """A SOAP group's transformation: :func:`lowbit_tree.scale_by_soap` with the group's numbers
    (injected by the optimizer) and ``options`` (its static arguments and the ``whole_step``)."""
    return scale_by_soap(b1, b2, shampoo_beta, eps, learning_rate=learning_rate, weight_decay=weight_decay,
                         **options)


class OwnerStep:
    """The core's ``whole_step`` for a SOAP optimizer (:func:`lowbit_tree.scale_by_soap`): a plain
    param's leaf is stepped as it is; a DTensor param's blocks (param, gradient, every state) are
    gathered to its owner (:func:`bridge.owner_step.layout` of its index over all groups), which
    steps the whole leaf and scatters each rank its block of the update and of the new states
    (:mod:`bridge.soap_states`); each collective on :func:`~bridge.collectives.group_for`'s group
    for the blocks' device (the mesh's, or a registered host group). ``params`` and ``offset``
    (the group's params and the position of its first) are set before each group's step;
    ``sent`` counts the bytes this rank sent since :meth:`reset` (``communication()``)."""

    def __init__(self, state, owner: str):
        self.state, self.owner = state, owner
        self.params: list = []
        self.offset = 0
        self.reset()

    def reset(self) -> None:
        self.sent = dict.fromkeys(_SENT, 0)

    def __call__(self, index: int, old: tuple, param, grad, step):
        p = self.params[index - self.offset]
        if not is_dtensor(p):
            return step(old, param, grad)
        lay = owner_step.layout(p, index, self.owner, _REMEDY)
        local = to_local(p.detach())
        state = self.state[p]
        box = owner_step.whole_box
        whole = owner_step.gather(lay, [(local, box), (local_grad(p), box)], _GATHER, self.sent, "gather")
        sharded = [(name, v, soap_states.state_parts(v)) for name, v in state.items() if is_dtensor(v)]
        got = owner_step.gather(lay, [(t, boxes) for _, _, parts in sharded for _, t, boxes, _ in parts],
                                _GATHER_STATES, self.sent, "state_gather")
        u, out = None, [None] * len(sharded)
        if whole is not None:
            full_state, at = {name: v for name, v in state.items() if not is_dtensor(v)}, 0
            for name, v, parts in sharded:
                full_state[name] = soap_states.assemble(v, got[at:at + len(parts)])
                at += len(parts)
            u = step(_leaf(full_state), whole[0], whole[1]).to(p.dtype)
            out = [soap_states.whole_parts(full_state[name]) for name, _, _ in sharded]
        one = owner_step.Boxes(dict.fromkeys(lay.blocks, ((0,), (1,))), ((0,), (1,)))  # a counter, to every rank
        counters = [old[0], old[-1]]  # soap_step, precond_failures: 0-d, the same on every rank
        parts = [(u, box, p.dtype)]
        parts += [(None if w is None else w[j], boxes, t.dtype) for (_, _, ps), w in zip(sharded, out)
                  for j, (_, t, boxes, _) in enumerate(ps)]
        parts += [(c.reshape(1), one, c.dtype) for c in counters]
        keys = ["scatter"] + ["state_scatter"] * (len(parts) - 1)
        news = owner_step.scatter(lay, parts, _SCATTER, self.sent, keys, local.device)
        targets = [t for _, _, ps in sharded for _, t, _, _ in ps] + counters
        for t, new in zip(targets, news[1:]):
            t.copy_(new.reshape(t.shape))
        return news[0]


class SOAP(LowBitOptimizer):
    """SOAP (github.com/nikhilvyas/SOAP ``soap.py`` at a1e5535: same arguments, defaults and
    param steps; ``lowbit_tree.soap_transform`` has the algorithm) with states in
    ``state_format`` (the Adam moments, as the other classes) and ``precond_format`` (the
    eigenbases and couplings: ``"fp32"``, ``"8bit"``, ``"4bit"``).

    ``merge_dims=True`` is refused (not implemented); ``data_format`` is checked and, without it,
    changes nothing (as in the reference). ``skip_nonfinite=True`` skips the step of its groups
    (params, states, steps) when any gradient is NaN or infinite (with DTensor params: in any
    rank's block; every rank skips), as every ``LowBitOptimizer``. ``bjorck_steps``,
    ``block_size``, ``min_quant_size``: :func:`lowbit_tree.scale_by_soap`'s.
    """

    _default_state_format = "fp32"
    _default_precond_format = "fp32"
    _whole_steps = True
    PICKLED = LowBitOptimizer.PICKLED + ("_owner",)

    def __init__(self, params, lr: float = 3e-3, betas=(0.95, 0.95), shampoo_beta: float = -1, eps: float = 1e-8,
                 weight_decay: float = 0.01, precondition_frequency: int = 10, max_precond_dim: int = 10000,
                 merge_dims: bool = False, precondition_1d: bool = False, normalize_grads: bool = False,
                 data_format: str = "channels_first", correct_bias: bool = True, *, state_format=None,
                 precond_format: Optional[str] = None, bjorck_steps: Optional[int] = None,
                 block_size: Optional[int] = None, min_quant_size: int = 4096, skip_nonfinite: bool = False):
        group_args.betas(type(self).__name__, betas)
        self._owner = OwnerStep(None, type(self).__name__)
        defaults = dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
                        precondition_frequency=precondition_frequency, max_precond_dim=max_precond_dim,
                        merge_dims=merge_dims, precondition_1d=precondition_1d, normalize_grads=normalize_grads,
                        data_format=data_format, correct_bias=correct_bias,
                        state_format=self._state_format_default() if state_format is None else state_format,
                        precond_format=self._default_precond_format if precond_format is None else precond_format,
                        bjorck_steps=bjorck_steps, block_size=block_size, min_quant_size=min_quant_size,
                        skip_nonfinite=skip_nonfinite)
        super().__init__(params, soap_of_group, defaults, group_to_kwargs=self._kwargs)
        self._owner.state = self.state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._owner.state = self.state

    def _state_format_default(self):
        return self._default_state_format

    def _kwargs(self, group: dict) -> dict:
        b1, b2 = group["betas"]
        options = {k: group[k] for k in _OPTIONS}
        options.update(bias_correction=group["correct_bias"], whole_step=self._owner)
        return dict(learning_rate=group["lr"], b1=b1, b2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                    shampoo_beta=group["shampoo_beta"], options=options)

    # -- groups ------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """The base's, then the group's arguments checked (:meth:`_check_group`); a refused group
        is not added."""
        super().add_param_group(param_group)
        try:
            self._check_group(type(self).__name__, self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def _check_group(self, owner: str, group: dict) -> None:
        """A ValueError naming the class and the argument: betas, ``merge_dims``, ``skip_nonfinite``,
        ``lr``, the core's checks; a DTensor param unless placed ``Shard`` / ``Replicate`` on a 1-D
        mesh or a 2-D mesh over all processes."""
        group_args.betas(owner, group["betas"])
        try:
            if group["merge_dims"] is not False:
                raise ValueError("merge_dims=True is not implemented (the reference's folding of small "
                                 "dimensions); use merge_dims=False")
            if not isinstance(group["skip_nonfinite"], bool):
                raise ValueError(f"skip_nonfinite must be True or False, got {group['skip_nonfinite']!r}")
            if not isinstance(group["lr"], (int, float)) or not group["lr"] >= 0:
                raise ValueError(f"lr must be a number >= 0, got {group['lr']!r}")
            kw = self._kwargs(group)
            kw["learning_rate"] = float(kw["learning_rate"])
            soap_of_group(**kw)
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None
        for p in group_args.group_params(group):
            why = _unsupported_sharding(p)
            if why:
                raise ValueError(f"{owner}: a DTensor param of shape {tuple(p.shape)} {why}")

    # -- the step ----------------------------------------------------------------------------
    def step(self, closure=None):
        self._owner.reset()
        return super().step(closure)

    def _step_group(self, group, params, offset, only=None):
        self._owner.params, self._owner.offset = params, offset
        super()._step_group(group, params, offset, only)

    def communication(self) -> dict:
        """Bytes this rank sent in the last step for DTensor params: ``gather`` (its blocks of the
        params it does not own and of their gradients, padded to the largest rank's extents),
        ``scatter`` (the other ranks' padded blocks of the updates of the params it owns),
        ``state_gather`` and ``state_scatter`` (the same of their states, and the 0-d counters
        scattered to every rank)."""
        return dict(self._owner.sent)

    # -- reports -----------------------------------------------------------------------------
    def state_report(self) -> list:
        """:func:`bridge.report.state_report`'s rows (this rank's blocks of a DTensor param's
        states) as :class:`lowbit_tree.ReportRow`, ``param{i}/{name}``, then a total."""
        rows = []
        for row in report.state_report(self):
            p = self._params()[row.index]
            rows.append(moments.leaf_row(f"param{row.index}/{row.name}", _unwrap(self.state[p][row.name])))
        rows.append(moments.ReportRow("total", "", (), sum(r.nbytes for r in rows)))
        return rows

    def soap_report(self) -> list[SoapLeafReport]:
        """Per param with a state: rotated dimensions, gradients seen, refreshes that failed
        (``index``: the param's position over all groups)."""
        out = []
        for i, p in enumerate(self._params()):
            state = self.state.get(p)
            if not state or "soap_step" not in state:  # none yet
                continue
            core = ScaleBySoapState(torch.zeros((), dtype=torch.int32), *([x] for x in _leaf(state)))
            out.append(soap_report(core)[0]._replace(index=i))
        return out

    def _params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]


SOAP4BIT_STATE_FORMAT = {"exp_avg": "nf4", "exp_avg_sq": "8bit"}
"""SOAP4bit's moments. In the eigenbasis the second moment spans more decades than in Adam's
coordinates; the rank-1 normalized 4-bit map rounds its small entries up to its smallest code:
on the GPT of docs/guide/soap.md it cost 1.7% held-out loss where an 8-bit one cost 0.4%."""


class SOAP8bit(SOAP):
    """SOAP with 8-bit moments (``"8bit"``) and 8-bit eigenbases and couplings (the signed
    dynamic map, blocks of 64, two Bjorck steps after decoding): 6.3 state bytes a param on a
    2048 x 2048 matrix (fp32 SOAP: 24)."""

    _default_state_format = "8bit"
    _default_precond_format = "8bit"


class SOAP4bit(SOAP):
    """SOAP with 4-bit eigenbases and couplings (the normal-float map, blocks of 64, three Bjorck
    steps after decoding) and ``exp_avg`` (normal-float, blocks of 32); ``exp_avg_sq`` is 8-bit
    (``SOAP4BIT_STATE_FORMAT``): 3.9 state bytes a param on a 2048 x 2048 matrix."""

    _default_precond_format = "4bit"

    def _state_format_default(self):
        return dict(SOAP4BIT_STATE_FORMAT)
