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
    for fqn, states in osd.get("state", {}).items():
        for name, value in states.items():
            if not isinstance(value, dict) or set(value) != {"codes", "scale"}:
                continue
            prefix = f"{key}.state.{fqn}.{name}"
            meta = {part: saved.get(f"{prefix}.{part}") for part in ("codes", "scale")}
            if any(m is None for m in meta.values()):
                continue  # dcp.load names what is missing
            if all(tuple(meta[part].size) == tuple(value[part].shape) for part in meta):
                continue
            # another grid: read the whole saved codes and scales (plain tensors: every rank)
            states[name] = {part: torch.empty(tuple(meta[part].size), dtype=value[part].dtype)
                            for part in ("codes", "scale")}
    dcp.load({key: osd}, checkpoint_id=checkpoint_id)
    set_optimizer_state_dict(model, optimizer, osd)
