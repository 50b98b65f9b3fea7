"""Saving, loading and exporting ``LowBitOptimizer`` state dicts.

Kept apart from the optimizer because it is where every kind of foreign input
arrives: our own state dicts (any device, any FSDP world size: codes and scales
are row-sharded, so loading is slicing rows), plain torch.optim state dicts
(migration: fp32 moments are quantized into this optimizer's formats), and
mismatches, which must fail loudly, naming what differs, before anything is
changed.

Layout (version 3): torch.optim's, state names included. A record state ``name`` is a
nested dict of its parts as :mod:`lowbit_tree.records` declares them (``{"codes": uint8
(fp8 codes as their bit pattern), "scale": float32}``, a rank-1 record ``{"codes", "row_max",
"col_max"}``, a low-rank momentum (Muon's ``momentum_rank``) ``{"codes", "scale", "row_factor",
"col_factor"}``); under FSDP2 and tensor parallel each is a DTensor of the whole param's part,
placed like the param's rows and columns. Clients that look states up by the live
names of ``optim.state[p]`` (torch's ``flatten_optimizer_state_dict``, which
writes ``state.<fqn>.exp_avg.codes`` and rebuilds the nested dict from that
prefix; torchtitan's ``OptimizersContainer``) find them. Version 1 wrote the
same tensors as ``name::codes`` / ``name::scale``; it still loads.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

import lowbit_tree as lt
from lowbit_tree import QTensor, records
from lowbit_tree.moments import FORMAT_ARGUMENTS
from lowbit_tree.rules import RULE_DEFS, VARIANT_FLAGS

from .distributed import is_dtensor, part_dtensor, part_local, to_local, wrap_like
from .qstate import QState

STATE_DICT_VERSION = 3
"""Version of the layout ``state_dict()`` writes; ``load_state_dict`` checks it. Version 3: a
group without ``rank1_normalization`` has its format's default (rank-1 for ``"4bit"``); in
versions 1 and 2 it meant ``False`` (block-normalized, the 4-bit default then)."""

VERSION_KEY = "lowbit_tree_version"

RANK1_KEY = "rank1_normalization"
RANK_KEY = "momentum_rank"
# group keys that shape the state: fixed per param, compared on load (RANK1_KEY: _rank1_on_load;
# RANK_KEY: a group saved without it, written before it existed, had none: _load_lowrank). The
# flags that choose a rule's variant are the declaration's (lowbit_tree.rules.VARIANT_FLAGS).
# SOAP_KEYS: SOAP's options that decide which per-dimension states exist and how they are stored
SOAP_KEYS = ("precond_format", "max_precond_dim", "precondition_1d", "merge_dims")
STATIC_KEYS = ("state_format", "block_size", "min_quant_size", *VARIANT_FLAGS, "bf16_stochastic_round",
               RANK1_KEY, RANK_KEY, *SOAP_KEYS)

HAS_MOMENTUM = "has_momentum"  # the variant flag that is ours: torch.optim's groups say it by their momentum
CORRECTION = "param_correction"  # a bfloat16 / float16 param's state (and its group's option): its master's low bits
# the static keys torch.optim's groups have too: an export keeps them
TORCH_GROUP_KEYS = tuple(f for f in VARIANT_FLAGS if f != HAS_MOMENTUM)

STATE_SUFFIXES = ("::codes", "::scale", "::row_max", "::col_max")  # version 1
READABLE_VERSIONS = (1, 2, 3)
NEW_IN_VERSION_2 = ("foreach", "maximize", "capturable", "differentiable", "fused")  # group keys


def save_state_dict(opt) -> dict:
    """``opt.state_dict()``: torch.optim's layout and state names; each quantized state is a
    nested dict of plain tensors (see the module docstring), row-sharded DTensors under
    FSDP2 (views of the live storage, so ``dcp.load`` writes in place). Groups carry the
    format version."""

    params = [p for g in opt.param_groups for p in g["params"]]
    if opt.param_states.whole_steps and any(is_dtensor(p) for p in params):
        # every param's states, zeros for one not stepped yet (the core's init): the template a
        # fresh optimizer's state dict offers torch.distributed.checkpoint to load into
        for g in opt.param_groups:
            for p in g["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p].update(opt.param_states.create(p, g))
    sd = torch.optim.Optimizer.state_dict(opt)
    for group in sd["param_groups"]:
        group[VERSION_KEY] = STATE_DICT_VERSION
    new_state = {}
    ids = {i for g in sd["param_groups"] for i in g["params"]}
    for idx, st in sd["state"].items():
        if idx not in ids:  # a key that is not a param's (a pre-hook's): passed through, as torch does
            new_state[idx] = st
            continue
        p = params[idx]
        out = {}
        for name, v in st.items():
            local = to_local(v)
            out[name] = saved_parts(local, v if is_dtensor(v) else p) if isinstance(local, QState) else v
        new_state[idx] = out
    sd["state"] = new_state
    return sd


def _as_saved(t: torch.Tensor) -> torch.Tensor:
    """A record part as state dicts hold it: float8 codes as their bit pattern (uint8), a view."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def saved_parts(q: QState, p: torch.Tensor) -> dict:
    """A record state's state-dict form: its parts (float8 codes as their bits), each a DTensor
    of the whole state's part shape laid out as its kind declares (placed like the state, or
    per row / per column of it) under sharding, else the plain local tensors. Views of the live
    storage, so ``dcp.load`` writes in place. ``p``: the DTensor state (placed like its param, or
    a per-dimension factor's own placements), or the plain param."""
    kind, meta = q.kind, q.meta
    out = {}
    for part in kind.parts:
        t = _as_saved(getattr(q, part.name))
        out[part.name] = part_dtensor(t, p, part.along, kind.whole_part_shape(part, tuple(p.shape), meta, t))
    return out


def as_version_1(state_dict: dict) -> dict:
    """A version-2 state dict re-keyed the way version 1 saved it (``name::codes``, ...), holding
    the same tensor objects: the target for ``dcp.load`` of a DCP checkpoint written by
    version 1. The tensors are the live storage (or views of it), so ``dcp.load`` fills them in
    place, and ``set_optimizer_state_dict`` / ``load_state_dict`` of the result loads it::

        osd = as_version_1(get_optimizer_state_dict(model, opt))
        dcp.load({"optim": osd}, checkpoint_id=old_checkpoint)
        set_optimizer_state_dict(model, opt, osd)

    Takes the nested layout (``{"state": ..., "param_groups": ...}``) or torch's flattened one
    (``state.<fqn>.<name>.codes`` keys). Group keys version 1 did not write (torch.optim's
    ``foreach``, ``fused``, ... arguments, and ``rank1_normalization=False``: its default then)
    are left out, so that DCP does not look for them; loading keeps this optimizer's values for
    them."""
    if "state" in state_dict and "param_groups" in state_dict:
        state = {}
        for pid, st in state_dict["state"].items():
            state[pid] = {}
            for name, v in st.items():
                if isinstance(v, dict):
                    state[pid].update({f"{name}::{part}": t for part, t in v.items()})
                else:
                    state[pid][name] = v
        groups = [{k: v for k, v in g.items() if k not in NEW_IN_VERSION_2 and not _false_rank1(k, v)}
                  for g in state_dict["param_groups"]]
        return {"state": state, "param_groups": groups}
    out = {}
    for key, v in state_dict.items():
        head, _, part = key.rpartition(".")
        if key.startswith("param_groups.") and (part in NEW_IN_VERSION_2 or _false_rank1(part, v)):
            continue
        out[f"{head}::{part}" if key.startswith("state.") and f"::{part}" in STATE_SUFFIXES else key] = v
    return out


def _false_rank1(key: str, value) -> bool:
    """``rank1_normalization=False``, which version 1 never wrote (it was the default)."""
    return key == RANK1_KEY and value is False


def _saved_version(saved_group: dict, state_dict: dict):
    """The group's format version. torch's ``flatten_optimizer_state_dict`` rebuilds
    param groups from the live groups' keys and so drops ours; nested state dicts are
    written by versions 2 and 3 (taken as 3: the two differ only in what a missing
    ``rank1_normalization`` means, and :func:`_saved_rank1` reads that off the records),
    ``::`` keys by version 1 only."""

    if VERSION_KEY in saved_group:
        return saved_group[VERSION_KEY]
    states = [st for st in state_dict.get("state", {}).values() if isinstance(st, dict)]
    if any(isinstance(v, dict) for st in states for v in st.values()):
        return STATE_DICT_VERSION
    if any(isinstance(k, str) and k.endswith(STATE_SUFFIXES) for st in states for k in st):
        return 1
    return None


def _rows(t: torch.Tensor, p: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's part of a saved tensor: the local shard of a DTensor, or, for a sharded
    param, the part of a full (unsharded) tensor that the param's placements give this rank
    (``distribute_tensor`` without communication: every rank holds the full tensor). Codes
    and scales are placed like their param: their rows are its rows and, under tensor
    parallel, their columns are whole blocks of its columns (see ``shard_block_size``)."""
    if is_dtensor(t):
        return t.to_local()
    if is_dtensor(p):
        if t.ndim == 0 or t.shape[0] != p.shape[0]:
            raise ValueError(f"{what}: a full tensor of shape {tuple(t.shape)} cannot be sharded like a param with "
                             f"{p.shape[0]} rows")
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None).to_local()
    return t


def check_groups(opt, saved_groups: list[dict], migrating: bool, state_dict: dict) -> dict:
    """Checks the saved groups against this optimizer's; returns ``{group index: rank-1 choice}``
    for the groups that take the saved one (:func:`_rank1_on_load`). :mod:`bridge.dcp` runs it
    before a distributed load, so a mismatch is named before any tensor is read."""
    adopted: dict = {}
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
            _check_torch_settings(gi, saved, group)
            continue
        version = _saved_version(saved, state_dict)
        if version not in READABLE_VERSIONS:
            raise ValueError(
                f"param group {gi}: state dict format version {version!r}, this lowbit-tree reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))} (writes {STATE_DICT_VERSION}); load it with the "
                "lowbit-tree release that wrote it and export it with torch_state_dict(), which any version can load"
            )
        for key in STATIC_KEYS:
            if key == RANK1_KEY:
                continue
            if key == "state_format" and key in group:
                _check_formats(opt, gi, saved, group)
                continue
            value, mine = saved.get(key), group.get(key)
            if key == RANK_KEY and key not in saved:
                continue  # written before momentum_rank: its buffers have no factors (_load_lowrank)
            if key in group and value != mine:
                raise ValueError(_static_mismatch(gi, key, value, mine))
        if _takes_rank1(opt):
            value = _rank1_on_load(gi, saved, group, version, state_dict)
            if value is not None:
                adopted[gi] = value
    return adopted


def _static_mismatch(gi: int, key: str, value, mine, detail: str = "") -> str:
    build = f"{key}={value!r}"
    if key == HAS_MOMENTUM:  # not an argument: the group's momentum decides it
        detail += " (whether a momentum other than 0 keeps a 'momentum_buffer')"
        build = "a momentum other than 0" if value else "momentum=0"
    return (f"param group {gi}: the state dict has {key}={value!r} but this optimizer has "
            f"{key}={mine!r}{detail}; build the optimizer with {build}, or convert: "
            "load it into a matching optimizer, then new_opt.load_state_dict(old_opt.torch_state_dict()) "
            "re-quantizes its fp32 export")


def _state_settings(group: dict) -> dict:
    """The settings of a group, ours or torch.optim's, that decide which states its params keep
    and how its rule reads them, ``{name: value}`` for those it has: the variant flags torch's
    groups have too (``amsgrad``: a ``max_exp_avg_sq``; ``centered``: a ``grad_avg``;
    ``nesterov``), and whether ``momentum`` keeps a ``momentum_buffer`` (torch.optim.SGD and
    RMSprop: ``momentum != 0``; ours: ``has_momentum``, fixed when the group was made)."""
    out = {k: bool(group[k]) for k in TORCH_GROUP_KEYS if k in group}
    if HAS_MOMENTUM in group:
        out["momentum"] = bool(group[HAS_MOMENTUM])
    elif "momentum" in group:
        out["momentum"] = float(group["momentum"]) != 0
    return out


SETTING_EFFECTS = {
    **{s.when: f"{s.when} keeps a {s.name!r} per param" for d in RULE_DEFS.values() for s in d.states
       if s.when in TORCH_GROUP_KEYS},
    "momentum": "a momentum other than 0 keeps a 'momentum_buffer' per param",
    "nesterov": "nesterov changes how the momentum buffer is applied",
}


def _check_torch_settings(gi: int, saved: dict, group: dict) -> None:
    """A torch.optim-layout group (torch.optim's own, or ``torch_state_dict()``) against this
    group, setting by setting (:func:`_state_settings`): loading one into the other would drop a
    state the dict holds, or lack one the rule reads (torch restores the group's values)."""
    theirs, mine = _state_settings(saved), _state_settings(group)
    for key in theirs:
        if key in mine and theirs[key] != mine[key]:
            raise ValueError(
                f"param group {gi}: the state dict has {key}={saved.get(key)!r} but this optimizer has "
                f"{key}={group.get(key)!r} ({SETTING_EFFECTS[key]}): loading it would change which states the "
                f"group keeps; build the optimizer with {key}={saved.get(key)!r}, as the run that wrote it")


FORMAT_KEYS = ("state_format",) + tuple(FORMAT_ARGUMENTS.values())  # the group keys that say states' formats


def _check_formats(opt, gi: int, saved: dict, group: dict) -> None:
    """The saved group's state formats against this group's, state by state, as this optimizer
    reads both (``opt.state_formats``), for the states the group keeps (``opt.param_states.kept_states``): a
    mapping that gives every kept state the format a name gives matches that name; a kept state in
    another format is refused, naming it. An optimizer that cannot say its states (a plain
    ``LowBitOptimizer``) compares the values as they are."""
    theirs_group = {k: v for k, v in group.items() if k not in FORMAT_KEYS}
    theirs_group.update({k: saved[k] for k in FORMAT_KEYS if k in saved})
    value, mine = saved.get("state_format"), group["state_format"]
    mine_formats = opt.state_formats(group)
    if mine_formats is None:
        if value != mine:
            raise ValueError(_static_mismatch(gi, "state_format", value, mine))
        return
    try:
        theirs = opt.state_formats(theirs_group) if "state_format" in saved else None
    except ValueError as e:
        raise ValueError(_static_mismatch(gi, "state_format", value, mine, f" ({e})")) from None
    if theirs == mine_formats:
        return
    if theirs is None:
        raise ValueError(_static_mismatch(gi, "state_format", value, mine))
    kept = opt.param_states.kept_states(group)
    differ = [n for n in mine_formats if n in kept and theirs[n] != mine_formats[n]]
    if not differ:
        return
    name = differ[0]
    key = FORMAT_ARGUMENTS.get(name, "state_format") if value == mine else "state_format"  # (that argument differs)
    detail = f" (the state dict keeps {name!r} in {theirs[name]!r}, this optimizer in {mine_formats[name]!r})"
    raise ValueError(_static_mismatch(gi, key, saved.get(key), group.get(key), detail))


def _takes_rank1(opt) -> bool:
    return opt.factory_takes(RANK1_KEY)


def _saved_rank1(saved: dict, state_dict: dict, version):
    """The saved group's rank-1 choice: its key; else what its second-moment records are
    (a flattened round trip drops group keys torch.optim does not know); else, with no record
    to say, ``False`` for versions 1 and 2 (block-normalized 4-bit was the default then) and
    ``None`` (the format's default) for version 3."""
    if RANK1_KEY in saved:
        return saved[RANK1_KEY]
    for i in saved["params"]:
        st = state_dict["state"].get(i)
        for k, v in (st.items() if isinstance(st, dict) else ()):
            name, _, part = str(k).partition("::")  # version 1: "exp_avg_sq::row_max"
            parts = set(v) if isinstance(v, dict) else {part}
            if "row_max" in parts:
                return True
            if name in ("exp_avg_sq", "max_exp_avg_sq") and "scale" in parts:
                return False
    return False if version in (1, 2) else None


def _rank1_on_load(gi: int, saved: dict, group: dict, version, state_dict: dict):
    """The saved group's rank-1 choice against this group's: ``None`` if they agree; the saved
    value if this group has the format's default (no key, or ``None``: the checkpoint's layout is
    kept, as torch.optim restores a group's hyperparameters; the group then says so); a
    ValueError if this group chose otherwise explicitly."""
    from lowbit_tree.moments import STATE_FORMAT_NAMES, resolve_rank1

    fmt = _second_moment_format(saved.get("state_format", group.get("state_format")))
    if fmt not in STATE_FORMAT_NAMES:
        return None  # the format check names it
    value = resolve_rank1(_saved_rank1(saved, state_dict, version), fmt)
    mine = group.get(RANK1_KEY)
    if value == resolve_rank1(mine, _second_moment_format(group.get("state_format", fmt))):
        return None
    if mine is not None:
        raise ValueError(_static_mismatch(gi, RANK1_KEY, value, mine))
    return value


def _second_moment_format(state_format):
    """The format ``exp_avg_sq`` is kept in, whose rank-1 choice ``rank1_normalization`` is."""
    return state_format.get("exp_avg_sq") if isinstance(state_format, Mapping) else state_format


def _is_ours(state_dict: dict) -> bool:

    if any(VERSION_KEY in g for g in state_dict.get("param_groups", [])):
        return True
    states = [st for st in state_dict.get("state", {}).values() if isinstance(st, dict)]
    return any(isinstance(v, dict) or (isinstance(k, str) and k.endswith(STATE_SUFFIXES))
               for st in states for k, v in st.items())


def load_into(opt, state_dict: dict) -> None:
    """``opt.load_state_dict``: checks the groups, builds every param's new state (nothing
    changes unless all of it loads), then lets torch restore the groups (hyperparameters from the
    state dict, as torch.optim does; the settings that decide the states stay this optimizer's)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("not an optimizer state dict: expected a dict with 'state' and 'param_groups'")
    migrating = not _is_ours(state_dict)
    adopted = check_groups(opt, state_dict["param_groups"], migrating, state_dict)
    # the groups as they will be: a group on its format's default takes the saved rank-1 choice
    as_loaded = [dict(g, **{RANK1_KEY: adopted[gi]}) if gi in adopted else g for gi, g in enumerate(opt.param_groups)]

    # Build every new state first: nothing changes unless all of it loads.
    new_states = {}
    for gi, (saved_group, group) in enumerate(zip(state_dict["param_groups"], as_loaded)):
        for sid, p in zip(saved_group["params"], group["params"]):
            saved = state_dict["state"].get(sid)
            if saved is not None:
                st = _loaded_state(opt, saved, p, group, migrating, gi, sid)
            elif not saved_group.get(CORRECTION):
                st = _fresh_keeping_correction(opt, p, group)
            else:  # a run with corrections held no state for it: its correction was zero
                st = None
            if st is not None:
                new_states[id(p)] = (p, st)
    ids = {i for g in state_dict["param_groups"] for i in g["params"]}
    passed = {k: v for k, v in state_dict["state"].items() if k not in ids}  # keys not of params: as torch

    groups = [_restored_group(saved, group, migrating) for saved, group in zip(state_dict["param_groups"], as_loaded)]
    check = getattr(opt, "_check_group", None)  # the named classes' checks of a group's values
    for gi, (g, group) in enumerate(zip(groups, as_loaded)):
        if check is not None:  # (the saved group names its params by index: the live ones are checked)
            check(f"{type(opt).__name__}.load_state_dict, param group {gi}", dict(g, params=group["params"]))
    torch.optim.Optimizer.load_state_dict(opt, {"state": {}, "param_groups": groups})
    for p, st in new_states.values():
        opt.state[p] = st
    for k, v in passed.items():
        opt.state[k] = v


def _restored_group(saved: dict, group: dict, migrating: bool) -> dict:
    """The group as torch restores it: the saved hyperparameters; keys the saved group lacks (a
    torch.optim dict has none of our static keys; an older dict lacks keys added since) keep
    this optimizer's values, and so do its state formats (the same, checked: its spelling) and
    ``param_correction`` (whether its params keep a correction: the states were built so)."""
    g = {k: v for k, v in saved.items() if k not in (VERSION_KEY, CORRECTION)}
    for k, v in group.items():
        if k != "params" and k not in g:
            g[k] = v
    if not migrating and "state_format" in group:
        g["state_format"] = group["state_format"]
    return g


def _loaded_state(opt, saved: dict, p, group: dict, migrating: bool, gi: int, sid) -> dict:
    """Param ``p``'s new state from its saved one, in the layout ``group`` keeps (``opt.param_states.create``),
    every state validated. A correction the dict does not hold (written on float32 params, or by
    torch.optim) is left as it is (:func:`_live_correction`); a saved state this optimizer would
    not keep is refused, never dropped."""
    where = f"param {sid} (shape {tuple(p.shape)})"
    fresh = opt.param_states.create(p, group)  # the expected layout, on the param's device
    if saved.get(CORRECTION) is not None and CORRECTION not in fresh:
        raise ValueError(_dropped_correction(gi, sid, p, group))
    st: dict[str, Any] = {}
    for name, expected in fresh.items():
        exp_local = to_local(expected)
        if name == "step":
            st["step"] = _loaded_step(saved, exp_local, migrating, where)
        elif name == CORRECTION and name not in saved:
            st[name] = _live_correction(opt, p, expected)
        elif isinstance(exp_local, QState):
            st[name] = _load_record(opt, saved, name, p, exp_local, expected, where)
        else:
            st[name] = _load_plain(saved, name, p, exp_local, expected, where, f"param {sid}'s {name}")
    known = set(fresh) | {f"{n}{s}" for n in fresh for s in STATE_SUFFIXES}
    unknown = sorted(k for k in saved if k not in known and not (migrating and saved[k] is None))
    if unknown:
        raise ValueError(f"{where}: unexpected state entries {unknown}; expected {sorted(fresh)}"
                         + ("; loading would drop them: build the optimizer with the settings of the one that "
                            "wrote the state dict (amsgrad, momentum, ...)" if migrating else ""))
    return st


def _loaded_step(saved: dict, exp_local: torch.Tensor, migrating: bool, where: str) -> torch.Tensor:
    """The saved ``step`` as our 0-d float32 count; torch.optim.SGD / Muon keep no step: a
    migrated buffer starts our count at 0."""
    if "step" not in saved and not (migrating and set(saved) == {"momentum_buffer"}):
        raise ValueError(f"{where}: the state dict has no 'step'")
    step = saved.get("step", 0)
    step = step.to_local() if is_dtensor(step) else step
    step = torch.as_tensor(step, dtype=torch.float32, device=exp_local.device).detach().clone().reshape(())
    _check_step(step, where)
    return step


def _load_plain(saved: dict, name: str, p, exp_local: torch.Tensor, expected, where: str, label: str = ""):
    """A state this optimizer keeps unquantized: the saved tensor (this rank's rows: of the
    param's, or of a DTensor state placed otherwise, a per-dimension factor's), checked, copied
    in the live dtype."""
    if name not in saved:
        raise ValueError(f"{where}: the state dict has no {name!r} (has {sorted(saved)})")
    if not isinstance(saved[name], torch.Tensor):
        raise ValueError(f"{where}: {name!r} is a {type(saved[name]).__name__}, expected a tensor: this "
                         f"optimizer keeps it unquantized ({_describe(exp_local)}); the state dict was "
                         "written with another state_format or min_quant_size")
    if is_dtensor(expected):
        value = _rows(saved[name], expected, f"{where} {name}")
    elif exp_local.shape == to_local(p).shape and p.ndim:
        value = _rows(saved[name], p, f"{where} {name}")
    else:
        value = saved[name]
    value = to_local(value)
    if tuple(value.shape) != tuple(exp_local.shape):
        raise ValueError(f"{where}: {label or repr(name)} has shape {tuple(value.shape)}, expected "
                         f"{tuple(exp_local.shape)}")
    if value.is_floating_point() != exp_local.is_floating_point():
        want = "a float tensor" if exp_local.is_floating_point() else f"a {exp_local.dtype} tensor"
        raise ValueError(f"{where}: {name!r} has dtype {value.dtype}, expected {want}")
    local = value.detach().to(device=exp_local.device, dtype=exp_local.dtype).clone()
    return wrap_like(local, expected) if is_dtensor(expected) else local  # placed as the live state


def _live_correction(opt, p, fresh_correction):
    """Param ``p``'s correction as it is: the one :func:`bridge.load_master_params` (or earlier
    steps) set, else the fresh zeros. A state dict without corrections says nothing about the
    low bits of the master weights, so loading one keeps them (in either order with
    ``load_master_params``)."""
    live = opt.state.get(p, {}).get(CORRECTION)  # .get: the state is a defaultdict
    return fresh_correction if live is None else live


def _fresh_keeping_correction(opt, p, group: dict) -> dict | None:
    """A new state (zeros, step 0) for a param the state dict holds none for, carrying its live
    correction (:func:`_live_correction`); ``None`` (no state, as torch) if it has none."""
    live = opt.state.get(p, {}).get(CORRECTION)
    if live is None:
        return None
    st = opt.param_states.create(p, group)
    if CORRECTION not in st:
        return None
    st[CORRECTION] = live
    return st


def _dropped_correction(gi: int, sid, p, group: dict) -> str:
    return (f"param group {gi}, param {sid} (shape {tuple(p.shape)}, {p.dtype}): the state dict holds its "
            f"'param_correction' (the low bits of its float32 master weight) but this optimizer keeps none for it "
            f"(param_correction={group.get(CORRECTION, False)!r}): loading would drop them; build the optimizer with "
            "param_correction=True over bfloat16 / float16 params, or continue in float32: copy "
            "bridge.master_params(old_optimizer) into float32 params and load the state dict without its "
            "'param_correction' entries")


def _record_parts(saved: dict, name: str, kind, where: str) -> dict | None:
    """The saved tensors of record state ``name``, ``{part: (label, tensor)}``: a nested dict
    (versions 2 and 3) or ``name::part`` keys (version 1); None if the state is saved neither way.
    The kind's optional parts may be left out, all of them together."""
    names = [p.name for p in kind.parts]
    optional = {p.name for p in kind.parts if p.optional}
    value = saved.get(name)
    if isinstance(value, dict):
        have = set(value)
        missing = [k for k in names if k not in have]
        extra = sorted(str(k) for k in have if k not in names)
        if extra or (missing and set(missing) != optional):
            raise ValueError(f"{where}: {name!r} has entries {sorted(map(str, value))}, expected {names}"
                             + (f" (or without {sorted(optional)})" if optional else "")
                             + (" (an empty dict: nothing was saved under this name)" if not value else ""))
        return {k: (f"{name}.{k}", value[k]) for k in names if k in have}
    keys = {k: f"{name}::{k}" for k in names if k not in optional}
    if not any(key in saved for key in keys.values()):
        return None
    for key in keys.values():
        if key not in saved:
            raise ValueError(f"{where}: the state dict has {sorted(k for k in keys.values() if k in saved)} "
                             f"without {key!r}")
    return {k: (key, saved[key]) for k, key in keys.items()}


def _tensor(label: str, value, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: {label!r} is a {type(value).__name__}, expected a tensor")
    return value


def _describe(t) -> str:
    t = to_local(t)
    return records.describe(t.record) if isinstance(t, QState) else records.describe(t)


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


def _load_record(opt, saved, name, p, q: QState, expected, where):
    """A record state: its saved parts (this rank's part of each, checked against the live
    layout, then copied in); or a float state (torch.optim's, our fp32 export), stored into the
    record's kind; or a whole record saved on another block grid (tensor parallel), regridded."""
    kind = q.kind
    like = expected if is_dtensor(expected) else p  # whose placements and whole shape the parts follow
    whole = saved.get(name)
    if isinstance(to_local(whole), QState):  # a record state as a tensor (e.g. gathered with full_tensor())
        w = to_local(whole)
        if w.kind_name != q.kind_name or w.meta != q.meta:
            raise ValueError(f"{where}: {name!r} is {_describe(w)}, but this optimizer's state is {_describe(q)}: "
                             "the state was written with another state format, block size or momentum_rank")
        found = {k: (f"{name}.{k}", _as_saved(t))
                 for k, t in w.parts.items()}
    else:
        found = _record_parts(saved, name, kind, where)
    if found is not None:
        found = {k: (label, _tensor(label, t, where)) for k, (label, t) in found.items()}
        if kind.regrid and not any(is_dtensor(t) for _, t in found.values()):
            regridded = _regrid(found["codes"][1], found["scale"][1], name, like if is_dtensor(like) else q, q, where)
            if regridded is not None:
                q.set_(regridded)
                return expected
        loaded = {}
        for part in kind.parts:
            live = _as_saved(getattr(q, part.name))
            if part.name not in found:  # an optional part left out: zeros (the same value)
                loaded[part.name] = torch.zeros_like(live)
                continue
            label, t = found[part.name]
            if part.along == "param" and not is_dtensor(t) and is_dtensor(like) and (t.ndim == 0 or t.shape[0] != like.shape[0]):
                raise ValueError(f"{where}: {label!r}: a full tensor of shape {tuple(t.shape)} cannot be sharded "
                                 f"like a param with {like.shape[0]} rows")
            t = to_local(part_local(t, like, part.along))
            if tuple(t.shape) == tuple(live.shape) and t.dtype != live.dtype:
                raise ValueError(f"{where}: {label!r} has dtype {t.dtype}, expected {live.dtype}")
            if tuple(t.shape) != tuple(live.shape):
                hint = (" (the state dict was written with another momentum_rank)" if part.optional else
                        ": the state dict was written with another state format, block size or parameter shape")
                raise ValueError(f"{where}: {name!r} {part.name}: the saved {_describe(t)} and this optimizer's "
                                 f"{_describe(live)} (of {_describe(q)}) do not match{hint}")
            if part.is_scale:
                _check_scales(t, f"{where}: {label!r}")
            loaded[part.name] = t
        for part in kind.parts:
            _as_saved(getattr(q, part.name)).copy_(loaded[part.name])
        return expected
    if name in saved:  # a float state (torch.optim, or an fp32 export): stored into this kind
        value = to_local(_rows(_tensor(name, saved[name], where), like, f"{where} {name}"))
        if not value.is_floating_point():
            raise ValueError(f"{where}: {name!r} is {_describe(value)}, expected a float tensor")
        if tuple(value.shape) != tuple(q.shape):
            raise ValueError(f"{where}: {name!r} has shape {tuple(value.shape)}, expected {tuple(q.shape)}")
        like = opt.param_states.record(p, q)
        q.set_(kind.from_float(value.detach().to(q.device, torch.float32), like))
        return expected
    raise ValueError(f"{where}: the state dict has no {name!r} (has {sorted(saved)})")


def _regrid(codes, scale, name, p, exp_local: QState, where):
    """A full (unsharded) quantized state saved on another block grid than this optimizer's
    (tensor parallel chose another block size, see ``shard_block_size``): this rank's part,
    dequantized and quantized again on the live grid, with a warning that names the param
    and the sizes and says how much the values moved. ``None`` when the grids agree."""
    if p.ndim < 2 or codes.ndim != 2 or scale.ndim != 2:
        return None
    r = math.prod(p.shape[1:])
    fmt = lt.get_format(exp_local.format)
    live_nb = -(-r // exp_local.block_size)
    nb = scale.shape[1]
    if nb == live_nb or codes.shape != ((p.shape[0], -(-r // 2) if fmt.bits == 4 else r)) or nb == 0:
        return None  # same grid, or not this format / shape: the checks below name the mismatch
    if r % nb:
        raise ValueError(
            f"{where}: {name!r} has {nb} blocks per row of {r}: neither this optimizer's block size "
            f"{exp_local.block_size} nor a tensor-parallel block size (one that divides the row) gives that"
        )
    saved_bs = r // nb
    if scale.dtype != torch.float32 or codes.dtype != torch.uint8:
        raise ValueError(f"{where}: {name!r} codes {codes.dtype} / scale {scale.dtype}, expected uint8 / float32")
    _check_scales(scale, f"{where}: {name!r} scale")
    dev = exp_local.codes.device
    c = codes.to(dev).view(torch.float8_e4m3fn) if exp_local.is_float8 else codes.to(dev)
    whole = lt.dequantize(QTensor(c, scale.to(dev), tuple(p.shape), saved_bs, exp_local.format))
    local = _rows(whole, p, f"{where} {name}")
    q = lt.quantize(local, exp_local.format, exp_local.block_size)
    moved = (lt.dequantize(q) - local).abs().max().item() if local.numel() else 0.0
    peak = local.abs().max().item() if local.numel() else 0.0
    warnings.warn(
        f"{where}: {name!r} was saved on blocks of {saved_bs} and this optimizer's layout has blocks of "
        f"{exp_local.block_size} (tensor parallel cuts its columns otherwise): requantized on the new blocks; "
        f"values moved by at most {moved:.3g} (state absmax {peak:.3g})",
        stacklevel=4,
    )
    return q


def export_torch(opt) -> dict:
    """``opt.torch_state_dict()``: torch.optim's layout with float32 states (records dequantized)
    and the group keys torch.optim knows (``amsgrad`` and ``nesterov`` kept: torch's
    ``load_state_dict`` would otherwise default them to False)."""
    sd = torch.optim.Optimizer.state_dict(opt)
    state = {}
    ids = {i for g in sd["param_groups"] for i in g["params"]}
    for idx, st in sd["state"].items():
        if idx not in ids:  # not a param's: passed through, as torch does
            state[idx] = st
            continue
        out = {}
        for name, v in st.items():
            local = to_local(v)
            if isinstance(local, QState):
                deq = local.dequantize()
                out[name] = wrap_like(deq, v) if is_dtensor(v) else deq
            else:
                out[name] = v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        state[idx] = out
    ours = [k for k in STATIC_KEYS + FORMAT_KEYS if k not in TORCH_GROUP_KEYS] + ["skip_nonfinite"]
    groups = [{k: v for k, v in g.items() if k not in ours} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}
