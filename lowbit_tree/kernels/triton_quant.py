"""Quantize and dequantize in Triton: block records' rows (every block format) and the rank-1
record's parts (decode, row and column maxima, 4-bit codes), with the bits of the native kernel
and of the references (:mod:`lowbit_tree.qtensor`, :mod:`lowbit_tree.rank1`).

The block kernels are the step kernel's own state code (``triton_step.load_state`` and
``store_state``: float32 division ``div_rn``, root ``sqrt_rn``, codes by the threshold search
``triton_step.code_index``) over a one-slot address table, with the step's tile layout: a
program quantizes ``L`` elements of a row (``L`` a multiple of the block size and of 2), or ``k``
short rows. The rank-1 encode divides by ``min(row_max, col_max)`` (1 where that is not > 0,
NaN where either is NaN) with ``div_rn``; its maxima are taken on the values' bits (a negative or
NaN value: NaN), as ``cpu.c`` does, by torch's integer ``amax`` (exact in any order; a kernel
looping over a runtime row length fails under triton 3.6's interpreter with a current numpy).
Launched with ``enable_fp_fusion=False``.

On CUDA tensors it compiles for the GPU; on CPU tensors it runs under Triton's interpreter
(``TRITON_INTERPRET=1``). Imported only where the triton backend is chosen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import get_format
from ..rank1 import RANK1_FORMAT
from . import triton_step as ts
from .triton_backend import FORMAT_IDS, MAX_TILE, format_tables, tile_length, tile_unit, triton_next_pow2

__all__ = ["quantize_rows", "dequantize_rows", "rank1_values", "rank1_maxima", "rank1_encode", "block_fits"]

_RANK1_BLOCK = 1024
"""Elements of a row one rank-1 program takes (even: a program's 4-bit bytes are its own)."""


@triton.jit
def _quantize_kernel(x, slot, ftab, etab, R, rows, tpr, Rp, k, K: tl.constexpr, BS: tl.constexpr,
                     NB: tl.constexpr, L: tl.constexpr, TILE: tl.constexpr):
    geo = ts.tile_geometry(tl.program_id(0), R, rows, tpr, Rp, k, L, TILE, False)
    base, loc, valid = geo[2], geo[3], geo[4]
    v = tl.load(x + base + loc, mask=valid, other=0.0)
    ts.store_state(slot, geo, R, v, ftab, etab, K, BS, NB, L, TILE, False)


@triton.jit
def _dequantize_kernel(out, slot, ftab, R, rows, tpr, Rp, k, K: tl.constexpr, BS: tl.constexpr,
                       L: tl.constexpr, TILE: tl.constexpr):
    geo = ts.tile_geometry(tl.program_id(0), R, rows, tpr, Rp, k, L, TILE, False)
    base, loc, valid = geo[2], geo[3], geo[4]
    v = ts.load_state(slot, geo, R, ftab, K, BS, L, TILE, False)
    tl.store(out + base + loc, v, mask=valid)


def block_fits(block_size: int) -> bool:
    """Whether a block of this size fits the kernels' tile (``triton_backend.tile_length``)."""
    try:
        tile_length([block_size])
    except ValueError:
        return False
    return True


def _launch_shape(rows: int, R: int, block_size: int) -> tuple[int, dict, dict]:
    """(programs, runtime layout, constexprs) of a block kernel over ``(rows, R)``."""
    L, unit = tile_length([block_size]), tile_unit([block_size])
    tile = triton_next_pow2(L)
    Rp = -(-R // unit) * unit
    if Rp <= L // 2:  # short rows: k of them a program
        k, tpr = L // Rp, 1
        programs = -(-rows // k)
    else:
        k, Rp, tpr = 1, L, -(-R // L)
        programs = rows * tpr
    return programs, dict(R=R, rows=rows, tpr=tpr, Rp=Rp, k=k), dict(BS=block_size, L=L, TILE=tile)


def _slot(codes_in, codes_out, scale_in, scale_out, fmt_name: str, device) -> torch.Tensor:
    """The one-slot address table ``triton_step.SLOT_FIELDS`` names."""
    addr = [0 if t is None else t.data_ptr() for t in (codes_in, codes_out, scale_in, scale_out)]
    return torch.tensor(addr + [FORMAT_IDS[fmt_name], 0], dtype=torch.int64).to(device)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(_quantize_kernel, InterpretedFunction):
            raise RuntimeError("the triton quantizers run CPU tensors only under Triton's interpreter: set "
                               "TRITON_INTERPRET=1 before triton is imported (or use LOWBIT_TREE_BACKEND=native)")


def _check_block(block_size: int) -> None:
    if not block_fits(block_size):
        raise ValueError(f"block_size={block_size} does not fit the triton kernels' tile (a block of at most "
                         f"{MAX_TILE} elements and its least common multiple with 2); "
                         "choose a smaller block size")


def quantize_rows(x2: torch.Tensor, fmt_name: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``(rows, R)`` (computed in float32) -> ``(codes uint8, scale float32)``: the codes of
    :func:`lowbit_tree.qtensor.quantize_rows` (``(rows, ceil(R/2))`` for 4-bit; fp8's bytes)."""
    fmt = get_format(fmt_name)
    _check_device(x2)
    _check_block(block_size)
    rows, R = x2.shape
    dev = x2.device
    codes = torch.empty(rows, (R + 1) // 2 if fmt.bits == 4 else R, dtype=torch.uint8, device=dev)
    scale = torch.empty(rows, -(-R // block_size), dtype=torch.float32, device=dev)
    if x2.numel() == 0:
        return codes.zero_(), scale.zero_()
    x = x2.detach().float().contiguous()
    ftab, etab = format_tables(dev)
    programs, layout, cx = _launch_shape(rows, R, block_size)
    slot = _slot(None, codes, None, scale, fmt.name, dev)
    nb = triton_next_pow2(-(-cx["TILE"] // block_size))
    _quantize_kernel[(programs,)](x, slot, ftab, etab, **layout, K=fmt.bits, NB=nb, **cx, enable_fp_fusion=False)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, fmt_name: str, block_size: int, r: int) -> torch.Tensor:
    """``(codes, scale)`` of a ``(rows, r)`` row view -> float32 ``(rows, r)``, the values of
    :func:`lowbit_tree.qtensor.dequantize`."""
    fmt = get_format(fmt_name)
    _check_device(codes)
    _check_block(block_size)
    rows = codes.shape[0]
    dev = codes.device
    out = torch.empty(rows, r, dtype=torch.float32, device=dev)
    if rows == 0 or r == 0:
        return out
    codes = codes.view(torch.uint8).contiguous()
    scale = scale.float().contiguous()
    ftab, _ = format_tables(dev)
    programs, layout, cx = _launch_shape(rows, r, block_size)
    slot = _slot(codes, None, scale, None, fmt.name, dev)
    _dequantize_kernel[(programs,)](out, slot, ftab, **layout, K=fmt.bits, **cx, enable_fp_fusion=False)
    return out


# ----------------------------------------------------------------------------- rank-1 records
@triton.jit
def _rank1_norm(rm, cm):
    """min(row_max, col_max), NaN where either is (torch.minimum; cpu.c's rank1_norm)."""
    m = tl.where(cm != cm, float("nan"), tl.where(cm < rm, cm, rm))
    return tl.where(rm != rm, float("nan"), m)


@triton.jit
def _rank1_decode_kernel(codes, row_max, col_max, dec, out, R, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = j < R
    b = tl.load(codes + i * ((R + 1) // 2) + j // 2, mask=valid, other=0).to(tl.int32)
    c = tl.where(j % 2 == 0, b & 15, b >> 4)
    nm = _rank1_norm(tl.load(row_max + i), tl.load(col_max + j, mask=valid, other=0.0))
    tl.store(out + i * R + j, tl.load(dec + c) * nm, mask=valid)


@triton.jit
def _rank1_encode_kernel(x, row_max, col_max, thr, codes, R, last, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = j < R
    v = tl.load(x + i * R + j, mask=valid, other=0.0)
    nm = _rank1_norm(tl.load(row_max + i), tl.load(col_max + j, mask=valid, other=0.0))
    q = tl.where(v < 0.0, float("nan"), tl.div_rn(v, tl.where(nm > 0.0, nm, 1.0)))
    c = tl.where(valid, ts.code_index(q, thr, last, 4), 0)
    lo, hi = tl.split(tl.reshape(c, (BLOCK // 2, 2)))
    p = tl.program_id(1).to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    tl.store(codes + i * ((R + 1) // 2) + p, (lo | (hi << 4)).to(tl.uint8), mask=2 * p < R)


def _rank1_grid(rows: int, R: int) -> tuple[int, int]:
    return rows, -(-R // _RANK1_BLOCK)


def rank1_values(q) -> torch.Tensor:
    """float32 ``(rows, R)``: a :class:`~lowbit_tree.rank1.Rank1QTensor`'s values
    (:func:`lowbit_tree.rank1.rank1_dequantize`'s bits)."""
    from ..qtensor import row_layout

    rows, R = row_layout(q.shape)
    dev = q.codes.device
    _check_device(q.codes)
    out = torch.empty(rows, R, dtype=torch.float32, device=dev)
    if rows and R:
        ftab, _ = format_tables(dev)
        dec = ftab[FORMAT_IDS[q.format]]
        _rank1_decode_kernel[_rank1_grid(rows, R)](q.codes.contiguous(), q.row_max.float().contiguous(),
                                                  q.col_max.float().contiguous(), dec, out, R, BLOCK=_RANK1_BLOCK,
                                                  enable_fp_fusion=False)
    return out


def rank1_maxima(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(rows,)`` and ``(R,)``: the row and column maxima of float32 ``(rows, R)`` values
    (a negative or NaN value makes its row's and column's maximum NaN; 0 for no element)."""
    _check_device(x2)
    rows, R = x2.shape
    dev = x2.device
    row_max = torch.zeros(rows, dtype=torch.float32, device=dev)
    col_max = torch.zeros(R, dtype=torch.float32, device=dev)
    if rows and R:  # maxima of the bits: integers, exact in any order, so torch's own amax
        x = x2.float()
        bits = torch.where(x >= 0.0, x.view(torch.int32) & 0x7FFFFFFF, 0x7FC00000)  # negative or NaN: NaN's
        row_max = bits.amax(dim=1).view(torch.float32)
        col_max = bits.amax(dim=0).view(torch.float32)
    return row_max, col_max


def rank1_encode(x2: torch.Tensor, row_max: torch.Tensor, col_max: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Writes into ``codes`` (uint8 ``(rows, ceil(R/2))``, contiguous) the rank-1 codes of float32
    ``(rows, R)`` values with these maxima (:func:`lowbit_tree.rank1.rank1_quantize`'s); returns it."""
    _check_device(x2)
    rows, R = x2.shape
    if not codes.is_contiguous() or codes.dtype is not torch.uint8 or tuple(codes.shape) != (rows, (R + 1) // 2):
        raise ValueError(f"rank1_encode writes contiguous uint8 codes of shape {(rows, (R + 1) // 2)}, got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    if rows and R:
        ftab, _ = format_tables(x2.device)
        thr = ftab[FORMAT_IDS[RANK1_FORMAT], 256:]
        last = get_format(RANK1_FORMAT).values.numel() - 1
        _rank1_encode_kernel[_rank1_grid(rows, R)](x2.float().contiguous(), row_max.float().contiguous(),
                                                  col_max.float().contiguous(), thr, codes, R, last,
                                                  BLOCK=_RANK1_BLOCK, enable_fp_fusion=False)
    return codes
