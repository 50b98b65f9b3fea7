"""``lowbit-tree demo --tiny`` (what CI runs): it trains, prints the table and writes the PNG and JSON."""
import json
import math

import pytest
import torch

import bridge
from bridge.tools.cli import main
from bridge.tools.demo import MEMORY_SETUPS, TINY, Batches, CharGPT, load_corpus, loss_fn

# @pytest.mark.demo: a demo run plots its curves with matplotlib (the demo extra)


@pytest.fixture
def one_thread():
    # tiny matmuls: a second thread only adds contention under pytest-xdist
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.demo
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
    # the training-state table: one row per setup, printed as the JSON holds it
    memory = {r["name"]: r for r in record["training_state"]}
    assert list(memory) == list(MEMORY_SETUPS)
    for name, r in memory.items():
        n = r["elements"]
        cells = (r["params"], r["grads"], r["states"], r["params"] + r["grads"] + r["states"])
        assert f"\n{name:14s} " + " ".join(f"{b / n:7.3f}" for b in cells) + "\n" in text
    assert "bf16c: bfloat16 params with param_correction=True" in text


def _independent_training_bytes(name: str) -> tuple[int, int, int]:
    """(params, gradients at their peak, states) of a demo setup on the --tiny model, from its
    live tensors: the bridge class built here, one step, every state's parts summed."""
    fmt, _, rest = name.partition("-")
    torch.manual_seed(0)
    model = CharGPT(256, TINY["d_model"], TINY["layers"], TINY["heads"], TINY["seq_len"])
    options = {}
    if rest.startswith("bf16c"):
        model, options = model.to(torch.bfloat16), {"param_correction": True}
    cls = {"fp32": bridge.AdamW, "8bit": bridge.AdamW8bit, "4bit": bridge.AdamW4bit, "fp8": bridge.AdamWFp8}[fmt]
    opt = cls(model.parameters(), lr=1e-3, min_quant_size=1024, **options)
    loss_fn(model, torch.randint(0, 256, (2, TINY["seq_len"] + 1))).backward()
    grads = [p.grad.numel() * p.grad.element_size() for p in model.parameters()]
    opt.step()

    def nbytes(t):
        if type(t) is not torch.Tensor:  # a QState: its parts
            return sum(nbytes(getattr(t, k)) for k in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    states = sum(nbytes(v) for st in opt.state.values() for k, v in st.items() if k != "step")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, max(grads) if name.endswith("-bw") else sum(grads), states


@pytest.mark.demo
def test_demo_training_state_counts_every_tensor(tmp_path, capsys, one_thread):
    """The table's bytes are the live tensors' (params, gradients, every state's parts), and the
    new setups take what they promise: bfloat16 params and gradients (2 + 2 bytes), the int8
    correction (1 byte), gradients freed in backward (only the largest counted)."""
    out = tmp_path / "demo"
    assert main(["demo", "--tiny", "--no-progress", "--formats", "8bit,8bit-bf16c-bw", "--out", str(out)]) == 0
    record = json.loads((out / "results.json").read_text())
    memory = {r["name"]: r for r in record["training_state"]}
    for name, r in memory.items():
        assert (r["params"], r["grads"], r["states"]) == _independent_training_bytes(name), name
    per = {name: {k: r[k] / r["elements"] for k in ("params", "grads", "states")} for name, r in memory.items()}
    assert per["fp32"] == {"params": 4.0, "grads": 4.0, "states": 8.0}
    for name in ("8bit-bf16c", "4bit-bf16c"):
        assert per[name]["params"] == per[name]["grads"] == 2.0
        fp32_twin = per[name.split("-")[0]]["states"]
        assert per[name]["states"] == pytest.approx(fp32_twin + 1.0)  # the int8 correction
        assert per[name + "-bw"]["grads"] < 0.6 and per[name + "-bw"]["states"] == per[name]["states"]
    # the bfloat16 runs trained (the steps in backward too, which leave no gradient to clip)
    for r in record["runs"]:
        curve, k = r["train_curve"], len(r["train_curve"]) // 5
        assert all(math.isfinite(x) for x in curve) and sum(curve[-k:]) / k < sum(curve[:k]) / k - 0.3, r["name"]
    assert "int8" in {r["name"]: r for r in record["runs"]}["8bit-bf16c-bw"]["state_formats"]


def test_demo_refuses_an_unknown_setup(tmp_path, capsys):
    assert main(["demo", "--tiny", "--no-progress", "--formats", "8bit-bf17", "--out", str(tmp_path)]) == 2
    assert "unknown setup '8bit-bf17'" in capsys.readouterr().err


@pytest.mark.demo
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
