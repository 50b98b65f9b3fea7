"""The step as one ``@triton.jit`` kernel: the same float32 operations in the same order as
``cpu.c``'s ``rule_run`` and its block quantizer (``kernels/spec.py``'s docstring), so a GPU (and
Triton's interpreter on CPU) gives the native kernel's bits.

What makes the bits equal: every division is ``tl.div_rn`` and every root ``tl.sqrt_rn``
(Triton's ``/`` and ``tl.sqrt`` lower to approximate PTX); the kernel is launched and compiled
with ``enable_fp_fusion=False`` (no contraction of ``a * b + c`` into an fma); ``tl.fma`` stands
exactly where ``cpu.c`` calls ``fmaf`` (torch.lerp's one rounding in Muon's momentum and
centered RMSprop's gradient average). The codes: the count of a format's float32 thresholds
``<= x / scale`` by binary search over the table (NaN: the last index), the reference
quantizer's rule, which every fast path of ``cpu.c`` is checked against at load.

One program steps one tile: ``L`` elements of one row of one leaf (``L`` a multiple of every
quantized state's block size and of 2, so blocks and 4-bit bytes never straddle programs). A
launch covers every leaf of a (group, static combination): each leaf's addresses come from an
int64 table row (:data:`LEAF_FIELDS`), each program's leaf from an int32 map, both built once
(``triton_backend``). Imported only where triton is (``LOWBIT_TREE_BACKEND=triton``).

Index math: a tile's start is int64 (a leaf may pass 2**31 elements), its lanes int32 from it.
Two forms of each variant (``ALIGNED``, in the launch key): where every address of a leaf's row
is a multiple of :data:`ALIGN_BYTES` and its rows of whole :data:`ALIGN_ELEMS` vectors (and blocks),
its lanes are contiguous from an aligned start and the pointers carry that as hints
(``tl.multiple_of``), so the compiler may load and store them as vectors (128-bit for float32
params and gradients); any other leaf (an offset view, an odd row) takes the general form, the
same arithmetic on the same elements.
"""
from __future__ import annotations

import re
from pathlib import Path

import triton
import triton.language as tl

from .spec import HYPER_NAMES, RULE_IDS

__all__ = ["step_kernel", "TRITON_RULES", "LEAF_FIELDS", "SLOT_FIELDS", "LEAF_ROW", "FMT_STRIDE",
           "ALIGN_BYTES", "ALIGN_ELEMS", "tile_geometry", "load_state", "store_state", "code_index",
           "STORAGE_F32", "STORAGE_BF16", "STORAGE_Q8", "STORAGE_Q4", "DT_F32", "DT_BF16", "DT_F16"]

TRITON_RULES = tuple(r for r in RULE_IDS if re.search(rf'RULE_IDS\["{r}"\]', Path(__file__).read_text()))
"""The declared rules (``spec.RULE_IDS``) whose math this kernel has: those whose id it names for
a branch (``_ADAM = tl.constexpr(RULE_IDS["adam"])``), read from this file, so a rule declared
without a branch here is refused by name (``triton_backend``), with no list to keep."""

LEAF_FIELDS = ("R", "tiles_per_row", "tile_start", "p", "g", "out", "sr_hash", "corr", "rows", "Rp", "k")
"""A leaf's int64 table row, header: row length, tiles per row, the leaf's first program, the
param, gradient and output addresses, the stochastic-rounding hash, the param's int8 correction
(``lowbit_tree.correction``; read and written in place), the rows, and how a program lays them
out: ``k`` rows of ``Rp`` lanes each (``Rp`` the row length rounded up to the tile's block
multiple) where rows are shorter than a tile, else one piece of ``Rp = L`` lanes of one row."""
SLOT_FIELDS = ("in", "out", "scale_in", "scale_out", "fmt", "unused")
"""Then per state slot (3): codes or values in and out, scales in and out, the format's row in
the format table."""
LEAF_ROW = len(LEAF_FIELDS) + 3 * len(SLOT_FIELDS)

ALIGN_BYTES = 16
"""The aligned variant's promise about every address of a leaf's table row (one 128-bit load)..."""
ALIGN_ELEMS = 32
"""... and about its row length (so about every tile's start and length): a multiple of this many
elements (16 bytes of a 4-bit state)."""

FMT_STRIDE = 520
"""float32 entries per format in the format table: 256 decoded values, 256 thresholds (+inf
padded), then divisor, last index, sqrt flag, unsigned flag."""

STORAGE_F32, STORAGE_BF16, STORAGE_Q8, STORAGE_Q4 = 0, 1, 8, 4
DT_F32, DT_BF16, DT_F16 = 0, 1, 2

_ROW = tl.constexpr(LEAF_ROW)
_HDR = tl.constexpr(len(LEAF_FIELDS))
_SLOT = tl.constexpr(len(SLOT_FIELDS))
_FMT = tl.constexpr(FMT_STRIDE)
_AB = tl.constexpr(ALIGN_BYTES)
_AE = tl.constexpr(ALIGN_ELEMS)
_ADAM = tl.constexpr(RULE_IDS["adam"])
_LION = tl.constexpr(RULE_IDS["lion"])
_MOMENTUM = tl.constexpr(RULE_IDS["momentum"])
_ADEMAMIX = tl.constexpr(RULE_IDS["ademamix"])
_MUON = tl.constexpr(RULE_IDS["muon"])
_RMSPROP = tl.constexpr(RULE_IDS["rmsprop"])
_ADAGRAD = tl.constexpr(RULE_IDS["adagrad"])
_ADAMAX = tl.constexpr(RULE_IDS["adamax"])
_ADADELTA = tl.constexpr(RULE_IDS["adadelta"])
_RADAM = tl.constexpr(RULE_IDS["radam"])
_NADAM = tl.constexpr(RULE_IDS["nadam"])


def _hyper_index(name: str) -> tl.constexpr:
    """Where the hyperparameter vector holds ``name`` (``spec.HYPER_NAMES``; cpu.c's ``LBT_H_<NAME>``)."""
    return tl.constexpr(HYPER_NAMES.index(name))


_H_B1, _H_OMB1, _H_B2, _H_OMB2 = (_hyper_index(n) for n in ("b1", "omb1", "b2", "omb2"))
_H_RBC1, _H_RSBC2, _H_EPS, _H_LR = (_hyper_index(n) for n in ("rbc1", "rsbc2", "eps", "lr"))
_H_WD, _H_L2, _H_B3, _H_OMB3 = (_hyper_index(n) for n in ("wd", "l2", "b3", "omb3"))
_H_ALPHA, _H_CM, _H_RECT, _H_CG = (_hyper_index(n) for n in ("alpha", "cm", "rect", "cg"))


@triton.jit
def _typed(addr, TY: tl.constexpr, ALIGNED: tl.constexpr):
    """An address (int64) as a pointer to TY; in the aligned variant hinted a multiple of
    :data:`ALIGN_BYTES` (the launcher checked it; a hint on the int64 does not survive the cast),
    which lets the loads and stores through it be vectors."""
    ptr = addr.to(tl.pointer_type(TY))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, _AB)
    return ptr


@triton.jit
def _ptr(row, k, TY: tl.constexpr, ALIGNED: tl.constexpr):
    """The pointer at ``k`` of a leaf's table row."""
    return _typed(tl.load(row + k), TY, ALIGNED)


@triton.jit
def _load_plain(addr, base, loc, valid, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Elements ``base + loc`` (an int64 scalar, int32 lanes) of the tensor at ``addr``, as float32."""
    if DT == 0:
        x = tl.load(_typed(addr, tl.float32, ALIGNED) + base + loc, mask=valid, other=0.0)
    elif DT == 1:
        h = tl.load(_typed(addr, tl.uint16, ALIGNED) + base + loc, mask=valid, other=0)
        x = (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(_typed(addr, tl.float16, ALIGNED) + base + loc, mask=valid, other=0.0).to(tl.float32)
    return x


@triton.jit
def _bf16_bits(x):
    """torch's float -> bfloat16: to nearest even, NaN -> 0x7FC0."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, r).to(tl.uint16)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _bf16_stochastic(x, idx, h):
    """lowbit_tree.rounding.stochastic_round of element ``idx`` (int64) under hash ``h``."""
    c = _mix32(((idx >> 32).to(tl.uint32) + h)) + h
    r = _mix32(_mix32(idx.to(tl.uint32)) ^ c) & 0xFFFF
    u = x.to(tl.uint32, bitcast=True)
    s = ((u + r) & 0xFFFF0000) >> 16
    return tl.where((u & 0x7F800000) == 0x7F800000, _bf16_bits(x), s.to(tl.uint16))


@triton.jit
def _store_plain(addr, base, loc, valid, x, DT: tl.constexpr, ALIGNED: tl.constexpr):
    if DT == 0:
        tl.store(_typed(addr, tl.float32, ALIGNED) + base + loc, x, mask=valid)
    elif DT == 1:
        tl.store(_typed(addr, tl.uint16, ALIGNED) + base + loc, _bf16_bits(x), mask=valid)
    else:
        tl.store(_typed(addr, tl.float16, ALIGNED) + base + loc, x.to(tl.float16), mask=valid)


@triton.jit
def _scale_at(g, R, BS: tl.constexpr, L: tl.constexpr):
    """(the tile's first block scale: int64, each lane's from it: int32) of block size BS."""
    r0, j0, lrow, lcol = g[0], g[1], g[5], g[6]
    nb = (R + BS - 1) // BS
    return r0 * nb + j0 // BS, lrow * tl.minimum(nb, L).to(tl.int32) + lcol // BS


@triton.jit
def _codes_in(cptr, g, K: tl.constexpr, TILE: tl.constexpr):
    """The tile's code bytes (8-bit) or nibbles (4-bit: the even element in the low one; a lane
    pair's byte)."""
    base, loc, valid, pbase, ploc, pvalid = g[2], g[3], g[4], g[7], g[8], g[9]
    if K == 8:
        c = tl.load(cptr + base + loc, mask=valid, other=0).to(tl.int32)
    else:
        b = tl.load(cptr + pbase + ploc, mask=pvalid, other=0).to(tl.int32)
        c = tl.reshape(tl.join(b & 15, b >> 4), (TILE,))
    return c


@triton.jit
def load_state(slot, g, R, ftab, K: tl.constexpr, BS: tl.constexpr, L: tl.constexpr, TILE: tl.constexpr,
                ALIGNED: tl.constexpr):
    """State values of the tile as float32: plain values, or codes decoded (``dec[c] * s``,
    squared for the sqrt formats)."""
    base, loc, valid = g[2], g[3], g[4]
    if K == 0:
        x = _load_plain(tl.load(slot + 0), base, loc, valid, 0, ALIGNED)
    elif K == 1:
        x = _load_plain(tl.load(slot + 0), base, loc, valid, 1, ALIGNED)
    else:
        c = _codes_in(_ptr(slot, 0, tl.uint8, ALIGNED), g, K, TILE)
        sfirst, sloc = _scale_at(g, R, BS, L)
        s = tl.load(_ptr(slot, 2, tl.float32, ALIGNED) + sfirst + sloc, mask=valid, other=0.0)
        f = ftab + tl.load(slot + 4) * _FMT
        t = tl.load(f + c) * s
        x = tl.where(tl.load(f + 514) != 0.0, t * t, t)
    return x


@triton.jit
def _block_max(bits, BS: tl.constexpr, NB: tl.constexpr, TILE: tl.constexpr):
    """Each element's block maximum of ``bits`` (int32, >= 0), blocks of BS from the tile's start."""
    if (BS & (BS - 1)) == 0 and TILE % BS == 0:
        m = tl.max(tl.reshape(bits, (TILE // BS, BS)), axis=1)
        out = tl.reshape(tl.broadcast_to(m[:, None], (TILE // BS, BS)), (TILE,))
    else:
        sel = (tl.arange(0, TILE) // BS)[None, :] == tl.arange(0, NB)[:, None]
        m = tl.max(tl.where(sel, bits[None, :], 0), axis=1)
        out = tl.max(tl.where(sel, m[:, None], 0), axis=0)
    return out


@triton.jit
def code_index(n, thr, last, STEPS: tl.constexpr):
    """The code index of normalized values ``n``: the count of the format's thresholds ``thr``
    (float32, ``last`` of them) ``<= n``, by binary search in ``STEPS`` halvings; NaN: ``last``."""
    idx = tl.zeros(n.shape, tl.int32)
    for k in tl.static_range(STEPS):
        cand = idx + (1 << (STEPS - 1 - k))
        ok = cand <= last
        tk = tl.load(thr + tl.where(ok, cand - 1, 0))
        idx = tl.where(ok & (tk <= n), cand, idx)
    return tl.where(n != n, last, idx)


@triton.jit
def store_state(slot, g, R, x, ftab, etab, K: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr, L: tl.constexpr,
                 TILE: tl.constexpr, ALIGNED: tl.constexpr):
    """The new values ``x`` of a state: plain, or transformed (sqrt; NaN for a negative value of
    an unsigned map), block scale ``absmax / divisor`` (NaN for a non-finite absmax), codes of
    ``t / scale`` (``scale`` 1 where it is not > 0)."""
    base, loc, valid, lcol, pbase, ploc, pvalid = g[2], g[3], g[4], g[6], g[7], g[8], g[9]
    if K == 0:
        _store_plain(tl.load(slot + 1), base, loc, valid, x, 0, ALIGNED)
    elif K == 1:
        _store_plain(tl.load(slot + 1), base, loc, valid, x, 1, ALIGNED)
    else:
        fid = tl.load(slot + 4)
        f = ftab + fid * _FMT
        divisor = tl.load(f + 512)
        last = tl.load(f + 513).to(tl.int32)
        t = tl.where(tl.load(f + 514) != 0.0, tl.sqrt_rn(x), x)
        t = tl.where(tl.load(f + 515) != 0.0, tl.where(t < 0.0, float("nan"), t), t)
        bits = tl.where(valid, t.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        amax = _block_max(bits, BS, NB, TILE)
        s = tl.where(amax >= 0x7F800000, float("nan"), tl.div_rn(amax.to(tl.float32, bitcast=True), divisor))
        sfirst, sloc = _scale_at(g, R, BS, L)
        tl.store(_ptr(slot, 3, tl.float32, ALIGNED) + sfirst + sloc, s, mask=valid & (lcol % BS == 0))
        n = tl.div_rn(t, tl.where(s > 0.0, s, 1.0))
        idx = code_index(n, f + 256, last, 8 if K == 8 else 4)
        code = tl.load(etab + fid * 256 + idx).to(tl.int32)
        cptr = _ptr(slot, 1, tl.uint8, ALIGNED)
        if K == 8:
            tl.store(cptr + base + loc, code.to(tl.uint8), mask=valid)
        else:
            code = tl.where(valid, code, 0)
            lo, hi = tl.split(tl.reshape(code, (TILE // 2, 2)))
            tl.store(cptr + pbase + ploc, (lo | (hi << 4)).to(tl.uint8), mask=pvalid)


@triton.jit
def _correction_scale(q, PDT: tl.constexpr):
    """lowbit_tree.correction.correction_scale: ulp(q) / 256 as float32, q the param's float32 value."""
    MANT: tl.constexpr = 7 if PDT == 1 else 10
    EMIN: tl.constexpr = -126 if PDT == 1 else -14
    e = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    biased = e - MANT - 8 + 127
    normal = tl.maximum(biased, 1) << 23
    sub = tl.full(biased.shape, 1, tl.int32) << tl.minimum(tl.maximum(biased + 22, 0), 22)
    return tl.where(biased >= 1, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def _rint(v):
    """Round to nearest even, for |v| < 2**22 (the magic-number sum; no contraction)."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _param_bits(x, PDT: tl.constexpr):
    """x rounded to nearest even into the param dtype, as its 16 bits (int32, sign-extended)."""
    if PDT == 1:
        b = _bf16_bits(x).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        b = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return b


@triton.jit
def _param_value(b, PDT: tl.constexpr):
    """The float32 value of param bits b (int32 holding int16)."""
    if PDT == 1:
        v = ((b & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        v = b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return v


@triton.jit
def _finite(v):
    return (v.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def _corrected_write(pptr, cptr, loc, valid, p, u, PDT: tl.constexpr):
    """lowbit_tree.correction: x = (p + c * scale(p)) + u; p' = x to nearest even, or the neighbour
    above where the rest would be 128; c' = rint((x - p') / scale(p')) clamped to int8, 0 where p' is
    not finite."""
    c = tl.load(cptr + loc, mask=valid, other=0).to(tl.float32)
    x = (p + c * _correction_scale(p, PDT)) + u
    b = _param_bits(x, PDT)
    q = _param_value(b, PDT)
    r = _rint(tl.div_rn(x - q, _correction_scale(q, PDT)))
    up = tl.where(b >= 0, b + 1, tl.where(b == -32768, 1, b - 1))
    qa = _param_value(up, PDT)
    move = (r > 127.0) & _finite(q) & _finite(qa)
    b = tl.where(move, up, b)
    q = tl.where(move, qa, q)
    r = tl.where(move, _rint(tl.div_rn(x - q, _correction_scale(q, PDT))), r)
    r = tl.where(_finite(q), tl.where(r < -128.0, -128.0, tl.where(r > 127.0, 127.0, r)), 0.0)
    tl.store(pptr + loc, b.to(tl.uint16), mask=valid)
    tl.store(cptr + loc, r.to(tl.int8), mask=valid)


@triton.jit
def tile_geometry(t, R, rows, tpr, Rp, k, L: tl.constexpr, TILE: tl.constexpr, ALIGNED: tl.constexpr):
    """Program ``t`` of a leaf's tiles (``tpr`` a row, ``k`` rows of ``Rp`` lanes each, or a piece of
    one row of ``Rp = L`` lanes): ``(r0, j0, base, loc, valid, lrow, lcol, pbase, ploc, pvalid)``,
    the tile's first row and column, where it starts (int64, elements; ``pbase``: 4-bit bytes),
    each lane's int32 offset from there, validity, row and column in the tile, and each lane
    pair's byte offset and validity. The step kernel's tile, and :mod:`.triton_quant`'s."""
    q = t // tpr  # this program's first row r0 and column j0: k rows of Rp lanes, or a piece of one row
    r0 = (q * k).to(tl.int64)
    j0 = (t - q * tpr).to(tl.int64) * L
    kr = tl.minimum(rows - r0, k).to(tl.int32)  # the tile's rows, and lanes of each
    cw = tl.minimum(R - j0, Rp).to(tl.int32)
    # int64 where a tile starts (element, 4-bit byte), int32 lanes from it: R, nb and cc clamped
    # to L multiply only a short-row tile's rows (R <= L / 2) among the valid lanes
    base = r0 * R + j0
    cc = (R + 1) // 2
    pbase = r0 * cc + j0 // 2
    lane = tl.arange(0, TILE)
    if ALIGNED:  # rows of whole tiles' multiples (Rp == R), every address aligned: lanes contiguous
        base = tl.multiple_of(base, _AE)
        pbase = tl.multiple_of(pbase, _AE // 2)
        n = tl.multiple_of(kr * cw, _AE)
        lrow = 0
        lcol = lane
        loc = lane
        valid = lane < n
        ploc = tl.arange(0, TILE // 2)
        pvalid = ploc < tl.multiple_of(n // 2, _AE // 2)
    else:
        lrow = lane // Rp
        lcol = lane - lrow * Rp
        loc = lrow * tl.minimum(R, L).to(tl.int32) + lcol
        valid = (lrow < kr) & (lcol < cw)
        pl = 2 * tl.arange(0, TILE // 2)  # 4-bit codes: each lane pair's byte
        plrow = pl // Rp
        plcol = pl - plrow * Rp
        ploc = plrow * tl.minimum(cc, L).to(tl.int32) + plcol // 2
        pvalid = (plrow < kr) & (plcol < cw)
    return r0, j0, base, loc, valid, lrow, lcol, pbase, ploc, pvalid


@triton.jit
def _lerp(a, c, w):
    """torch.lerp's float32 result, one rounding (cpu.c's fmaf)."""
    if tl.abs(w) < 0.5:
        r = tl.fma(w, c - a, a)
    else:
        r = tl.fma(w - 1.0, c - a, c)
    return r


@triton.jit(do_not_specialize=["links"])
def step_kernel(leaves, tile_leaf, hyper, ftab, etab, links,
                RULE: tl.constexpr, VAR: tl.constexpr, NS: tl.constexpr,
                K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                BS0: tl.constexpr, BS1: tl.constexpr, BS2: tl.constexpr,
                NB0: tl.constexpr, NB1: tl.constexpr, NB2: tl.constexpr,
                PDT: tl.constexpr, GDT: tl.constexpr, P: tl.constexpr,
                WRITE: tl.constexpr, SR: tl.constexpr, CORR: tl.constexpr, L: tl.constexpr, TILE: tl.constexpr,
                ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    row_ptr = leaves + tl.load(tile_leaf + pid) * _ROW
    R = tl.load(row_ptr + 0)
    tpr = tl.load(row_ptr + 1).to(tl.int32)
    t = pid - tl.load(row_ptr + 2).to(tl.int32)
    rows = tl.load(row_ptr + 8)
    Rp = tl.load(row_ptr + 9).to(tl.int32)
    k = tl.load(row_ptr + 10).to(tl.int32)
    geo = tile_geometry(t, R, rows, tpr, Rp, k, L, TILE, ALIGNED)  # the tile the state functions take
    r0, j0, base, loc, valid, lrow, lcol, pbase, ploc, pvalid = geo
    s0 = row_ptr + _HDR
    s1 = row_ptr + _HDR + _SLOT
    s2 = row_ptr + _HDR + 2 * _SLOT

    b1 = tl.load(hyper + _H_B1)
    omb1 = tl.load(hyper + _H_OMB1)
    b2 = tl.load(hyper + _H_B2)
    omb2 = tl.load(hyper + _H_OMB2)
    rbc1 = tl.load(hyper + _H_RBC1)
    rsbc2 = tl.load(hyper + _H_RSBC2)
    eps = tl.load(hyper + _H_EPS)
    nlr = -tl.load(hyper + _H_LR)
    wd = tl.load(hyper + _H_WD)
    l2 = tl.load(hyper + _H_L2)

    p = tl.zeros((TILE,), tl.float32)
    if P:
        p = _load_plain(tl.load(row_ptr + 3), base, loc, valid, PDT, ALIGNED)
    g = _load_plain(tl.load(row_ptr + 4), base, loc, valid, GDT, ALIGNED)
    g = tl.where((links & 1) != 0, -g, g)  # the fused links: runtime flags (spec.FLAGS' order)
    g = tl.where((links & 2) != 0, g + l2 * p, g)

    x0 = load_state(s0, geo, R, ftab, K0, BS0, L, TILE, ALIGNED)
    if NS > 1:
        x1 = load_state(s1, geo, R, ftab, K1, BS1, L, TILE, ALIGNED)
    else:
        x1 = x0
    if NS > 2:
        x2 = load_state(s2, geo, R, ftab, K2, BS2, L, TILE, ALIGNED)
    else:
        x2 = x0

    if RULE == _ADAM or RULE == _ADEMAMIX:
        m = b1 * x0 + omb1 * g
        v = b2 * x1 + omb2 * (g * g)
        sr = tl.sqrt_rn(v)
        num = m * rbc1
        n2 = x2
        if RULE == _ADEMAMIX:
            b3 = tl.load(hyper + _H_B3)
            omb3 = tl.load(hyper + _H_OMB3)
            alpha = tl.load(hyper + _H_ALPHA)
            n2 = b3 * x2 + omb3 * g
            num = num + alpha * n2
        elif VAR:
            n2 = tl.where((v > x2) | (v != v), v, x2)
            sr = tl.sqrt_rn(n2)
        u = tl.div_rn(num, sr * rsbc2 + eps)
        n0 = m
        n1 = v
    elif RULE == _LION:
        c = b1 * x0 + omb1 * g
        u = tl.where(c > 0.0, 1.0, tl.where(c < 0.0, -1.0, 0.0))
        n0 = b2 * x0 + omb2 * g
        n1 = x1
        n2 = x2
    elif RULE == _MUON:
        b = _lerp(x0, g, omb1)
        u = b
        if VAR:
            u = _lerp(g, b, b1)
        n0 = b
        n1 = x1
        n2 = x2
    elif RULE == _RMSPROP:
        v = b2 * x0 + omb2 * (g * g)
        n1 = x1
        n2 = x2
        if VAR & 2:
            if VAR & 1:
                a = _lerp(x2, g, omb2)
                n2 = a
            else:
                a = _lerp(x1, g, omb2)
                n1 = a
            d = tl.sqrt_rn(v - a * a) + eps
        else:
            d = tl.sqrt_rn(v) + eps
        u = tl.div_rn(g, d)
        if VAR & 1:
            u = b1 * x1 + u
            n1 = u
        n0 = v
    elif RULE == _ADAGRAD:
        s = tl.where(x0 < b1, b1, x0) + g * g
        u = tl.div_rn(g, tl.sqrt_rn(s) + eps)
        n0 = s
        n1 = x1
        n2 = x2
    elif RULE == _ADAMAX:  # states (e, m): e = max(b2*e, |g| + eps), NaN if either is (cpu.c's amsgrad_max)
        be = b2 * x0
        ge = tl.abs(g) + eps
        n0 = tl.where((be > ge) | (be != be), be, ge)
        n1 = b1 * x1 + omb1 * g
        n2 = x2
        u = tl.div_rn(n1 * rbc1, n0)
    elif RULE == _ADADELTA:  # states (v, a), b2 its rho; a's new value from the old one and u
        n0 = b2 * x0 + omb2 * (g * g)
        u = tl.div_rn(tl.sqrt_rn(x1 + eps), tl.sqrt_rn(n0 + eps)) * g
        n1 = b2 * x1 + omb2 * (u * u)
        n2 = x2
    elif RULE == _RADAM:  # states (v, m); cm and rect this step's (spec.radam_terms)
        cm = tl.load(hyper + _H_CM)
        rect = tl.load(hyper + _H_RECT)
        n0 = b2 * x0 + omb2 * (g * g)
        n1 = b1 * x1 + omb1 * g
        num = n1 * cm
        u = tl.where(rect != 0.0, tl.div_rn(num, tl.sqrt_rn(n0) + eps), num)
        n2 = x2
    elif RULE == _NADAM:  # states (v, m); cg and cm this step's (spec.nadam_terms)
        cg = tl.load(hyper + _H_CG)
        cm = tl.load(hyper + _H_CM)
        n0 = b2 * x0 + omb2 * (g * g)
        n1 = b1 * x1 + omb1 * g
        u = tl.div_rn(cg * g + cm * n1, tl.sqrt_rn(n0) * rsbc2 + eps)
        n2 = x2
    else:  # momentum
        b = b1 * x0 + g
        u = b
        if VAR:
            u = g + b1 * b
        n0 = b
        n1 = x1
        n2 = x2

    u = tl.where((links & 4) != 0, u + wd * p, u)
    u = tl.where((links & 8) != 0, nlr * u, u)
    if CORR:
        _corrected_write(_ptr(row_ptr, 3, tl.uint16, ALIGNED) + base, _ptr(row_ptr, 7, tl.int8, ALIGNED) + base, loc,
                         valid, p, u, PDT)
    elif WRITE:
        y = p + u
        if PDT == 1 and SR:
            h = tl.load(row_ptr + 6).to(tl.uint32)
            y16 = _bf16_stochastic(y, base + loc.to(tl.int64), h)
            tl.store(_ptr(row_ptr, 3, tl.uint16, ALIGNED) + base + loc, y16, mask=valid)
        else:
            _store_plain(tl.load(row_ptr + 3), base, loc, valid, y, PDT, ALIGNED)
    else:
        tl.store(_ptr(row_ptr, 5, tl.float32, ALIGNED) + base + loc, u, mask=valid)

    store_state(s0, geo, R, n0, ftab, etab, K0, BS0, NB0, L, TILE, ALIGNED)
    if NS > 1:
        store_state(s1, geo, R, n1, ftab, etab, K1, BS1, NB1, L, TILE, ALIGNED)
    if NS > 2:
        store_state(s2, geo, R, n2, ftab, etab, K2, BS2, NB2, L, TILE, ALIGNED)
