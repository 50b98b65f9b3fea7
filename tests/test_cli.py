"""``lowbit-tree inspect`` on each input kind, and its one-line errors; and ``roundtrip``."""
import warnings

import pytest
import torch

import bridge
from bridge.tools.cli import main
from lowbit_tree import alias
from lowbit_tree.checkpoint import state_to_dict


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 7))


def _stepped(opt_cls, **kw):
    torch.manual_seed(0)
    m = _model()
    opt = opt_cls(m.parameters(), **kw)
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    return opt


def _inspect(path, capsys):
    rc = main(["inspect", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("fmt, kw, first, second, block, second_block", [
    ("8bit", {}, "dynamic8", "dynamic8_sqrt", "256", "256"),
    ("4bit", {}, "dynamic4", "rank1_linear4_unsigned", "128", "-"),  # 4-bit's default: rank-1 second moments
    ("4bit", {"rank1_normalization": False}, "dynamic4", "linear4_unsigned", "128", "128"),
    ("fp8", {}, "e4m3", "e4m3_sqrt", "256", "256"),
])
def test_inspect_optimizer_state_dict(tmp_path, capsys, fmt, kw, first, second, block, second_block):
    opt = _stepped(bridge.AdamW, state_format=fmt, min_quant_size=0, **kw)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    rc, out, err = _inspect(tmp_path / "opt.pt", capsys)
    assert rc == 0, err
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert lines["0/exp_avg"][1:3] == [first, block]
    assert lines["0/exp_avg_sq"][1:3] == [second, second_block]
    assert lines["1/exp_avg"][1] == "fp32"  # bias: never quantized
    assert f"format version: {bridge.STATE_DICT_VERSION}" in out
    assert f"total: 8 states, {opt.state_bytes()} bytes" in out


def test_inspect_ademamix_slow_ema_in_its_own_format(tmp_path, capsys):
    opt = _stepped(bridge.AdEMAMix4bit, min_quant_size=0)  # slow EMA 8-bit by default
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    rc, out, err = _inspect(tmp_path / "opt.pt", capsys)
    assert rc == 0, err
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert lines["0/exp_avg"][1:3] == ["dynamic4", "128"]
    assert lines["0/exp_avg_slow"][1:3] == ["dynamic8", "256"]
    assert "slow_state_format=8bit" in out and f"total: {len(opt.state_report())} states, {opt.state_bytes()} bytes" in out


def test_inspect_flags_block_size_that_does_not_fit_the_scales(tmp_path, capsys):
    sd = _stepped(bridge.AdamW8bit, min_quant_size=0, block_size=32).state_dict()
    sd["param_groups"][0]["block_size"] = 64  # a lie: the scales say 2 blocks of 32 a row
    torch.save(sd, tmp_path / "opt.pt")
    rc, out, _ = _inspect(tmp_path / "opt.pt", capsys)
    assert rc == 0 and "64?" in out and "not block size 64" in out


def test_inspect_dcp_directory(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    opt = _stepped(bridge.AdamW4bit, min_quant_size=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    rc, out, err = _inspect(tmp_path / "ckpt", capsys)
    assert rc == 0, err
    assert out.startswith("DCP checkpoint directory")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("optim/")}
    assert rows["optim/0/exp_avg"][1:3] == ["dynamic4", "128"]
    assert rows["optim/2/exp_avg_sq"][1:3] == ["rank1_linear4_unsigned", "-"]  # 4-bit's default
    assert f"format version: {bridge.STATE_DICT_VERSION}" in out
    assert f"{opt.state_bytes()} bytes" in out


def test_inspect_core_state_pytree(tmp_path, capsys):
    torch.manual_seed(0)
    params = {"w": torch.randn(64, 33), "b": torch.randn(33)}
    tx = alias.adamw(1e-3, state_format="4bit", block_size=64, min_quant_size=0, rank1_normalization=True)
    state = tx.init(params)
    torch.save(state, tmp_path / "core.pt")
    rc, out, err = _inspect(tmp_path / "core.pt", capsys)
    assert rc == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:] if "/" in line.split()[0]}
    assert rows["0/mu/w"][1:3] == ["dynamic4", "64"]
    assert rows["0/nu/w"][1] == "rank1_linear4_unsigned"
    assert rows["0/mu/b"][1] == "fp32"
    # the flat state_to_dict form says the same, plus its version
    torch.save(state_to_dict(state), tmp_path / "flat.pt")
    rc, flat, _ = _inspect(tmp_path / "flat.pt", capsys)
    assert rc == 0 and "format version: 1" in flat
    assert out.splitlines()[-2] == flat.splitlines()[-2]  # same totals


def _error(path, capsys):
    rc, out, err = _inspect(path, capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


def test_inspect_corrupt_file(tmp_path, capsys):
    torch.save(_stepped(bridge.AdamW8bit, min_quant_size=0).state_dict(), tmp_path / "opt.pt")
    data = (tmp_path / "opt.pt").read_bytes()
    (tmp_path / "bad.pt").write_bytes(data[: len(data) // 2])
    assert "corrupt or truncated" in _error(tmp_path / "bad.pt", capsys)


def test_inspect_rejects_non_checkpoints(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    assert "not a torch.save file" in _error(tmp_path / "notes.txt", capsys)
    torch.save(_model().state_dict(), tmp_path / "model.pt")
    assert "not an optimizer state dict" in _error(tmp_path / "model.pt", capsys)
    torch.save(_model(), tmp_path / "module.pt")  # pickled code: weights_only refuses it
    assert "not safe to load" in _error(tmp_path / "module.pt", capsys)
    (tmp_path / "empty_dir").mkdir()
    assert "not a readable DCP checkpoint" in _error(tmp_path / "empty_dir", capsys)
    assert "no such file" in _error(tmp_path / "missing.pt", capsys)


def test_roundtrip_still_works(capsys):
    assert main(["roundtrip", "--rows", "8", "--cols", "64"]) == 0
    assert "dynamic8" in capsys.readouterr().out


def test_inspect_reads_a_version_1_state_dict(tmp_path, capsys):
    """tests/data/v1_state_dict.pt: written by the version-1 code (``name::codes`` keys)."""
    import os

    data = torch.load(os.path.join(os.path.dirname(__file__), "data", "v1_state_dict.pt"), weights_only=True)
    torch.save(data["optim"], tmp_path / "v1.pt")
    rc, out, err = _inspect(tmp_path / "v1.pt", capsys)
    assert rc == 0, err
    assert "format version: 1 (this lowbit-tree reads 1, 2, 3)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert rows["0/exp_avg"][1:3] == ["dynamic8", "256"] and rows["1/exp_avg"][1] == "fp32"
    assert rows["2/exp_avg_sq"][1:3] == ["linear4_unsigned", "16"] and rows["3/exp_avg"][1:3] == ["e4m3", "256"]
    nbytes = sum(t.numel() * t.element_size() for st in data["optim"]["state"].values()
                 for k, t in st.items() if k != "step")
    assert f"total: 10 states, {nbytes} bytes" in out


def test_inspect_flattened_dcp_checkpoint(tmp_path, capsys):
    """torch's flatten_optimizer_state_dict (torchtitan's layout): 'state.<fqn>.<name>.codes' and one
    'param_groups.<fqn>.<key>' entry per param."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    m = _model()
    opt = bridge.AdamW(m.parameters(), state_format="fp8", block_size=32, min_quant_size=0)
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    osd = get_optimizer_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert "state.0.weight.exp_avg.codes" in osd and "param_groups.0.weight.state_format" in osd
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optimizer": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    rc, out, err = _inspect(tmp_path / "ckpt", capsys)
    assert rc == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("optimizer/")}
    assert rows["optimizer/0.weight/exp_avg"][1:3] == ["e4m3", "32"]
    assert rows["optimizer/1.weight/exp_avg_sq"][1:3] == ["e4m3_sqrt", "32"]
    assert rows["optimizer/1.bias/exp_avg"][1] == "fp32"
    assert f"format version: {bridge.STATE_DICT_VERSION} (this lowbit-tree reads 1, 2, 3)" in out
    assert f"{opt.state_bytes()} bytes" in out


def test_inspect_infers_the_version_a_flattened_load_dropped(tmp_path, capsys):
    sd = _stepped(bridge.AdamW8bit, min_quant_size=0).state_dict()
    for g in sd["param_groups"]:
        del g["lowbit_tree_version"]  # what torch's unflatten (groups from the live keys) returns
    torch.save(sd, tmp_path / "opt.pt")
    rc, out, err = _inspect(tmp_path / "opt.pt", capsys)
    assert rc == 0, err
    assert f"format version: {bridge.STATE_DICT_VERSION} (inferred from the state layout" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert rows["0/exp_avg"][1:3] == ["dynamic8", "256"]


def test_inspect_low_rank_muon_states(tmp_path, capsys):
    """Muon4bit's momentum (rank-16 factors + nf4 residual) in a state dict, a flat core dict and
    a pickled core pytree: one row each, named with the residual's format and the rank."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(48, 5, bias=False))
    opt = bridge.Muon4bit(m.parameters(), lr=0.01, min_quant_size=1)
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    rc, out, _ = _inspect(tmp_path / "opt.pt", capsys)
    assert rc == 0
    rows = [line.split() for line in out.splitlines() if "momentum_buffer" in line]
    assert [r[1:3] for r in rows] == [["normal4+rank16", "32"], ["normal4+rank5", "32"]]
    assert "row_factor bfloat16[48, 16]" in out and f"{opt.state_bytes()} bytes" in out
    tx = alias.muon(0.01, state_format="nf4", min_quant_size=1, momentum_rank=4)
    p = [torch.randn(40, 70)]
    state = tx.update([torch.randn(40, 70)], tx.init(p), p)[1]
    torch.save(state_to_dict(state), tmp_path / "flat.pt")
    torch.save(state, tmp_path / "tree.pt")
    for name in ("flat.pt", "tree.pt"):
        rc, out, _ = _inspect(tmp_path / name, capsys)
        assert rc == 0 and "normal4+rank4" in out and "col_factor" in out, out
