"""bfloat16 stochastic rounding and the hash its random bits come from.

One definition for every backend: the torch ops here, and the native kernel, which draws the
same bits from :func:`rounding_hash` (a Python int handed to C). Kept apart from
:mod:`lowbit_tree.update` so that the kernels, which round their outputs, and ``update``, which
calls the kernels, import it without importing each other.
"""
from __future__ import annotations

import torch

__all__ = ["rounding_hash", "stochastic_round"]

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding uint32 values.

    Products are taken modulo 2**64 by int64 wrap-around; masking keeps the low
    32 bits, which wrap-around leaves exact.
    """
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _key_hash(key: torch.Tensor, leaf_index: int, device) -> torch.Tensor:
    """The 32-bit hash of ``(key words, leaf_index)`` (int64 0-d tensor)."""
    words = key.reshape(-1).to(device=device, dtype=torch.int64)
    h = _mix32(words[0] + 0x9E3779B9 * (leaf_index + 1))
    for i in range(1, words.numel()):
        h = _mix32(h ^ _mix32(words[i]))
    return h


def _random_bits(key: torch.Tensor, leaf_index: int, numel: int, device) -> torch.Tensor:
    """``numel`` hashed uint32 values (as int64) for one leaf under ``key``: element
    ``i`` gets ``mix(mix(i) ^ (mix((i >> 32) + h) + h))`` (the native kernel draws the
    same bits from :func:`rounding_hash`)."""
    h = _key_hash(key, leaf_index, device)
    idx = torch.arange(numel, device=device, dtype=torch.int64)
    return _mix32(_mix32(idx & _MASK32) ^ (_mix32((idx >> 32) + h) + h))


def _mix32_int(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rounding_hash(key: torch.Tensor, leaf_index: int) -> int:
    """:func:`_key_hash` on the host, as a Python int (reads ``key``: a CPU tensor
    costs nothing, a CUDA one a sync)."""
    words = [int(w) for w in key.reshape(-1).tolist()]
    h = _mix32_int(words[0] + 0x9E3779B9 * (leaf_index + 1))
    for w in words[1:]:
        h = _mix32_int(h ^ _mix32_int(w))
    return h


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, key: torch.Tensor, leaf_index: int = 0) -> torch.Tensor:
    """Round float32 ``x`` to ``dtype``: stochastically for bfloat16, to nearest otherwise.

    For bf16 the low 16 bits of the float32 pattern are dropped after adding 16
    random bits, so ``E[result] == x`` for finite values. Non-finite values round
    to nearest.
    """
    if dtype != torch.bfloat16:
        return x.to(dtype)
    x = x.float()
    r = (_random_bits(key, leaf_index, x.numel(), x.device) & 0xFFFF).to(torch.int32).reshape(x.shape)
    bits = (x.view(torch.int32) + r) & -65536
    rounded = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero
    return torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))


