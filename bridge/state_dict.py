"""Loading and exporting ``LowBitOptimizer`` state dicts.

Kept apart from the optimizer because it is where every kind of foreign input
arrives: our own state dicts (any device, any FSDP world size: codes and scales
are row-sharded, so loading is slicing rows), plain torch.optim state dicts
(migration: fp32 moments are quantized into this optimizer's formats), and
mismatches, which must fail loudly, naming what differs, before anything is
changed.
"""
from __future__ import annotations

import os
from typing import Any

import torch

import lowbit_tree as lt

from .distributed import is_dtensor, local_row_range, to_local, wrap_like
from .qstate import QState

STATE_SUFFIXES = ("::codes", "::scale", "::row_max", "::col_max")


def _rows(t: torch.Tensor, p: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's rows of a saved tensor: the local shard of a DTensor, or rows
    ``[a, b)`` of a full (unsharded) tensor for a sharded param."""
    if is_dtensor(t):
        return t.to_local()
    if is_dtensor(p):
        a, b = local_row_range(p)
        if t.shape[0] != p.shape[0]:
            raise ValueError(f"{what}: a full tensor with {t.shape[0]} rows cannot be sharded like a param with {p.shape[0]} rows")
        return t[a:b]
    return t


def _check_groups(opt, saved_groups: list[dict], migrating: bool) -> None:
    from .optimizer import STATE_DICT_VERSION, STATIC_KEYS, VERSION_KEY

    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has {len(opt.param_groups)}"
        )
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {gi}: loaded state dict has {len(saved['params'])} params, this optimizer has {len(group['params'])}"
            )
        if migrating:
            continue
        version = saved.get(VERSION_KEY)
        if version != STATE_DICT_VERSION:
            raise ValueError(
                f"param group {gi}: state dict format version {version!r}, this lowbit-tree reads version "
                f"{STATE_DICT_VERSION}; load it with the lowbit-tree release that wrote it and export it with "
                "torch_state_dict(), which any version can load"
            )
        for key in STATIC_KEYS:
            if key in group and saved.get(key) != group.get(key):
                raise ValueError(
                    f"param group {gi}: the state dict has {key}={saved.get(key)!r} but this optimizer has "
                    f"{key}={group.get(key)!r}; build the optimizer with {key}={saved.get(key)!r}, or convert: "
                    "load it into a matching optimizer, then new_opt.load_state_dict(old_opt.torch_state_dict()) "
                    "re-quantizes its fp32 export"
                )


def _is_ours(state_dict: dict) -> bool:
    from .optimizer import VERSION_KEY

    if any(VERSION_KEY in g for g in state_dict.get("param_groups", [])):
        return True
    return any(k.endswith(STATE_SUFFIXES) for st in state_dict.get("state", {}).values() for k in st)


def load_into(opt, state_dict: dict) -> None:
    from .optimizer import VERSION_KEY, _Rank1Holder

    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("not an optimizer state dict: expected a dict with 'state' and 'param_groups'")
    migrating = not _is_ours(state_dict)
    _check_groups(opt, state_dict["param_groups"], migrating)

    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}

    # Build every new state first: nothing changes unless all of it loads.
    new_states = {}
    for sid, p in zip(saved_ids, params):
        saved = state_dict["state"].get(sid)
        if saved is None:
            continue
        group = group_of[id(p)]
        where = f"param {sid} (shape {tuple(p.shape)})"
        fresh = opt._init_state(p, group)  # the expected layout, on the param's device
        st: dict[str, Any] = {}
        for name, expected in fresh.items():
            exp_local = to_local(expected)
            if name == "step":
                if "step" not in saved:
                    raise ValueError(f"{where}: the state dict has no 'step'")
                step = saved["step"]
                step = step.to_local() if is_dtensor(step) else step
                st["step"] = torch.as_tensor(step, dtype=torch.float32, device=exp_local.device).detach().clone().reshape(())
                _check_step(st["step"], where)
                continue
            if isinstance(exp_local, QState):
                st[name] = _load_quantized(saved, name, p, exp_local, expected, where, migrating)
            elif isinstance(exp_local, _Rank1Holder):
                st[name] = _load_rank1(saved, name, exp_local, where)
            else:
                if name not in saved:
                    raise ValueError(f"{where}: the state dict has no {name!r} (has {sorted(saved)})")
                value = _rows(saved[name], p, f"{where} {name}") if exp_local.shape == to_local(p).shape and p.ndim else saved[name]
                value = to_local(value)
                if tuple(value.shape) != tuple(exp_local.shape):
                    raise ValueError(f"{where}: {name!r} has shape {tuple(value.shape)}, expected {tuple(exp_local.shape)}")
                if value.is_floating_point() is False:
                    raise ValueError(f"{where}: {name!r} has dtype {value.dtype}, expected a float tensor")
                local = value.detach().to(device=exp_local.device, dtype=exp_local.dtype).clone()
                st[name] = wrap_like(local, p) if is_dtensor(expected) else local
        known = set(fresh) | {f"{n}{s}" for n in fresh for s in STATE_SUFFIXES}
        unknown = sorted(k for k in saved if k not in known)
        if unknown and not migrating:
            raise ValueError(f"{where}: unexpected state entries {unknown}; expected {sorted(fresh)}")
        new_states[id(p)] = (p, st)

    # torch restores the groups (hyperparameters from the state dict, as torch.optim does)
    groups = []
    for saved, group in zip(state_dict["param_groups"], opt.param_groups):
        g = {k: v for k, v in saved.items() if k != VERSION_KEY}
        if migrating:  # a torch.optim dict has none of our static keys: keep ours
            for k, v in group.items():
                if k != "params" and k not in g:
                    g[k] = v
        groups.append(g)
    torch.optim.Optimizer.load_state_dict(opt, {"state": {}, "param_groups": groups})
    for p, st in new_states.values():
        opt.state[p] = st


def _check_scales(scale: torch.Tensor, what: str) -> None:
    """A block scale is absmax / divisor: >= 0 and finite, or NaN for a poisoned block. Anything
    else (negative, infinite) can only come from a corrupted file."""
    bad = ~(torch.isnan(scale) | (torch.isfinite(scale) & (scale >= 0)))
    if bool(bad.any()):
        first = scale[bad][0].item()
        raise ValueError(f"{what} holds {int(bad.sum())} invalid block scales (e.g. {first}); scales are >= 0, "
                         "or NaN for a non-finite block: the checkpoint is corrupted")


def _check_step(step: torch.Tensor, where: str) -> None:
    v = step.item()
    if not (v >= 0 and v == int(v) and v < 2**24):  # NaN fails every comparison
        raise ValueError(f"{where}: 'step' is {v}, expected a whole number of steps >= 0: the checkpoint is corrupted")


def read_state_dict(path: str, map_location=None) -> dict:
    """``torch.load(path, weights_only=True)`` of a saved optimizer state dict, with a clear error
    naming the file when it is truncated, corrupted or not a state dict (torch's own errors
    range from "negative seek value" to unpickling messages)."""
    try:
        sd = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the file named, cause chained
        size = os.path.getsize(path) if os.path.exists(path) else 0
        raise ValueError(f"{path} ({size} bytes) is not a readable torch.save file: it is truncated or corrupted "
                         f"({type(e).__name__}: {e})") from e
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError(f"{path} holds a {type(sd).__name__}, not an optimizer state dict ('state', 'param_groups')")
    return sd


def _load_quantized(saved, name, p, exp_local: QState, expected, where, migrating):
    codes_key, scale_key = f"{name}::codes", f"{name}::scale"
    if codes_key in saved:
        if scale_key not in saved:
            raise ValueError(f"{where}: {codes_key!r} without {scale_key!r}")
        codes = to_local(_rows(saved[codes_key], p, f"{where} {codes_key}"))
        scale = to_local(_rows(saved[scale_key], p, f"{where} {scale_key}"))
        want_codes = exp_local.codes.view(torch.uint8) if exp_local.is_float8 else exp_local.codes
        if codes.dtype != torch.uint8:
            raise ValueError(f"{where}: {codes_key!r} has dtype {codes.dtype}, expected torch.uint8")
        if tuple(codes.shape) != tuple(want_codes.shape) or tuple(scale.shape) != tuple(exp_local.scale.shape):
            raise ValueError(
                f"{where}: {name!r} codes {tuple(codes.shape)} / scale {tuple(scale.shape)} do not match this "
                f"optimizer's {exp_local.format!r} state with block size {exp_local.block_size} (codes "
                f"{tuple(want_codes.shape)} / scale {tuple(exp_local.scale.shape)}): the state dict was written "
                "with another state format, block size or parameter shape"
            )
        if scale.dtype != torch.float32:
            raise ValueError(f"{where}: {scale_key!r} has dtype {scale.dtype}, expected torch.float32")
        _check_scales(scale, f"{where}: {scale_key!r}")
        exp_local.codes.view(torch.uint8).copy_(codes)
        exp_local.scale.copy_(scale)
        return expected
    if name in saved:  # a float state (torch.optim, or an fp32 export): quantize it
        value = to_local(_rows(saved[name], p, f"{where} {name}"))
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ValueError(f"{where}: {name!r} is not a float tensor")
        if tuple(value.shape) != tuple(exp_local.shape):
            raise ValueError(f"{where}: {name!r} has shape {tuple(value.shape)}, expected {tuple(exp_local.shape)}")
        q = lt.quantize(value.detach().to(exp_local.codes.device, torch.float32), exp_local.format, exp_local.block_size)
        exp_local.set_(q)
        return expected
    raise ValueError(f"{where}: the state dict has no {name!r} (has {sorted(saved)})")


def _load_rank1(saved, name, holder, where):
    from lowbit_tree.moments import rank1_quantize

    keys = [f"{name}::codes", f"{name}::row_max", f"{name}::col_max"]
    if all(k in saved for k in keys):
        r = holder.record
        new = type(r)(*[saved[k].to(t.device) for k, t in zip(keys, (r.codes, r.row_max, r.col_max))], r.shape, r.format)
        for a, b in zip((new.codes, new.row_max, new.col_max), (r.codes, r.row_max, r.col_max)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"{where}: {name!r} rank-1 record does not match ({tuple(a.shape)} vs {tuple(b.shape)})")
        holder.record = new
        return holder
    if name in saved:
        holder.record = rank1_quantize(saved[name].float().to(holder.record.codes.device))
        return holder
    raise ValueError(f"{where}: the state dict has no {name!r}")


def export_torch(opt) -> dict:
    from .optimizer import STATIC_KEYS, _Rank1Holder

    sd = torch.optim.Optimizer.state_dict(opt)
    state = {}
    for idx, st in sd["state"].items():
        out = {}
        for name, v in st.items():
            local = to_local(v)
            if isinstance(local, QState):
                deq = local.dequantize()
                out[name] = wrap_like(deq, v) if is_dtensor(v) else deq
            elif isinstance(local, _Rank1Holder):
                from lowbit_tree.moments import rank1_dequantize

                out[name] = rank1_dequantize(local.record)
            else:
                out[name] = v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        state[idx] = out
    groups = [{k: v for k, v in g.items() if k not in STATIC_KEYS and k != "skip_nonfinite"} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}
