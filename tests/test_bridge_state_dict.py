"""bridge state dicts: round trips, devices, migration from torch.optim, bad input, version 1."""
import copy
import io
import os
import re

import pytest
import torch

import bridge
from bridge import QState
from test_bridge_optimizer import data, mlp, train
from test_subclass import PUBLIC


def save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def trained(cls=bridge.AdamW8bit, steps=3, **kw):
    m = mlp()
    opt = cls(m.parameters(), lr=1e-3, min_quant_size=0, **kw)
    train(m, opt, steps)
    return m, opt


@pytest.mark.parametrize("cls", [bridge.AdamW8bit, bridge.AdamW4bit, bridge.AdamWFp8, bridge.Lion8bit, bridge.SGD8bit])
def test_round_trip_bit_for_bit_weights_only_and_training_continues_identically(cls):
    kw = dict(momentum=0.9) if cls is bridge.SGD8bit else {}
    m1, o1 = trained(cls, **kw)
    sd = save_load(o1.state_dict())
    for i, st in sd["state"].items():
        live = o1.state[o1.param_groups[0]["params"][i]]
        assert sorted(st) == sorted(live)  # torch.optim's names, the live ones
        for k, v in st.items():
            if isinstance(live[k], QState) and live[k].kind_name == "block":  # nested plain tensors, honest dtypes
                assert sorted(v) == ["codes", "scale"]
                assert type(v["codes"]) is torch.Tensor and v["codes"].dtype == torch.uint8
                assert type(v["scale"]) is torch.Tensor and v["scale"].dtype == torch.float32
            elif isinstance(live[k], QState):  # AdamW4bit's rank-1 second moment
                assert sorted(v) == ["codes", "col_max", "row_max"] and v["codes"].dtype == torch.uint8
                assert all(type(t) is torch.Tensor for t in v.values())
            else:
                assert type(v) is torch.Tensor, (k, type(v))
    m2 = copy.deepcopy(m1)
    o2 = cls(m2.parameters(), lr=1e-3, min_quant_size=0, **kw)
    o2.load_state_dict(sd)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k, v in o1.state[p1].items():
            w = o2.state[p2][k]
            if isinstance(v, QState):
                assert isinstance(w, QState) and w.kind_name == v.kind_name and w.meta == v.meta
                assert torch.equal(w, v)  # every part, bit for bit
                assert all(a.dtype == b.dtype for a, b in zip(w.parts.values(), v.parts.values()))  # not cast
            else:
                assert torch.equal(w, v) and w.dtype == v.dtype
    l1, l2 = train(m1, o1, 3), train(m2, o2, 3)
    assert l1 == l2
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


def test_state_dict_carries_version_and_static_options():
    _, opt = trained()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["lowbit_tree_version"] == bridge.STATE_DICT_VERSION
    assert sd["param_groups"][0]["state_format"] == "8bit"
    assert "lowbit_tree_version" not in opt.param_groups[0]


def test_wrong_version_format_block_size_and_shape_are_clear_errors():
    m, opt = trained()
    sd = opt.state_dict()

    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["lowbit_tree_version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        bridge.AdamW8bit(mlp().parameters(), min_quant_size=0).load_state_dict(bad)

    with pytest.raises(ValueError, match="state_format='8bit' but this optimizer has state_format='4bit'"):
        bridge.AdamW4bit(mlp().parameters(), min_quant_size=0).load_state_dict(sd)

    with pytest.raises(ValueError, match="block_size=None but this optimizer has block_size=64"):
        bridge.AdamW8bit(mlp().parameters(), min_quant_size=0, block_size=64).load_state_dict(sd)

    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"]["codes"] = bad["state"][0]["exp_avg"]["codes"][:, :-1]
    fresh = bridge.AdamW8bit(mlp().parameters(), min_quant_size=0)
    with pytest.raises(ValueError, match=r"param 0 .*'exp_avg' codes"):
        fresh.load_state_dict(bad)
    assert len(fresh.state) == 0, "a failed load must not change the optimizer"

    bad = copy.deepcopy(sd)
    del bad["state"][2]["exp_avg_sq"]["scale"]
    with pytest.raises(ValueError, match=r"param 2 .*'exp_avg_sq' has entries \['codes'\], expected \['codes', 'scale'\]"):
        bridge.AdamW8bit(mlp().parameters(), min_quant_size=0).load_state_dict(bad)

    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"]["scale"] = bad["state"][0]["exp_avg"]["scale"].double()
    with pytest.raises(ValueError, match=r"'exp_avg.scale' has dtype torch.float64"):
        bridge.AdamW8bit(mlp().parameters(), min_quant_size=0).load_state_dict(bad)

    bad = copy.deepcopy(sd)
    bad["state"][1]["exp_avg"] = {"codes": torch.zeros(96, dtype=torch.uint8), "scale": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"param 1 .*'exp_avg' is a dict, expected a tensor.*keeps it unquantized"):
        bridge.AdamW8bit(mlp().parameters(), min_quant_size=0).load_state_dict(bad)

    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="params"):
        bridge.AdamW8bit(other.parameters(), min_quant_size=0).load_state_dict(sd)

    with pytest.raises(ValueError, match="not an optimizer state dict"):
        bridge.AdamW8bit(mlp().parameters()).load_state_dict({"weights": 1})


def test_migration_from_torch_adamw_quantizes_its_fp32_states():
    m = mlp()
    ref = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train(m, ref, 5)
    sd = save_load(ref.state_dict())
    m2 = copy.deepcopy(m)
    opt = bridge.AdamW8bit(m2.parameters(), lr=1e-3, min_quant_size=0)
    opt.load_state_dict(sd)
    for p_ref, p in zip(m.parameters(), m2.parameters()):
        st = opt.state[p]
        assert st["step"].item() == 5
        for name in ("exp_avg", "exp_avg_sq"):
            want = ref.state[p_ref][name]
            got = st[name].dequantize() if isinstance(st[name], QState) else st[name]
            bound = 0.0072 * want.abs().max() if isinstance(st[name], QState) else 0
            assert (got - want).abs().max() <= bound + 1e-12
    # continues close to the fp32 optimizer
    l_ref, l_ours = train(m, ref, 10), train(m2, opt, 10)
    assert abs(l_ref[-1] - l_ours[-1]) < 0.01 * l_ref[0]


def test_export_to_torch_adamw_and_back():
    m, opt = trained(steps=5)
    exported = save_load(opt.torch_state_dict())
    m2 = copy.deepcopy(m)
    plain = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    plain.load_state_dict(exported)
    for p, p2 in zip(m.parameters(), m2.parameters()):
        st = opt.state[p]
        for name in ("exp_avg", "exp_avg_sq"):
            want = st[name].dequantize() if isinstance(st[name], QState) else st[name]
            assert torch.equal(plain.state[p2][name], want)
    train(m2, plain, 2)  # torch's AdamW runs on it
    # converting formats goes through the export: 8bit -> 4bit
    m3 = copy.deepcopy(m)
    four = bridge.AdamW4bit(m3.parameters(), lr=1e-3, min_quant_size=0)
    four.load_state_dict(opt.torch_state_dict())
    assert four.state[m3[0].weight]["exp_avg"].format == "dynamic4"


def test_load_is_not_cast_to_param_dtype_for_bf16_params():
    m = mlp(dtype=torch.bfloat16)
    opt = bridge.AdamW8bit(m.parameters(), lr=1e-3, min_quant_size=0)
    x, y = data()
    train(m, opt, 2, x=x.bfloat16(), y=y.bfloat16())
    m2 = copy.deepcopy(m)
    o2 = bridge.AdamW8bit(m2.parameters(), lr=1e-3, min_quant_size=0)
    o2.load_state_dict(save_load(opt.state_dict()))
    st = o2.state[m2[0].weight]
    assert st["exp_avg"].codes.dtype == torch.uint8 and st["exp_avg"].scale.dtype == torch.float32
    assert o2.state[m2[0].bias]["exp_avg"].dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cpu_state_dict_loads_into_cuda_optimizer_and_back():
    m, opt = trained()
    sd = opt.state_dict()
    mc = copy.deepcopy(m).cuda()
    oc = bridge.AdamW8bit(mc.parameters(), lr=1e-3, min_quant_size=0)
    oc.load_state_dict(sd)
    assert oc.state[mc[0].weight]["exp_avg"].codes.device.type == "cuda"
    back = bridge.AdamW8bit(copy.deepcopy(m).parameters(), lr=1e-3, min_quant_size=0)
    buf = io.BytesIO()
    torch.save(oc.state_dict(), buf)
    buf.seek(0)
    back.load_state_dict(torch.load(buf, weights_only=True, map_location="cpu"))
    for p, q in zip(m.parameters(), back.param_groups[0]["params"]):
        a, b = opt.state[p]["exp_avg"], back.state[q]["exp_avg"]
        if isinstance(a, QState):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


DATA = os.path.join(os.path.dirname(__file__), "data", "v1_state_dict.pt")


def _v1_fixture():
    import repo_scripts

    v1 = repo_scripts.load(DATA.replace("v1_state_dict.pt", "make_v1_state_dict.py"))  # how the fixture was written
    return v1, torch.load(DATA, weights_only=True)


def _assert_loaded_exactly(opt, params, saved_state):
    """Every live state equals the saved tensors of the same param, bit for bit."""
    for i, p in enumerate(params):
        saved, live = saved_state[i], opt.state[p]
        assert torch.equal(live["step"], saved["step"])
        for name, v in live.items():
            if name == "step":
                continue
            if isinstance(v, QState):
                for part, t in v.parts.items():
                    t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                    assert torch.equal(t, saved[f"{name}::{part}"]) and t.dtype == saved[f"{name}::{part}"].dtype
            else:
                assert torch.equal(v, saved[name]) and v.dtype == saved[name].dtype


def test_version_1_state_dict_loads_bit_for_bit_and_saves_as_version_3():
    """tests/data/v1_state_dict.pt was written by the version-1 code (tests/data/make_v1_state_dict.py).
    Its 4-bit group is block-normalized (the 4-bit default then): a group on today's default
    (rank-1) takes the checkpoint's choice, and says so."""
    v1, data = _v1_fixture()
    sd = data["optim"]
    assert sd["param_groups"][0]["lowbit_tree_version"] == 1 and "exp_avg::codes" in sd["state"][0]
    ps = v1.params(5)  # other values than the saved run: loading must not depend on them
    opt = bridge.AdamW(v1.groups(ps), lr=1e-2, weight_decay=0.1, min_quant_size=0)
    assert "rank1_normalization" not in opt.param_groups[1]  # the format's default: rank-1
    opt.load_state_dict(sd)
    assert opt.param_groups[1]["rank1_normalization"] is False
    params = list(ps.values())
    assert [opt.state[p]["exp_avg"].format for p in (params[0], params[2], params[3])] == ["dynamic8", "dynamic4", "e4m3"]
    assert isinstance(opt.state[params[2]]["exp_avg_sq"], QState)
    _assert_loaded_exactly(opt, params, sd["state"])
    # saved again, it is version 3 with the same tensors under torch's names
    again = save_load(opt.state_dict())
    assert {g["lowbit_tree_version"] for g in again["param_groups"]} == {3}
    assert again["param_groups"][1]["rank1_normalization"] is False
    for i, st in sd["state"].items():
        for key, t in st.items():
            name, _, part = key.partition("::")
            got = again["state"][i][name][part] if part else again["state"][i][name]
            assert torch.equal(got, t) and got.dtype == t.dtype, (i, key)
    # a v1 load and a v2 load of the same states continue identically
    ps2 = v1.params(5)
    opt2 = bridge.AdamW(v1.groups(ps2), lr=1e-2, weight_decay=0.1, min_quant_size=0)
    opt2.load_state_dict(again)
    for ps_, opt_ in ((ps, opt), (ps2, opt2)):
        with torch.no_grad():
            for k, p in ps_.items():
                p.copy_(data["params"][k])
        v1.steps(ps_, opt_, 2, 9)
    assert all(torch.equal(a, b) for a, b in zip(ps.values(), ps2.values()))


def test_version_1_rank1_record_loads_bit_for_bit():
    from lowbit_tree.alias import adamw

    v1, data = _v1_fixture()
    sd = data["rank1_optim"]
    ps = v1.params(6)
    opt = bridge.LowBitOptimizer(list(ps.values()), adamw, dict(learning_rate=1e-2, state_format="4bit",
                                                              rank1_normalization=True, min_quant_size=0))
    opt.load_state_dict(sd)
    _assert_loaded_exactly(opt, list(ps.values()), sd["state"])
    again = save_load(opt.state_dict())
    assert sorted(again["state"][0]["exp_avg_sq"]) == ["codes", "col_max", "row_max"]
    opt2 = bridge.LowBitOptimizer(list(v1.params(6).values()), adamw, dict(learning_rate=1e-2, state_format="4bit",
                                                                         rank1_normalization=True, min_quant_size=0))
    opt2.load_state_dict(again)
    _assert_loaded_exactly(opt2, opt2.param_groups[0]["params"], sd["state"])


def test_version_1_errors_still_name_the_key():
    v1, data = _v1_fixture()
    bad = copy.deepcopy(data["optim"])
    del bad["state"][0]["exp_avg_sq::scale"]
    opt = bridge.AdamW(v1.groups(v1.params(5)), lr=1e-2, min_quant_size=0)
    with pytest.raises(ValueError, match=r"param 0 .*without 'exp_avg_sq::scale'"):
        opt.load_state_dict(bad)
    assert len(opt.state) == 0


def test_version_is_inferred_when_a_flattened_round_trip_dropped_it():
    """torch's flatten_optimizer_state_dict rebuilds groups from the live keys: no version key.
    Nested states can only be version 2; without them the dict loads as a torch.optim one."""
    m, opt = trained(bridge.AdamW4bit)
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        del g["lowbit_tree_version"]
    m2 = copy.deepcopy(m)
    o2 = bridge.AdamW4bit(m2.parameters(), lr=1e-3, min_quant_size=0)
    o2.load_state_dict(sd)
    for p, q in zip(m.parameters(), m2.parameters()):
        a, b = opt.state[p]["exp_avg"], o2.state[q]["exp_avg"]
        assert torch.equal(a.codes, b.codes) if isinstance(a, QState) else torch.equal(a, b)


def test_a_version_1_dcp_checkpoint_loads_through_as_version_1(tmp_path):
    """DCP finds tensors by key: a version-1 checkpoint ('state.0.exp_avg::codes') has no
    'state.0.exp_avg.codes'. as_version_1 re-keys the live dict the old way for dcp.load."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from bridge.state_dict import as_version_1

    v1, data = _v1_fixture()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group
        dcp.save({"optim": data["optim"]}, checkpoint_id=str(tmp_path / "v1"))  # what version 1 wrote
    ps = v1.params(5)
    groups = v1.groups(ps)
    groups[1]["rank1_normalization"] = False  # DCP loads into the live layout: the checkpoint's 4-bit is per block
    opt = bridge.AdamW(groups, lr=1e-2, weight_decay=0.1, min_quant_size=0)
    v1.steps(ps, opt, 1, 4)  # states exist (get_optimizer_state_dict would do this step itself)
    target = as_version_1(opt.state_dict())
    assert "exp_avg::codes" in target["state"][0] and "exp_avg" not in target["state"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"optim": target}, checkpoint_id=str(tmp_path / "v1"))
    opt.load_state_dict(target)
    _assert_loaded_exactly(opt, list(ps.values()), data["optim"]["state"])
    # the flattened layout too
    assert opt.param_groups[0]["fused"] is None  # a key version 1 lacked keeps this optimizer's value
    flat = {"state.0.weight.exp_avg.codes": 1, "state.0.weight.step": 2, "param_groups.0.weight.lr": 3,
            "param_groups.0.weight.fused": None}
    assert as_version_1(flat) == {"state.0.weight.exp_avg::codes": 1, "state.0.weight.step": 2,
                                  "param_groups.0.weight.lr": 3}


def test_rank1_normalized_4bit_classes_save_and_load():
    """``AdamW4bit(rank1_normalization=True)``: the second moment is a rank-1 normalized record,
    saved as {"codes", "row_max", "col_max"}; a reload continues bit for bit; an optimizer built
    without the option refuses the dict naming it; 8-bit refuses the option."""
    import io

    torch.manual_seed(5)
    w = torch.randn(40, 300)
    p = torch.nn.Parameter(w.clone())
    opt = bridge.AdamW4bit([p], rank1_normalization=True, min_quant_size=1024)
    grads = [torch.randn(40, 300) for _ in range(4)]
    for g in grads[:2]:
        p.grad = g.clone()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert set(saved["state"][0]["exp_avg_sq"]) == {"codes", "row_max", "col_max"}
    assert saved["param_groups"][0]["rank1_normalization"] is True

    q = torch.nn.Parameter(p.detach().clone())
    opt2 = bridge.AdamW4bit([q], rank1_normalization=True, min_quant_size=1024)
    opt2.load_state_dict(saved)
    for g in grads[2:]:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(p, q)
    a, b = opt.state[p]["exp_avg_sq"].record, opt2.state[q]["exp_avg_sq"].record
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("codes", "row_max", "col_max"))

    with pytest.raises(ValueError, match="rank1_normalization=True but this optimizer has rank1_normalization=False"):
        bridge.AdamW4bit([torch.nn.Parameter(w.clone())], min_quant_size=1024,
                         rank1_normalization=False).load_state_dict(saved)
    with pytest.raises(ValueError, match="rank1_normalization=True is a 4-bit second moment"):
        bridge.AdamW8bit([torch.nn.Parameter(w.clone())], rank1_normalization=True)


@pytest.mark.parametrize("how", ["v2-no-key", "v3-explicit", "flattened-no-version"])
def test_block_4bit_checkpoint_loads_into_the_rank1_default(how):
    """A block-normalized 4-bit state dict (written before rank-1 became 4-bit's default, or by
    ``rank1_normalization=False``) loads into ``AdamW4bit()`` as it was saved: the group takes the
    checkpoint's choice (visible in the group and the states), and training continues bit for
    bit as in the optimizer that wrote it. An explicit ``rank1_normalization=True`` refuses it."""
    torch.manual_seed(7)
    w = torch.randn(40, 300)
    grads = [torch.randn(40, 300) for _ in range(5)]
    p = torch.nn.Parameter(w.clone())
    opt = bridge.AdamW4bit([p], rank1_normalization=False, min_quant_size=1024)
    for g in grads[:2]:
        p.grad = g.clone()
        opt.step()
    saved = save_load(opt.state_dict())
    assert set(saved["state"][0]["exp_avg_sq"]) == {"codes", "scale"}
    if how == "v2-no-key":  # what version 2 wrote for AdamW4bit(): no key, version 2
        for g in saved["param_groups"]:
            del g["rank1_normalization"]
            g["lowbit_tree_version"] = 2
    elif how == "flattened-no-version":  # torch's flatten_optimizer_state_dict drops both keys
        for g in saved["param_groups"]:
            del g["rank1_normalization"], g["lowbit_tree_version"]
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = bridge.AdamW4bit([q], min_quant_size=1024)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["rank1_normalization"] is False and isinstance(opt2.state[q]["exp_avg_sq"], QState)
    for g in grads[2:]:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(p, q)
    with pytest.raises(ValueError, match="rank1_normalization=False but this optimizer has rank1_normalization=True"):
        bridge.AdamW4bit([torch.nn.Parameter(w.clone())], min_quant_size=1024,
                         rank1_normalization=True).load_state_dict(saved)


def test_4bit_default_is_rank1_and_saves_without_the_key():
    """``AdamW4bit()`` keeps rank-1 second moments (the measured default) and writes no
    ``rank1_normalization`` key (DCP checkpoints of older versions then still match the groups);
    a version-3 dict without it means the default again."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40, 300))
    opt = bridge.AdamW4bit([p], min_quant_size=1024)
    p.grad = torch.randn(40, 300)
    opt.step()
    assert opt.state[p]["exp_avg_sq"].kind_name == "rank1" and opt.state[p]["exp_avg"].kind_name == "block"
    saved = save_load(opt.state_dict())
    assert "rank1_normalization" not in saved["param_groups"][0] and saved["param_groups"][0]["lowbit_tree_version"] == 3
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = bridge.AdamW4bit([q], min_quant_size=1024)
    opt2.load_state_dict(saved)
    assert "rank1_normalization" not in opt2.param_groups[0] and opt2.state[q]["exp_avg_sq"].kind_name == "rank1"


def test_dcp_load_optimizer_and_an_older_block_4bit_checkpoint(tmp_path):
    """A DCP checkpoint of block-normalized 4-bit states as version 2 wrote it (no
    ``rank1_normalization`` key): ``bridge.dcp.load_optimizer`` into today's default (rank-1)
    says what to build; built with ``rank1_normalization=False`` (a group key the checkpoint
    lacks, which DCP would report missing) it loads exactly."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from bridge.dcp import load_optimizer

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(32, 40), torch.nn.Linear(40, 8))
    opt = bridge.AdamW4bit(model.parameters(), rank1_normalization=False, min_quant_size=64)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    osd = get_optimizer_state_dict(model, opt)
    for g in osd["param_groups"]:
        del g["rank1_normalization"]
        g["lowbit_tree_version"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group
        dcp.save({"optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
        default = copy.deepcopy(model)
        opt2 = bridge.AdamW4bit(default.parameters(), min_quant_size=64)
        with pytest.raises(ValueError, match=r"0\.weight exp_avg_sq: the checkpoint holds a block-normalized 4-bit "
                                             r"state .* rank1_normalization=False to load it"):
            load_optimizer(default, opt2, str(tmp_path / "ckpt"))
        block = copy.deepcopy(model)
        opt3 = bridge.AdamW4bit(block.parameters(), rank1_normalization=False, min_quant_size=64)
        load_optimizer(block, opt3, str(tmp_path / "ckpt"))
    assert opt3.param_groups[0]["rank1_normalization"] is False
    for p, q in zip(model.parameters(), block.parameters()):
        for k, v in opt.state[p].items():
            w = opt3.state[q][k]
            if isinstance(v, QState):
                assert torch.equal(v.codes, w.codes) and torch.equal(v.scale, w.scale), k
            else:
                assert torch.equal(v, w), k


def test_bridge_dcp_is_reachable_after_import_bridge():
    """The docs write ``bridge.dcp.load_optimizer``: a fresh process with only ``import bridge``
    reaches it (another test importing ``bridge.dcp`` first would hide a missing import)."""
    import subprocess
    import sys

    code = "import bridge; print(callable(bridge.dcp.load_optimizer))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


# ----------------------------------------------------------------------------- variant flags
_OPTIMIZERS = [c for c in PUBLIC if c is not bridge.LowBitOptimizer]  # (every public optimizer class)


def _variant_cases():
    """``(class, flag)`` for every variant flag of the declaration (``lowbit_tree.rules``) that a
    public class's groups hold, found by building each class with its defaults."""
    from lowbit_tree.rules import VARIANT_FLAGS

    cases = []
    for cls in _OPTIMIZERS:
        opt = cls(torch.nn.Linear(8, 8, bias=False).parameters())
        cases += [(cls, f) for f in VARIANT_FLAGS if f in opt.defaults]
    assert {f for _, f in cases} == set(VARIANT_FLAGS), "a variant flag no public class holds"
    return cases


def _on_off(cls, flag):
    """The constructor arguments of an optimizer with ``flag`` on and one with it off (the
    dict's value first), and how a fix says the first."""
    import inspect

    if flag == "has_momentum":  # ours: the group's momentum decides it
        return dict(momentum=0.9), dict(momentum=0), "a momentum other than 0"
    default = inspect.signature(cls).parameters[flag].default
    both = dict(momentum=0.9) if "momentum" in inspect.signature(cls).parameters else {}
    return {**both, flag: not default}, {**both, flag: default}, f"{flag}={not default!r}"


@pytest.mark.parametrize("cls, flag", _variant_cases(), ids=lambda x: getattr(x, "__name__", x))
def test_a_state_dict_of_another_variant_is_refused_naming_the_flag_and_the_fix(cls, flag):
    saved_kw, mine_kw, fix = _on_off(cls, flag)
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8, bias=False)
    theirs, mine = cls(m.parameters(), **saved_kw), cls(m.parameters(), **mine_kw)
    for opt in (theirs, mine):
        m(torch.randn(2, 8)).square().sum().backward()
        opt.step()
    before = copy.deepcopy(mine.state_dict())
    with pytest.raises(ValueError, match=rf"group 0: the state dict has {flag}=.*build the optimizer with {re.escape(fix)}"):
        mine.load_state_dict(theirs.state_dict())
    named = "momentum" if flag == "has_momentum" else flag  # torch's layout says the momentum
    with pytest.raises(ValueError, match=rf"group 0: the state dict has {named}=.*loading it would change which states"):
        mine.load_state_dict(theirs.torch_state_dict())
    after = mine.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v) if isinstance(v, torch.Tensor) else after["state"][i][k] == v
