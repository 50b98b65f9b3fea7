"""benchmarks/muon_momentum_probe.py: its simulated nf4 storage is the kernel's, bit for bit
(and both are the nearest normal-float code by brute force); its low-rank split keeps a
low-rank buffer whole; a short run prints its JSON line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import repo_scripts
import torch

from lowbit_tree import kernels
from lowbit_tree.formats import normal_map
from lowbit_tree.qtensor import QTensor

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "muon_momentum_probe.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")


def load():
    return repo_scripts.load(SCRIPT)


def brute_force_blocks(e: torch.Tensor, block: int = 32) -> torch.Tensor:
    codes = normal_map().double()
    out = torch.empty_like(e, dtype=torch.float64)
    for i in range(e.shape[0]):
        for j0 in range(0, e.shape[1], block):
            x = e[i, j0:j0 + block].double()
            s = x.abs().max()
            y = x / s if s > 0 else torch.zeros_like(x)
            out[i, j0:j0 + block] = codes[(y[:, None] - codes[None, :]).abs().argmin(1)] * s
    return out


@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (7, 45), (16, 64)])
def test_probe_nf4_is_the_kernels_stored_momentum(shape):
    mod = load()
    g = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    x = torch.randn(*shape, generator=g) * torch.logspace(-4, 2, shape[1])
    x[0, : min(5, shape[1])] = 0  # a zero run; a whole-zero block when the row is short
    codes, scale = kernels.quantize_rows_fast(x, "normal4", 32)
    stored = kernels.dequantize_fast(QTensor.unchecked(codes, scale, x.shape, 32, "normal4"))
    probe = mod.round_blocks(x)
    assert torch.equal(probe, stored)
    ref = brute_force_blocks(x)
    assert torch.allclose(probe.double(), ref, rtol=1e-6, atol=0)


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
