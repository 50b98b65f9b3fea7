"""Building blocks, combinators and the quantize-or-not decision."""
import optree
import pytest
import torch

from lowbit_tree.alias import adam, adamw, lion, sgd
from lowbit_tree.base import EmptyState, GradientTransformation, identity
from lowbit_tree.combine import chain, named_chain, partition
from lowbit_tree.moments import Rank1QTensor, rank1_dequantize, rank1_quantize, should_quantize, state_report
from lowbit_tree.qtensor import QTensor, dequantize, quantize
from lowbit_tree.transform import (
    ScaleByAdamState,
    add_decayed_weights,
    clip_by_global_norm,
    scale_by_adam,
    scale_by_learning_rate,
)
from lowbit_tree.update import apply_updates
from lowbit_tree.wrappers import masked


FORMATS = ["fp32", "bf16", "8bit", "4bit", "fp8", "8bit_bnb"]


def _params(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(64, 96, generator=g).to(device, dtype),  # 6144: quantized
        "mlp": [torch.randn(32, 32, generator=g).to(device, dtype), torch.randn(32, generator=g).to(device, dtype)],
        "frozen": torch.randn(4, 4, generator=g).to(device, dtype),
    }


def _grads(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(lambda p: torch.randn(p.shape, generator=g).to(p.device, p.dtype), params)


def _snapshot(tree):
    leaves = optree.tree_leaves(tree)
    return [(t.data_ptr(), t.clone()) for t in leaves if isinstance(t, torch.Tensor)]


def _unchanged(tree, snap):
    leaves = [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return all(t.data_ptr() == ptr and torch.equal(t, v) for t, (ptr, v) in zip(leaves, snap))


ALIASES = {
    "adam": lambda f: adam(1e-2, state_format=f),
    "adam_amsgrad_rank1": lambda f: adam(1e-2, amsgrad=True, state_format=f, rank1_normalization=f == "4bit"),
    "adamw": lambda f: adamw(1e-2, state_format=f, stochastic_round=True),
    "lion": lambda f: lion(1e-3, weight_decay=0.1, state_format=f),
    "sgd": lambda f: sgd(1e-2, momentum=0.9, weight_decay=0.1, state_format=f),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("algo", sorted(ALIASES))
def test_update_is_pure_and_keeps_dtypes_and_formats(algo, fmt, dtype):
    tx = ALIASES[algo](fmt)
    params = _params(dtype=dtype)
    state = tx.init(params)
    spec0 = optree.tree_structure(state)
    dtypes0 = [t.dtype for t in optree.tree_leaves(state)]
    for step in range(2):
        grads = _grads(params, seed=step)
        snaps = [_snapshot(t) for t in (grads, state, params)]
        updates, new_state = tx.update(grads, state, params)
        assert all(_unchanged(t, s) for t, s in zip((grads, state, params), snaps)), "update mutated an input"
        assert optree.tree_structure(new_state) == spec0  # same records, formats, block sizes, shapes
        assert [t.dtype for t in optree.tree_leaves(new_state)] == dtypes0
        assert all(u.dtype == torch.float32 for u in optree.tree_leaves(updates))  # rounded once, by apply_updates
        snap_p = _snapshot(params)
        new_params = apply_updates(params, updates)
        assert _unchanged(params, snap_p)
        assert all(n.dtype == p.dtype for n, p in zip(optree.tree_leaves(new_params), optree.tree_leaves(params)))
        params, state = new_params, new_state


def test_should_quantize_and_report():
    assert should_quantize((64, 64), 4096) and not should_quantize((4096,), 0)
    assert not should_quantize((63, 64), 4096) and should_quantize((2, 2), 0)
    tx = chain(scale_by_adam(state_format="8bit"), scale_by_learning_rate(1e-3))
    rows = state_report(tx.init(_params()))
    by_path = {r.path: r for r in rows}
    assert by_path["0/mu/emb"].format == "dynamic8" and by_path["0/nu/emb"].format == "dynamic8_sqrt"
    assert by_path["0/mu/emb"].nbytes == 64 * 96 + 64 * 1 * 4  # codes + one fp32 scale per 256-block (a row of 96 is one block)
    assert by_path["0/mu/mlp/0"].format == "float32" and by_path["0/mu/mlp/0"].shape == (32, 32)  # 1024 < 4096
    assert by_path["0/count"].format == "int32"
    assert rows[-1].path == "total" and rows[-1].nbytes == sum(r.nbytes for r in rows[:-1])
    bf = {r.path: r.format for r in state_report(scale_by_adam(state_format="bf16").init(_params()))}
    assert bf["mu/emb"] == "bfloat16" and bf["nu/mlp/1"] == "bfloat16"


def test_state_is_created_on_the_param_device_also_meta():
    params = _params(device="meta")
    state = adamw(1e-3, state_format="4bit", rank1_normalization=True).init(params)
    assert all(t.device.type == "meta" for t in optree.tree_leaves(state))
    assert isinstance(state[0].nu["emb"], Rank1QTensor) and isinstance(state[0].mu["emb"], QTensor)


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_none_leaves_and_empty_trees(fmt):
    torch.manual_seed(0)
    tx = adamw(1e-2, state_format=fmt, min_quant_size=0)
    assert tx.update({}, tx.init({}), {})[0] == {}
    u, s = tx.update((), tx.init(()), ())
    assert u == ()
    params = {"a": torch.randn(4, 8), "b": torch.randn(4, 8), "none": None}
    s = tx.init(params)
    grads = {"a": torch.randn(4, 8), "b": None, "none": None}
    u, s2 = tx.update(grads, s, params)
    assert u["b"] is None and u["none"] is None
    new = apply_updates(params, u)
    assert new["b"] is params["b"] and new["none"] is None and not torch.equal(new["a"], params["a"])
    # the state of a param without gradient is left as it was
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(s[0].mu["b"]), optree.tree_leaves(s2[0].mu["b"])))


def test_update_tolerates_unknown_kwargs_and_chains():
    torch.manual_seed(0)
    tx = named_chain(("clip", clip_by_global_norm(1.0)), ("adam", scale_by_adam(state_format="fp32")), ("lr", scale_by_learning_rate(0.1)))
    p = {"w": torch.randn(3, 3)}
    s = tx.init(p)
    assert set(s) == {"clip", "adam", "lr"} and s["clip"] == EmptyState()
    u, s = tx.update({"w": torch.randn(3, 3)}, s, p, loss=torch.tensor(1.0), anything="x")
    u2, _ = chain(identity()).update(u, chain(identity()).init(p), p, foo=1)
    assert u2 is u


def test_clip_by_global_norm_matches_torch_clip_grad_norm():
    torch.manual_seed(0)
    g = [torch.randn(5, 7) * 10, torch.randn(3) * 10, None]
    u, _ = clip_by_global_norm(2.0).update(g, EmptyState())
    ps = [torch.nn.Parameter(torch.zeros_like(t)) for t in g[:2]]
    for p, t in zip(ps, g):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(ps, 2.0)  # clip_coef = max/(norm + 1e-6): ~1e-7 relative apart
    for a, b in zip(u[:2], [p.grad for p in ps]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    assert u[2] is None
    small = [torch.full((2,), 0.1)]
    assert torch.equal(clip_by_global_norm(2.0).update(small, EmptyState())[0][0], small[0])
    assert torch.equal(clip_by_global_norm(torch.tensor(2.0)).update(small, EmptyState())[0][0], small[0])


def test_add_decayed_weights_and_masked():
    p = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    u = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    out, _ = add_decayed_weights(0.5, mask={"w": True, "b": False}).update(u, add_decayed_weights(0.5, {"w": True, "b": False}).init(p), p)
    assert torch.equal(out["w"], torch.full((2, 2), 0.5)) and torch.equal(out["b"], torch.zeros(2))
    # a masked stateful transformation creates state only for selected leaves
    tx = masked(scale_by_adam(state_format="fp32"), lambda params: {"w": True, "b": False})
    s = tx.init(p)
    assert s.inner_state.mu["b"] is None and s.inner_state.mu["w"] is not None
    out, _ = tx.update({"w": torch.ones(2, 2), "b": torch.full((2,), 7.0)}, s, p)
    assert torch.equal(out["b"], torch.full((2,), 7.0))
    torch.testing.assert_close(out["w"], torch.ones(2, 2), rtol=1e-6, atol=0)  # Adam's first step: sign


def test_partition_keeps_fp32_state_for_embeddings():
    params = _params()
    labels = {"emb": "fp32", "mlp": "8bit", "frozen": "none"}
    tx = partition(
        {"fp32": adam(1e-2, state_format="fp32"), "8bit": adam(1e-2, state_format="8bit", min_quant_size=0),
         "none": GradientTransformation(lambda p: EmptyState(), lambda u, s, p=None, **k: (optree.tree_map(torch.zeros_like, u), s))},
        labels,
    )
    s = tx.init(params)
    fmts = {r.path: r.format for r in state_report(s)}
    assert fmts["inner_states/fp32/0/mu/emb"] == "float32" and fmts["inner_states/8bit/0/mu/mlp/0"] == "dynamic8"
    assert "inner_states/fp32/0/mu/mlp/0" not in fmts
    grads = _grads(params)
    u, s = tx.update(grads, s, params)
    ref_u, _ = adam(1e-2, state_format="fp32").update(grads, adam(1e-2, state_format="fp32").init(params), params)
    torch.testing.assert_close(u["emb"], ref_u["emb"])
    assert torch.equal(u["frozen"], torch.zeros(4, 4))
    with pytest.raises(ValueError, match="no transformation"):
        partition({"a": identity()}, {"emb": "a", "mlp": "b", "frozen": "a"}).init(params)


def test_hyperparams_may_be_tensors():
    torch.manual_seed(0)
    p = {"w": torch.randn(8, 8)}
    g = {"w": torch.randn(8, 8)}
    a = adamw(1e-2, 0.9, 0.999, 1e-8, 0.1, state_format="fp32")
    b = adamw(torch.tensor(1e-2), torch.tensor(0.9), torch.tensor(0.999), torch.tensor(1e-8), torch.tensor(0.1), state_format="fp32")
    ua, _ = a.update(g, a.init(p), p)
    ub, _ = b.update(g, b.init(p), p)
    torch.testing.assert_close(ua["w"], ub["w"], rtol=1e-4, atol=0)  # betas rounded to float32


def test_rank1_record_costs_and_gains():
    """Rank-1 normalization (arXiv 2309.01507) vs block-wise absmax for a 4-bit
    second moment with heavy-tailed rows and columns (v = r_i * c_j * noise,
    r and c log-uniform over 4 decades each: the structure Adam's v has when
    gradient scales differ per row and per column). Measured on 256 x 512:
    bytes 68,608 (rank-1: one fp32 per row and per column) vs 69,632 (block
    128) and 81,920 (block 32); median relative error of v 0.32 vs 6.1 (block
    128; the zero-free map rounds small entries up to absmax/16); median error
    of Adam's 1/sqrt(v) factor 0.16 vs 0.63."""
    g = torch.Generator().manual_seed(0)
    rows, cols = 256, 512
    r = 10 ** (4 * torch.rand(rows, 1, generator=g))
    c = 10 ** (4 * torch.rand(1, cols, generator=g))
    v = r * c * (0.5 + torch.rand(rows, cols, generator=g))
    q1 = rank1_quantize(v)
    qb = quantize(v, "linear4_unsigned", 128)
    d1, db = rank1_dequantize(q1), dequantize(qb)
    assert q1.nbytes == rows * cols // 2 + 4 * (rows + cols) == 68_608
    assert qb.nbytes == rows * cols // 2 + 4 * rows * (cols // 128) == 69_632
    e1, eb = ((d1 - v).abs() / v).median(), ((db - v).abs() / v).median()
    assert e1 < 0.5 and eb > 3, (e1, eb)
    u1, ub = ((v / d1).sqrt() - 1).abs().median(), ((v / db).sqrt() - 1).abs().median()
    assert u1 < 0.25 and ub > 0.5, (u1, ub)
    # a negative / NaN entry poisons, never becomes finite garbage; zeros stay zero
    bad = v.clone()
    bad[3, 5] = float("nan")
    assert torch.isnan(rank1_dequantize(rank1_quantize(bad))[3, 5])
    assert torch.equal(rank1_dequantize(rank1_quantize(torch.zeros(4, 6))), torch.zeros(4, 6))


def test_hyperparameter_vectors_are_the_kernels_own_whatever_came_before():
    """transform._hyper's vector equals step_hyperparams' of the same values, bit for bit, whatever
    the calls before it: the same numbers again, one tensor hyperparameter changed in place between
    calls, the same numbers for another rule."""
    from lowbit_tree import kernels
    from lowbit_tree.rule_builder import Fusion, hyper_vector as _hyper

    b2 = torch.tensor(0.999, dtype=torch.float64)
    fusion = Fusion(decay=0.1, l2=None)
    for count in (0, 3, 3):
        for rule in ("adam", "lion", "adam"):
            spec = kernels.StepSpec(rule=rule)
            for b2_value in (0.999, 0.99, 0.999):
                b2.fill_(b2_value)
                got = _hyper(spec, dict(b1=0.9, b2=b2, eps=1e-8), torch.tensor(count), fusion, 1e-3, "cpu")
                want = kernels.step_hyperparams(spec, count=count, b1=0.9, b2=b2_value, eps=1e-8, lr=1e-3,
                                                weight_decay=0.1, l2=0.0, device="cpu")
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (rule, count, b2_value)
