"""apply_updates and reproducible stochastic rounding."""
import io

import pytest
import torch

import lowbit_tree as lt
from lowbit_tree.alias import adamw, sgd
from lowbit_tree.update import apply_updates, rounding_key, stochastic_round


def test_apply_updates_is_pure_and_keeps_param_dtypes():
    params = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2, dtype=torch.float64), "c": torch.ones(2), "n": None, "g": torch.ones(1)}
    updates = {"a": torch.full((3,), 0.5), "b": torch.full((2,), 1e-12, dtype=torch.float32), "c": torch.full((2,), 0.25, dtype=torch.bfloat16), "n": None, "g": None}
    before = {k: v.clone() for k, v in params.items() if v is not None}
    out = apply_updates(params, updates)
    assert all(torch.equal(params[k], before[k]) for k in before)
    assert out["a"].dtype == torch.bfloat16 and torch.equal(out["a"], torch.full((3,), 1.5, dtype=torch.bfloat16))
    assert out["b"].dtype == torch.float64 and out["b"][0].item() == 1 + float(torch.tensor(1e-12))  # float64 sum
    assert out["c"].dtype == torch.float32 and out["n"] is None and out["g"] is params["g"]
    assert apply_updates({}, {}) == {}
    with pytest.raises(ValueError, match="key"):
        apply_updates(params, updates, stochastic_round=True)


def test_stochastic_round_is_unbiased():
    """1e-4 is 1/78 of bf16's spacing at 1.0 (2^-7): round-to-nearest loses it,
    stochastic rounding keeps it on average. 64 keys x 4096 elements."""
    torch.manual_seed(0)
    x = torch.full((4096,), 1.0 + 1e-4)
    assert torch.equal(x.to(torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16))
    means = [stochastic_round(x, torch.bfloat16, torch.tensor([7, i])).float().mean() for i in range(64)]
    mean = torch.stack(means).mean().item() - 1.0
    # p = 0.0128 up-moves of 2^-7 per element over 262144 draws: std of the mean ~ 1.7e-6
    assert abs(mean - 1e-4) < 1e-5, mean
    # negative values and mixed magnitudes: E[round(x)] == x
    y = torch.randn(4096) * 10
    acc = torch.stack([stochastic_round(y, torch.bfloat16, torch.tensor(i)).double() for i in range(256)]).mean(0)
    assert ((acc - y.double()).abs() / y.double().abs().clamp(min=1e-3)).max() < 2 ** -8 * 0.35  # ~5 std
    # representable values are kept, non-finite ones pass, results are deterministic
    z = torch.tensor([1.0, -2.5, 0.0, float("inf"), float("nan")])
    r = stochastic_round(z, torch.bfloat16, torch.tensor(3))
    assert torch.equal(r[:4].float(), z[:4]) and torch.isnan(r[4])
    k = torch.tensor([1, 2])
    assert torch.equal(stochastic_round(y, torch.bfloat16, k), stochastic_round(y, torch.bfloat16, k))
    assert not torch.equal(stochastic_round(y, torch.bfloat16, k), stochastic_round(y, torch.bfloat16, torch.tensor([1, 3])))


def test_stochastic_rounding_alias_keeps_small_updates_alive():
    """SGD on bf16 params with steps 1/40 of bf16 spacing: nearest rounding never
    moves them; stochastic rounding tracks the fp32 trajectory on average."""
    p0 = {"w": torch.ones(64, 64, dtype=torch.bfloat16)}
    g = {"w": torch.full((64, 64), 1.0, dtype=torch.bfloat16)}

    def run(tx, steps=200):
        p, s = p0, tx.init(p0)
        for _ in range(steps):
            u, s = tx.update(g, s, p)
            p = apply_updates(p, u)
        return p["w"].float()

    lr = 2 ** -7 / 40 * 2  # bf16 spacing just below 1.0 is 2^-8
    assert torch.equal(run(sgd(lr)), torch.ones(64, 64))
    w = run(sgd(lr, stochastic_round=True))
    assert abs(w.mean().item() - (1 - 200 * lr)) < 2e-3, w.mean().item()


def test_stochastic_rounding_resume_is_bit_identical():
    tx = adamw(1e-3, state_format="8bit", min_quant_size=0, stochastic_round=True, seed=123)
    gen = torch.Generator().manual_seed(0)
    grads = [{"w": torch.randn(16, 64, generator=gen).bfloat16(), "b": torch.randn(64, generator=gen).bfloat16()} for _ in range(8)]
    p = {"w": torch.randn(16, 64, generator=gen).bfloat16(), "b": torch.zeros(64, dtype=torch.bfloat16)}

    def steps(p, s, gs):
        for g in gs:
            u, s = tx.update(g, s, p)
            p = apply_updates(p, u)
        return p, s

    straight, _ = steps(p, tx.init(p), grads)
    mid_p, mid_s = steps(p, tx.init(p), grads[:4])
    buf = io.BytesIO()
    torch.save((mid_p, mid_s), buf)
    buf.seek(0)
    lp, ls = torch.load(buf, weights_only=True)
    resumed, _ = steps(lp, ls, grads[4:])
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    # the rounding key lives in the state and advances with it
    assert rounding_key(ls[-1]).tolist() == [123, 4]
    # and the stochastic choice differs from round-to-nearest
    tx_nearest = adamw(1e-3, state_format="8bit", min_quant_size=0)
    p_nearest = p
    s_nearest = tx_nearest.init(p)
    for g in grads:
        u, s_nearest = tx_nearest.update(g, s_nearest, p_nearest)
        p_nearest = apply_updates(p_nearest, u)
    assert not torch.equal(straight["w"], p_nearest["w"])


def test_apply_updates_with_key_matches_the_transformation():
    """apply_updates(stochastic_round=True, key) and the alias option round the
    same way: one is the other's last link."""
    from lowbit_tree.update import stochastic_rounding

    torch.manual_seed(0)
    p = {"w": torch.randn(8, 8).bfloat16()}
    u = {"w": torch.randn(8, 8) * 1e-3}
    tx = stochastic_rounding(seed=5)
    s = tx.init(p)
    u2, _ = tx.update(u, s, p)
    assert torch.equal(apply_updates(p, u2)["w"], apply_updates(p, u, stochastic_round=True, key=rounding_key(s))["w"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2048, 2048), (300, 301), (70001,)])
def test_apply_updates_on_the_native_kernel_equals_torch_add(dtype, shape):
    """Large CPU params take the C kernel's add (non-temporal stores): the same bits as
    ``torch.add(p, u)`` rounded once to the param's dtype, with NaN, inf and -0 updates."""
    from lowbit_tree.kernels import native
    from lowbit_tree.update import _native_apply

    gen = torch.Generator().manual_seed(sum(shape))
    p = torch.randn(shape, generator=gen).to(dtype)
    u = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 4)
    u.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    got = lt.apply_updates({"w": p}, {"w": u})["w"]
    want = torch.add(p, u, out=torch.empty_like(p))
    assert _native_apply(p, u) == native.available()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan].view(bits), want[~nan].view(bits))
