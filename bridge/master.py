"""Float32 master weights of an optimizer whose bfloat16 / float16 params carry a correction.

With ``param_correction=True`` a param's float32 master value is the param plus its int8
``"param_correction"`` state (:mod:`lowbit_tree.correction`). :func:`master_params` reads
them (to export float32 weights, or to evaluate at full precision); :func:`load_master_params`
sets params and corrections from float32 values (to start or resume low-precision training
from a float32 checkpoint without losing its low bits).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from lowbit_tree.correction import CORRECTED_DTYPES, master_value, split_master

from .distributed import is_dtensor, to_local, wrap_like

__all__ = ["master_params", "load_master_params"]

NAME = "param_correction"


def _params(opt) -> list:
    return [p for group in opt.param_groups for p in group["params"]]


def master_params(opt) -> list[torch.Tensor]:
    """The float32 master value of each of ``opt``'s params, in ``param_groups`` order: the
    param plus its correction where it has one, else the param as float32. Under FSDP2 / tensor
    parallel each is a DTensor placed like its param (``full_tensor()`` gathers it)."""
    out = []
    for p in _params(opt):
        c = opt.state.get(p, {}).get(NAME)
        local = to_local(p).detach()
        value = local.float() if c is None else master_value(local, to_local(c))
        out.append(wrap_like(value, p) if is_dtensor(p) else value)
    return out


def _mapped_pairs(params: list, values: Mapping, strict: bool) -> list:
    """``(param, value)`` for a mapping keyed by params; refuses other keys (a model's state
    dict is keyed by names) and, when ``strict``, a mapping that leaves a param out."""
    ids = {id(p) for p in params}
    for k in values:
        if not isinstance(k, torch.Tensor) or id(k) not in ids:
            what = f"the key {k!r}" if not isinstance(k, torch.Tensor) else f"a tensor of shape {tuple(k.shape)}"
            raise ValueError(f"load_master_params: {what} is not a param of the optimizer; a mapping is keyed by the "
                             "params themselves: for a model's state dict pass "
                             "{p: sd[name] for name, p in model.named_parameters()}")
    pairs = [(p, values[p]) for p in params if p in values]
    if strict and len(pairs) != len(params):
        raise ValueError(f"load_master_params: the mapping has values for {len(pairs)} of the optimizer's "
                         f"{len(params)} params; pass strict=False to set only those")
    return pairs


def load_master_params(opt, values: Iterable[torch.Tensor] | Mapping[torch.Tensor, torch.Tensor], *,
                       strict: bool = True) -> None:
    """Set each param of ``opt`` from a float32 master value: the param becomes the value
    rounded to nearest in its dtype and, for a param with ``param_correction=True``, its
    correction the rest (the param's state is created if it has none yet; its other states are
    left as they are). ``values``: one tensor per param in ``param_groups`` order, or a mapping
    ``{param: value}`` (every param, unless ``strict=False``); a value has the param's (global)
    shape, and under FSDP2 / tensor parallel is a DTensor placed like its param."""
    params = _params(opt)
    if isinstance(values, Mapping):
        pairs = _mapped_pairs(params, values, strict)
    else:
        values = list(values)
        if len(values) != len(params):
            raise ValueError(f"load_master_params: {len(values)} values for {len(params)} params")
        pairs = list(zip(params, values))
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    for p, v in pairs:
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"load_master_params: a value of shape {tuple(v.shape)} for a param of shape "
                             f"{tuple(p.shape)}")
        if is_dtensor(p) != is_dtensor(v) or (is_dtensor(p) and tuple(v.placements) != tuple(p.placements)):
            raise ValueError("load_master_params: under FSDP2 / tensor parallel a value is a DTensor placed like its "
                             "param (e.g. distribute_tensor(value, p.device_mesh, p.placements))")
        group = groups[id(p)]
        local, x = to_local(p), to_local(v).detach().to(device=to_local(p).device, dtype=torch.float32)
        if group.get(NAME) and local.dtype in CORRECTED_DTYPES:
            st = opt.state[p]
            if len(st) == 0:
                st.update(opt.param_states.create(p, group))
            new_p, new_c = split_master(x, local.dtype)
            to_local(st[NAME]).copy_(new_c)
        else:
            new_p = x.to(local.dtype)
        with torch.no_grad():
            local.copy_(new_p)
