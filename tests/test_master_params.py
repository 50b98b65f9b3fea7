"""Master weights of bfloat16 params with an int8 correction, through the bridge: the bridge
equals the functional core bit for bit, the master values are the core's, a float32
checkpoint starts corrected training without losing its low bits, and state dicts (torch.save
and DCP in one process) carry the corrections exactly."""
from __future__ import annotations

import copy

import pytest
import torch

import bridge
import lowbit_tree as lt
from lowbit_tree.correction import master_value, split_master


def _model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.ReLU(), torch.nn.Linear(80, 5)).to(dtype)


def _step(model, opt, s):
    x = torch.randn(6, 48, generator=torch.Generator().manual_seed(s)).to(next(model.parameters()).dtype)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("cls", ["AdamW8bit", "AdamW4bit", "Lion8bit", "SGD8bit", "AdEMAMix8bit", "AdamW"])
def test_bridge_with_correction_equals_the_functional_core(cls):
    model = _model()
    ref = copy.deepcopy(model)
    kw = dict(lr=1e-2, min_quant_size=64, param_correction=True)
    if cls == "SGD8bit":
        kw["momentum"] = 0.9
    opt = getattr(bridge, cls)(model.parameters(), **kw)
    names = [n for n, _ in ref.named_parameters()]
    params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    fmt = {"AdamW8bit": "8bit", "AdamW4bit": "4bit", "Lion8bit": "8bit", "SGD8bit": "8bit", "AdEMAMix8bit": "8bit",
           "AdamW": "fp32"}[cls]
    common = dict(state_format=fmt, min_quant_size=64, param_correction=True)
    tx = {"AdamW8bit": lambda: lt.adamw(1e-2, **common), "AdamW4bit": lambda: lt.adamw(1e-2, **common),
          "AdamW": lambda: lt.adamw(1e-2, **common), "Lion8bit": lambda: lt.lion(1e-2, **common),
          "SGD8bit": lambda: lt.sgd(1e-2, 0.9, **common), "AdEMAMix8bit": lambda: lt.ademamix(1e-2, **common)}[cls]()
    state = tx.init(params)
    for s in range(3):
        x = torch.randn(6, 48, generator=torch.Generator().manual_seed(s)).bfloat16()
        model(x).float().square().mean().backward()
        ref_model = copy.deepcopy(ref)
        with torch.no_grad():
            for n, p in ref_model.named_parameters():
                p.copy_(params[n])
        ref_model(x).float().square().mean().backward()
        grads = {n: p.grad for n, p in ref_model.named_parameters()}
        opt.step()
        opt.zero_grad()
        updates, state = tx.update(grads, state, params)
        params = lt.apply_updates(params, updates)
    corrections = state[-1].correction
    for n, p in zip(names, model.parameters()):
        assert torch.equal(p.detach(), params[n]), n
        assert torch.equal(opt.state[p]["param_correction"], corrections[n]), n


def test_master_params_are_param_plus_correction_and_load_back_exactly():
    model = _model()
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-3, min_quant_size=64, param_correction=True)
    for s in range(3):
        _step(model, opt, s)
    masters = bridge.master_params(opt)
    for p, m in zip(model.parameters(), masters):
        assert m.dtype == torch.float32
        assert torch.equal(m, master_value(p.detach(), opt.state[p]["param_correction"]))
    # a float32 checkpoint into a fresh bfloat16 model: params and corrections carry its bits
    fresh = _model(seed=5)
    opt2 = bridge.AdamW8bit(fresh.parameters(), lr=1e-3, min_quant_size=64, param_correction=True)
    bridge.load_master_params(opt2, masters)
    for m, want in zip(bridge.master_params(opt2), masters):
        assert torch.equal(m, want)
    # a float32 value with low bits beyond bf16: kept by the correction, lost without
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(p.shape, generator=g) for p in fresh.parameters()]
    bridge.load_master_params(opt2, values)
    err = max(((m - v).abs() / v.abs().clamp(min=1e-30)).max().item() for m, v in zip(bridge.master_params(opt2), values))
    plain = max(((v.bfloat16().float() - v).abs() / v.abs().clamp(min=1e-30)).max().item() for v in values)
    assert err <= 2 ** -15 < plain
    with pytest.raises(ValueError, match="values for"):
        bridge.load_master_params(opt2, values[:1])


def _relative_error(got, want) -> float:
    want = want.detach()
    return ((got - want).abs() / want.abs().clamp(min=1e-30)).max().item()


def test_master_params_load_from_a_mapping_of_params_and_refuse_other_keys():
    """A mapping is keyed by the params: it sets each param it names; a model's state dict
    (keyed by names) or a mapping that leaves params out is refused, never loaded as nothing."""
    fp32 = _model(torch.float32, seed=3)
    model = _model(seed=4)
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-3, min_quant_size=64, param_correction=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="key '0.weight' is not a param.*named_parameters"):
        bridge.load_master_params(opt, fp32.state_dict())
    with pytest.raises(ValueError, match="not a param"):
        bridge.load_master_params(opt, {torch.zeros(80, 48): torch.zeros(80, 48)})
    first = next(model.parameters())
    with pytest.raises(ValueError, match="1 of the optimizer's 4 params; pass strict=False"):
        bridge.load_master_params(opt, {first: fp32[0].weight.detach()})
    for p, b in zip(model.parameters(), before):  # nothing was set by a refused call
        assert torch.equal(p, b)
    sd = fp32.state_dict()
    bridge.load_master_params(opt, {p: sd[n] for n, p in model.named_parameters()})
    for m, want in zip(bridge.master_params(opt), fp32.parameters()):
        assert _relative_error(m, want) <= 2 ** -15
    fresh = _model(seed=4)
    opt2 = bridge.AdamW8bit(fresh.parameters(), lr=1e-3, min_quant_size=64, param_correction=True)
    bridge.load_master_params(opt2, {next(fresh.parameters()): fp32[0].weight.detach()}, strict=False)
    got = bridge.master_params(opt2)
    assert _relative_error(got[0], fp32[0].weight) <= 2 ** -15
    assert torch.equal(got[1], before[1].float())  # the params it leaves out keep their values


def test_corrections_survive_state_dict_and_dcp_round_trips(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = _model()
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-3, min_quant_size=64, param_correction=True)
    for s in range(2):
        _step(model, opt, s)
    twin = copy.deepcopy(model)
    twin_opt = bridge.AdamW8bit(twin.parameters(), lr=1e-3, min_quant_size=64, param_correction=True)
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    twin_opt.load_state_dict(torch.load(tmp_path / "o.pt", weights_only=True))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.state[p]["param_correction"], twin_opt.state[q]["param_correction"])
    dcp.save({"opt": opt.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    third = copy.deepcopy(model)
    third_opt = bridge.AdamW8bit(third.parameters(), lr=1e-3, min_quant_size=64, param_correction=True)
    _step(third, third_opt, 0)  # states exist to load into
    sd = {"opt": third_opt.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    third_opt.load_state_dict(sd["opt"])
    with torch.no_grad():
        for p, q in zip(model.parameters(), third.parameters()):
            q.copy_(p)
    for s in range(2, 4):
        for m, o in ((model, opt), (twin, twin_opt), (third, third_opt)):
            _step(m, o, s)
    for p, q, r in zip(model.parameters(), twin.parameters(), third.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)
        assert torch.equal(opt.state[p]["param_correction"], third_opt.state[r]["param_correction"])


def test_correction_and_stochastic_rounding_are_refused_together():
    with pytest.raises(ValueError, match="choose one"):
        bridge.AdamW8bit(_model().parameters(), bf16_stochastic_round=True, param_correction=True)
    with pytest.raises(ValueError, match="choose one"):
        lt.adamw(1e-3, stochastic_round=True, param_correction=True)


def test_float32_params_take_no_correction_state():
    model = _model(torch.float32)
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-3, min_quant_size=64, param_correction=True)
    _step(model, opt, 0)
    assert all("param_correction" not in st for st in opt.state.values())


def test_split_master_is_exact_on_float32_values_within_16_bits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g) * torch.exp(torch.randn(4096, generator=g) * 8)
    p, c = split_master(x, torch.bfloat16)
    back = master_value(p, c)
    assert ((back - x).abs() <= x.abs() * 2 ** -16 + 1e-38).all()  # half a 256th of an ulp
    again = split_master(back, torch.bfloat16)
    assert torch.equal(again[0], p) and torch.equal(again[1], c)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cls", ["AdamW8bit", "AdamW4bit", "Lion8bit"])
def test_cuda_correction_equals_the_cpu_run(cls):
    """The compiled CUDA step with a correction: params and corrections bit for bit the CPU's."""
    runs = []
    for device in ("cpu", "cuda"):
        model = _model().to(device)
        opt = getattr(bridge, cls)(model.parameters(), lr=1e-2, min_quant_size=64, param_correction=True)
        for s in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(s)).bfloat16().to(device)
            opt.step()
        runs.append(([p.detach().cpu() for p in model.parameters()],
                     [opt.state[p]["param_correction"].cpu() for p in model.parameters()]))
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert torch.equal(a, b)
