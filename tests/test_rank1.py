"""The rank-1 record (lowbit_tree.rank1): the reference quantizer against a brute-force
threshold count, and the native kernel's encode against the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lowbit_tree.formats import get_format
from lowbit_tree.qtensor import row_layout
from lowbit_tree.kernels import native
from lowbit_tree.rank1 import RANK1_FORMAT, rank1_dequantize, rank1_quantize

NATIVE = pytest.mark.skipif(not native.available(), reason="no C compiler")
SHAPES = [(0, 5), (4, 0), (1, 1), (3, 7), (37, 301), (2, 4500), (3, 2, 9)]


def values(shape, seed, specials=True):
    """Non-negative values over many octaves, with zeros, and (``specials``) a negative
    entry, a NaN, an inf and denormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 4)
    flat = x.view(-1)
    n = flat.numel()
    if n > 8:
        flat[0] = 0.0
        flat[n // 3] = 1e-44
        if specials:
            flat[n // 2] = -1e-3
            flat[n - 1] = float("nan")
            flat[n // 5] = float("inf")
    return x


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", [(3, 7), (37, 31), (2, 9, 4)])
def test_reference_codes_are_the_threshold_count(shape, seed):
    """Each code is the number of midpoints of the map <= x / min(row_max, col_max) (each
    maximum over the non-negative entries), computed element by element in numpy."""
    x = values(shape, seed, specials=False)
    q = rank1_quantize(x)
    x2 = x.reshape(shape[0], -1).numpy()
    rows, r = x2.shape
    table = get_format(RANK1_FORMAT).values.double().numpy()
    mids = (table[1:] + table[:-1]) / 2
    want = np.zeros((rows, r), dtype=np.int64)
    for i in range(rows):
        for j in range(r):
            norm = min(x2[i].max(), x2[:, j].max())
            qv = np.float32(x2[i, j]) / np.float32(norm if norm > 0 else 1.0)
            want[i, j] = int(np.sum(mids <= float(qv)))
    codes = q.codes.numpy().astype(np.int64)
    got = np.stack([codes & 15, codes >> 4], -1).reshape(rows, -1)[:, :r]
    assert np.array_equal(got, want)
    assert np.array_equal(q.row_max.numpy(), x2.max(1)) and np.array_equal(q.col_max.numpy(), x2.max(0))
    if r % 2:  # the pad nibble of an odd row is 0
        assert not (q.codes[:, -1] >> 4).any()


@NATIVE
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_native_rank1_encode_equals_reference(shape, seed):
    """Codes of the C kernel's encode equal the reference's, bit for bit, given the reference's
    maxima (NaN for a row or column with a negative or NaN entry, inf with an inf). The maxima the
    step takes and its decoding are checked in tests/test_kernels_step.py."""
    x = values(shape, seed)
    want = rank1_quantize(x)
    rows, r = row_layout(shape)
    x2 = x.reshape(rows, r).contiguous()
    codes = torch.full_like(want.codes, 0xAA)
    native.rank1_encode(x2, want.row_max, want.col_max, RANK1_FORMAT, codes)
    assert torch.equal(codes, want.codes)


@NATIVE
def test_native_rank1_encode_checks_sizes():
    torch.manual_seed(0)
    x = torch.rand(4, 6)
    with pytest.raises(ValueError, match="rank-1 col_max has 5 elements, expected 6"):
        native.rank1_encode(x, torch.empty(4), torch.empty(5), RANK1_FORMAT, torch.empty(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rank-1 codes"):
        native.rank1_encode(x, torch.empty(4), torch.empty(6), RANK1_FORMAT, torch.empty(4, 2, dtype=torch.uint8))


def test_a_uniformly_decaying_record_decays_exactly():
    """Requantized every step and scaled by 0.999, a rank-1 record keeps its codes (each value's
    ratio to its row's and column's maxima is unchanged, and the maxima are exact float32), so
    it decays exactly: the property lossy (bfloat16) maxima were measured to break."""
    x = values((37, 301), 4, specials=False)
    first = rank1_dequantize(rank1_quantize(x))
    for _ in range(1000):
        x = 0.999 * rank1_dequantize(rank1_quantize(x))
    torch.testing.assert_close(x, first * 0.999**1000, rtol=2e-4, atol=0)
