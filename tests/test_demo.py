"""``lowbit-tree demo --tiny`` (what CI runs): it trains, prints the table and writes the PNG and JSON."""
import json
import math

import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from bridge.cli import main  # noqa: E402
from bridge.demo import Batches, load_corpus  # noqa: E402


@pytest.fixture
def one_thread():
    # tiny matmuls: a second thread only adds contention under pytest-xdist
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_demo_tiny_writes_table_png_json(tmp_path, capsys, one_thread):
    out = tmp_path / "demo"
    assert main(["demo", "--tiny", "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for name in ("fp32", "8bit", "4bit", "fp8"):
        assert f"\n{name} " in text
    png = out / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in record["runs"]}
    assert list(runs) == ["fp32", "8bit", "4bit", "fp8"]
    for name, r in runs.items():
        curve = r["train_curve"]
        assert all(math.isfinite(x) for x in curve + r["eval_curve"]), name
        k = len(curve) // 5
        assert sum(curve[-k:]) / k < sum(curve[:k]) / k - 0.3, (name, curve)  # from ~5.5 (uniform over 256)
        assert r["eval_curve"][-1] < r["eval_curve"][0], name
        assert r["state_bytes"] > 0 and r["ms_per_step"] > 0
    # quantized states really are quantized (not the fp32 fallback for small tensors)
    assert runs["8bit"]["bytes_per_param"] < 0.35 * runs["fp32"]["bytes_per_param"]
    assert runs["4bit"]["bytes_per_param"] < runs["8bit"]["bytes_per_param"]
    assert "dynamic8" in runs["8bit"]["state_formats"] and "e4m3" in runs["fp8"]["state_formats"]


def test_demo_tiny_ademamix(tmp_path, capsys, one_thread):
    """--optimizer ademamix: the same run with bridge.AdEMAMix, its three states quantized."""
    out = tmp_path / "demo"
    assert main(["demo", "--tiny", "--no-progress", "--optimizer", "ademamix", "--formats", "fp32,8bit",
                 "--out", str(out)]) == 0
    runs = {r["name"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert list(runs) == ["fp32", "8bit"]
    for name, r in runs.items():
        curve = r["train_curve"]
        k = len(curve) // 5
        assert all(math.isfinite(x) for x in curve) and sum(curve[-k:]) / k < sum(curve[:k]) / k - 0.3, name
    assert runs["8bit"]["bytes_per_param"] < 0.35 * runs["fp32"]["bytes_per_param"]  # 3 states: 12 -> ~3.1 B


def test_same_data_order_for_every_run():
    train, held, info = load_corpus()
    assert len(held) > 0 and info["files"][0] == "argparse.py"
    a, b = Batches(train, 16, 4, seed=3), Batches(train, 16, 4, seed=3)
    assert torch.equal(a(7), b(7)) and not torch.equal(a(7), a(8))
