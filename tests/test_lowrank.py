"""The low-rank-plus-residual momentum record (``lowbit_tree/lowrank.py``) and Muon's
``momentum_rank`` step: the factor product against float64 and against itself on shards, the
power iteration against an SVD, the step against the documented definition rebuilt from
independent pieces (numpy's lerp, the reference quantizer, torch's Newton-Schulz), purity,
what the split buys on a low-rank momentum, checkpoints and argument errors."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import lowbit_tree as lt
from lowbit_tree.lowrank import (FACTOR_DTYPE, LowRankQTensor, lowrank_dequantize, lowrank_expand, lowrank_rank,
                                 refresh_factors)
from lowbit_tree.muon_transform import DEFAULT_NS_COEFFICIENTS
from test_kernels_step import np_lerp, same


def same_record(a, b) -> bool:
    return (isinstance(a, LowRankQTensor) and isinstance(b, LowRankQTensor) and same(a.residual, b.residual)
            and same(a.row_factor, b.row_factor) and same(a.col_factor, b.col_factor))


def _factors(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen).to(FACTOR_DTYPE), (torch.randn(n, k, generator=gen) * 3).to(FACTOR_DTYPE))


def _sequential_product(p, r) -> np.ndarray:
    """``sum_k p[:, k] r[:, k]`` in float32, k in order, written with numpy (the documented order)."""
    pf, rf = p.float().numpy(), r.float().numpy()
    out = np.zeros((pf.shape[0], rf.shape[0]), dtype=np.float32)
    for k in range(pf.shape[1]):
        term = pf[:, k:k + 1] * rf[None, :, k]
        out = term if k == 0 else (out + term).astype(np.float32)
    return out


@pytest.mark.parametrize("backend", ["native", "eager"])
@pytest.mark.parametrize("m,n,k", [(37, 53, 8), (1, 300, 1), (130, 24, 5), (64, 64, 16), (0, 9, 3), (9, 4, 0),
                                   (300, 1027, 16)])
def test_expand_is_the_sequential_sum_on_any_shard(m, n, k, backend, monkeypatch):
    """The C loop (native) and the torch ops (eager, CUDA's) give the sequential sum's bits."""
    from lowbit_tree.kernels import native

    if backend == "native" and not native.available():
        pytest.skip(f"native kernel unavailable: {native.build_error()}")
    monkeypatch.setenv("LOWBIT_TREE_BACKEND", backend)
    p, r = _factors(m, n, k, m * 7 + n)
    if m > 2 and n > 2 and k:  # special values travel as in float32 arithmetic
        p[1, 0], r[2, -1] = float("inf"), float("nan")
    full = lowrank_expand(p, r)
    assert full.dtype == torch.float32 and full.shape == (m, n)
    with np.errstate(invalid="ignore"):
        want = _sequential_product(p, r)
    assert np.array_equal(full.numpy(), want, equal_nan=True)
    if m > 2 and n > 2 and k:
        p, r = p.clone(), r.clone()
        p[1, 0], r[2, -1] = 0, 0
        full = lowrank_expand(p, r)
    if m and n and k:
        exact = p.double() @ r.double().T  # bfloat16 products are exact; only the sums round
        assert ((full.double() - exact).abs() <= 1e-6 * (p.double().abs() @ r.double().abs().T)).all()
    for a, b in ((0, m // 3), (m // 3, m), (m // 2, m // 2)):  # row shards (FSDP2), an empty one
        assert torch.equal(lowrank_expand(p[a:b], r), full[a:b])
    for a, b in ((0, n // 2), (n // 2, n)):  # column shards (tensor parallel)
        assert torch.equal(lowrank_expand(p, r[a:b]), full[:, a:b])


def test_refresh_finds_the_top_subspace():
    """Warm-started power iterations from a zero column factor (the first step) converge to the
    best rank-K approximation's error (numpy's SVD), up to the factors' bfloat16 rounding."""
    gen = torch.Generator().manual_seed(4)
    m, n, k = 96, 70, 6
    u, v = torch.linalg.qr(torch.randn(m, k, generator=gen))[0], torch.linalg.qr(torch.randn(n, k, generator=gen))[0]
    b = (u * torch.tensor([40.0, 30, 20, 10, 5, 3])) @ v.T + 0.005 * torch.randn(m, n, generator=gen)
    s = np.linalg.svd(b.double().numpy(), compute_uv=False)
    best = np.sqrt((s[k:] ** 2).sum())
    r = torch.zeros(n, k, dtype=FACTOR_DTYPE)
    for _ in range(6):
        p, r = refresh_factors(b, r)
    assert p.dtype == r.dtype == FACTOR_DTYPE and p.shape == (m, k) and r.shape == (n, k)
    err = (b - lowrank_expand(p, r)).double().norm().item()
    bf16 = 2 ** -8 * b.double().norm().item()  # the factors' storage
    assert err <= best + bf16, (err, best, bf16)
    one = lowrank_expand(*refresh_factors(b, torch.zeros(n, k, dtype=FACTOR_DTYPE)))
    assert (b - one).norm().item() > 3 * err  # one iteration from the coordinate start is not there yet


def test_refresh_of_a_zero_or_non_finite_matrix():
    torch.manual_seed(0)
    p, r = refresh_factors(torch.zeros(20, 30), torch.zeros(30, 4, dtype=FACTOR_DTYPE))
    assert not lowrank_expand(p, r).any()
    bad = torch.randn(20, 30)
    bad[3, 4] = float("nan")
    p, r = refresh_factors(bad, torch.ones(30, 4, dtype=FACTOR_DTYPE))
    assert torch.isnan(lowrank_expand(p, r)).all()  # a NaN poisons the whole matrix's factors


def _record(shape, k, fmt, bs, seed):
    gen = torch.Generator().manual_seed(seed)
    p, r = _factors(shape[0], shape[1], k, seed + 1)
    res = lt.quantize(torch.randn(shape, generator=gen) * 0.05, fmt, bs, signed=True)
    return LowRankQTensor(res.codes, res.scale, p * 0.1, r, shape, bs, res.format)


@pytest.mark.parametrize("fmt", ["nf4", "8bit", "4bit", "fp8"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(24, 80), (90, 30)])
def test_step_is_the_definition(fmt, nesterov, shape):
    """The documented step from independent pieces: L by the sequential sum (numpy), the rule by
    numpy's lerp (one rounding, as torch.lerp), every stored form by the reference quantizer,
    the refresh by its QR definition on the stored-form new buffer, Newton-Schulz by torch's of
    ``L`` plus the 8-bit residual of ``u - L``."""
    k, bs, mu = 5, 32, 0.9
    rec = _record(shape, k, fmt, bs, seed=sum(shape))
    g = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    tx = lt.scale_by_muon(mu, nesterov, state_format=fmt, block_size=bs, min_quant_size=1, momentum_rank=k)
    (u,), new = tx.update([g], lt.ScaleByMuonState(torch.zeros((), dtype=torch.int32), [rec]))

    low = _sequential_product(rec.row_factor, rec.col_factor)
    s = lt.dequantize(rec.residual).numpy()
    y = (g.numpy() - low).astype(np.float32)
    s1 = np_lerp(s, y, np.float32(1 - mu))
    stored = lt.quantize(torch.from_numpy(s1), rec.format, bs)
    b_tilde = torch.from_numpy((low + lt.dequantize(stored).numpy()).astype(np.float32))
    q = torch.linalg.qr(rec.col_factor.float())[0]
    p_new = torch.linalg.qr(b_tilde @ q)[0]
    r_new = (b_tilde.T @ p_new).to(FACTOR_DTYPE)
    p_new = p_new.to(FACTOR_DTYPE)
    low_new = _sequential_product(p_new, r_new)
    e = ((s1 + low).astype(np.float32) - low_new).astype(np.float32)
    want = LowRankQTensor(*[getattr(lt.quantize(torch.from_numpy(e), rec.format, bs), f) for f in ("codes", "scale")],
                          p_new, r_new, shape, bs, rec.format)
    assert same_record(new.trace[0], want)

    x_res = np_lerp(y, s1, np.float32(mu)) if nesterov else s1
    x8 = lt.quantize(torch.from_numpy(x_res), "8bit", bs, signed=True)  # the input's residual: 8 bits
    assert x8.format == "dynamic8"
    x = torch.from_numpy((low + lt.dequantize(x8).numpy())
                         .astype(np.float32))
    ratio = max(1, shape[0] / shape[1]) ** 0.5
    want_u = _zeropower_via_newtonschulz(x, DEFAULT_NS_COEFFICIENTS, 5, 1e-7).float() * ratio
    assert torch.equal(u, want_u)


def test_update_is_pure_and_state_report_names_the_rank():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(40, 70, generator=gen), torch.randn(3, 300, generator=gen), torch.randn(8, 8, generator=gen)]
    tx = lt.muon(0.02, state_format="nf4", min_quant_size=100, momentum_rank=8)
    state = tx.init(params)
    trace = state[0].trace
    assert [type(t).__name__ for t in trace] == ["LowRankQTensor", "LowRankQTensor", "Tensor"]  # 64 < 100: fp32
    assert trace[1].rank == 3 == lowrank_rank((3, 300), 8)
    grads = [[torch.randn_like(p) for p in params] for _ in range(2)]
    state = tx.update(grads[0], state, params)[1]
    snap = copy.deepcopy((params, grads[1], state))
    tx.update(grads[1], state, params)
    for a, b in zip(*(lt.tree_utils.flatten(t)[0] for t in (snap, (params, grads[1], state)))):
        assert same_record(a, b) if isinstance(a, LowRankQTensor) else (not isinstance(a, torch.Tensor) or torch.equal(a, b))
    rows = lt.state_report(state)
    assert [r.format for r in rows[:-1] if "trace" in r.path] == ["normal4+rank8", "normal4+rank3", "float32"]
    r0 = trace[0]
    assert rows[[i for i, r in enumerate(rows) if r.path.endswith("trace/0")][0]].nbytes == (
        r0.codes.numel() + 4 * r0.scale.numel() + 2 * (40 + 70) * 8)


def _ema_error(rank: int, steps: int = 60) -> float:
    """Relative rms error of the stored buffer against the float32 EMA, on gradients that are a
    slowly turning rank-4 signal plus noise (a momentum whose energy sits in few directions)."""
    gen = torch.Generator().manual_seed(11)
    m, n = 128, 96
    u, w, v = torch.randn(m, 4, generator=gen), torch.randn(m, 4, generator=gen), torch.randn(n, 4, generator=gen)
    tx = lt.scale_by_muon(0.95, False, state_format="nf4", min_quant_size=1, momentum_rank=rank, ns_steps=0)
    state = tx.init([torch.zeros(m, n)])
    ref = torch.zeros(m, n)
    for t in range(steps):
        g = (u + 0.02 * t * w) @ v.T + 0.3 * torch.randn(m, n, generator=gen)
        ref = torch.lerp(ref, g, 0.05)
        _, state = tx.update([g], state)
    got = lt.moments.load(state.trace[0])
    return ((got - ref).norm() / ref.norm()).item()


def test_the_split_shrinks_the_stored_error():
    plain, split = _ema_error(0), _ema_error(8)  # measured: 0.52 and 0.005
    assert split < 0.05 * plain, (split, plain)


def test_a_nan_gradient_poisons_only_its_own_matrix():
    torch.manual_seed(0)
    params = [torch.randn(20, 30), torch.randn(16, 40)]
    tx = lt.muon(0.01, state_format="nf4", min_quant_size=1, momentum_rank=4)
    state = tx.init(params)
    g = [torch.randn(20, 30), torch.randn(16, 40)]
    g[0][2, 3] = float("nan")
    u, state = tx.update(g, state, params)
    assert torch.isnan(lt.moments.load(state[0].trace[0])).any()
    assert torch.isfinite(lt.moments.load(state[0].trace[1])).all() and torch.isfinite(u[1]).all()


def test_checkpoint_round_trip_and_rank_mismatch():
    torch.manual_seed(0)
    params = [torch.randn(40, 70)]
    tx = lt.muon(0.02, state_format="nf4", min_quant_size=1, momentum_rank=4)
    state = tx.update([torch.randn(40, 70)], tx.init(params), params)[1]
    back = lt.state_from_dict(tx.init(params), lt.state_to_dict(state))
    assert same_record(back[0].trace[0], state[0].trace[0])
    other = lt.muon(0.02, state_format="nf4", min_quant_size=1, momentum_rank=2)
    with pytest.raises(ValueError, match="row_factor"):
        lt.state_from_dict(other.init(params), lt.state_to_dict(state))
    plain = lt.muon(0.02, state_format="nf4", min_quant_size=1)
    with pytest.raises(ValueError, match="__format__"):
        lt.state_from_dict(plain.init(params), lt.state_to_dict(state))
    assert torch.equal(lowrank_dequantize(state[0].trace[0]), state[0].trace[0].dequantize())


def test_argument_errors():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="momentum_rank must be an int >= 0"):
            lt.scale_by_muon(momentum_rank=bad)
    with pytest.raises(ValueError, match="quantized state_format"):
        lt.scale_by_muon(state_format="fp32", momentum_rank=4)
    p, r = _factors(4, 5, 2, 0)
    with pytest.raises(ValueError, match="factors"):
        LowRankQTensor(torch.zeros(4, 3, dtype=torch.uint8), torch.zeros(4, 1), p, r[:, :1], (4, 5), 32, "normal4")
    with pytest.raises(TypeError, match="written by its optimizer's step"):
        lt.moments.store(torch.zeros(4, 5), _record((4, 5), 2, "nf4", 32, 0))
