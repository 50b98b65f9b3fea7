"""``opt.training_bytes()`` and the last line of ``format_state_report()``: params + gradients +
optimizer states, against a count of the live tensors themselves (every param, every
``p.grad`` after backward, the parts of every ``opt.state`` tensor), and with the steps in
backward against the gradient bytes a hook sees alive."""
import re
from pathlib import Path

import pytest
import repo_scripts
import torch

import bridge


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 256),
                               torch.nn.LayerNorm(256), torch.nn.Linear(256, 16)).to(dtype)


def _nbytes(t: torch.Tensor) -> int:
    """A plain tensor's bytes; a QState's: the sum of its parts (codes, scales, maxima, factors)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return sum(_nbytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def _state_bytes(opt) -> int:
    # "step" is torch.optim's counter: 4 bytes per param tensor, not per element; not counted
    return sum(_nbytes(v) for st in opt.state.values() for k, v in st.items() if k != "step")


def _backward(model, dtype):
    x = torch.randn(8, model[0].in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    model(x).float().square().mean().backward()


SETUPS = [
    (bridge.AdamW, torch.float32, {}),
    (bridge.AdamW8bit, torch.float32, {}),
    (bridge.AdamW4bit, torch.float32, {}),
    (bridge.AdamW8bit, torch.bfloat16, {"param_correction": True}),
    (bridge.AdamW4bit, torch.bfloat16, {"param_correction": True}),
    (bridge.AdamW8bit, torch.bfloat16, {"bf16_stochastic_round": True}),
    (bridge.AdEMAMix8bit, torch.float32, {}),
    (bridge.SGD8bit, torch.float16, {"param_correction": True}),
]


@pytest.mark.parametrize("cls, dtype, options", SETUPS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_training_bytes_equal_the_live_tensors(cls, dtype, options):
    model = _model(dtype)
    kw = {"momentum": 0.9} if cls is bridge.SGD8bit else {}
    opt = cls(model.parameters(), lr=1e-3, min_quant_size=1024, **kw, **options)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        _backward(model, dtype)
        opt.step()
    params = list(model.parameters())
    counted = opt.training_bytes()
    assert counted.params == sum(p.numel() * p.element_size() for p in params)
    assert counted.grads == sum(p.grad.numel() * p.grad.element_size() for p in params)
    assert counted.states == _state_bytes(opt) == opt.state_bytes()
    assert counted.elements == sum(p.numel() for p in params)
    assert counted.total == counted.params + counted.grads + counted.states
    if options.get("param_correction"):  # one int8 byte per element beside the moments
        assert sum(opt.state[p]["param_correction"].numel() for p in params) == counted.elements
    line = opt.format_state_report().splitlines()[-1]
    p, g, s, total = counted.per_param()
    assert line == (f"training state, bytes/param: params {p:.3f} + gradients {g:.3f} + optimizer states {s:.3f} "
                    f"= {total:.3f}")


def test_bfloat16_correction_targets():
    """bf16 params + int8 correction: 2 (param) + 2 (gradient) + 1 (correction) + the moments;
    on matrices whose rows are whole blocks, AdamW8bit's moments are 2 + 2 * 4/256 bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False), torch.nn.Linear(512, 512, bias=False))
    model = model.to(torch.bfloat16)
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-3, param_correction=True)
    _backward(model, torch.bfloat16)
    opt.step()
    p, g, s, total = opt.training_bytes().per_param()
    assert (p, g) == (2.0, 2.0) and s == pytest.approx(1 + 2 * (1 + 4 / 256)) and total < 7.1


def test_steps_in_backward_count_the_largest_gradient():
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    opt = bridge.AdamW8bit(params, lr=1e-3, min_quant_size=1024, param_correction=True)
    alive = []  # the gradient bytes alive whenever a param's gradient is final, before its step

    def seen(_):
        alive.append(sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None))

    for q in params:  # registered first, so it runs before the step's hook, which frees the gradient
        q.register_post_accumulate_grad_hook(seen)
    with bridge.step_in_backward(model, opt):
        _backward(model, torch.bfloat16)
        opt.step()
        counted = opt.training_bytes()
        line = opt.format_state_report().splitlines()[-1]
    assert counted.grads == max(alive) == max(q.numel() * q.element_size() for q in params)
    assert counted.states == _state_bytes(opt)
    assert "(steps in backward: the largest)" in line
    after = opt.training_bytes()  # the hooks removed: every gradient counted again
    assert after.grads == after.params


def test_state_report_names_integer_states():
    model = _model(torch.bfloat16)
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-3, param_correction=True)
    _backward(model, torch.bfloat16)
    opt.step()
    formats = {r.format for r in opt.state_report() if r.name == "param_correction"}
    assert formats == {"int8"}
    assert re.search(r"^ +0 param_correction +int8 ", opt.format_state_report(), re.M)


BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "training_state_bytes.py"


@pytest.mark.skipif(not BENCHMARK.exists(), reason="benchmarks/ not in this checkout")
def test_benchmark_measures_what_is_counted(capsys):
    """benchmarks/training_state_bytes.py on the --tiny demo model: what its dispatcher-level
    tracker finds alive between steps is the counted params + states (plus the plans' scalars:
    hyperparameter vectors, step counts), and at the peak at least the counted total."""
    mod = repo_scripts.load(BENCHMARK)
    n = torch.get_num_threads()
    try:
        rows = {r["name"]: r for r in mod.main(["--quick", "--setups", "8bit,8bit-bf16c-bw"])}
    finally:
        torch.set_num_threads(n)
    tiny = mod.CharGPT(256, *(mod.TINY[k] for k in ("d_model", "layers", "heads", "seq_len")))
    tensors = len(list(tiny.parameters()))
    for name, r in rows.items():
        kept = r["params"] + r["states"]
        # steps in backward keep a plan per param: a 13-float vector, its step count, a few scalars
        assert kept <= r["between_steps"] <= kept + 128 * tensors, (name, r)
        assert r["peak"] >= r["params"] + r["grads"] + r["states"], (name, r)
        # where the state bytes go: every byte counted somewhere, each part what its layout says
        parts = r["parts"]
        assert sum(parts.values()) == r["states"], (name, parts)
        assert parts["unquantized states"] == 2 * 4 * r["unquantized_elements"], (name, parts)
        quantized = r["elements"] - r["unquantized_elements"]
        assert parts["codes"] == 2 * quantized, (name, parts)  # two 8-bit codes an element
        assert 0 < parts["scales and maxima"] < parts["codes"], (name, parts)
        assert parts["correction"] == (r["elements"] if "bf16c" in name else 0), (name, parts)
    assert "| 8bit-bf16c-bw | 2.000 |" in capsys.readouterr().out
