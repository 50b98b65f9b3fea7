"""``bridge.Muon``: torch.optim.Muon with low-bit momentum, AdamW groups, and FSDP2.

Newton-Schulz needs a whole matrix. Under FSDP2 each rank holds rows of it (``Shard(0)``; under
tensor parallel columns, on a 2-D mesh a block); the core hands ``ShardedNS`` each
matrix's Newton-Schulz input in *storage form*
(:mod:`lowbit_tree.muon_transform`: the quantized momentum or update, or bfloat16), whose blocks
are blocks of the unsharded optimizer's (no quantization block straddles a shard). One owner
rank per matrix (round-robin over the step's matrices) gathers the blocks, runs Newton-Schulz
and scatters each rank its block of the result
(bfloat16, what Newton-Schulz returns): the same bits as one process, with 8-bit momentum
about a quarter of the bytes of gathering float32 rows. One collective at a time (design.md,
"One collective in flight").
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from lowbit_tree import QTensor, alias, records
from lowbit_tree.base import state_names
from lowbit_tree.lowrank import LowRankQTensor, lowrank_expand
from lowbit_tree.muon_transform import (DEFAULT_NS_COEFFICIENTS, ScaleByMuonState, check_momentum_rank, check_ns_args,
                                       ns_matrix, refresh_record)
from lowbit_tree.transform import ScaleByAdamState

from . import owner_step
from .distributed import is_dtensor
from . import group_args
from .classes import TorchOptimizerBase

__all__ = ["ADAMW_FORMATS", "Muon", "Muon8bit", "Muon4bit", "ShardedNS", "muon_param_groups"]

_SCATTER = "Muon's scatter of Newton-Schulz results"


def _geometry(kind: str, width=None):
    """A part's place in the whole: ``(block shape, block offset) -> (offsets, extents)`` in that
    part's own 2-D layout (:func:`bridge.owner_step.gather`'s geometry). ``"block"``: the block's
    rows and its columns through ``width`` (codes of 4-bit values, scales of blocks); ``"rows"``: a
    factor over the rows (``(rows, K)``); ``"cols"``: one over the columns (``(cols, K)``, whole on
    every rank that holds all columns)."""
    if kind == "block":
        return lambda s, o: ((o[0], width(o[1])), (s[0], width(s[1])))
    if kind == "rows":
        return lambda s, o, k=width: ((o[0], 0), (s[0], k))
    return lambda s, o, k=width: ((o[1], 0), (s[1], k))


def _record_parts(x) -> list:
    """``(local tensor, geometry)`` for each tensor of a Newton-Schulz input or stored buffer: a
    record's parts as its kind lays them out (:mod:`lowbit_tree.records`), or a plain matrix."""
    kind = records.kind_of(x)
    if kind is None:
        return [(x, _geometry("block", lambda c: c))]
    meta, out = kind.meta_of(x), []
    for part in kind.parts:
        t = getattr(x, part.name)
        if part.along == "param":
            u = part.unit(meta)
            out.append((t, _geometry("block", lambda c, u=u: -(-c // u))))
        else:
            out.append((t, _geometry(part.along, t.shape[1])))
    return out


class ShardedNS:
    """The ``orthogonalize`` hook of :func:`lowbit_tree.scale_by_muon` for a param group whose
    params may be DTensors (FSDP2 rows, tensor-parallel columns, both on a 2-D mesh). ``params``
    (the group's params, by leaf index) is set before each step. ``sent`` counts the bytes this
    rank sent since :meth:`reset`: ``gather`` (Newton-Schulz inputs in storage form, to the
    owners, and with ``momentum_rank`` the new buffers' residuals), ``scatter`` (the owners'
    bfloat16 results, and the refreshed factors' rows), ``gather_float32`` (the same gathered
    rows as float32: what gathering the float32 momentum or update would move)."""

    def __init__(self):
        self.params: list = []
        self.offset = 0
        self.reset()

    def reset(self) -> None:
        self.sent = {"gather": 0, "scatter": 0, "gather_float32": 0}

    def _param(self, index: int):
        p = self.params[index - self.offset]
        sharded = is_dtensor(p) and not all(pl.is_replicate() for pl in p.placements)
        return p, sharded

    def __call__(self, inputs, ns) -> list:
        out = []
        k = 0  # round-robin over this call's sharded matrices (the same sequence on every rank)
        for inp in inputs:
            p, sharded = self._param(inp.index)
            if not sharded:  # every row here: the core's factor product serves
                o = ns(ns_matrix(inp.x, inp.low))
                out.append((o, tuple(p.shape)) if inp.buffer is None
                           else (o, tuple(p.shape), refresh_record(inp.buffer, inp.low)))
                continue
            out.append(self._sharded(p, inp.x, inp.buffer, ns, k))
            k += 1
        return out

    def _sharded(self, p, x: Any, buffer: Any, ns, k: int):
        """Matrix ``p``'s Newton-Schulz result, rows and columns of this rank's block: every
        rank's block of ``x`` (in storage form, as bytes: gloo has no float8) goes to the owner,
        which assembles the whole ``x``, runs ``ns`` and sends each rank its block back:
        ``(o, shape)``. With a low-rank ``buffer`` (``momentum_rank``) the owner also assembles it
        (its residual; its factors are ``x``'s) and sends back each rank's rows of the refreshed
        factors: ``(o, shape, (P rows, R rows))``."""
        lay = owner_step.layout(p, k, "Muon", "give this param to a group with use_muon=False")
        parts = _record_parts(x)
        if buffer is not None:
            parts += _record_parts(buffer)[:2]  # its codes and scales; the factors are x's
        whole = owner_step.gather(lay, parts, "Muon's gather of Newton-Schulz inputs", self.sent, "gather")
        if lay.me != lay.owner:
            nr, nc = (max(b[0][d] for b in lay.blocks.values()) for d in (0, 1))
            self.sent["gather_float32"] += nr * nc * 4
        o = pf = rf = None
        if whole is not None:
            low = None
            if isinstance(x, LowRankQTensor):
                xf = LowRankQTensor(*whole[:4], lay.shape, x.block_size, x.format)
                low = lowrank_expand(xf.row_factor, xf.col_factor)  # the input's and the buffer's (same factors)
            elif isinstance(x, QTensor):
                xf = QTensor.unchecked(whole[0], whole[1], lay.shape, x.block_size, x.format)
            else:
                xf = whole[0]
            o = ns(ns_matrix(xf, low))
            if buffer is not None:
                pf, rf = refresh_record(LowRankQTensor(whole[4], whole[5], whole[2], whole[3], lay.shape,
                                                       buffer.block_size, buffer.format), low)
        dev = p.to_local().device
        out = [(o, _geometry("block", lambda c: c), torch.bfloat16)]
        if buffer is None:
            return owner_step.scatter(lay, out, _SCATTER, self.sent, "scatter", dev)[0], tuple(p.shape)
        out += [(pf, _geometry("rows", x.rank), x.row_factor.dtype), (rf, _geometry("cols", x.rank), x.col_factor.dtype)]
        o, p_rows, r_rows = owner_step.scatter(lay, out, _SCATTER, self.sent, "scatter", dev)
        return o, tuple(p.shape), (p_rows, r_rows)


def muon_or_adamw(learning_rate, momentum, weight_decay, eps, b1, b2, adamw_eps, *, use_muon=True, nesterov=True,
                  ns_coefficients=DEFAULT_NS_COEFFICIENTS, ns_steps=5, adjust_lr_fn=None, state_format="8bit",
                  block_size=None, min_quant_size=4096, stochastic_round=False, momentum_rank=0,
                  orthogonalize=None):
    """A Muon group's transformation (:func:`lowbit_tree.muon`), or an AdamW group's
    (:func:`lowbit_tree.adamw` with ``betas`` and ``adamw_eps``; ``momentum_rank`` is Muon's)."""
    if use_muon:
        return alias.muon(learning_rate, momentum, weight_decay, nesterov, ns_coefficients, eps, ns_steps,
                          adjust_lr_fn, state_format=state_format, block_size=block_size,
                          min_quant_size=min_quant_size, momentum_rank=momentum_rank,
                          orthogonalize=orthogonalize, stochastic_round=stochastic_round)
    return alias.adamw(learning_rate, b1, b2, adamw_eps, weight_decay, state_format=state_format,
                       block_size=block_size, min_quant_size=min_quant_size, stochastic_round=stochastic_round)


ADAMW_FORMATS = {"nf4": "8bit"}
"""The state format of a Muon optimizer's AdamW groups (those without one of their own) where it
differs from the optimizer's. ``"nf4"`` (Muon4bit) gives them ``"8bit"`` (AdamW8bit's): on the
convergence benchmark the AdamW groups (embeddings, head) in 4 bits cost more held-out loss than
the 4-bit momentum itself (``benchmarks/convergence.py --variants muon-4bit,muon-4bit-adamw4``),
and ``"nf4"`` suits Adam worse still (it has no value below 0.08 of a block's absmax, and Adam
divides its first moment by ``sqrt(v)``). A group that names a format keeps it."""


class Muon(TorchOptimizerBase):
    """torch.optim.Muon (same signature, defaults and state name ``momentum_buffer``) with
    ``state_format`` momentum (default ``"fp32"``), under FSDP2 too.

    A param group with ``use_muon=False`` runs AdamW instead (embeddings, norms, biases, the
    head: what Muon is not for), with the group's ``lr`` and ``weight_decay``, ``betas`` and
    ``adamw_eps`` (defaults: the constructor's ``adamw_betas`` / ``adamw_eps``); its states are
    ``exp_avg`` / ``exp_avg_sq`` in the group's ``state_format`` (default: the optimizer's, or
    ``"8bit"`` for ``"nf4"``: ``ADAMW_FORMATS``). :func:`muon_param_groups` splits a model
    that way. Muon groups take 2-D params only (as torch).

    A ``state_format`` mapping may name the states of both kinds of group (``momentum_buffer``;
    ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``); each group takes the entries of its own
    states, and the states it leaves out keep the class's format (for AdamW groups, the
    ``ADAMW_FORMATS`` one: ``"8bit"`` in Muon4bit).

    ``momentum_rank=K`` (default 0; Muon4bit's 16) keeps each quantized momentum buffer as
    bfloat16 factors of rank ``K`` plus a quantized residual (``lowbit_tree.lowrank``; the
    state ``momentum_buffer`` is then a record of four tensors, ``codes``, ``scale``,
    ``row_factor``, ``col_factor``); it needs a quantized ``state_format``.
    """

    _default_momentum_rank = 0
    _state_types = (ScaleByMuonState, ScaleByAdamState)

    def _group_state_types(self, group: dict) -> tuple:
        return (ScaleByMuonState,) if group["use_muon"] else (ScaleByAdamState,)

    def _default_formats(self, names: tuple) -> dict:
        adamw = ADAMW_FORMATS.get(self._default_format, self._default_format)
        return {n: adamw if n in state_names(ScaleByAdamState) else self._default_format for n in names}

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS, eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None, *,
                 adamw_betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
                 adamw_eps: float = 1e-8, state_format: str | Mapping[str, str] | None = None,
                 block_size: int | None = None, min_quant_size: int = 4096, momentum_rank: int | None = None,
                 bf16_stochastic_round: bool = False, skip_nonfinite: bool = False) -> None:
        self._ortho = ShardedNS()
        if momentum_rank is None:
            momentum_rank = self._default_momentum_rank
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        use_muon=True, betas=tuple(adamw_betas), adamw_eps=adamw_eps,
                        state_format=self._state_format(state_format), block_size=block_size,
                        min_quant_size=min_quant_size, momentum_rank=momentum_rank,
                        bf16_stochastic_round=bf16_stochastic_round, skip_nonfinite=skip_nonfinite)
        super().__init__(params, muon_or_adamw, defaults, group_to_kwargs=self._kwargs)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, plus: an AdamW group (``use_muon=False``) without a ``state_format`` of its own
        takes ``ADAMW_FORMATS``'s format for the optimizer's, written into the group (so its
        ``param_groups``, state dict and ``state_report`` say it)."""
        default = self.defaults["state_format"]
        if (not param_group.get("use_muon", self.defaults["use_muon"]) and "state_format" not in param_group
                and isinstance(default, str)):  # (a mapping's left-out states: _default_formats)
            fmt = ADAMW_FORMATS.get(default)
            if fmt is not None:
                param_group = {**param_group, "state_format": fmt}
        super().add_param_group(param_group)

    PICKLED = TorchOptimizerBase.PICKLED + ("_ortho",)

    def _kwargs(self, group: dict) -> dict:
        b1, b2 = group["betas"]
        return dict(learning_rate=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"],
                    eps=group["eps"], b1=b1, b2=b2, adamw_eps=group["adamw_eps"], use_muon=group["use_muon"],
                    nesterov=group["nesterov"], ns_coefficients=tuple(group["ns_coefficients"]),
                    ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"],
                    state_format=group["state_format"], block_size=group["block_size"],
                    min_quant_size=group["min_quant_size"], stochastic_round=group["bf16_stochastic_round"],
                    momentum_rank=group["momentum_rank"],
                    orthogonalize=self._ortho)

    def _check_group(self, owner, group):
        group_args.in_range(owner, "lr", group["lr"], 0.0)
        group_args.in_range(owner, "weight_decay", group["weight_decay"], 0.0)
        group_args.in_range(owner, "momentum", group["momentum"], 0.0)
        group_args.in_range(owner, "eps", group["eps"], 0.0)
        group_args.in_range(owner, "adamw_eps", group["adamw_eps"], 0.0)
        group_args.betas(owner, group["betas"])
        group_args.flag(owner, "nesterov", group["nesterov"])
        group_args.flag(owner, "use_muon", group["use_muon"])
        if group.get("param_correction"):
            raise ValueError(f"{owner}: param_correction is not supported by the Muon classes (a group asks for it); "
                             "keep float32 params for Muon, or step bfloat16 params with bf16_stochastic_round=True")
        try:
            check_ns_args(group["ns_coefficients"], group["ns_steps"], group["adjust_lr_fn"])
            check_momentum_rank(group["momentum_rank"],
                                self._state_formats(group)["momentum_buffer"] if group["use_muon"] else None)
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None
        if group["use_muon"]:
            for p in group_args.group_params(group):
                if p.ndim != 2:
                    raise ValueError(
                        f"{owner} only supports 2D parameters whereas we found a parameter with size: {tuple(p.shape)}; "
                        "put embeddings, norms, biases and the head in a param group with use_muon=False (AdamW), "
                        "e.g. bridge.muon_param_groups(model)"
                    )

    def _step_group(self, group, params, offset, only=None):
        self._ortho.params, self._ortho.offset = params, offset
        super()._step_group(group, params, offset, only)

    def step(self, closure=None):
        self._ortho.reset()
        return super().step(closure)

    def communication(self) -> dict:
        """Bytes this rank sent for Newton-Schulz in the last step (``ShardedNS``)."""
        return dict(self._ortho.sent)


class Muon8bit(Muon):
    """Muon with an 8-bit momentum (signed dynamic map)."""

    _default_format = "8bit"


class Muon4bit(Muon):
    """Muon with a 4-bit momentum: ``state_format="nf4"`` and ``momentum_rank=16``, i.e. each
    matrix's buffer is rank-16 bfloat16 factors plus a residual on the normal-float map, blocks of
    32 (0.625 bytes a value, plus ``2 K (m + n)`` bytes a matrix for the factors: ``32 (m + n)`` at
    rank 16, so it takes less memory than Muon8bit only on square matrices wider than about 165); its AdamW groups are AdamW8bit's
    (``"8bit"``) unless they name a format (``ADAMW_FORMATS``). Its held-out loss against fp32
    Muon is on docs/results.md ("Convergence"). A state dict saved without factors (``"nf4"``, no
    ``row_factor``) loads as the same buffer; one saved with ``state_format='4bit'`` loads into
    ``bridge.Muon(state_format="4bit")``."""

    _default_format = "nf4"
    _default_momentum_rank = 16


def muon_param_groups(model: torch.nn.Module, *, exclude: tuple = ("embed", "emb", "head", "lm_head", "wte", "wpe"),
                      **adamw_options) -> list[dict]:
    """``[{"params": hidden matrices}, {"params": the rest, "use_muon": False, **adamw_options}]``:
    the 2-D weights of hidden layers for Muon; 1-D params, other shapes, and params whose name has
    a part in ``exclude`` (embeddings and the output head, by convention) for AdamW."""
    muon, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        hidden = p.ndim == 2 and not any(part in exclude for part in parts)
        (muon if hidden else rest).append(p)
    groups = [{"params": muon}] if muon else []
    if rest:
        groups.append({"params": rest, "use_muon": False, **adamw_options})
    return groups
