"""State pytrees to and from a flat ``{path: tensor}`` dict.

``torch.save(state)`` / ``torch.load(f, weights_only=True)`` already round-trip
a state bit for bit (every state class is a registered safe global). The flat
dict is for checkpoint formats that want plain tensors only (safetensors,
distributed checkpoints) and for loading into a state built elsewhere.

Keys are path strings (``"0/mu/layer/weight/codes"``: NamedTuple field names,
dict keys, sequence indices, record fields). Each quantized record at path
``P`` also writes ``P/__format__`` (uint8 bytes of its format name),
``P/__shape__`` (int64) and, for QTensor and LowRankQTensor, ``P/__block_size__`` (int64 0-d),
so loading validates them (a low-rank record's rank is its factors' shape). ``__lowbit_tree_version__`` (int64 0-d) names the layout.
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from . import records
from .tree_utils import path_string

__all__ = ["STATE_DICT_VERSION", "VERSION_KEY", "state_to_dict", "state_from_dict"]

STATE_DICT_VERSION = 1
VERSION_KEY = "__lowbit_tree_version__"


_is_record = records.is_record


def _record_meta(path: str, q: Any) -> dict[str, torch.Tensor]:
    kind = records.kind_of(q)
    fmt = kind.flat_prefix + q.format
    meta = {
        f"{path}/__format__": torch.tensor(list(fmt.encode()), dtype=torch.uint8, device="cpu"),
        f"{path}/__shape__": torch.tensor(q.shape, dtype=torch.int64, device="cpu"),
    }
    if "block_size" in kind.meta:
        meta[f"{path}/__block_size__"] = torch.tensor(q.block_size, dtype=torch.int64, device="cpu")
    return meta


def _entries(state: Any) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every entry in tree order (a record's metadata just before its tensors), and the metadata keys."""
    entries: dict[str, torch.Tensor] = {}
    meta_keys: set[str] = set()
    accessors, leaves, _ = optree.tree_flatten_with_accessor(state, is_leaf=_is_record)
    for acc, leaf in zip(accessors, leaves):
        path = path_string(acc)
        if _is_record(leaf):
            meta = _record_meta(path, leaf)
            entries.update(meta)
            meta_keys.update(meta)
            for sub_acc, t in zip(*optree.tree_flatten_with_accessor(leaf)[:2]):
                entries[f"{path}/{path_string(sub_acc)}"] = t
        elif isinstance(leaf, torch.Tensor):
            entries[path] = leaf
        else:
            raise TypeError(f"state leaf at {path!r} is a {type(leaf).__name__}, not a tensor")
    return entries, meta_keys


def state_to_dict(state: Any) -> dict[str, torch.Tensor]:
    """A flat ``{path: tensor}`` view of ``state`` (tensors shared, not copied)."""
    return {VERSION_KEY: torch.tensor(STATE_DICT_VERSION, dtype=torch.int64, device="cpu"), **_entries(state)[0]}


def _meta_text(key: str, t: torch.Tensor) -> str:
    t = t.cpu()
    if key.endswith("__format__") and t.dtype == torch.uint8:
        return repr(bytes(t.tolist()).decode(errors="replace"))
    return repr(t.tolist())


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def state_from_dict(template: Any, d: dict[str, torch.Tensor], *, device: torch.device | str | None = None) -> Any:
    """Rebuild a state shaped like ``template`` (from ``tx.init``) from ``state_to_dict`` output.

    Each tensor goes to its template leaf's device, or -- for a template built
    on the ``meta`` device -- to ``device`` (default: where it is in ``d``).

    Raises:
      ValueError: naming the first differing path (in template order) when the
        version, structure, a record's format / shape / block size, or a tensor's
        dtype / shape differs.
    """
    if VERSION_KEY not in d:
        raise ValueError(f"{VERSION_KEY!r}: missing (not a lowbit_tree state dict)")
    version = d[VERSION_KEY]
    if not isinstance(version, torch.Tensor) or version.numel() != 1 or int(version) != STATE_DICT_VERSION:
        raise ValueError(f"{VERSION_KEY!r}: version {version!r}, this library reads version {STATE_DICT_VERSION}")
    expected, meta_keys = _entries(template)
    leaves = []
    for key, want in expected.items():
        got = d.get(key)
        if got is None:
            raise ValueError(f"{key!r}: missing from the state dict (template expects {_describe(want)})")
        if key in meta_keys:
            if got.dtype != want.dtype or not torch.equal(got.cpu(), want):
                raise ValueError(f"{key!r}: checkpoint has {_meta_text(key, got)}, template has {_meta_text(key, want)}")
            continue
        if got.dtype != want.dtype or got.shape != want.shape:
            raise ValueError(f"{key!r}: checkpoint has {_describe(got)}, template expects {_describe(want)}")
        target = want.device if want.device.type != "meta" else (device if device is not None else got.device)
        leaves.append(got.to(target))
    extra = [k for k in d if k != VERSION_KEY and k not in expected]
    if extra:
        raise ValueError(f"{extra[0]!r}: in the state dict but not in the template")
    return optree.tree_unflatten(optree.tree_structure(template), leaves)
