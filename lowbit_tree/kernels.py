"""Fast quantize / dequantize and the fused low-bit Adam step, on plain tensors.

Everything here produces **bit-identical codes and scales** to the reference
quantizer :func:`lowbit_tree.qtensor.quantize_rows` (tested for every format).

How the nearest code is found without a search. The reference rounds a float32
normalized value ``n`` to the nearest map value, ties to the larger one: the code
index is the number of exact (float64) midpoints ``<= n``. Since ``n`` is a
float32, ``n >= midpoint`` exactly when ``n >= T`` with ``T`` the smallest float32
``>= midpoint``, so the comparison can be made in float32. The thresholds ``T``
are sorted; a monotone integer key of ``n`` (its float bits, sign folded) shifted
right by ``shift`` names a *bucket* that holds at most one threshold (``shift`` is
chosen per table so that this holds). A small per-table array ``base[bucket]``
counts the thresholds below the bucket, and the index is
``base + (n >= T[base])``: two gathers and one comparison, for every format (the
dynamic, linear and e4m3 maps alike), in float32 / int32 only.

Compiled and eager. :func:`adam_step_quantized` and the ``*_fast`` functions run
a ``torch.compile``-d core (``dynamic=True``; one graph per static combination of
formats, block sizes, whether a parameter is passed, and device — never per
parameter shape). Set the environment variable ``LOWBIT_TREE_EAGER=1`` or pass
``compile=False`` to run the same code eagerly (slower, no compilation).

Float contract. On CPU inductor compiles without floating-point contraction
(``-ffp-contract=off``) and its float32 ``sqrt`` and division are correctly
rounded, so compiled and eager results agree bit for bit. On CUDA the compiled
core is built with ``emulate_precision_casts`` (which turns Triton's FMA fusion
off) and Triton's ``div_rn`` / ``sqrt_rn``. Eager CPU ``torch.sqrt(float32)`` is
not correctly rounded, so the eager path takes the square root in float64
(:func:`_exact_sqrt`), as the reference does.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
from typing import Optional, Sequence

import numpy as np
import torch

from .formats import FORMATS, Format, get_format
from .qtensor import resolve_block_size, row_layout

__all__ = [
    "CodeTable",
    "code_table",
    "quantize_rows_fast",
    "dequantize_rows_fast",
    "dequantize_fast",
    "adam_hyperparams",
    "adam_step_quantized",
    "adam_step_quantized_",
    "adam_step_fp32_",
    "adam_steps_",
    "adam_step_reference",
    "use_compile",
]

_INF_BITS = 0x7F800000


# --------------------------------------------------------------------------- tables


@dataclasses.dataclass(frozen=True)
class CodeTable:
    """Static lookup data for one format, on one device.

    Attributes:
      shift, key_min, key_max, bucket_offset: static ints of the bucket map:
        ``rel = clamp(|bits|, key_min, key_max) - key_min``, ``key = rel`` (or
        ``~rel`` for negative values), ``bucket = (key >> shift) - bucket_offset``.
      last: the largest code index (``len(map) - 1``).
      base: int32 ``(nbuckets,)``, number of thresholds below each bucket.
      thresholds: float32 ``(len(map),)``, the float32 ceilings of the midpoints,
        then ``+inf``.
      bucket_thresholds: float32 ``(nbuckets,)``, the threshold inside each bucket
        (``+inf`` if none).
      decode: float32 ``(256,)``, code byte -> normalized value (fp8: the e4m3
        value of the byte, NaN for the NaN bytes; 4-bit: the first 16 entries).
      encode: uint8 ``(len(map),)``, code index -> stored byte (the index itself,
        or the float8 bits of the map value for fp8 formats).
    """

    shift: int
    key_min: int
    key_max: int
    bucket_offset: int
    last: int
    base: torch.Tensor
    thresholds: torch.Tensor
    bucket_thresholds: torch.Tensor
    decode: torch.Tensor
    encode: torch.Tensor


def _float32_ceil(x: np.ndarray) -> np.ndarray:
    """Smallest float32 >= each float64 value."""
    t = x.astype(np.float32)
    return np.where(t.astype(np.float64) < x, np.nextafter(t, np.float32(np.inf)), t)


def _build_code_table(fmt: Format) -> CodeTable:
    values = fmt.values.numpy()
    mids = fmt.midpoints.numpy()
    thr = _float32_ceil(mids)
    assert (thr.astype(np.float64) >= mids).all() and (np.diff(thr) > 0).all()
    mag = thr.view(np.int32).astype(np.int64) & 0x7FFFFFFF
    for shift in range(23, 0, -1):
        # Keys: clamp |bits| into [key_min, key_max] (one bucket below the
        # smallest and above the largest threshold magnitude, so clamping never
        # moves a value across a threshold; inf and NaN land in the top bucket),
        # rel = |bits| - key_min, key = rel for n >= 0 and ~rel for n < 0:
        # monotone in n and dense, so the table is small.
        key_min = max(0, ((int(mag.min()) >> shift) - 1) << shift)
        key_max = min(_INF_BITS, ((int(mag.max()) >> shift) + 1) << shift)
        rel = mag - key_min
        keys = np.where(thr < 0, ~rel, rel)
        kb = keys >> shift
        if (np.diff(kb) >= 1).all():
            break
    else:  # pragma: no cover - every map has distinct float32 midpoints
        raise AssertionError(f"no bucket shift separates the thresholds of {fmt.name}")
    top = (key_max - key_min) >> shift
    lo = ~top if fmt.signed else 0
    buckets = np.arange(lo, top + 1, dtype=np.int64)
    # number of thresholds whose bucket is below each bucket
    base = np.searchsorted(kb, buckets, side="left").astype(np.int32)
    thresholds = np.concatenate([thr, np.array([np.inf], np.float32)])
    # the one threshold inside each bucket (+inf if none): a lookup that does not
    # wait for ``base`` (idx = base[b] + (n >= bucket_thresholds[b]))
    bucket_thresholds = np.full(len(buckets), np.inf, dtype=np.float32)
    bucket_thresholds[kb - lo] = thr

    if fmt.float8:
        encode = torch.from_numpy(values.copy()).to(torch.float8_e4m3fn).view(torch.uint8)
        decode = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        encode = torch.arange(len(values), dtype=torch.int32).to(torch.uint8)
        decode = torch.zeros(256, dtype=torch.float32)
        decode[: len(values)] = torch.from_numpy(values.copy())
    return CodeTable(
        shift=shift,
        key_min=key_min,
        key_max=key_max,
        bucket_offset=int(lo),
        last=len(values) - 1,
        base=torch.from_numpy(base),
        thresholds=torch.from_numpy(thresholds),
        bucket_thresholds=torch.from_numpy(bucket_thresholds),
        decode=decode,
        encode=encode,
    )


# Built once at import (constants, like formats.TABLES); the compiled core reads
# only their static ints, the tensors are passed in as arguments.
_CPU_TABLES: dict[str, CodeTable] = {name: _build_code_table(f) for name, f in FORMATS.items()}


def _mark_static(tab: CodeTable) -> CodeTable:
    # table sizes are compile-time constants (dynamic=True would make them symbols)
    for t in (tab.base, tab.thresholds, tab.decode, tab.encode):
        torch._dynamo.mark_static(t)
    return tab


for _tab in _CPU_TABLES.values():
    _mark_static(_tab)
del _tab


def _cpu_code_table(name: str) -> CodeTable:
    return _CPU_TABLES[name]


@functools.lru_cache(maxsize=64)
def _device_code_table(name: str, device: torch.device) -> CodeTable:
    t = _cpu_code_table(name)
    if device.type == "cpu":
        return t
    return _mark_static(
        dataclasses.replace(
            t,
            base=t.base.to(device),
            thresholds=t.thresholds.to(device),
            bucket_thresholds=t.bucket_thresholds.to(device),
            decode=t.decode.to(device),
            encode=t.encode.to(device),
        )
    )


def code_table(format: str | Format, device: torch.device | str = "cpu") -> CodeTable:
    """The (cached, read-only) :class:`CodeTable` of a format on a device."""
    return _device_code_table(get_format(format).name, torch.device(device))


# --------------------------------------------------------------------------- mode


def use_compile(compile: Optional[bool] = None) -> bool:
    """Whether the compiled core runs: ``compile`` if given, else not when
    ``LOWBIT_TREE_EAGER=1`` (or ``true``/``yes``) is set, else yes."""
    if compile is not None:
        return bool(compile)
    return os.environ.get("LOWBIT_TREE_EAGER", "").strip().lower() not in ("1", "true", "yes", "on")


def _exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt (eager CPU's float32 sqrt is not)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return torch.sqrt(x)
    return torch.sqrt(x.double()).float()


# --------------------------------------------------------------------------- core (plain tensors)


def _nearest_index(n: torch.Tensor, fmt_name: str, base: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """int32 index of the nearest map value to float32 ``n`` (ties up; NaN -> last)."""
    tab = _CPU_TABLES[fmt_name]  # static ints only; the tensors come as arguments
    bits = n.view(torch.int32)
    rel = (bits & 0x7FFFFFFF).clamp(tab.key_min, tab.key_max) - tab.key_min
    key = torch.where(n < 0, ~rel, rel) if FORMATS[fmt_name].signed else rel
    # the clamps are no-ops that tell inductor the gathers are in bounds (no
    # wrap-around of negative indices, no bounds checks, vectorized code)
    bucket = ((key >> tab.shift) - tab.bucket_offset).clamp(0, tab.base.numel() - 1)
    b = base[bucket].clamp(0, tab.last + 1)
    idx = b + (n >= thresholds[b]).to(torch.int32)
    return idx.clamp(0, tab.last)


def _block_index(r: int, block_size: int, device) -> torch.Tensor:
    return torch.arange(r, device=device) // block_size


def _quantize_core(
    x2: torch.Tensor,
    base: torch.Tensor,
    thresholds: torch.Tensor,
    encode: torch.Tensor,
    fmt_name: str,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (rows, R) -> (codes uint8, scale float32); the reference's math."""
    fmt = FORMATS[fmt_name]
    rows, r = x2.shape
    nblocks = (r + block_size - 1) // block_size
    if not fmt.signed:
        x2 = torch.where(x2 < 0, torch.full_like(x2, float("nan")), x2)
    if fmt.sqrt:
        x2 = _exact_sqrt(x2)
    pad = nblocks * block_size - r
    xb = torch.nn.functional.pad(x2, (0, pad)).reshape(rows, nblocks, block_size)
    absmax = xb.abs().amax(dim=-1)
    absmax = torch.where(torch.isfinite(absmax), absmax, torch.full_like(absmax, float("nan")))
    scale = absmax / fmt.scale_divisor
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    n = x2 / safe[:, _block_index(r, block_size, x2.device)]
    idx = _nearest_index(n, fmt_name, base, thresholds)
    if fmt.bits == 4:
        idx = torch.nn.functional.pad(idx, (0, r % 2)).reshape(rows, (r + 1) // 2, 2)
        codes = (idx[..., 0] | (idx[..., 1] << 4)).to(torch.uint8)
    elif fmt.float8:
        codes = encode[idx]
    else:
        codes = idx.to(torch.uint8)
    return codes, scale


def _dequantize_core(
    codes: torch.Tensor, scale: torch.Tensor, decode: torch.Tensor, fmt_name: str, block_size: int, odd: bool
) -> torch.Tensor:
    """(uint8 codes, scale) -> float32 (rows, R); the reference's math.

    ``odd``: 4-bit rows hold an odd number R of codes (the last high nibble is padding).
    """
    fmt = FORMATS[fmt_name]
    rows = codes.shape[0]
    r = 2 * codes.shape[1] - int(odd) if fmt.bits == 4 else codes.shape[1]
    if fmt.bits == 4:
        c = codes.to(torch.int32)
        idx = torch.stack([c & 0x0F, c >> 4], dim=-1).reshape(rows, 2 * codes.shape[1])[:, :r]
    else:
        idx = codes.to(torch.int32)
    out = decode[idx] * scale[:, _block_index(r, block_size, codes.device)]
    if fmt.sqrt:
        out = out * out
    return out


def _adam_update(m, v, g, p, hyper):
    """The fused step's float32 math (every path: quantized or plain float32
    moments, eager or compiled; the C kernel's ``adam_block`` does the same
    operations): returns the new ``(m, v, out)``, ``out = p + (-lr) * (u + wd * p)``
    in p's dtype, or the direction ``u`` when ``p`` is None."""
    b1, omb1, b2, omb2, rbc1, rsbc2, eps, lr, wd = hyper.unbind(0)
    m = b1 * m + omb1 * g
    v = b2 * v + omb2 * (g * g)
    u = (m * rbc1) / (_exact_sqrt(v) * rsbc2 + eps)
    if p is None:
        return m, v, u
    pf = p.float()
    return m, v, (pf + (-lr) * (u + wd * pf)).to(p.dtype)


def _adam_core(
    p: Optional[torch.Tensor],
    g: torch.Tensor,
    m_codes: torch.Tensor,
    m_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    hyper: torch.Tensor,
    m_base: torch.Tensor,
    m_thresholds: torch.Tensor,
    m_decode: torch.Tensor,
    m_encode: torch.Tensor,
    v_base: torch.Tensor,
    v_thresholds: torch.Tensor,
    v_decode: torch.Tensor,
    v_encode: torch.Tensor,
    fmt_m: str,
    fmt_v: str,
    bs_m: int,
    bs_v: int,
    return_moments: bool = False,
):
    """One Adam step on a (rows, R) parameter with quantized moments.

    ``hyper`` is float32 ``[b1, 1-b1, b2, 1-b2, 1/bc1, 1/sqrt(bc2), eps, lr, wd]``.
    """
    r = g.shape[1]
    odd = bool(r % 2)
    m = _dequantize_core(m_codes, m_scale, m_decode, fmt_m, bs_m, odd)
    v = _dequantize_core(v_codes, v_scale, v_decode, fmt_v, bs_v, odd)
    m, v, out = _adam_update(m, v, g.float(), p, hyper)
    mc, ms = _quantize_core(m, m_base, m_thresholds, m_encode, fmt_m, bs_m)
    vc, vs = _quantize_core(v, v_base, v_thresholds, v_encode, fmt_v, bs_v)
    if return_moments:
        return out, mc, ms, vc, vs, m, v
    return out, mc, ms, vc, vs


# --------------------------------------------------------------------------- compiled entry points


def _compile_options(device_type: str) -> dict:
    # No FMA contraction in Triton, so moments equal eager's mul/add exactly.
    return {"emulate_precision_casts": True} if device_type == "cuda" else {}


_CORES = {"quantize": _quantize_core, "dequantize": _dequantize_core, "adam": _adam_core}


def _bound(*tensors):
    return _CORE(*tensors, *_STATIC)


def _bind_static(core, static: tuple):
    """``core`` with its trailing static arguments fixed, as a function with its
    own code object and globals: dynamo caches (and counts recompilations) per
    code object, and specializes on globals (block sizes stay compile-time
    constants even under ``dynamic=True``)."""
    glb = dict(globals())
    glb["_CORE"], glb["_STATIC"] = core, static
    code = _bound.__code__.replace(co_name=f"{core.__name__}_bound")
    return types.FunctionType(code, glb, code.co_name)


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, static: tuple, device_type: str):
    """One compiled callable per (kernel, static arguments, device type)."""
    return torch.compile(
        _bind_static(_CORES[kind], static), dynamic=True, fullgraph=True, options=_compile_options(device_type)
    )


def _run(kind: str, tensors: tuple, static: tuple, device: torch.device, compile: Optional[bool]):
    if use_compile(compile):
        return _compiled(kind, static, device.type)(*tensors)
    return _CORES[kind](*tensors, *static)


def _tables(tab: CodeTable):
    return tab.base, tab.thresholds, tab.decode, tab.encode


def _use_native(device: torch.device, backend: Optional[str]) -> bool:
    if backend not in (None, "auto", "native", "torch"):
        raise ValueError(f"backend must be None, 'auto', 'native' or 'torch', got {backend!r}")
    if device.type != "cpu" or backend == "torch":
        return False
    from . import kernels_cpu

    if backend == "native" and not kernels_cpu.available():
        raise RuntimeError("the native CPU kernels could not be built (no C compiler, or LOWBIT_TREE_NATIVE=0)")
    return kernels_cpu.available()


_CPU = torch.device("cpu")


def _native_on(backend: Optional[str]) -> bool:
    """:func:`_use_native` for CPU tensors (checked once per call, not per tensor)."""
    return _use_native(_CPU, backend)


def _f32c(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous float32 tensor (itself when it already is one)."""
    return t if t.dtype is torch.float32 and t.is_contiguous() else t.float().contiguous()


def quantize_rows_fast(
    x2: torch.Tensor,
    fmt: str | Format,
    block_size: int,
    *,
    compile: Optional[bool] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for :func:`lowbit_tree.qtensor.quantize_rows`: same ``(codes, scale)``,
    bit for bit.

    Args:
      x2: floating ``(rows, R)`` tensor (any float dtype; computed in float32).
      fmt: a :class:`Format` or format name.
      block_size: elements per block within a row.
      compile: torch path only: compiled (default) or eager (``False`` or
        ``LOWBIT_TREE_EAGER=1``).
      backend: ``None``/``"auto"``: the native C kernel on CPU when it builds, else
        the torch path; ``"native"`` or ``"torch"`` to force one.
    Returns:
      codes ``(rows, R)`` uint8 (float8_e4m3fn for fp8 formats; ``(rows, ceil(R/2))``
      for 4-bit) and scale float32 ``(rows, ceil(R / block_size))``.
    """
    fmt = get_format(fmt)
    rows, r = x2.shape
    ncols = (r + 1) // 2 if fmt.bits == 4 else r
    nblocks = -(-r // block_size)
    if x2.numel() == 0:
        codes = torch.zeros(rows, ncols, dtype=fmt.code_dtype, device=x2.device)
        return codes, torch.zeros(rows, nblocks, dtype=torch.float32, device=x2.device)
    if _use_native(x2.device, backend):
        from . import kernels_cpu

        codes = torch.empty(rows, ncols, dtype=torch.uint8)
        scale = torch.empty(rows, nblocks, dtype=torch.float32)
        kernels_cpu.quantize(x2.detach().float().contiguous(), fmt.name, block_size, codes, scale)
    else:
        tab = code_table(fmt, x2.device)
        codes, scale = _run(
            "quantize", (x2.detach().float(), tab.base, tab.thresholds, tab.encode), (fmt.name, block_size), x2.device, compile
        )
    if fmt.float8:
        codes = codes.view(torch.float8_e4m3fn)
    return codes, scale


def dequantize_rows_fast(
    codes: torch.Tensor,
    scale: torch.Tensor,
    fmt: str | Format,
    block_size: int,
    r: int,
    *,
    compile: Optional[bool] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Codes and scale of a ``(rows, r)`` row view -> float32 ``(rows, r)``, bit-identical
    to :func:`lowbit_tree.qtensor.dequantize`."""
    fmt = get_format(fmt)
    rows = codes.shape[0]
    if rows == 0 or r == 0:
        return torch.zeros(rows, r, dtype=torch.float32, device=codes.device)
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8)
    if _use_native(codes.device, backend):
        from . import kernels_cpu

        out = torch.empty(rows, r, dtype=torch.float32)
        kernels_cpu.dequantize(codes.contiguous(), scale.float().contiguous(), fmt.name, block_size, r, out)
        return out
    tab = code_table(fmt, codes.device)
    return _run("dequantize", (codes, scale, tab.decode), (fmt.name, block_size, bool(r % 2)), codes.device, compile)


def dequantize_fast(q, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor:
    """:func:`lowbit_tree.dequantize` of a :class:`~lowbit_tree.QTensor`, on the fast path."""
    rows, r = row_layout(q.shape)
    out = dequantize_rows_fast(q.codes, q.scale, q.format, q.block_size, r, **kwargs)
    return out.reshape(q.shape).to(dtype)


# --------------------------------------------------------------------------- Adam


def adam_hyperparams(
    *, count, lr, b1: float, b2: float, eps: float, weight_decay: float = 0.0, device=None
) -> torch.Tensor:
    """float32 ``[b1, 1-b1, b2, 1-b2, 1/bc1, 1/sqrt(bc2), eps, lr, wd]`` for
    :func:`adam_step_quantized`.

    ``count`` is the number of steps already taken (the bias corrections use
    ``count + 1``: ``bc = 1 - b ** (count + 1)``; ``1/bc1`` and ``1/sqrt(bc2)`` are
    computed in float64, then rounded to float32). Reciprocals, so that the step
    multiplies where it would divide: a float32 division or square root costs
    several multiplications on CPUs. ``count`` and ``lr`` may be Python numbers or
    0-d tensors (no host sync then).
    """
    if isinstance(count, torch.Tensor) or isinstance(lr, torch.Tensor):
        dev = device if device is not None else (count.device if isinstance(count, torch.Tensor) else lr.device)
        c = torch.as_tensor(count, device=dev).to(torch.float64) + 1
        bc1 = 1 - torch.pow(torch.tensor(b1, dtype=torch.float64, device=dev), c)
        bc2 = 1 - torch.pow(torch.tensor(b2, dtype=torch.float64, device=dev), c)
        consts = torch.tensor([b1, 1 - b1, b2, 1 - b2], dtype=torch.float64, device=dev)
        tail = torch.tensor([eps], dtype=torch.float64, device=dev)
        lr_t = torch.as_tensor(lr, device=dev).to(torch.float64).reshape(1)
        wd_t = torch.tensor([weight_decay], dtype=torch.float64, device=dev)
        return torch.cat([consts, (1 / bc1).reshape(1), bc2.rsqrt().reshape(1), tail, lr_t, wd_t]).float()
    c = int(count) + 1
    vals = [b1, 1 - b1, b2, 1 - b2, 1 / (1 - b1**c), 1 / math.sqrt(1 - b2**c), eps, float(lr), weight_decay]
    return torch.tensor(vals, dtype=torch.float32, device=device)


def _bs_pair(block_size, fm: Format, fv: Format) -> tuple[int, int]:
    if isinstance(block_size, (tuple, list)):
        return resolve_block_size(fm, block_size[0]), resolve_block_size(fv, block_size[1])
    return resolve_block_size(fm, block_size), resolve_block_size(fv, block_size)


def adam_step_quantized(
    p32: Optional[torch.Tensor],
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_scale: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    fmt_m: str | Format,
    fmt_v: str | Format,
    block_size: int | None | tuple[int | None, int | None] = None,
    shape: Optional[Sequence[int]] = None,
    count=0,
    lr=1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    hyper: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    state_out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    compile: Optional[bool] = None,
    backend: Optional[str] = None,
    return_moments: bool = False,
):
    """Fused Adam(W) step with block-quantized moments, on plain tensors.

    Per element, in float32: ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*(g*g)``,
    ``u = (m * (1/bc1)) / (sqrt(v) * (1/sqrt(bc2)) + eps)`` with ``bc = 1 - b**(count+1)``
    (the reciprocals rounded to float32 once per step: one division and one square
    root per element, the root shared with ``sqrt`` formats' transform); the new
    ``m`` and ``v`` are requantized (codes bit-identical to
    :func:`~lowbit_tree.qtensor.quantize_rows` of those float32 moments). One pass
    per tile of whole blocks: the float32 moments never exist for the whole tensor.

    Args:
      p32: the parameter (float32 for the native in-place path; any float dtype
        otherwise), any shape with ``numel == prod(shape)``, or ``None``.
      grad: gradient, same numel (any float dtype; used as float32).
      m_codes, m_scale, v_codes, v_scale: the moments' codes and scales in the
        ``(rows, R)`` row layout of ``shape`` (as held by a ``QTensor``).
      fmt_m, fmt_v: formats of the moments (e.g. ``"dynamic8"``, ``"dynamic8_sqrt"``).
      block_size: int, or ``(bs_m, bs_v)``; ``None`` takes each format's default.
      shape: logical shape (default ``grad.shape``).
      count: steps taken so far (int or 0-d tensor); lr, b1, b2, eps, weight_decay:
        hyperparameters. ``hyper``: a precomputed :func:`adam_hyperparams` tensor
        (overrides them; build it once per step to save per-parameter overhead).
      out: where to write the result (may be ``p32`` itself: in-place update).
      state_out: ``(m_codes, m_scale, v_codes, v_scale)`` to write the new state
        into (may be the input tensors themselves: in-place).
      compile, backend: see :func:`quantize_rows_fast`.
      return_moments: also return the new float32 moments (tests / debugging).

    Returns:
      ``(out, m_codes, m_scale, v_codes, v_scale)``: ``out`` is the new parameter
      ``p + (-lr) * (u + weight_decay * p)`` in ``p32``'s dtype and shape when
      ``p32`` is given, else the Adam direction ``u`` (float32, ``shape``); codes in
      the formats' code dtypes. Inputs are not modified unless passed as ``out`` /
      ``state_out``.
    """
    fm, fv = get_format(fmt_m), get_format(fmt_v)
    bs_m, bs_v = _bs_pair(block_size, fm, fv)
    shape = tuple(grad.shape) if shape is None else tuple(int(s) for s in shape)
    rows, r = row_layout(shape)
    device = grad.device
    if hyper is None:
        hyper = adam_hyperparams(count=count, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, device=device)
    if rows * r == 0:
        res = (
            (torch.zeros(shape, device=device) if p32 is None else p32.clone()) if out is None else out,
            *(state_out if state_out is not None else (m_codes.clone(), m_scale.clone(), v_codes.clone(), v_scale.clone())),
        )
        if return_moments:
            return res + (torch.zeros(rows, r, device=device), torch.zeros(rows, r, device=device))
        return res
    native = _use_native(device, backend) and (p32 is None or p32.dtype == torch.float32)
    if native:
        from . import kernels_cpu

        target = out  # a non-contiguous or non-float32 ``out`` gets the result copied in
        if out is None or out.dtype != torch.float32 or not out.is_contiguous():
            out = torch.empty(shape, dtype=torch.float32)
        if state_out is None:
            state_out = (torch.empty_like(m_codes), torch.empty_like(m_scale), torch.empty_like(v_codes), torch.empty_like(v_scale))
        mc_o, ms_o, vc_o, vs_o = state_out
        m32 = torch.empty(rows, r) if return_moments else None
        v32 = torch.empty(rows, r) if return_moments else None
        p_c = None if p32 is None else p32.detach().contiguous()
        kernels_cpu.adam(
            rows, r, p_c, grad.detach().float().contiguous(), out,
            m_codes.view(torch.uint8), m_scale, v_codes.view(torch.uint8), v_scale,
            mc_o.view(torch.uint8), ms_o, vc_o.view(torch.uint8), vs_o, m32, v32, hyper.float().contiguous(),
            fm.name, bs_m, fv.name, bs_v,
        )
        if target is not None and target is not out:
            target.copy_(out.view(target.shape))
            out = target
        res = (out, mc_o, ms_o, vc_o, vs_o)
        return res + ((m32, v32) if return_moments else ())
    tm, tv = code_table(fm, device), code_table(fv, device)
    p2 = None if p32 is None else p32.reshape(rows, r)
    res = _run(
        "adam",
        (p2, grad.reshape(rows, r), m_codes.view(torch.uint8), m_scale, v_codes.view(torch.uint8), v_scale, hyper)
        + _tables(tm)
        + _tables(tv),
        (fm.name, fv.name, bs_m, bs_v, return_moments),
        device,
        compile,
    )
    new, mc, ms, vc, vs = res[:5]
    new = new.reshape(shape)
    if fm.float8:
        mc = mc.view(torch.float8_e4m3fn)
    if fv.float8:
        vc = vc.view(torch.float8_e4m3fn)
    if out is not None:
        out.copy_(new)
        new = out
    if state_out is not None:
        for dst, src in zip(state_out, (mc, ms, vc, vs)):
            dst.view(torch.uint8).copy_(src.view(torch.uint8)) if dst.dtype != torch.float32 else dst.copy_(src)
        mc, ms, vc, vs = state_out
    return (new, mc, ms, vc, vs) + tuple(res[5:])
def adam_step_quantized_(steps: Sequence[tuple], *, backend: Optional[str] = None) -> None:
    """:func:`adam_step_quantized` for many parameters, **in place**: each step is
    ``(p32, grad, m_codes, m_scale, v_codes, v_scale, fmt_m, fmt_v, block_size, hyper)``
    and overwrites ``p32`` and the four state tensors.

    On CPU with the native kernels, every contiguous float32 parameter goes into
    one call that shares the tiles of all of them out among the threads (per
    parameter: a row of integers, no foreign call, no thread wake-up); the rest
    runs one :func:`adam_step_quantized` each. Results are bit-identical to
    calling :func:`adam_step_quantized` per parameter.
    """
    adam_steps_(steps, (), backend=backend)


def adam_step_fp32_(steps: Sequence[tuple], *, backend: Optional[str] = None) -> None:
    """The Adam(W) step of :func:`adam_step_quantized` on plain float32 moments, **in
    place**: each step is ``(p32, grad, exp_avg, exp_avg_sq, hyper)`` (float32 param
    and moments, :func:`adam_hyperparams` vector) and overwrites ``p32``,
    ``exp_avg`` and ``exp_avg_sq``.

    For the many small tensors (norms, biases) that keep float32 state: on CPU
    with the native kernels all contiguous ones go into one call (torch's
    multi-tensor Adam on CPU dispatches about 15 kernels per tensor). Elsewhere
    the same float32 operations run eagerly, one param at a time. Elementwise
    and deterministic: a shard's result does not depend on where it starts.
    """
    adam_steps_((), steps, backend=backend)


def adam_steps_(quantized: Sequence[tuple] = (), fp32: Sequence[tuple] = (), *,
                backend: Optional[str] = None) -> None:
    """:func:`adam_step_quantized_` and :func:`adam_step_fp32_` together, **in place**:
    on CPU with the native kernels, the params of both kinds that it can take go into
    one call (one parallel region for a whole param group); the others run as those
    two functions describe."""
    use_native = _native_on(backend)
    jobs = []
    for p32, grad, mc, ms, vc, vs, fmt_m, fmt_v, block_size, hyper in quantized:
        fm, fv = get_format(fmt_m), get_format(fmt_v)
        bs_m, bs_v = _bs_pair(block_size, fm, fv)
        rows, r = row_layout(p32.shape)
        if rows * r == 0:
            continue
        native = (
            p32.is_cpu
            and use_native
            and p32.dtype is torch.float32
            and all(t.is_contiguous() for t in (p32, mc, ms, vc, vs))
            and ms.dtype is torch.float32
            and vs.dtype is torch.float32
        )
        if not native:
            adam_step_quantized(
                p32, grad, mc, ms, vc, vs, fmt_m=fm, fmt_v=fv, block_size=(bs_m, bs_v), shape=tuple(p32.shape),
                hyper=hyper, out=p32, state_out=(mc, ms, vc, vs), backend=backend,
            )
            continue
        g32, h32 = _f32c(grad), _f32c(hyper)  # kept alive by ``jobs`` until the call below
        mcu = mc if mc.dtype is torch.uint8 else mc.view(torch.uint8)
        vcu = vc if vc.dtype is torch.uint8 else vc.view(torch.uint8)
        jobs.append((rows, r, p32, g32, p32, mcu, ms, vcu, vs, mcu, ms, vcu, vs, None, None, h32, fm.name, bs_m, fv.name, bs_v))
    fp32_jobs = []
    for p32, grad, m, v, hyper in fp32:
        if p32.numel() == 0:
            continue
        if p32.is_cpu and use_native and all(t.dtype is torch.float32 and t.is_contiguous() for t in (p32, m, v)):
            fp32_jobs.append((p32, _f32c(grad), m, v, _f32c(hyper)))
            continue
        m_new, v_new, p_new = _adam_update(m, v, grad.float(), p32, hyper.to(p32.device).float())
        m.copy_(m_new)
        v.copy_(v_new)
        p32.copy_(p_new)
    if jobs or fp32_jobs:
        from . import kernels_cpu

        kernels_cpu.adam_many(jobs, fp32_jobs)


def adam_step_reference(
    p32: Optional[torch.Tensor],
    grad: torch.Tensor,
    m,
    v,
    *,
    count: int,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float = 0.0,
):
    """The unfused composition on :class:`~lowbit_tree.QTensor` records, with the
    core's reference functions (eager, float32). Returns ``(out, m_q, v_q, m32, v32)``."""
    from .qtensor import QTensor, dequantize, quantize_rows

    hyper = adam_hyperparams(count=count, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    b1_, omb1, b2_, omb2, rbc1, rsbc2, eps_, lr_, wd = [hyper[i] for i in range(9)]
    g = grad.float().reshape(m.shape)
    m32 = b1_ * dequantize(m) + omb1 * g
    v32 = b2_ * dequantize(v) + omb2 * (g * g)
    u = (m32 * rbc1) / (torch.sqrt(v32.double()).float() * rsbc2 + eps_)
    if p32 is not None:
        pf = p32.float()
        out = (pf + (-lr_) * (u + wd * pf)).to(p32.dtype)
    else:
        out = u
    rows, r = row_layout(m.shape)
    fm, fv = get_format(m.format), get_format(v.format)
    mc, ms = quantize_rows(m32.reshape(rows, r), fm, m.block_size)
    vc, vs = quantize_rows(v32.reshape(rows, r), fv, v.block_size)
    return (
        out,
        QTensor(mc, ms, m.shape, m.block_size, m.format),
        QTensor(vc, vs, v.shape, v.block_size, v.format),
        m32,
        v32,
    )
