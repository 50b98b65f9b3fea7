"""The fast quantize / dequantize of block records' rows, on the backend :func:`.backend_choice.backend_for`
picks: codes and scales bit-identical to the reference quantizer in :mod:`lowbit_tree.qtensor`.

On CUDA the automatic choice takes the triton kernels (:mod:`.triton_quant`) where triton is
importable and the block fits their tile (:func:`_backend`), as the step does; the compiled
backend only where it cannot."""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import Format, get_format
from ..qtensor import row_layout
from . import backend_choice, native, torch_backend
from .backend_choice import backend_for

__all__ = ["quantize_rows_fast", "dequantize_rows_fast", "dequantize_fast"]


def _backend(device: torch.device, backend: Optional[str], block_size: int) -> str:
    """:func:`backend_for`, except that the automatic choice on CUDA is triton where
    :func:`.backend_choice.auto_triton` and the block fits the kernels' tile."""
    which = backend_for(device, backend)
    if which == "compiled" and backend_choice.auto_triton(device, backend):
        from . import triton_quant  # imports triton: only here

        if triton_quant.block_fits(block_size):
            return "triton"
    return which


def quantize_rows_fast(x2: torch.Tensor, fmt: str | Format, block_size: int, *, backend: Optional[str] = None):
    """Drop-in for :func:`lowbit_tree.qtensor.quantize_rows`: same ``(codes, scale)``, bit for bit.

    Args:
      x2: floating ``(rows, R)`` tensor (any float dtype; computed in float32).
      fmt: a :class:`Format` or format name.
      block_size: elements per block within a row.
      backend: ``None`` (``LOWBIT_TREE_BACKEND``), or one of :data:`BACKENDS`.
    Returns:
      codes ``(rows, R)`` uint8 (float8_e4m3fn for fp8 formats; ``(rows, ceil(R/2))``
      for 4-bit) and scale float32 ``(rows, ceil(R / block_size))``.
    """
    fmt = get_format(fmt)
    rows, r = x2.shape
    ncols = (r + 1) // 2 if fmt.bits == 4 else r
    nblocks = -(-r // block_size)
    dev = x2.device
    if x2.numel() == 0:
        codes = torch.zeros(rows, ncols, dtype=fmt.code_dtype, device=dev)
        return codes, torch.zeros(rows, nblocks, dtype=torch.float32, device=dev)
    which = _backend(dev, backend, block_size)
    if which == "native":
        codes = torch.empty(rows, ncols, dtype=torch.uint8, device=dev)
        scale = torch.empty(rows, nblocks, dtype=torch.float32, device=dev)
        native.quantize(x2.detach().float().contiguous(), fmt.name, block_size, codes, scale)
    elif which == "triton":
        from . import triton_quant

        codes, scale = triton_quant.quantize_rows(x2, fmt.name, block_size)
    else:
        codes, scale = torch_backend.quantize_rows(x2, fmt.name, block_size, compile=which == "compiled")
    if fmt.float8:
        codes = codes.view(torch.float8_e4m3fn)
    return codes, scale


def dequantize_rows_fast(codes: torch.Tensor, scale: torch.Tensor, fmt: str | Format, block_size: int, r: int, *,
                         backend: Optional[str] = None) -> torch.Tensor:
    """Codes and scale of a ``(rows, r)`` row view -> float32 ``(rows, r)``, bit-identical
    to :func:`lowbit_tree.qtensor.dequantize`."""
    fmt = get_format(fmt)
    rows = codes.shape[0]
    dev = codes.device
    if rows == 0 or r == 0:
        return torch.zeros(rows, r, dtype=torch.float32, device=dev)
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8)
    which = _backend(dev, backend, block_size)
    if which == "native":
        out = torch.empty(rows, r, dtype=torch.float32, device=dev)
        native.dequantize(codes.contiguous(), scale.float().contiguous(), fmt.name, block_size, r, out)
        return out
    if which == "triton":
        from . import triton_quant

        return triton_quant.dequantize_rows(codes, scale, fmt.name, block_size, r)
    return torch_backend.dequantize_rows(codes, scale, fmt.name, block_size, r, compile=which == "compiled")


def dequantize_fast(q, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor:
    """:func:`lowbit_tree.dequantize` of a :class:`~lowbit_tree.QTensor`, on the fast path."""
    rows, r = row_layout(q.shape)
    out = dequantize_rows_fast(q.codes, q.scale, q.format, q.block_size, r, **kwargs)
    return out.reshape(q.shape).to(dtype)
