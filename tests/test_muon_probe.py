"""benchmarks/muon_momentum_probe.py: its stored forms are the nearest normal-float code by
brute force (blocks: the kernels' quantizer; rank-1 scales: the probe's own rounding); its
low-rank split keeps a low-rank buffer whole; a short run prints its JSON line."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from lowbit_tree.formats import normal_map

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "muon_momentum_probe.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")


def load():
    spec = importlib.util.spec_from_file_location("muon_momentum_probe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def brute_force(e: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each value's nearest normal-float code times its scale, by trying every code."""
    codes = normal_map().double()
    s = scale.double()
    y = torch.where(s > 0, e.double() / s.clamp_min(1e-300), torch.zeros_like(s))
    return codes[(y[..., None] - codes).abs().argmin(-1)] * s


def odd_input(shape):
    g = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    x = torch.randn(*shape, generator=g) * torch.logspace(-4, 2, shape[1])
    x[0, : min(5, shape[1])] = 0  # a zero run; a whole-zero block when the row is short
    return x


@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (7, 45), (16, 64)])
def test_probe_nf4_blocks_are_the_nearest_codes(shape):
    mod = load()
    x = odd_input(shape)
    pad = (-shape[1]) % 32
    blocks = torch.nn.functional.pad(x, (0, pad)).view(shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True).expand_as(blocks)
    ref = brute_force(blocks, scale).reshape(shape[0], -1)[:, : shape[1]]
    assert torch.allclose(mod.round_blocks(x).double(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (7, 45), (16, 64)])
def test_probe_rank1_scaled_rounding_is_the_nearest_codes(shape):
    mod = load()
    x = odd_input(shape)
    scale = torch.minimum(x.abs().amax(1, keepdim=True), x.abs().amax(0, keepdim=True))
    assert torch.allclose(mod.round_grid(x).double(), brute_force(x, scale), rtol=1e-6, atol=0)


def test_low_rank_split_keeps_a_low_rank_buffer():
    mod = load()
    g = torch.Generator().manual_seed(1)
    b = torch.randn(48, 3, generator=g) @ torch.randn(3, 80, generator=g)  # rank 3
    plain, split = b.clone(), b.clone()
    mod.StoredMomentum("nf4")(0, plain)
    store = mod.StoredMomentum("lr4-nf4")
    for _ in range(3):  # power iterations from a random start converge on the 3-D row space
        split = b.clone()
        store(0, split)
    err = lambda x: ((x - b).norm() / b.norm()).item()  # noqa: E731
    assert err(plain) > 0.02  # one nf4 rounding
    assert err(split) < 1e-4 * err(plain)


def test_unknown_variant_is_refused():
    mod = load()
    with pytest.raises(ValueError, match="unknown variant"):
        mod.StoredMomentum("lrx-nf4")
    with pytest.raises(ValueError, match="unknown variant"):
        mod.StoredMomentum("nf3")


def test_short_run_prints_its_line(capsys):
    mod = load()
    assert mod.main(["--variant", "lr2-nf4", "--steps", "3", "--d-model", "32"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["variant"] == "lr2-nf4" and line["steps"] == 3 and line["held_out"] > 0
