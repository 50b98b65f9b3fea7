"""The code maps: golden copies, bitsandbytes/torchao parity, structure."""
import importlib.util

import pytest
import torch

import golden_maps
from lowbit_tree import FORMATS, STATE_FORMATS, get_format
from lowbit_tree.formats import TABLES


def test_8bit_maps_equal_golden_bitsandbytes_maps():
    assert torch.equal(TABLES["dynamic8_signed"].view(torch.int32), golden_maps.BNB_DYNAMIC_SIGNED.view(torch.int32))
    assert torch.equal(TABLES["dynamic8_unsigned"].view(torch.int32), golden_maps.BNB_DYNAMIC_UNSIGNED.view(torch.int32))


def test_4bit_maps_equal_golden_paper_maps():
    assert torch.equal(TABLES["dynamic4_signed"], golden_maps.TORCHAO_4BIT_SIGNED)
    assert torch.equal(TABLES["linear4_unsigned_zero_free"], golden_maps.TORCHAO_4BIT_UNSIGNED)


@pytest.mark.parity
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_8bit_maps_equal_installed_bitsandbytes():
    import bitsandbytes.functional as F

    assert torch.equal(TABLES["dynamic8_signed"], F.create_dynamic_map(signed=True).cpu())
    assert torch.equal(TABLES["dynamic8_unsigned"], F.create_dynamic_map(signed=False).cpu())


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
