"""``lowbit-tree inspect PATH``: what precision each saved optimizer state is really stored in.

Reads, without running any pickled code (``torch.load(weights_only=True)``, DCP metadata):

- a ``torch.save``d ``LowBitOptimizer.state_dict()`` (or a plain torch.optim one): each
  quantized state is a nested dict ``{"codes", "scale"}`` under its torch name (versions 2 and 3;
  version 1 wrote ``name::codes`` / ``name::scale`` keys, also read); the format comes from
  the param group's ``state_format`` (first or second moment by state name; a mapping's entry
  for the state, or the group's own argument for it such as ``slow_state_format``) and the block
  size from its ``block_size`` (or the format's default), checked against the tensors' shapes;
- a distributed checkpoint (DCP) directory: global shapes and dtypes from its metadata,
  the groups' ``state_format`` / ``block_size`` / version read from the checkpoint, nested
  (``state.<param>.<name>.codes``, ``param_groups`` lists) or flattened the way torch's
  ``flatten_optimizer_state_dict`` and torchtitan write them (``param_groups.<fqn>.<key>``);
- a ``torch.save``d core state pytree (``tx.init`` / ``tx.update`` output), or its flat
  ``lowbit_tree.checkpoint.state_to_dict`` form: every record's own format and block size.

Anything else is an :class:`InspectError` (one line, no traceback).
"""
from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass

import torch

import lowbit_tree as lt
import lowbit_tree.alias  # noqa: F401  (registers every state class as a safe global)
import lowbit_tree.checkpoint
import lowbit_tree.update  # noqa: F401
import lowbit_tree.wrappers  # noqa: F401
from lowbit_tree.formats import STATE_FORMATS, get_format
from lowbit_tree import records
from lowbit_tree.moments import FORMAT_ARGUMENTS, ReportRow, leaf_row

# torch.optim state name -> is it a first (signed) moment
SIGNED_STATES = {"exp_avg": True, "momentum_buffer": True, "exp_avg_sq": False, "max_exp_avg_sq": False,
                 "exp_avg_slow": True}
GROUP_KEYS = ("state_format", "slow_state_format", "precond_format", "block_size", "min_quant_size", "lowbit_tree_version",
              "params")
MAPPING_GROUP_KEYS = ("state_format",)  # group keys whose value may be a mapping (DCP saves one key per entry)
RECORD_PARTS = tuple(dict.fromkeys(p.name for kind in records.KINDS for p in kind.parts))  # the tensors of a
# quantized state (versions 2 and 3 nest them), of every record kind: codes, scale, row_max, col_max, ...


class InspectError(Exception):
    """A one-line, user-facing reason the path cannot be inspected."""


@dataclass
class Report:
    kind: str
    version: str
    rows: list

    def render(self) -> str:
        width = max([len(r.path) for r in self.rows] + [5])
        fw = max([len(r.format) for r in self.rows] + [6])
        lines = [f"{self.kind}", f"format version: {self.version}",
                 f"{'state':<{width}}  {'format':<{fw}} {'block':>6} {'shape':<18} {'bytes':>12}  stored as"]
        for r in self.rows:
            lines.append(f"{r.path:<{width}}  {r.format:<{fw}} {r.block:>6} {str(tuple(r.shape)):<18} {r.nbytes:>12}  {r.detail}")
        total = sum(r.nbytes for r in self.rows)
        by_fmt: dict[str, int] = {}
        for r in self.rows:
            by_fmt[r.format] = by_fmt.get(r.format, 0) + r.nbytes
        lines.append(f"total: {len(self.rows)} states, {total} bytes ({total / 2**20:.3f} MiB)")
        lines.append("by format: " + ", ".join(f"{k} {v} B" for k, v in sorted(by_fmt.items(), key=lambda kv: -kv[1])))
        return "\n".join(lines)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _plain_format(dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, _dtype_name(dtype))


# ----------------------------------------------------------------------------
# quantized states described by (group options, codes/scale shapes)
# ----------------------------------------------------------------------------
def _quantized_row(path: str, name: str, group: dict, parts: dict[str, tuple]) -> ReportRow:
    """``parts``: suffix -> (shape, dtype, nbytes) of one state's ``name::suffix`` tensors."""
    nbytes = sum(p[2] for p in parts.values())
    detail = ", ".join(f"{k} {_dtype_name(p[1])}{list(p[0])}" for k, p in parts.items())
    kind = records.kind_of_part_names(parts)
    if kind is records.RANK1:  # rank-1 normalized 4-bit record
        return ReportRow(path, records.label(records.RANK1.zeros((0, 0), {}, "meta")), _rank1_shape(parts), nbytes,
                         "-", detail)
    if kind is records.LOWRANK:  # low rank: the residual's row, named with the rank
        rest = {k: v for k, v in parts.items() if k in records.BLOCK.part_names}
        row = _quantized_row(path, name, group, rest)
        rank = parts["row_factor"][0][-1] if len(parts["row_factor"][0]) == 2 else "?"
        return ReportRow(path, f"{row.format}+rank{rank}", row.shape, nbytes, row.block, detail)
    codes, scale = parts.get("codes"), parts.get("scale")
    fmt, block, state_format = _format_of(group, name)
    if fmt is None or codes is None or scale is None:
        return ReportRow(path, f"?({state_format})", codes[0] if codes else (), nbytes, "?", detail)
    if len(codes[0]) != 2 or len(scale[0]) != 2:
        return ReportRow(path, fmt.name, tuple(codes[0]), nbytes, "?", detail + "  [not a (rows, cols) layout]")
    rows, cols = codes[0]
    packed = fmt.bits == 4
    candidates = (2 * cols - 1, 2 * cols) if packed else (cols,)
    nblocks = scale[0][1]
    ok = any(math.ceil(r / block) == nblocks for r in candidates if r > 0) or (cols == 0 and nblocks == 0)
    block_text = str(block) if ok else f"{block}?"
    if not ok:
        detail += f"  [scale has {nblocks} blocks a row: not block size {block}]"
    if packed:  # two codes a byte: the row length is 2*cols or 2*cols - 1
        detail += "  [row view; 4-bit rows may be one shorter]"
    return ReportRow(path, fmt.name, (rows, 2 * cols if packed else cols), nbytes, block_text, detail)


def _format_of(group: dict, name: str) -> tuple:
    """(block format or ``None`` where unknown, block size, the group's format argument) of
    quantized state ``name``: SOAP's bases and couplings (``eigenbasis_d``, ``coupling_d``) by the
    group's ``precond_format`` at :data:`~lowbit_tree.soap_transform.PRECOND_BLOCK_SIZE`, a moment
    by its ``state_format`` (first or second moment by name) at the group's ``block_size``."""
    if _SOAP_FACTOR.fullmatch(name) and "precond_format" in group:
        from lowbit_tree.soap_transform import PRECOND_BLOCK_SIZE, PRECOND_FORMATS

        kind = PRECOND_FORMATS.get(group["precond_format"])
        return (get_format(kind) if kind else None), PRECOND_BLOCK_SIZE, group["precond_format"]
    state_format = _state_format_of(group, name)
    signed = SIGNED_STATES.get(name)
    if state_format not in STATE_FORMATS or signed is None:
        return None, None, state_format
    fmt = get_format(STATE_FORMATS[state_format][0 if signed else 1])
    return fmt, group.get("block_size") or fmt.default_block_size, state_format


_SOAP_FACTOR = re.compile(r"(eigenbasis|coupling)_\d+")


def _state_format_of(group: dict, name: str):
    """The format ``group`` keeps state ``name`` in: the group's own argument for that state
    (``FORMAT_ARGUMENTS``: ``slow_state_format``), else its ``state_format`` mapping's entry, else
    its ``state_format``."""
    own = group.get(FORMAT_ARGUMENTS.get(name, ""))
    if own:
        return own
    state_format = group.get("state_format")
    return state_format.get(name) if isinstance(state_format, dict) else state_format


def _rank1_shape(parts) -> tuple:
    return (parts["row_max"][0][0], parts["col_max"][0][0])


def _group_of(groups: list[dict], pid) -> dict:
    for g in groups:
        if pid in g.get("params", []) or str(pid) in [str(x) for x in g.get("params", [])]:
            return g
    return groups[0] if len(groups) == 1 else {}


def _state_rows(entries: dict, groups: list[dict]) -> list[ReportRow]:
    """``entries``: (param id, state key) -> (shape, dtype, nbytes), in saved order."""
    rows = []
    pending: dict[tuple, dict] = {}
    order: list[tuple] = []
    for (pid, key), info in entries.items():
        if key == "step":
            continue
        sep = "::" if "::" in key else "." if "." in key and key.rsplit(".", 1)[1] in RECORD_PARTS else None
        if sep is not None:  # one tensor of a quantized state: "name::part" (version 1), "name.part" (2)
            name, part = key.rsplit(sep, 1)
            if (pid, name) not in pending:
                pending[(pid, name)] = {}
                order.append((pid, name))
            pending[(pid, name)][part] = info
        else:
            order.append((pid, key))
            pending[(pid, key)] = {"": info}
    for pid, name in order:
        parts = pending[(pid, name)]
        path = f"{pid}/{name}"
        if "" in parts:
            shape, dtype, nbytes = parts[""]
            rows.append(ReportRow(path, _plain_format(dtype), tuple(shape), nbytes, "-", _dtype_name(dtype)))
        else:
            rows.append(_quantized_row(path, name, _group_of(groups, pid), parts))
    return rows


def _versions(groups: list[dict], layout: int | None = None) -> str:
    """``layout``: the version the state keys show (3: nested records, 1: ``name::part`` keys)."""
    vs = sorted({str(g.get("lowbit_tree_version")) for g in groups} - {"None"})
    reads = f"this lowbit-tree reads {', '.join(map(str, _readable_versions()))}"
    if not vs and layout is not None:
        return f"{layout} (inferred from the state layout: the param groups carry no version) ({reads})"
    if not vs:
        return "none (a plain torch.optim state dict: every state is a float tensor)"
    return ", ".join(vs) + f" ({reads})"


def _readable_versions() -> tuple:
    from ..state_dict import READABLE_VERSIONS

    return READABLE_VERSIONS


def _layout(entries: dict) -> int | None:
    keys = [key for _, key in entries]
    if any("::" in k for k in keys):
        return 1
    if any("." in k and k.rsplit(".", 1)[1] in RECORD_PARTS for k in keys):
        from ..state_dict import STATE_DICT_VERSION

        return STATE_DICT_VERSION  # versions 2 and 3 nest records alike; the loader takes it as 3
    return None


def _block_size_text(group: dict) -> str:
    """The block size the group's states use: its ``block_size``, or (when that is None) each
    format's default, as the rows show it; ``-`` for unquantized formats."""
    if group.get("block_size") is not None:
        return str(group["block_size"])
    state_format = group.get("state_format")
    per_state = state_format.items() if isinstance(state_format, dict) else [(None, state_format)]
    names = set()
    for state, fmt in per_state:
        if isinstance(fmt, str) and fmt in STATE_FORMATS:  # a state's own pair member, or both for a plain name
            pair = STATE_FORMATS[fmt]
            names.update(pair if state is None else [pair[0 if SIGNED_STATES.get(state, True) else 1]])
    if not names:
        return "-"
    sizes = sorted({get_format(n).default_block_size for n in names})
    return "/".join(map(str, sizes)) + " (format default)"


def _group_summary(groups: list[dict]) -> str:
    parts = []
    for i, g in enumerate(groups):
        slow = f" slow_state_format={g['slow_state_format']}" if g.get("slow_state_format") else ""
        parts.append(f"group {i}: state_format={g.get('state_format', '?')!s}{slow} block_size={_block_size_text(g)}"
                     f" min_quant_size={g.get('min_quant_size', '?')!s}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------
# the three inputs
# ----------------------------------------------------------------------------
def inspect_optimizer_state_dict(sd: dict) -> Report:
    groups = list(sd["param_groups"])
    entries = {}
    for pid, st in sd["state"].items():
        if not isinstance(st, dict):
            raise InspectError(f"state of param {pid!r} is a {type(st).__name__}, not a dict")
        for key, t in st.items():
            if isinstance(t, dict):  # versions 2, 3: a quantized state's tensors under its name
                for part, tt in t.items():
                    if isinstance(tt, torch.Tensor):
                        entries[(pid, f"{key}.{part}")] = (tuple(tt.shape), tt.dtype, tt.numel() * tt.element_size())
            elif isinstance(t, torch.Tensor):
                entries[(pid, key)] = (tuple(t.shape), t.dtype, t.numel() * t.element_size())
    kind = "torch.save'd optimizer state dict; " + _group_summary(groups)
    return Report(kind, _versions(groups, _layout(entries)), _state_rows(entries, groups))


def inspect_dcp(path: str) -> Report:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 -- any failure here means "not a readable DCP checkpoint"
        raise InspectError(f"a directory but not a readable DCP checkpoint ({type(e).__name__}: {_first_line(e)})")
    tensors, group_keys = {}, []
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            tensors[key] = (tuple(m.size), m.properties.dtype, math.prod(m.size) * _itemsize(m.properties.dtype))
        elif _group_entry(key):
            group_keys.append(key)
    groups_by_prefix = _read_dcp_groups(path, group_keys)
    entries, other = {}, []
    for key, info in tensors.items():
        if ".state." in f".{key}":
            prefix, rest = f".{key}".split(".state.", 1)
            pid, name = rest.rsplit(".", 1)
            if name in RECORD_PARTS and "." in pid:  # versions 2, 3: "<param>.<name>.codes"
                pid, state_name = pid.rsplit(".", 1)
                name = f"{state_name}.{name}"
            entries[(prefix.lstrip(".") + ("/" if prefix.strip(".") else "") + pid, name)] = info
        else:
            other.append(key)
    if not entries:
        raise InspectError(f"a DCP checkpoint with {len(tensors)} tensors but no optimizer state ('...state.<param>.<name>' keys)")
    groups = [g for gs in groups_by_prefix.values() for g in gs]
    # the param id in a DCP key is "<prefix>/<fqn or index>"; groups list bare ids
    rows = _state_rows(entries, [dict(g, params=[f"{g['_prefix']}{p}" for p in g.get("params", [])]) for g in groups])
    kind = f"DCP checkpoint directory ({len(tensors)} tensors, {len(md.state_dict_metadata) - len(tensors)} other entries)"
    if groups:
        kind += "; " + _group_summary(groups)
    if other:
        kind += f"; {len(other)} non-optimizer tensors not listed"
    return Report(kind, _versions(groups, _layout(entries)) if groups else "unknown (no param_groups saved)", rows)


def _group_entry(key: str) -> bool:
    """A DCP metadata key that holds (an entry of) a param group key we read: nested
    (``...param_groups.<i>.<key>``) or flattened (:func:`_flat_group_key`); a mapping's entries are
    keys of their own (``...state_format.exp_avg``)."""
    head, _, _ = key.rpartition(".")
    if head.rpartition(".")[2] in MAPPING_GROUP_KEYS:
        key = head
    return (".param_groups." in f".{key}" and key.rsplit(".", 1)[-1] in GROUP_KEYS) or _flat_group_key(key)


def _flat_group_key(key: str) -> bool:
    """A flattened group entry, ``[<prefix>.]param_groups.<fqn>.<key>`` (torch's
    ``flatten_optimizer_state_dict``, torchtitan)."""
    if "param_groups." not in key:
        return False
    rest = key.split("param_groups.", 1)[1]
    if "." not in rest or rest.rsplit(".", 1)[1] not in GROUP_KEYS:
        return False
    index, _, tail = rest.partition(".")
    return not (index.isdigit() and "." not in tail)  # "param_groups.<i>.<key>": a group list, not flattened


def _itemsize(dtype) -> int:
    return dtype.itemsize


def _read_dcp_groups(path: str, keys: list[str]) -> dict[str, list[dict]]:
    """{prefix: [group dict]} with the group keys we need (small pickled values, loaded by key)."""
    if not keys:
        return {}
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore")
            loaded = _load_state_dict_from_keys(set(keys), checkpoint_id=path)
    except Exception as e:  # noqa: BLE001
        raise InspectError(f"DCP checkpoint: cannot read its param groups ({type(e).__name__}: {_first_line(e)})")
    out: dict[str, list[dict]] = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            pre = prefix + "/" if prefix else ""
            if "param_groups" in node and isinstance(node["param_groups"], list):
                out[prefix] = [dict(g, _prefix=pre) for g in node["param_groups"] if isinstance(g, dict)]
            flat: dict[str, dict] = {}  # flattened layout: one group per param, "param_groups.<fqn>.<key>"
            for k, v in node.items():
                if isinstance(k, str) and _flat_group_key(k):
                    fqn, gk = k[len("param_groups."):].rsplit(".", 1)
                    flat.setdefault(fqn, {"params": [fqn], "_prefix": pre})[gk] = v
            if flat:
                out.setdefault(prefix, []).extend(flat.values())
            for k, v in node.items():
                if k != "param_groups" and not (isinstance(k, str) and _flat_group_key(k)):
                    walk(v, f"{prefix}.{k}" if prefix else str(k))

    walk(loaded, "")
    return out


_is_record = records.is_record


def _has_core_nodes(tree) -> bool:
    import optree

    if any(_is_record(x) for x in optree.tree_leaves(tree, is_leaf=_is_record)):
        return True
    found = []

    def visit(x):
        if type(x).__module__.startswith("lowbit_tree"):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)

    visit(tree)
    return bool(found)


def inspect_core_state(tree) -> Report:
    import optree

    from lowbit_tree.tree_utils import path_string

    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree, is_leaf=_is_record)
    rows = [row for row in (leaf_row(path_string(acc) or ".", leaf, _plain_format) for acc, leaf in zip(accessors, leaves))
            if row is not None]
    return Report("torch.save'd lowbit_tree core state pytree",
                  f"none stored (a pickled pytree of records; read by lowbit_tree {lt.__version__})", rows)


def inspect_flat_core_dict(d: dict) -> Report:
    """A ``lowbit_tree.checkpoint.state_to_dict`` dict: records announce themselves by metadata keys."""
    version = int(d[lowbit_tree.checkpoint.VERSION_KEY])
    records = sorted(k[: -len("/__format__")] for k in d if k.endswith("/__format__"))
    rows, used = [], {lowbit_tree.checkpoint.VERSION_KEY}
    for rec in records:
        fmt = bytes(d[f"{rec}/__format__"].tolist()).decode(errors="replace").replace("rank1:", "rank1_")
        if fmt.startswith("lowrank:") and f"{rec}/row_factor" in d:  # the residual's format and the factors' rank
            fmt = f"{fmt[len('lowrank:'):]}+rank{d[f'{rec}/row_factor'].shape[-1]}"
        shape = tuple(d[f"{rec}/__shape__"].tolist())
        block = d.get(f"{rec}/__block_size__")
        parts = {k: v for k, v in d.items() if k.startswith(rec + "/") and not k.endswith("__")}
        used.update(k for k in d if k.startswith(rec + "/"))
        detail = ", ".join(f"{k[len(rec) + 1:]} {_dtype_name(v.dtype)}{list(v.shape)}" for k, v in parts.items())
        rows.append(ReportRow(rec, fmt, shape, sum(v.numel() * v.element_size() for v in parts.values()),
                              str(int(block)) if block is not None else "-", detail))
    for k, v in d.items():
        if k not in used and isinstance(v, torch.Tensor):
            rows.append(ReportRow(k, _plain_format(v.dtype), tuple(v.shape), v.numel() * v.element_size(), "-",
                                  _dtype_name(v.dtype)))
    return Report("torch.save'd flat lowbit_tree state dict (lowbit_tree.checkpoint.state_to_dict)",
                  f"{version} (this lowbit_tree reads {lowbit_tree.checkpoint.STATE_DICT_VERSION})", rows)


# ----------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------
def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor {_dtype_name(obj.dtype)}{list(obj.shape)}"
    if isinstance(obj, dict):
        n = sum(isinstance(v, torch.Tensor) for v in obj.values())
        return f"a dict of {len(obj)} entries ({n} tensors)"
    return f"a {type(obj).__name__}"


def load_file(path: str):
    with open(path, "rb") as f:
        head = f.read(4)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torch.load raises many types for bad input
        if "Unsupported global" in str(e):
            glob = str(e).split("Unsupported global:", 1)[-1].strip().splitlines()[0].split(" was not")[0]
            raise InspectError(f"a torch.save file holding objects that are not safe to load "
                               f"(weights_only=True refused: {glob})")
        if head == b"PK\x03\x04":
            raise InspectError(f"a corrupt or truncated torch.save file ({type(e).__name__}: {_first_line(e)})")
        raise InspectError(f"not a torch.save file or DCP checkpoint directory ({type(e).__name__}: {_first_line(e)})")


def inspect_path(path: str) -> Report:
    if not os.path.exists(path):
        raise InspectError("no such file or directory")
    if os.path.isdir(path):
        return inspect_dcp(path)
    obj = load_file(path)
    if isinstance(obj, dict) and "state" in obj and "param_groups" in obj:
        if not isinstance(obj["state"], dict) or not isinstance(obj["param_groups"], list):
            raise InspectError("has 'state' and 'param_groups' but they are not a dict and a list")
        return inspect_optimizer_state_dict(obj)
    if isinstance(obj, dict) and lowbit_tree.checkpoint.VERSION_KEY in obj:
        return inspect_flat_core_dict(obj)
    if _has_core_nodes(obj):
        return inspect_core_state(obj)
    raise InspectError(f"holds {_describe(obj)}: not an optimizer state dict, a lowbit_tree state or a DCP checkpoint")


def run(args) -> int:
    import sys

    try:
        report = inspect_path(args.path)
    except InspectError as e:
        print(f"lowbit-tree inspect: {args.path}: {e}", file=sys.stderr)
        return 2
    print(report.render())
    return 0
