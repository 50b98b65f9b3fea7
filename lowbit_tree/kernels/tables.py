"""Static lookup tables of the code maps, shared by every backend.

How the nearest code is found without a search. The reference rounds a float32
normalized value ``n`` to the nearest map value, ties to the larger one: the code
index is the number of exact (float64) midpoints ``<= n``. Since ``n`` is a
float32, ``n >= midpoint`` exactly when ``n >= T`` with ``T`` the smallest float32
``>= midpoint``, so the comparison can be made in float32. The thresholds ``T``
are sorted; a monotone integer key of ``n`` (its float bits, sign folded) shifted
right by ``shift`` names a *bucket* that holds at most one threshold. A small
per-table array ``base[bucket]`` counts the thresholds below the bucket, and the
index is ``base + (n >= T[base])``: two gathers and one comparison, in float32 /
int32 only (the torch backend). The native backend builds its own range table
from ``thresholds`` (cpu.c, ``lbt_prepare``).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from ..formats import FORMATS, Format, get_format

__all__ = ["CodeTable", "code_table", "cpu_code_table"]

_INF_BITS = 0x7F800000


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
      divisor: float32 ``(1,)``, the format's scale divisor (``absmax / divisor``): a tensor,
        so that inductor cannot rewrite the division into a multiply by its reciprocal, as it
        does a division by a constant on a non-CPU device.
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
    divisor: torch.Tensor


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
        decode = torch.arange(256, dtype=torch.int32, device="cpu").to(torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        encode = torch.arange(len(values), dtype=torch.int32, device="cpu").to(torch.uint8)
        decode = torch.zeros(256, dtype=torch.float32, device="cpu")
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
        divisor=torch.tensor([fmt.scale_divisor], dtype=torch.float32),
    )


# Built once at import (constants, like formats.TABLES); the compiled core reads
# only their static ints, the tensors are passed in as arguments.
CPU_TABLES: dict[str, CodeTable] = {name: _build_code_table(f) for name, f in FORMATS.items()}


def _mark_static(tab: CodeTable) -> CodeTable:
    # table sizes are compile-time constants (dynamic=True would make them symbols)
    for t in (tab.base, tab.thresholds, tab.decode, tab.encode, tab.divisor):
        torch._dynamo.mark_static(t)
    return tab


for _tab in CPU_TABLES.values():
    _mark_static(_tab)
del _tab


def cpu_code_table(name: str) -> CodeTable:
    return CPU_TABLES[name]


@functools.lru_cache(maxsize=64)
def _device_code_table(name: str, device: torch.device) -> CodeTable:
    t = cpu_code_table(name)
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
            divisor=t.divisor.to(device),
        )
    )


def code_table(format: str | Format, device: torch.device | str = "cpu") -> CodeTable:
    """The (cached, read-only) :class:`CodeTable` of a format on a device."""
    return _device_code_table(get_format(format).name, torch.device(device))
