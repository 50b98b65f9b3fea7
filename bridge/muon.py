"""``bridge.Muon``: torch.optim.Muon with low-bit momentum, AdamW groups, and FSDP2.

Newton-Schulz needs a whole matrix. Under FSDP2 each rank holds rows of it (``Shard(0)``; under
tensor parallel columns, on a 2-D mesh a block); the core hands :class:`ShardedNS` each
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

from typing import Any

import torch

import lowbit_tree as lt
from lowbit_tree import QTensor, alias
from lowbit_tree.muon_transform import DEFAULT_NS_COEFFICIENTS, check_ns_args, ns_matrix

from .distributed import is_dtensor
from .optimizers import _TorchOptimizer, _betas, _flag, _group_params, _in_range

__all__ = ["ADAMW_FORMATS", "Muon", "Muon8bit", "Muon4bit", "ShardedNS", "muon_param_groups"]


class ShardedNS:
    """The ``orthogonalize`` hook of :func:`lowbit_tree.scale_by_muon` for a param group whose
    params may be DTensors (FSDP2 rows, tensor-parallel columns, both on a 2-D mesh). ``params`` (the group's params, by leaf index) is set before
    each step. ``sent`` counts the bytes this rank sent since :meth:`reset`: ``gather`` (Newton-Schulz
    inputs in storage form, to the owners), ``scatter`` (the owners' bfloat16 results), and
    ``gather_float32`` (the same gathered rows as float32: what gathering the float32 momentum
    or update would move)."""

    def __init__(self):
        self.params: list = []
        self.offset = 0
        self.reset()

    def reset(self) -> None:
        self.sent = {"gather": 0, "scatter": 0, "gather_float32": 0}

    def __call__(self, inputs, ns) -> list:
        out = []
        k = 0  # round-robin over this call's sharded matrices (the same sequence on every rank)
        for inp in inputs:
            p = self.params[inp.index - self.offset]
            if not is_dtensor(p) or all(pl.is_replicate() for pl in p.placements):
                out.append((ns(ns_matrix(inp.x)), tuple(p.shape)))
                continue
            out.append((self._sharded(p, inp.x, ns, k), tuple(p.shape)))
            k += 1
        return out

    def _sharded(self, p, x: Any, ns, k: int) -> torch.Tensor:
        """Matrix ``p``'s Newton-Schulz result, rows and columns of this rank's block: every
        rank's block of ``x`` (in storage form, as bytes: gloo has no float8) goes to the owner,
        which assembles the whole ``x``, runs ``ns`` and sends each rank its block back."""
        import itertools

        import torch.distributed as dist
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        mesh = p.device_mesh
        if mesh.ndim == 1:
            pg = mesh.get_group()
        elif mesh.mesh.numel() == dist.get_world_size():
            pg = None  # a mesh over every process (FSDP2 + TP): the default group
        else:
            raise NotImplementedError(
                f"Muon: the param of shape {tuple(p.shape)} lives on a {tuple(mesh.shape)} mesh over "
                f"{mesh.mesh.numel()} of {dist.get_world_size()} processes; distributed Newton-Schulz takes 1-D "
                "meshes and meshes over all processes: give this param to a group with use_muon=False"
            )
        rows, cols = p.shape
        blocks = {}  # global rank -> (rows, cols, row offset, col offset) of its block
        for coord in itertools.product(*(range(n) for n in mesh.shape)):
            shape, off = _compute_local_shape_and_global_offset(p.shape, mesh.shape, list(coord), p.placements)
            blocks[int(mesh.mesh[coord])] = (shape[0], shape[1], off[0], off[1])
        group_rank = {g: (dist.get_group_rank(pg, g) if pg is not None else g) for g in blocks}
        world = len(blocks)
        me = dist.get_rank()
        owner = sorted(blocks, key=group_rank.get)[k % world]
        max_r, max_c = max(b[0] for b in blocks.values()), max(b[1] for b in blocks.values())
        if isinstance(x, QTensor):
            bits4 = lt.get_format(x.format).bits == 4
            bs = x.block_size
            parts = [(x.codes, (lambda c: (c + 1) // 2) if bits4 else (lambda c: c)), (x.scale, lambda c: -(-c // bs))]
        else:
            parts = [(x, lambda c: c)]
        gathered = []
        for t, width in parts:  # as bytes, padded to the largest block
            unit = t.element_size()
            b = t.contiguous().view(torch.uint8)
            pad = torch.zeros(max_r, width(max_c) * unit, dtype=torch.uint8, device=t.device)
            pad[: b.shape[0], : b.shape[1]] = b
            dst = [torch.empty_like(pad) for _ in range(world)] if me == owner else None
            dist.gather(pad, dst, dst=owner, group=pg)
            if me != owner:
                self.sent["gather"] += pad.numel()
            gathered.append((dst, width, unit))
        if me != owner:
            self.sent["gather_float32"] += max_r * max_c * 4
        chunks = None
        if me == owner:
            full = []
            for (dst, width, unit), (t, _) in zip(gathered, parts):
                out = torch.zeros(rows, width(cols) * unit, dtype=torch.uint8, device=t.device)
                for g, (nr, nc, r0, c0) in blocks.items():
                    w0, w = width(c0) * unit, width(nc) * unit
                    out[r0:r0 + nr, w0:w0 + w] = dst[group_rank[g]][:nr, :w]
                full.append(out.view(t.dtype))
            xf = QTensor._trusted(full[0], full[1], (rows, cols), x.block_size, x.format) \
                if isinstance(x, QTensor) else full[0]
            o = ns(ns_matrix(xf))
            chunks = [None] * world
            for g, (nr, nc, r0, c0) in blocks.items():
                piece = torch.zeros(max_r, max_c, dtype=o.dtype, device=o.device)
                piece[:nr, :nc] = o[r0:r0 + nr, c0:c0 + nc]
                chunks[group_rank[g]] = piece.view(torch.uint8)
                if g != owner:
                    self.sent["scatter"] += piece.numel() * piece.element_size()
        recv = torch.empty(max_r, max_c * 2, dtype=torch.uint8, device=p.to_local().device)
        dist.scatter(recv, chunks, src=owner, group=pg)
        nr, nc = blocks[me][0], blocks[me][1]
        return recv.view(torch.bfloat16)[:nr, :nc]


def muon_or_adamw(learning_rate, momentum, weight_decay, eps, b1, b2, adamw_eps, *, use_muon=True, nesterov=True,
                  ns_coefficients=DEFAULT_NS_COEFFICIENTS, ns_steps=5, adjust_lr_fn=None, state_format="8bit",
                  block_size=None, min_quant_size=4096, stochastic_round=False, orthogonalize=None):
    """A Muon group's transformation (:func:`lowbit_tree.muon`), or an AdamW group's
    (:func:`lowbit_tree.adamw` with ``betas`` and ``adamw_eps``)."""
    if use_muon:
        return alias.muon(learning_rate, momentum, weight_decay, nesterov, ns_coefficients, eps, ns_steps,
                          adjust_lr_fn, state_format=state_format, block_size=block_size,
                          min_quant_size=min_quant_size, orthogonalize=orthogonalize,
                          stochastic_round=stochastic_round)
    return alias.adamw(learning_rate, b1, b2, adamw_eps, weight_decay, state_format=state_format,
                       block_size=block_size, min_quant_size=min_quant_size, stochastic_round=stochastic_round)


ADAMW_FORMATS = {"nf4": "4bit"}
"""The state format of a Muon optimizer's AdamW groups (those without one of their own) where it
differs from the optimizer's. ``"nf4"`` (Muon4bit) gives them ``"4bit"`` (AdamW4bit's): Adam
divides its first moment by ``sqrt(v)``, so its small values count, and the normal-float map
has none below 0.08 of a block's absmax (the dynamic map of ``"4bit"`` goes to 0.0055). On the
convergence benchmark, against fp32 Muon: AdamW groups in ``"nf4"`` +6.7% (one seed), in
``"4bit"`` +5.29%, in 8 bits +4.30% (three seeds; README, "Convergence")."""


class Muon(_TorchOptimizer):
    """torch.optim.Muon (same signature, defaults and state name ``momentum_buffer``) with
    ``state_format`` momentum (default ``"fp32"``), under FSDP2 too.

    A param group with ``use_muon=False`` runs AdamW instead (embeddings, norms, biases, the
    head: what Muon is not for), with the group's ``lr`` and ``weight_decay``, ``betas`` and
    ``adamw_eps`` (defaults: the constructor's ``adamw_betas`` / ``adamw_eps``); its states are
    ``exp_avg`` / ``exp_avg_sq`` in the group's ``state_format`` (default: the optimizer's, or
    ``"4bit"`` for ``"nf4"``: :data:`ADAMW_FORMATS`). :func:`muon_param_groups` splits a model
    that way. Muon groups take 2-D params only (as torch).
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=DEFAULT_NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 adamw_betas=(0.9, 0.999), adamw_eps=1e-8, state_format=None, block_size=None,
                 min_quant_size=4096, bf16_stochastic_round=False, skip_nonfinite=False):
        self._ortho = ShardedNS()
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        use_muon=True, betas=tuple(adamw_betas), adamw_eps=adamw_eps,
                        state_format=self._state_format(state_format), block_size=block_size,
                        min_quant_size=min_quant_size, bf16_stochastic_round=bf16_stochastic_round,
                        skip_nonfinite=skip_nonfinite)
        super().__init__(params, muon_or_adamw, defaults, group_to_kwargs=self._kwargs)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, plus: an AdamW group (``use_muon=False``) without a ``state_format`` of its own
        takes :data:`ADAMW_FORMATS`'s format for the optimizer's, written into the group (so its
        ``param_groups``, state dict and ``state_report`` say it)."""
        if not param_group.get("use_muon", self.defaults["use_muon"]) and "state_format" not in param_group:
            fmt = ADAMW_FORMATS.get(self.defaults["state_format"])
            if fmt is not None:
                param_group = {**param_group, "state_format": fmt}
        super().add_param_group(param_group)

    def _kwargs(self, group: dict) -> dict:
        b1, b2 = group["betas"]
        return dict(learning_rate=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"],
                    eps=group["eps"], b1=b1, b2=b2, adamw_eps=group["adamw_eps"], use_muon=group["use_muon"],
                    nesterov=group["nesterov"], ns_coefficients=tuple(group["ns_coefficients"]),
                    ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"],
                    state_format=group["state_format"], block_size=group["block_size"],
                    min_quant_size=group["min_quant_size"], stochastic_round=group["bf16_stochastic_round"],
                    orthogonalize=self._ortho)

    def _check_group(self, owner, group):
        _in_range(owner, "lr", group["lr"], 0.0)
        _in_range(owner, "weight_decay", group["weight_decay"], 0.0)
        _in_range(owner, "momentum", group["momentum"], 0.0)
        _in_range(owner, "eps", group["eps"], 0.0)
        _in_range(owner, "adamw_eps", group["adamw_eps"], 0.0)
        _betas(owner, group["betas"])
        _flag(owner, "nesterov", group["nesterov"])
        _flag(owner, "use_muon", group["use_muon"])
        try:
            check_ns_args(group["ns_coefficients"], group["ns_steps"], group["adjust_lr_fn"])
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None
        if group["use_muon"]:
            for p in _group_params(group):
                if p.ndim != 2:
                    raise ValueError(
                        f"{owner} only supports 2D parameters whereas we found a parameter with size: {tuple(p.shape)}; "
                        "put embeddings, norms, biases and the head in a param group with use_muon=False (AdamW), "
                        "e.g. bridge.muon_param_groups(model)"
                    )

    def _step_group(self, group, params, offset):
        self._ortho.params, self._ortho.offset = params, offset
        super()._step_group(group, params, offset)

    def step(self, closure=None):
        self._ortho.reset()
        return super().step(closure)

    def communication(self) -> dict:
        """Bytes this rank sent for Newton-Schulz in the last step (:class:`ShardedNS`)."""
        return dict(self._ortho.sent)


class Muon8bit(Muon):
    """Muon with an 8-bit momentum (signed dynamic map)."""

    _default_format = "8bit"


class Muon4bit(Muon):
    """Muon with a 4-bit momentum: ``state_format="nf4"``, the normal-float map on blocks of 32
    (0.625 bytes a param); its AdamW groups are AdamW4bit's (``"4bit"``) unless they name a
    format (:data:`ADAMW_FORMATS`). It costs held-out loss: +5.3% against fp32 Muon on the
    convergence benchmark, +4.3% with the AdamW groups in ``"8bit"`` (Muon4bit before: +7.0%,
    ``state_format="4bit"``, the dynamic map on blocks of 128 for the momentum too; its old
    state dicts say so and load into ``bridge.Muon(state_format="4bit")``); Muon8bit: +0.74%.
    README, "Convergence"; design.md, "Muon"."""

    _default_format = "nf4"


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
