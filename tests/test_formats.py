"""The code maps: golden copies, bitsandbytes/torchao parity, structure."""

import pytest
import torch

import golden_maps
from lowbit_tree import FORMATS, STATE_FORMATS, get_format
from lowbit_tree import formats
from lowbit_tree.formats import TABLES


def test_8bit_maps_equal_golden_bitsandbytes_maps():
    assert torch.equal(TABLES["dynamic8_signed"].view(torch.int32), golden_maps.BNB_DYNAMIC_SIGNED.view(torch.int32))
    assert torch.equal(TABLES["dynamic8_unsigned"].view(torch.int32), golden_maps.BNB_DYNAMIC_UNSIGNED.view(torch.int32))


def test_4bit_maps_equal_golden_paper_maps():
    assert torch.equal(TABLES["dynamic4_signed"], golden_maps.TORCHAO_4BIT_SIGNED)
    assert torch.equal(TABLES["linear4_unsigned_zero_free"], golden_maps.TORCHAO_4BIT_UNSIGNED)


@pytest.mark.parity
def test_8bit_maps_equal_installed_bitsandbytes():
    import bitsandbytes.functional as F

    assert torch.equal(TABLES["dynamic8_signed"], F.create_dynamic_map(signed=True).cpu())
    assert torch.equal(TABLES["dynamic8_unsigned"], F.create_dynamic_map(signed=False).cpu())


def test_normal4_table_is_the_normal_float_construction():
    """The stored constant equals its construction (so a platform's ndtri cannot change what a
    checkpoint's codes mean without this failing), and the construction is what it says:
    standard-normal quantiles, 8 positive and 7 negative plus zero, extremes exactly -1 and 1."""
    t = TABLES["normal4_signed"]
    assert torch.equal(formats.normal_map(), t)
    assert t.numel() == 16 and t[0].item() == -1.0 and t[-1].item() == 1.0 and (t == 0).sum() == 1
    assert int((t > 0).sum()) == 8 and int((t < 0).sum()) == 7
    # scipy-free check: the normal CDF of each value times the outermost quantile's z is the
    # evenly spaced probability it was taken at
    o = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))
    z = torch.special.ndtri(torch.tensor(o, dtype=torch.float64))
    cdf = torch.special.ndtr(t.double() * z)
    pos = torch.linspace(o, 0.5, 9, dtype=torch.float64)[:-1].flip(0)
    neg = 1 - torch.linspace(o, 0.5, 8, dtype=torch.float64)[:-1]
    assert torch.allclose(cdf[t > 0], pos, atol=1e-7)
    assert torch.allclose(cdf[t < 0], neg, atol=1e-7)
    assert get_format("nf4").name == "normal4" and get_format("nf4").default_block_size == 32
    assert get_format("nf4", signed=False).name == "linear4_unsigned"


def test_e4m3_tables_are_all_finite_e4m3_values():
    every = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = sorted(set(every[torch.isfinite(every)].tolist()))
    assert TABLES["e4m3_signed"].tolist() == finite
    assert TABLES["e4m3_unsigned_zero_free"].tolist() == [v for v in finite if v > 0]
    assert TABLES["e4m3_signed"].max().item() == 448.0


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tables_sorted_unique_and_sized(name):
    fmt = FORMATS[name]
    v = fmt.values
    assert v.dtype == torch.float32
    assert (v[1:] > v[:-1]).all(), "map must be strictly increasing"
    assert v.numel() <= 2**fmt.bits
    if fmt.signed:
        assert (v == 0).any(), "signed formats must represent 0 exactly"
    elif name == "dynamic8_unsigned":
        # bitsandbytes-compatible map: keeps its 0 (documented flush hazard)
        assert v[0].item() == 0.0 and (v[1:] > 0).all()
    else:
        assert (v > 0).all(), "robust second-moment formats are zero-free"
    # the top of every map is the scale divisor (absmax maps onto it)
    assert v.max().item() == fmt.scale_divisor


def test_state_format_pairs_and_lookup_errors():
    for name, (first, second) in STATE_FORMATS.items():
        assert get_format(name).name == first
        assert get_format(name, signed=True).name == first
        assert get_format(name, signed=False).name == second
        assert FORMATS[first].signed and not FORMATS[second].signed
    with pytest.raises(ValueError, match="unknown format 'int3'"):
        get_format("int3")
    with pytest.raises(ValueError, match="signed"):
        get_format("dynamic8_sqrt", signed=True)
