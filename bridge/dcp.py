"""Loading a DCP optimizer checkpoint whose block grid differs from this optimizer's.

Under tensor parallel the block size of a state depends on how the mesh cuts the param's
columns (``bridge.distributed.shard_block_size``). A checkpoint saved at TP degree 2 with
blocks of 4 columns then has other scale shapes than a run at TP degree 1 that uses blocks
of 8, and ``dcp.load`` stops with "Size mismatch between saved ... and current". Where the
grids agree (same format and block size: the same TP degree, or none that cuts a block),
plain ``dcp.load`` into ``get_optimizer_state_dict`` is exact and this module is not needed.
"""
from __future__ import annotations

from typing import Any

import torch

from lowbit_tree import records

__all__ = ["load_optimizer"]


def load_optimizer(model: torch.nn.Module, optimizer, checkpoint_id: Any, key: str = "optim") -> None:
    """``dcp.load`` the optimizer state saved under ``key`` (as ``{key:
    get_optimizer_state_dict(model, optimizer)}``) into ``optimizer``, on any mesh. States
    saved on this optimizer's block grid load exactly (as sharded DTensors); a state saved on
    another grid is read whole on every rank, and its part is requantized on the live grid
    with a warning naming the param, both block sizes and how far the values moved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer)
    reader = dcp.FileSystemReader(checkpoint_id) if isinstance(checkpoint_id, (str, bytes)) or hasattr(
        checkpoint_id, "__fspath__") else checkpoint_id
    saved = reader.read_metadata().state_dict_metadata
    _keep_group_keys_the_checkpoint_lacks(osd, saved, key)
    _check_groups_first(optimizer, osd, key, checkpoint_id)
    for fqn, states in osd.get("state", {}).items():
        for name, value in states.items():
            if isinstance(value, dict):
                _check_record_kind(value, saved, f"{key}.state.{fqn}.{name}", f"{fqn} {name}")
                if _saved_without_factors(value, saved, f"{key}.state.{fqn}.{name}"):
                    # a buffer saved before momentum_rank: its residual loads, its factors are zero
                    states[name] = value = {part: value[part] for part in records.BLOCK.part_names}
            if not isinstance(value, dict) or set(value) != set(records.BLOCK.part_names):
                continue
            prefix = f"{key}.state.{fqn}.{name}"
            meta = {part: saved.get(f"{prefix}.{part}") for part in records.BLOCK.part_names}
            if any(m is None for m in meta.values()):
                continue  # dcp.load names what is missing
            if all(tuple(meta[part].size) == tuple(value[part].shape) for part in meta):
                continue
            # another grid: read the whole saved codes and scales (plain tensors: every rank)
            states[name] = {part: torch.empty(tuple(meta[part].size), dtype=value[part].dtype)
                            for part in records.BLOCK.part_names}
    dcp.load({key: osd}, checkpoint_id=checkpoint_id)
    set_optimizer_state_dict(model, optimizer, osd)


def _check_groups_first(optimizer, osd: dict, key: str, checkpoint_id: Any) -> None:
    """The checkpoint's param-group entries checked against this optimizer's (state format, block
    size, ...: ``load_state_dict``'s checks) *before* the states load. ``dcp.load`` writes into
    the tensors of ``osd``, which are the optimizer's own states, so a checkpoint refused only
    afterwards (by ``set_optimizer_state_dict``) would already have overwritten them (e.g. codes
    of another map read as this one's)."""
    import copy

    import torch.distributed.checkpoint as dcp

    from .state_dict import VERSION_KEY, check_groups

    groups = copy.deepcopy(osd.get("param_groups", []))
    if not groups:
        return
    dcp.load({key: {"param_groups": groups}}, checkpoint_id=checkpoint_id)
    if any(VERSION_KEY in g for g in groups):  # ours (a torch.optim checkpoint migrates: nothing to compare)
        check_groups(optimizer, groups, False, {"state": {}, "param_groups": groups})


def _keep_group_keys_the_checkpoint_lacks(osd: dict, saved: dict, key: str) -> None:
    """Leave out of the load target the group entries the checkpoint has no value for (a key added
    since it was written, e.g. an explicit ``rank1_normalization``): ``dcp.load`` would stop with
    "Missing key", and loading keeps this optimizer's values for them (as ``load_state_dict`` does)."""
    for i, group in enumerate(osd.get("param_groups", [])):
        for k in [k for k, v in group.items() if k != "params" and not isinstance(v, (list, tuple, dict))]:
            if f"{key}.param_groups.{i}.{k}" not in saved:
                del group[k]


def _saved_without_factors(value: dict, saved: dict, prefix: str) -> bool:
    """A low-rank momentum record (Muon's ``momentum_rank``) whose checkpoint holds only codes and
    scales: one written with ``momentum_rank=0`` (Muon4bit before the low-rank split). That buffer
    is a record with zero factors and that residual, so it loads exactly (``load_state_dict``
    zeroes the factors); a checkpoint written with factors and a rank-0 optimizer are told apart
    by the groups' ``momentum_rank``, checked first."""
    return records.kind_of_part_names(value) is records.LOWRANK and _saved_kind(saved, prefix) is records.BLOCK


def _saved_kind(saved: dict, prefix: str):
    """The record kind whose parts the checkpoint holds under ``prefix`` (``None``: no record)."""
    return records.kind_of_part_names(p for k in records.KINDS for p in k.part_names if f"{prefix}.{p}" in saved)


def _check_record_kind(value: dict, saved: dict, prefix: str, what: str) -> None:
    """A 4-bit second moment saved per block where this optimizer keeps a rank-1 record, or the
    other way round: say so and what to build (``dcp.load`` would name a missing key)."""
    live, held = records.kind_of_part_names(value), _saved_kind(saved, prefix)
    if live is records.RANK1 and held is records.BLOCK:
        raise ValueError(
            f"{what}: the checkpoint holds a block-normalized 4-bit state (the 4-bit default before lowbit-tree's "
            "state-dict version 3) and this optimizer a rank-1 normalized one (today's 4-bit default); build the "
            "optimizer with rank1_normalization=False to load it")
    if live is records.BLOCK and held is records.RANK1:
        raise ValueError(
            f"{what}: the checkpoint holds a rank-1 normalized 4-bit state and this optimizer a block-normalized "
            "one; build the optimizer with rank1_normalization=True (or leave it unset: 4-bit's default) to load it")
