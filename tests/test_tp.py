"""Tensor parallel (``Shard(1)`` weights) on a 1-D gloo mesh, and FSDP2 + TP on a 2x2 mesh:
quantized states gather with ``full_tensor()``, a step equals the unsharded optimizer's
bit for bit (block sizes chosen so that no block straddles a column shard), DCP and full
state dicts round-trip exactly. Multi-process, on CPU."""
from __future__ import annotations

import pytest

import tp_workers as W

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_1d(tmp_path, world):
    W.launch(W.tp_worker, world, (world,), ("tp",), ("8bit", "4bitblock", "4bit", "muon8bit", "muon4bitlr", "rmsprop8bit", "adagradfp8") if world == 2 else ("8bit", "4bit", "muon8bit", "muon4bitlr"),
             str(tmp_path))


def test_fsdp_plus_tp_2x2(tmp_path):
    W.launch(W.tp_worker, 4, (2, 2), ("dp", "tp"), ("8bit", "fp8", "4bit", "muon8bit", "muon4bitlr", "8bitc", "rmsprop4bit",
                                                 "adagrad8bit"),
             str(tmp_path))


@pytest.mark.extended
def test_torch_family_tp_1d_and_2x2(tmp_path):
    """The rest of torch.optim's elementwise family (fsdp_workers.FAMILY_FORMATS): 1-D TP at 2
    ranks and FSDP2 + TP at 2x2, bit for bit against the unsharded run, DCP and full state dicts
    round trips (tp_worker)."""
    from fsdp_workers import FAMILY_FORMATS

    (tmp_path / "tp").mkdir()
    (tmp_path / "2x2").mkdir()
    W.launch(W.tp_worker, 2, (2,), ("tp",), FAMILY_FORMATS, str(tmp_path / "tp"))
    W.launch(W.tp_worker, 4, (2, 2), ("dp", "tp"), FAMILY_FORMATS, str(tmp_path / "2x2"))


def test_reshard_2x2_to_other_meshes_and_one_process(tmp_path):
    """Saved at (dp, tp) = (2, 2): fc2's columns in 2 x 20, blocks of 4. Loaded at (1, 2) the
    block sizes agree (exact); at (4, 1) and in one process fc2 uses blocks of 8: requantized,
    with a warning, within 3% of each state's absmax (the figures are printed)."""
    import warnings

    import torch

    W.launch(W.reshard_save_worker, 4, (2, 2), ("dp", "tp"), "8bit", str(tmp_path))
    W.launch(W.reshard_load_worker, 2, (1, 2), ("dp", "tp"), "8bit", str(tmp_path))
    assert torch.load(tmp_path / "errors_1x2.pt") == {}  # nothing requantized
    W.launch(W.reshard_load_worker, 4, (4, 1), ("dp", "tp"), "8bit", str(tmp_path))
    errors = torch.load(tmp_path / "errors_4x1.pt")
    assert set(errors) == {f"{n}.{k}" for n in ("fc2.weight", "tiny.weight") for k in ("exp_avg", "exp_avg_sq")}, errors

    # one process: the full state dict (gathered to plain tensors) into an unsharded optimizer
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    torch.manual_seed(1)
    model = W.Net()
    opt = W.make_opt(model.parameters(), "8bit")
    full = saved["full"]
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}  # torch.optim's keys: positions
    full["state"] = {index[n]: st for n, st in full["state"].items()}
    for g in full["param_groups"]:
        g["params"] = [index[n] for n in g["params"]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(full)
    got = W.full_states(opt, model)
    assert all(got[n] for n in index), "every param's state loaded"
    one = W.check_loaded(got, saved["states"], [str(w.message) for w in caught], "one process", labels=index)
    assert set(one) == set(errors)
    print("requantized at (4, 1):", errors, "in one process:", one)


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_fsdp_plus_tp_training_matches_unsharded(tmp_path, fmt):
    """A real forward / backward on a 2x2 mesh against the unsharded run, 3 steps: the gradients
    are summed in another order, so params agree within 1e-5 with float32 states and 3e-3 with
    8-bit ones (a last-bit difference can pick the neighbouring code); the figure is printed."""
    import torch

    W.launch(W.backward_worker, 4, (2, 2), ("dp", "tp"), fmt, str(tmp_path))
    print(f"{fmt}: largest param difference to the unsharded run:", torch.load(tmp_path / f"backward_{fmt}.pt"))


def test_unsupported_placements_are_refused(tmp_path):
    W.launch(W.refusals_worker, 2, str(tmp_path))


def test_example_2x2_resumes_on_1x2_and_4x1(tmp_path):
    """The README's tensor-parallel example under torchrun: trained on a 2x2 mesh (row-parallel
    MLP weights on blocks of 128), resumed on 1x2 (same blocks: nothing requantized) and on 4x1
    (blocks of 256: requantized, with a warning naming the params)."""
    from fsdp_workers import run_example

    ckpt = str(tmp_path / "ckpt")

    def torchrun(nproc, *args):
        return run_example(nproc, ckpt, *args)

    out, _ = torchrun(4, "--tp", "2", "--steps", "2")
    assert "(Shard(dim=0), Shard(dim=1)) exp_avg: local QState (32, 128) blocks of 128" in out and "saved" in out, out
    out, err = torchrun(2, "--tp", "2", "--steps", "1")
    assert "at step 2 (world size 2)" in out and "blocks of 128" in out and "requantized" not in err, out + err
    out, err = torchrun(4, "--tp", "1", "--steps", "1")
    assert "at step 3 (world size 4)" in out and "local QState (16, 256) blocks of 256" in out, out
    assert "blocks.0.mlp.2.weight (shape (64, 256)): 'exp_avg' was saved on blocks of 128" in err, err
    assert "total (4 ranks, whole model): " in out and " for 112481 param elements" in out, out
