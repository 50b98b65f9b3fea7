"""The Triton backend (``LOWBIT_TREE_BACKEND=triton``): launches :mod:`.triton_step`'s kernel
over a step's leaves, one launch per static combination (rule, variant, state storages and block
sizes, param / gradient dtype, write, stochastic rounding, param correction; the fused links are
runtime flags), over a table of the leaves' addresses built once per combination
(:class:`TritonLaunch`, as the native kernel's job rows; :class:`TritonSteps` holds them in a
``KernelPlan``).

On a CUDA device it compiles for the GPU; on CPU tensors it runs under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported), which is how CI checks the bits.
Imported only when this backend is chosen: the core never needs triton.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch

from ..formats import FORMATS, get_format
from ..qtensor import QTensor, row_layout
from ..record_base import Record
from ..rounding import rounding_hash
from . import tables
from .spec import FLAGS, RULES, StepSpec
from . import triton_step as ts

__all__ = ["run_step", "TritonLaunch", "TritonSteps", "launch_key", "format_tables", "launch_kernel", "FORMAT_IDS", "tile_length",
           "MAX_TILE"]

FORMAT_IDS = {name: i for i, name in enumerate(FORMATS)}
"""A format's row in the format table."""

MAX_TILE = 4096
"""The longest tile one program steps: the block sizes' least common multiple must fit."""

_DT = {torch.float32: ts.DT_F32, torch.bfloat16: ts.DT_BF16, torch.float16: ts.DT_F16}

def launch_kernel(programs: int, *args, **kwargs) -> None:
    """One launch of the step kernel over ``programs`` programs (the one place that launches:
    tests count launches by wrapping it)."""
    ts.step_kernel[(programs,)](*args, **kwargs)


@functools.lru_cache(maxsize=8)
def format_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(len(FORMATS), FMT_STRIDE)`` (decoded values, thresholds padded with +inf,
    divisor, last index, sqrt, unsigned) and uint8 ``(len(FORMATS), 256)`` (index -> stored
    byte), from :mod:`.tables` (the thresholds every backend rounds against)."""
    ftab = torch.full((len(FORMATS), ts.FMT_STRIDE), math.inf, dtype=torch.float32)
    etab = torch.zeros((len(FORMATS), 256), dtype=torch.uint8)
    for name, i in FORMAT_IDS.items():
        f, t = FORMATS[name], tables.cpu_code_table(name)
        ftab[i, :256] = t.decode
        ftab[i, 256:256 + t.last] = t.thresholds[: t.last]
        ftab[i, 512:516] = torch.tensor([f.scale_divisor, t.last, float(f.sqrt), float(not f.signed)])
        etab[i, : t.last + 1] = t.encode
    return ftab.to(device), etab.to(device)


def _storage(s) -> tuple[int, int]:
    """(how the slot is stored: ``triton_step.STORAGE_*``, block size) of a state leaf."""
    if isinstance(s, QTensor):
        return (ts.STORAGE_Q4 if get_format(s.format).bits == 4 else ts.STORAGE_Q8), int(s.block_size)
    if isinstance(s, Record):
        raise NotImplementedError(f"the triton backend has no kernel for {type(s).__name__} records (rank-1 and "
                                  "low-rank states); use LOWBIT_TREE_BACKEND=native on CPU or compiled")
    if isinstance(s, torch.Tensor) and s.dtype in (torch.float32, torch.bfloat16):
        return (ts.STORAGE_F32 if s.dtype is torch.float32 else ts.STORAGE_BF16), 0
    raise TypeError(f"the triton backend takes QTensor records and float32 / bfloat16 states, got "
                    f"{type(s).__name__} {getattr(s, 'dtype', '')}")


def tile_unit(block_sizes: Sequence[int]) -> int:
    """The least common multiple of the block sizes and 2: a row's lanes are a multiple of it."""
    lcm = 2
    for b in block_sizes:
        if b:
            lcm = lcm * b // math.gcd(lcm, b)
    return lcm


def tile_length(block_sizes: Sequence[int]) -> int:
    """Elements of one row a program steps: a multiple of every block size and of 2, about
    1024 where the block sizes are powers of two (a reshape finds the block maxima), about 128
    otherwise (a mask per block and element does)."""
    quant = [b for b in block_sizes if b]
    if not quant:
        return 1024
    lcm = 2
    for b in quant:
        lcm = lcm * b // math.gcd(lcm, b)
    if lcm > MAX_TILE:
        raise ValueError(f"block sizes {tuple(quant)} have no common tile of at most {MAX_TILE} elements (their "
                         f"least common multiple is {lcm}); the triton backend needs states whose block sizes "
                         "divide a common tile: choose block sizes that are powers of two")
    pow2 = all(b & (b - 1) == 0 for b in quant)
    return lcm * max(1, (1024 if pow2 else 128) // lcm)


def launch_key(spec: StepSpec, p: Optional[torch.Tensor], g: torch.Tensor, states: Sequence, write: bool,
               stochastic: bool, corrected: bool = False, others: Sequence[Optional[torch.Tensor]] = ()) -> tuple:
    """The static combination a leaf compiles to (its launch groups with the others of the same key),
    the last entry whether it is :func:`aligned` (``others``: the tensors besides ``p``, ``g`` and
    the states that its table row addresses, a correction or an output)."""
    storages = [_storage(s) for s in states]
    return (tuple(storages), _DT[p.dtype] if p is not None else 0, _DT[g.dtype], write, stochastic, corrected,
            aligned(g, states, [p, *others]))


def aligned(g: torch.Tensor, states: Sequence, tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether a leaf steps in the kernel's aligned variant, whose loads may be 128-bit vectors:
    the gradient, ``tensors`` and the states' tensors (codes, scales, values) start at a multiple of
    ``ALIGN_BYTES`` bytes, and its row length (the flat length where no state is quantized) is a
    multiple of ``ALIGN_ELEMS`` and of its tiles' block unit, so every tile starts and ends on whole
    vectors. Any other leaf (an offset view, an odd row) takes the general variant: the same bits."""
    parts = [g, *tensors]
    for s in states:
        parts += [s.codes, s.scale] if isinstance(s, QTensor) else [s]
    if any(t is not None and t.data_ptr() % ts.ALIGN_BYTES for t in parts):
        return False
    blocks = [b for _, b in (_storage(s) for s in states)]
    R = row_layout(g.shape)[1] if any(blocks) else g.numel()
    unit = tile_unit(blocks)
    need = unit * ts.ALIGN_ELEMS // math.gcd(unit, ts.ALIGN_ELEMS)
    return tile_length(blocks) % ts.ALIGN_ELEMS == 0 and R % need == 0


def _constexprs(spec: StepSpec, key: tuple) -> dict:
    storages, pdt, gdt, write, stochastic, corrected, aligned = (tuple(key) + (False, False))[:7]
    storages = list(storages) + [(0, 0)] * (3 - len(storages))
    L, unit = tile_length([b for _, b in storages]), tile_unit([b for _, b in storages])
    tile = triton_next_pow2(L)
    out = dict(RULE=RULES.index(spec.rule), VAR=spec.variant, NS=spec.nstates, PDT=pdt, GDT=gdt,
               P=write or spec.needs_param, WRITE=write, SR=stochastic, CORR=corrected, L=L, TILE=tile,
               ALIGNED=aligned)
    out["UNIT"] = unit  # not a kernel argument: the launcher's row padding
    for i, (k, b) in enumerate(storages):
        out[f"K{i}"], out[f"BS{i}"] = k, max(b, 1)
        out[f"NB{i}"] = triton_next_pow2(-(-tile // b)) if b else 1
    return out


def link_bits(spec: StepSpec) -> int:
    """The fused links as the kernel's runtime flags: maximize 1, l2 2, decay 4, lr 8 (the first
    four of ``spec.FLAGS``, in their order there)."""
    return sum(1 << i for i, name in enumerate(FLAGS[:4]) if getattr(spec, name))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class _Slot(NamedTuple):
    src: torch.Tensor
    dst: torch.Tensor
    scale_in: Optional[torch.Tensor]
    scale_out: Optional[torch.Tensor]
    fmt: int


class TritonLaunch:
    """One kernel launch over leaves of one static combination: the int64 address table and the
    program -> leaf map, built once; :meth:`set_leaf` rewrites a leaf's gradient, output and
    rounding hash (a new step's), :meth:`run` launches with a hyperparameter vector."""

    def __init__(self, spec: StepSpec, key: tuple, leaves: Sequence[tuple]):
        """``leaves``: ``(p, g, out, slots, sr_hash[, correction])`` each, ``out`` the update buffer
        or the param written in place, ``slots`` :class:`_Slot` per state, ``correction`` the
        param's int8 correction (written in place with the param)."""
        self.spec, self.key = spec, key
        self.constexprs = _constexprs(spec, key)
        self.aligned = bool(self.constexprs["ALIGNED"])
        self.links = link_bits(spec)
        L = self.constexprs["L"]
        dev = leaves[0][1].device
        rows_tab, owners, start = [], [], 0
        self.keep = []  # the tensors whose addresses the table holds
        unit = self.constexprs["UNIT"]
        for i, (p, g, out, slots, sr_hash, *corr) in enumerate(leaves):
            quantized = any(s.scale_in is not None for s in slots)
            rows, R = row_layout(g.shape) if quantized else (1, g.numel())
            Rp = -(-R // unit) * unit  # a row's lanes: whole blocks (and 4-bit bytes) of it
            if Rp <= L // 2:  # short rows: k of them a program
                k, Rp, tpr = L // Rp, Rp, 1
                programs = -(-rows // k)
            else:
                k, Rp, tpr = 1, L, -(-R // L)
                programs = rows * tpr
            row = [R, tpr, start, _addr(p), _addr(g), _addr(out), sr_hash, _addr(corr[0] if corr else None), rows, Rp, k]
            for s in slots:
                row += [_addr(s.src), _addr(s.dst), _addr(s.scale_in), _addr(s.scale_out), s.fmt, 0]
            row += [0] * (ts.LEAF_ROW - len(row))
            rows_tab.append(row)
            owners.append(torch.full((programs,), i, dtype=torch.int32))
            start += programs
            self.keep.append([p, g, out, slots])
        self.host = torch.tensor(rows_tab, dtype=torch.int64)
        self.table = self.host if dev.type == "cpu" else self.host.to(dev)
        self.tile_leaf = torch.cat(owners).to(dev)
        self.programs = start
        self.ftab, self.etab = format_tables(dev)
        self._dirty = False

    def set_leaf(self, i: int, g: torch.Tensor, out: Optional[torch.Tensor] = None,
                 sr_hash: Optional[int] = None) -> None:
        """Leaf ``i``'s gradient (contiguous, of the shape and dtype it was built with), its
        update buffer (``None``: the one it has, or the param written in place) and its
        stochastic-rounding hash for the next launch. In an aligned launch a gradient that does not
        start at a multiple of ``ALIGN_BYTES`` steps from an aligned copy."""
        if self.aligned and g.data_ptr() % ts.ALIGN_BYTES:
            g = g.clone()
        if self.aligned and out is not None and out.data_ptr() % ts.ALIGN_BYTES:
            raise ValueError(f"an update buffer of an aligned launch starts at a multiple of {ts.ALIGN_BYTES} bytes")
        h = self.host[i]
        h[4] = g.data_ptr()
        self.keep[i][1] = g
        if out is not None:
            h[5] = out.data_ptr()
            self.keep[i][2] = out
        if sr_hash is not None:
            h[6] = sr_hash
        self._dirty = self.table is not self.host

    def run(self, hyper: torch.Tensor) -> None:
        if self.programs == 0:
            return
        if self._dirty:
            self.table.copy_(self.host, non_blocking=True)
            self._dirty = False
        hyper = hyper.to(device=self.table.device, dtype=torch.float32).contiguous()
        cx = {k: v for k, v in self.constexprs.items() if k != "UNIT"}
        launch_kernel(self.programs, self.table, self.tile_leaf, hyper, self.ftab, self.etab, self.links, **cx,
                      enable_fp_fusion=False)


class TritonSteps:
    """The triton backend's leaves of a :class:`~.plan.KernelPlan`: states and params stepped in
    place, one :class:`TritonLaunch` per static combination built once; each :meth:`run` writes
    the step's gradient addresses (and update buffers, rounding hashes) into the tables and
    launches (``torch_backend.CompiledSteps``' interface)."""

    def __init__(self, spec: StepSpec, leaves: Sequence[tuple], *, write: bool, sr: bool):
        """``leaves``: ``(param, grad, states, index, correction)`` each (no correction)."""
        _check(spec)
        self.spec, self.write, self.sr = spec, write, sr
        self.indices = [leaf[3] for leaf in leaves]
        groups: dict = {}
        for j, (p, g, states, index, corr) in enumerate(leaves):
            _check_correction(corr, p, write)
            if write and not p.is_contiguous():
                raise ValueError("the triton backend writes contiguous params in place only")
            stochastic = bool(write and sr and p.dtype is torch.bfloat16 and corr is None)
            pin = p if (spec.needs_param or write) else None
            out = p if write else torch.empty(g.shape, dtype=torch.float32, device=g.device)
            key = launch_key(spec, pin, g, states, write, stochastic, corr is not None, (out, corr))
            slots = [_inplace_slot(s) for s in states]
            groups.setdefault(key, []).append((j, (pin, g.contiguous(), out, slots, 0, corr), stochastic))
        self.launches = []  # (launch, [(leaf position, row, stochastic)])
        for key, items in groups.items():
            launch = TritonLaunch(spec, key, [it for _, it, _ in items])
            self.launches.append((launch, [(j, r, st) for r, (j, _, st) in enumerate(items)]))

    def run(self, grads: Sequence[torch.Tensor], hyper: torch.Tensor, sr_key: Optional[torch.Tensor]) -> list:
        outs: list = [None] * len(grads)
        for launch, members in self.launches:
            for j, r, stochastic in members:
                g = grads[j].contiguous()
                out = None if self.write else torch.empty(g.shape, dtype=torch.float32, device=g.device)
                h = rounding_hash(sr_key, self.indices[j]) if stochastic and sr_key is not None else None
                launch.set_leaf(r, g, out, h)
                outs[j] = out
            launch.run(hyper)
        return outs


def _check_correction(corr: Optional[torch.Tensor], p: Optional[torch.Tensor], write: bool) -> None:
    if corr is None:
        return
    if not (write and p is not None and p.dtype in (torch.bfloat16, torch.float16) and corr.dtype is torch.int8
            and corr.shape == p.shape and corr.is_contiguous() and p.is_contiguous()):
        raise ValueError("a param correction goes with a bfloat16 / float16 param written in place and is a "
                         f"contiguous int8 tensor of its shape (param {None if p is None else (p.dtype, tuple(p.shape))})")


def _inplace_slot(s) -> "_Slot":
    if isinstance(s, QTensor):
        codes = s.codes.view(torch.uint8)
        return _Slot(codes, codes, s.scale, s.scale, FORMAT_IDS[s.format])
    _storage(s)  # the error for what the kernel does not take
    if not s.is_contiguous():
        raise ValueError("the triton backend steps contiguous states in place")
    return _Slot(s, s, None, None, 0)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(ts.step_kernel, InterpretedFunction)


def _addr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def backend_rules() -> dict:
    """The rules each backend (``backend_choice.BACKENDS``, a test holds them equal) steps: native and
    torch every declared rule (``spec.RULES``), triton its kernel's."""
    return {"native": RULES, "compiled": RULES, "eager": RULES, "triton": ts.TRITON_RULES}


def _check(spec: StepSpec) -> None:
    if spec.rule not in ts.TRITON_RULES:
        have = [b for b, rules in backend_rules().items() if spec.rule in rules]
        raise NotImplementedError(f"the triton backend has no kernel for the {spec.rule} rule; the backends that "
                                  f"have it: {', '.join(have)} (LOWBIT_TREE_BACKEND)")


def run_step(spec: StepSpec, hyper: torch.Tensor, leaves: Sequence, *, write: bool = False, inplace: bool = False,
             sr_key: Optional[torch.Tensor] = None) -> tuple[list, list]:
    """:func:`.stepper.run_step` on the triton backend: the same arguments and results (leaves
    are :class:`.stepper.StepLeaf`), one launch per static combination."""
    _check(spec)
    if any(leaf.grad.device.type == "cpu" for leaf in leaves) and not _interpreted():
        raise RuntimeError("the triton backend steps CPU tensors only under Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported (or use LOWBIT_TREE_BACKEND=native)")
    outs: list = [None] * len(leaves)
    news: list = [None] * len(leaves)
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        p, g = leaf.param, leaf.grad
        _check_correction(leaf.correction, p, write)
        if len(leaf.states) != spec.nstates:
            raise ValueError(f"the {spec.rule} rule takes {spec.nstates} states per leaf, got {len(leaf.states)}")
        if (spec.needs_param or write) and (p is None or p.shape != g.shape):
            raise ValueError(f"{spec} needs a param of the gradient's shape {tuple(g.shape)}")
        if write and not p.is_contiguous():
            raise ValueError("the triton backend writes contiguous params in place only")
        corr = leaf.correction
        stochastic = bool(write and sr_key is not None and p.dtype is torch.bfloat16 and corr is None)
        if g.numel() == 0:
            outs[i] = None if write else torch.zeros(g.shape, dtype=torch.float32, device=g.device)
            news[i] = tuple(s if inplace else s.clone() for s in leaf.states)
            continue
        pin = p.contiguous() if p is not None and (spec.needs_param or write) else None
        g = g.contiguous()
        key = launch_key(spec, pin, g, leaf.states, write, stochastic, corr is not None, (corr,))
        slots, new = [], []
        for s in leaf.states:
            if isinstance(s, QTensor):
                codes = s.codes.view(torch.uint8)
                if inplace:
                    slots.append(_Slot(codes, codes, s.scale, s.scale, FORMAT_IDS[s.format]))
                    new.append(s)
                else:
                    c2, s2 = torch.empty_like(codes), torch.empty_like(s.scale)
                    slots.append(_Slot(codes, c2, s.scale, s2, FORMAT_IDS[s.format]))
                    new.append(s.with_parts({"codes": c2.view(s.codes.dtype), "scale": s2}))
            else:
                src = s.contiguous()
                dst = src if inplace and src is s else torch.empty_like(src)
                slots.append(_Slot(src, dst, None, None, 0))
                new.append(s if inplace else dst)
                if inplace and dst is not s:
                    raise ValueError("the triton backend steps non-contiguous states in place only as copies")
        out = p if write else torch.empty(g.shape, dtype=torch.float32, device=g.device)
        sr_hash = rounding_hash(sr_key, leaf.index) if stochastic else 0
        groups.setdefault(key, []).append((pin, g, out, slots, sr_hash, corr))
        outs[i] = None if write else out
        news[i] = tuple(new)
    for key, items in groups.items():
        TritonLaunch(spec, key, items).run(hyper)
    return outs, news
