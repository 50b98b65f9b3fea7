"""lowbit_tree.soap against an independent float64 SOAP written here from the reference code
(github.com/nikhilvyas/SOAP ``soap.py`` at a1e5535): it keeps the factors ``GG`` themselves (the
module keeps their eigen-coordinates), projects with explicit loops over dimensions and rotates
``exp_avg`` back and forth at every step, as the reference does.

Eigenvector signs are a choice of the decomposition (float32 and float64 LAPACK may differ), and
so is the order of equal eigenvalues. The comparisons are of params, which do not depend on the
signs (a column's sign flips the projected gradient and ``exp_avg`` in that coordinate and flips
back when projecting back; ``exp_avg_sq`` squares it), and the inputs give every factor distinct
eigenvalues from the first gradient on (each unfolding of a gradient has at least as many columns
as rows: square matrices, a conv-like (3, 3, 4)), so the order is fixed. A vector's factor under
``precondition_1d`` is ``g g^T``, of rank 1 at the first gradient: that case is not compared.
"""
from __future__ import annotations

import math

import warnings

import pytest
import torch

import lowbit_tree as lt
from lowbit_tree import soap_transform as soap_mod


# ----------------------------------------------------------------------------- the float64 reference
def _ref_init(p, max_dim, precondition_1d):
    if p.ndim == 1:
        dims = [p.shape[0] if precondition_1d and p.shape[0] <= max_dim else None]
    else:
        dims = [n if n <= max_dim else None for n in p.shape]
    return {"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p),
            "GG": [None if n is None else torch.zeros(n, n, dtype=p.dtype) for n in dims], "Q": None}


def _ref_project(x, Q, back):
    for q in Q:
        if q is None:
            x = x.permute(*range(1, x.ndim), 0)
        else:
            # contract x's first dimension with Q's rows (project) or columns (back), one element at a time
            rows = q.shape[0]
            rest = x.shape[1:]
            y = torch.zeros(*rest, rows, dtype=x.dtype)
            for j in range(rows):
                col = q[:, j] if not back else q[j, :]
                acc = torch.zeros(rest, dtype=x.dtype)
                for i in range(rows):
                    acc = acc + x[i] * col[i]
                y[..., j] = acc
            x = y
    return x


def _ref_outer(g, d):
    gd = torch.movedim(g, d, 0).reshape(g.shape[d], -1)
    n = gd.shape[0]
    out = torch.zeros(n, n, dtype=g.dtype)
    for i in range(n):
        for j in range(n):
            out[i, j] = (gd[i] * gd[j]).sum()
    return out


def _ref_update_preconditioner(g, st, sb, freq):
    if st["Q"] is not None:
        st["m"] = _ref_project(st["m"], st["Q"], back=True)
    for d, gg in enumerate(st["GG"]):
        if gg is not None:
            st["GG"][d] = gg + (1 - sb) * (_ref_outer(g, d) - gg)
    if st["Q"] is None:
        st["Q"] = []
        for gg in st["GG"]:
            if gg is None:
                st["Q"].append(None)
                continue
            _, q = torch.linalg.eigh(gg + 1e-30 * torch.eye(gg.shape[0], dtype=gg.dtype))
            st["Q"].append(torch.flip(q, [1]))
    if st["step"] > 0 and st["step"] % freq == 0:
        new = []
        for d, (gg, o) in enumerate(zip(st["GG"], st["Q"])):
            if gg is None:
                new.append(None)
                continue
            est = torch.diag(o.T @ gg @ o)
            idx = torch.argsort(est, descending=True)
            st["v"] = st["v"].index_select(d, idx)
            q, _ = torch.linalg.qr(gg @ o[:, idx])
            new.append(q)
        st["Q"] = new
    if st["step"] > 0:
        st["m"] = _ref_project(st["m"], st["Q"], back=False)


def _ref_step(p, g, st, *, lr, b1, b2, sb, eps, wd, freq, normalize, correct_bias):
    """One step of the reference on float64 ``p`` (returned new); ``st`` is updated."""
    if st["Q"] is None:
        _ref_update_preconditioner(g, st, sb, freq)
        return p
    proj = _ref_project(g, st["Q"], back=False)
    st["step"] += 1
    st["m"] = st["m"] * b1 + (1 - b1) * proj
    st["v"] = st["v"] * b2 + (1 - b2) * proj * proj
    denom = st["v"].sqrt() + eps
    step_size = lr
    if correct_bias:
        step_size = lr * math.sqrt(1 - b2 ** st["step"]) / (1 - b1 ** st["step"])
    u = _ref_project(st["m"] / denom, st["Q"], back=True)
    if normalize:
        u = u / (1e-30 + (u * u).mean().sqrt())
    p = p - step_size * u
    if wd > 0:
        p = p - lr * wd * p
    _ref_update_preconditioner(g, st, sb, freq)
    return p


SHAPES = [(5, 5), (6,), (4, 40), (3, 3, 4)]
"""A square matrix, a vector (Adam, or rotated with precondition_1d), a matrix with one
dimension over max_precond_dim=16 (not rotated), a conv-like 3-D param."""


def _grads(shapes, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    # a per-row and per-column scale keeps the factors' eigenvalues apart
    out = []
    for _ in range(steps):
        gs = []
        for s in shapes:
            g = torch.randn(s, generator=gen, dtype=torch.float64)
            for d, n in enumerate(s):
                w = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
                g = g * w.reshape([n if k == d else 1 for k in range(len(s))])
            gs.append(g)
        out.append(gs)
    return out


@pytest.mark.parametrize("precondition_1d,normalize,correct_bias,wd", [
    (False, False, True, 0.01), (True, True, False, 0.0)])
def test_float32_soap_matches_a_float64_reference_over_20_steps_with_refreshes(precondition_1d, normalize,
                                                                                 correct_bias, wd):
    kw = dict(lr=0.01, b1=0.9, b2=0.95, sb=0.9, eps=1e-8, wd=wd, freq=5, normalize=normalize,
              correct_bias=correct_bias)
    gen = torch.Generator().manual_seed(1)
    params64 = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    grads = _grads(SHAPES, 20, seed=2)
    tx = lt.soap(kw["lr"], kw["b1"], kw["b2"], kw["sb"], kw["eps"], wd, 5, 16, precondition_1d, normalize,
                 bias_correction=correct_bias)
    params = [p.float() for p in params64]
    start = [p.clone() for p in params64]
    state = tx.init(params)
    refs = [_ref_init(p, 16, precondition_1d) for p in params64]
    errs = []
    for k, gs in enumerate(grads):
        upd, state = tx.update([g.float() for g in gs], state, params)
        params = lt.apply_updates(params, upd)
        params64 = [_ref_step(p, g, st, **kw) for p, g, st in zip(params64, gs, refs)]
        if k == 0:
            for p, p0 in zip(params, params64):
                assert torch.equal(p, p0.float()), "the first step only builds the preconditioner"
        for p, p64, s in zip(params, params64, SHAPES):
            if precondition_1d and len(s) == 1:
                continue  # a vector's factor g g^T has rank 1: its null space's basis is the decomposition's choice
            err = (p.double() - p64).abs().max().item()
            errs.append(err)
            assert err < 2e-5, f"step {k + 1}, shape {s}: |float32 - float64| = {err:.3g}"
    print("max err", max(errs), "moved", max((p.double() - p0).abs().max().item() for p, p0 in zip(params, start)))
    assert [r.steps for r in soap_mod.soap_report(state)] == [20] * len(SHAPES)
    assert all(r.failures == 0 for r in soap_mod.soap_report(state))
    assert soap_mod.soap_report(state)[2].rotated == (True, False)
    assert soap_mod.soap_report(state)[1].rotated == (precondition_1d,)


# ----------------------------------------------------------------------------- purity, in place, edges
def _tensors(tree):
    import optree
    return [t for t in optree.tree_leaves(tree, none_is_leaf=False) if isinstance(t, torch.Tensor)]


def _run(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        upd, state = tx.update(g, state, params)
        params = lt.apply_updates(params, upd)
    return params, state


@pytest.mark.parametrize("precond_format,state_format", [("fp32", "fp32"), ("8bit", "8bit"), ("4bit", "4bit")])
def test_update_is_pure_and_the_in_place_plan_gives_the_same_bits(precond_format, state_format):
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 80), (7,), (70, 8)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    tx = lt.soap(0.01, precondition_frequency=2, max_precond_dim=64, state_format=state_format,
                 precond_format=precond_format, min_quant_size=64)
    state = tx.init(params)
    live = tx.init(params)
    p_live = [p.clone() for p in params]
    step = tx.plan(live, p_live)
    for g in grads:
        before = [t.clone() for t in _tensors((params, g, state))]
        upd, new = tx.update(g, state, params)
        after = _tensors((params, g, state))
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "update modified an input"
        params = lt.apply_updates(params, upd)
        state = new
        for p, u in zip(p_live, step(list(g))):  # the plan's params advance in place
            p.add_(u)
        for p, q in zip(params, p_live):
            assert torch.equal(p, q)
    for a, b in zip(_tensors(state), _tensors(live)):
        assert torch.equal(a, b)


def test_zero_gradients_build_a_reversed_identity_basis_and_only_decay_moves_params():
    gen = torch.Generator().manual_seed(9)
    params = [torch.randn(4, 4, generator=gen), torch.randn(3, generator=gen)]
    tx = lt.soap(0.1, weight_decay=0.5)
    zeros = [torch.zeros_like(p) for p in params]
    upd, state = tx.update(zeros, tx.init(params), params)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in upd)
    assert torch.equal(state.basis[0][0], torch.eye(4).flip(1))
    upd, state = tx.update(zeros, state, params)
    for p, u in zip(params, upd):
        torch.testing.assert_close(p + u, p * (1 - 0.1 * 0.5), rtol=0, atol=1e-6)
    assert [r.failures for r in soap_mod.soap_report(state)] == [0, 0]


def test_a_non_finite_factor_keeps_the_basis_and_counts_a_failure():
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(4, 6, generator=gen), torch.randn(5, 5, generator=gen)]
    tx = lt.soap(0.01, precondition_frequency=1)
    state = tx.init(params)
    bad = torch.randn(4, 6, generator=gen)
    bad[1, 2] = float("nan")
    good = torch.randn(5, 5, generator=gen)
    upd, state = tx.update([bad, good], state, params)
    assert torch.equal(state.basis[0][0], torch.eye(4).flip(1)) and torch.equal(state.basis[0][1], torch.eye(6).flip(1))
    rows = soap_mod.soap_report(state)
    assert [r.failures for r in rows] == [2, 0]
    upd, state = tx.update([torch.randn(4, 6, generator=gen), good], state, params)  # a refresh every step
    assert [r.failures for r in soap_mod.soap_report(state)] == [4, 0]
    # the moments never saw the NaN (the first gradient only builds): Adam steps in the kept basis, while
    # the factor stays non-finite and every refresh keeps the basis
    assert torch.isfinite(upd[0]).all() and torch.isfinite(upd[1]).all()
    assert torch.isnan(state.eigenvalues[0][0]).any()


def test_an_eigh_that_fails_in_float32_retries_in_float64_then_keeps_the_basis(monkeypatch):
    real = torch.linalg.eigh
    calls = []

    def eigh(m):
        calls.append(m.dtype)
        if m.dtype == torch.float32 or len(calls) > 2:
            raise torch.linalg.LinAlgError("forced")
        return real(m)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(3, 3, generator=gen)]
    tx = lt.soap(0.01)
    _, state = tx.update([torch.randn(3, 3, generator=gen)], tx.init(params), params)
    assert calls == [torch.float32, torch.float64] * 2  # dim 0 in float64; dim 1 fails in both
    q = state.basis[0][0]
    torch.testing.assert_close(q.T @ q, torch.eye(3), rtol=0, atol=1e-6)
    assert torch.equal(state.basis[0][1], torch.eye(3).flip(1))
    assert soap_mod.soap_report(state)[0].failures == 1


@pytest.mark.parametrize("name,value", [("b1", 1.0), ("precondition_frequency", 0), ("max_precond_dim", 1.5),
                                        ("data_format", "nhwc"), ("precond_format", "2bit"), ("bjorck_steps", -1),
                                        ("normalize_grads", 1), ("eps", -1.0)])
def test_bad_arguments_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        lt.soap(**{name: value})


@pytest.mark.parametrize("wd", [0.01, 1e-30])
def test_weight_decay_without_a_learning_rate_is_refused(wd):
    """Without ``learning_rate`` the update is a direction: a decay (``lr wd p``) has nothing to
    scale it, so a non-zero ``weight_decay`` is refused, naming it and both fixes; zero is fine."""
    with pytest.raises(ValueError, match=r"weight_decay=.*needs a learning_rate.*pass learning_rate.*add_decayed_weights"):
        lt.scale_by_soap(weight_decay=wd)
    with pytest.raises(ValueError, match="weight_decay"):
        lt.soap(None, weight_decay=wd)
    lt.scale_by_soap(weight_decay=0.0)
    lt.scale_by_soap(learning_rate=0.1, weight_decay=wd)


def test_the_direction_chains_with_decay_and_learning_rate_links():
    """``scale_by_soap()`` without a learning rate is the direction; chained with
    ``scale_by_learning_rate`` (and no decay) it gives ``soap``'s params up to rounding order."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(6, 6, generator=gen), torch.randn(5, generator=gen)]
    tx = lt.chain(lt.scale_by_soap(precondition_frequency=2), lt.add_decayed_weights(0.0),
                  lt.scale_by_learning_rate(0.01))
    ref = lt.soap(lambda count: 0.01, weight_decay=0.0, precondition_frequency=2)  # a schedule, too
    s1, s2, p1, p2 = tx.init(params), ref.init(params), params, params
    for _ in range(5):
        gs = [torch.randn(p.shape, generator=gen) for p in params]
        u1, s1 = tx.update(gs, s1, p1)
        u2, s2 = ref.update(gs, s2, p2)
        p1, p2 = lt.apply_updates(p1, u1), lt.apply_updates(p2, u2)
    for a, b, p in zip(p1, p2, params):
        assert not torch.equal(a, p)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


@pytest.mark.parametrize("precond_format", ["fp32", "8bit", "4bit"])
def test_a_scalar_an_empty_param_and_a_missing_gradient(precond_format):
    """A 0-d param runs Adam, an empty one steps to nothing, a leaf without a gradient keeps its
    state and its step count."""
    gen = torch.Generator().manual_seed(10)
    params = [torch.randn((), generator=gen), torch.zeros(0, 5), torch.randn(3, 4, generator=gen)]
    tx = lt.soap(precondition_frequency=1, precond_format=precond_format, min_quant_size=1)
    state = tx.init(params)
    for i in range(3):
        gs = [torch.randn(p.shape, generator=gen) for p in params]
        if i == 1:
            gs[2] = None
            kept = [t.clone() for t in _tensors((state.exp_avg[2], state.basis[2], state.coupling[2]))]
        upd, state = tx.update(gs, state, params)
        if i == 1:
            assert upd[2] is None
            now = _tensors((state.exp_avg[2], state.basis[2], state.coupling[2]))
            assert all(torch.equal(a, b) for a, b in zip(kept, now))
        params = lt.apply_updates(params, upd)
    assert [r.steps for r in soap_mod.soap_report(state)] == [3, 3, 2]
    assert torch.isfinite(params[0]) and params[1].shape == (0, 5)


def test_correct_bias_is_the_old_name_of_bias_correction():
    """``correct_bias=`` (the name before ``bias_correction=``) still works for one release, with a
    FutureWarning, and gives the same transformation; both names with different values is refused."""
    p = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    g = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))
    runs = []
    for kwargs in (dict(bias_correction=False), dict(correct_bias=False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tx = lt.soap(1e-2, precondition_frequency=1, **kwargs)
        assert [w.category for w in caught] == ([FutureWarning] if "correct_bias" in kwargs else [])
        state = tx.init([p])
        for _ in range(3):
            u, state = tx.update([g], state, [p])
        runs.append(u[0])
    assert torch.equal(runs[0], runs[1])
    with pytest.raises(TypeError, match="give bias_correction= only"):
        lt.soap(1e-2, bias_correction=False, correct_bias=True)

