"""bridge state dicts: round trips, devices, migration from torch.optim, bad input."""
import copy
import io

import pytest
import torch

import bridge
from bridge import QState
from test_bridge_optimizer import data, mlp, train


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
    for st in sd["state"].values():
        for k, v in st.items():
            assert type(v) is torch.Tensor, (k, type(v))  # plain tensors only
            if k.endswith("::codes"):
                assert v.dtype == torch.uint8
    m2 = copy.deepcopy(m1)
    o2 = cls(m2.parameters(), lr=1e-3, min_quant_size=0, **kw)
    o2.load_state_dict(sd)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k, v in o1.state[p1].items():
            w = o2.state[p2][k]
            if isinstance(v, QState):
                assert isinstance(w, QState) and w.format == v.format and w.block_size == v.block_size
                assert torch.equal(w.codes.view(torch.uint8), v.codes.view(torch.uint8))
                assert torch.equal(w.scale, v.scale)
                assert w.codes.dtype == v.codes.dtype  # not cast to the param dtype
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
    bad["state"][0]["exp_avg::codes"] = bad["state"][0]["exp_avg::codes"][:, :-1]
    fresh = bridge.AdamW8bit(mlp().parameters(), min_quant_size=0)
    with pytest.raises(ValueError, match=r"param 0 .*'exp_avg' codes"):
        fresh.load_state_dict(bad)
    assert len(fresh.state) == 0, "a failed load must not change the optimizer"

    bad = copy.deepcopy(sd)
    del bad["state"][2]["exp_avg_sq::scale"]
    with pytest.raises(ValueError, match="exp_avg_sq::scale"):
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
