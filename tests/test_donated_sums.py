"""p + u in the step's own pass, as explicit API: UpdateStep(tx)(..., donate=True) writes each new
param in the kernel that computes its update, with the bits of torch.add (apply_updates' sum), and
gives the pure form's bits whatever the caller changed between calls."""
import pytest
import torch

import lowbit_tree as lt
from lowbit_tree.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernel not built here")

SHAPES = [(257, 301), (5, 7)]  # a large leaf (odd: partial blocks and tiles) and a small one


@pytest.fixture(autouse=True)
def _native(monkeypatch):
    monkeypatch.delenv("LOWBIT_TREE_BACKEND", raising=False)


def draw(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=gen) * 3).to(dtype) for s in SHAPES]
    grads = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    grads[0][0, :5] = torch.tensor([0.0, 1e30, -1e-30, 0.0, 7.0])  # zero and extreme values
    return params, grads


def same_bits(a, b):
    """Bit for bit, but for a NaN's payload: torch writes a bfloat16 NaN as 0x7FC0 in its scalar
    conversion and 0xFFFF in its vector one, so only where the NaNs are is compared."""
    view = torch.int32 if a.dtype is torch.float32 else torch.int16
    nan = a.isnan()
    return (a.dtype is b.dtype and torch.equal(nan, b.isnan())
            and torch.equal(a.view(view)[~nan], b.view(view)[~nan]))


def added(params, updates):
    """apply_updates' sum by torch alone: float32 sum, rounded once to the param's dtype."""
    return [torch.add(p.float(), u).to(p.dtype) for p, u in zip(params, updates)]


TXS = {
    "adamw-8bit": lambda: lt.adamw(1e-2, 0.9, 0.999, 1e-8, 0.1, state_format="8bit"),
    "adamw-fp32": lambda: lt.adamw(1e-2, 0.9, 0.999, 1e-8, 0.0, state_format="fp32"),
    "adamw-4bit": lambda: lt.adamw(1e-2, 0.9, 0.999, 1e-8, 0.1, state_format="4bit"),  # rank-1 second moment
    "lion-fp8": lambda: lt.lion(1e-3, weight_decay=0.1, state_format="fp8"),
    "sgd-8bit": lambda: lt.sgd(1e-2, momentum=0.9, state_format="8bit"),
}


def clone(tree):
    return lt.tree_utils.map_leaves(lambda x: x if x is None else x.clone(), tree)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TXS))
def test_a_donated_step_writes_torch_adds_bits(name, dtype):
    """Three donated steps: each new param is apply_updates' sum of the pure update (torch.add in
    float32, rounded once), each new state the pure update's, and the buffers are the donated ones."""
    params, grads = draw(dtype)
    tx = TXS[name]()
    step = lt.UpdateStep(tx)
    pure_params, pure_state = params, tx.init(params)
    donated_params, donated_state = clone(params), tx.init(params)
    ptrs = [p.data_ptr() for p in donated_params]
    for _ in range(3):
        updates, pure_state = tx.update(grads, pure_state, pure_params)
        want = added(pure_params, updates)
        pure_params = lt.apply_updates(pure_params, updates)
        donated_params, donated_state = step(grads, donated_state, donated_params, donate=True)
        for got, ref, pure in zip(donated_params, want, pure_params):
            assert got.dtype is dtype and same_bits(got, ref) and same_bits(got, pure)
        assert all(a.equal(b) for a, b in zip(_leaves(donated_state), _leaves(pure_state)))
    assert [p.data_ptr() for p in donated_params] == ptrs


def _leaves(tree):
    import optree

    return [x.view(torch.uint8) if x.dtype.is_floating_point and x.ndim else x for x in optree.tree_leaves(tree)]


def test_a_changed_param_or_container_between_donated_calls_gives_the_pure_bits():
    """What the held plan was built for, changed between calls: a param replaced in the list, a
    param modified in place, another params list of equal values, another state: each call's
    result is the pure form's on the same values."""
    params, grads = draw(torch.float32)
    tx = TXS["adamw-8bit"]()
    step = lt.UpdateStep(tx)
    p, s = clone(params), tx.init(params)
    p, s = step(grads, s, p, donate=True)

    def pure(p, s):
        return step(grads, clone(s), clone(p))  # the pure form, on copies

    p[0] = p[0] + 1.0  # a new tensor in the donated list
    want = pure(p, s)
    got = step(grads, s, p, donate=True)
    assert all(a.equal(b) for a, b in zip(_leaves(got), _leaves(want)))
    p, s = got
    p[1].add_(2.0)  # in place: the plan reads the param where it is
    want = pure(p, s)
    got = step(grads, s, p, donate=True)
    assert all(a.equal(b) for a, b in zip(_leaves(got), _leaves(want)))
    p, s = clone(got[0]), clone(got[1])  # other objects of equal values
    want = pure(p, s)
    got = step(grads, s, p, donate=True)
    assert all(a.equal(b) for a, b in zip(_leaves(got), _leaves(want)))


def test_a_changed_hyperparameter_entry_between_donated_calls_is_read():
    """A new tensor written into an injected state's hyperparams dict (the documented way to
    change one) reaches the next donated step: the held plan is rebuilt, as the bits show."""
    params, grads = draw(torch.float32)
    tx = lt.inject_hyperparams(lt.adamw)(learning_rate=1e-2, weight_decay=0.1)
    step = lt.UpdateStep(tx)
    p, s = step(grads, tx.init(params), clone(params), donate=True)
    s.hyperparams["learning_rate"] = torch.tensor(5e-2)
    want = step(grads, clone(s), clone(p))
    got = step(grads, s, p, donate=True)
    assert all(a.equal(b) for a, b in zip(_leaves(got), _leaves(want)))


def test_pure_calls_share_nothing():
    params, grads = draw(torch.float32)
    tx = TXS["adamw-fp32"]()
    step = lt.UpdateStep(tx)
    state = tx.init(params)
    first, second = step(grads, state, params), step(grads, state, params)
    assert all(a is not b and a.equal(b) for a, b in zip(first[0], second[0]))
    first[0][0].zero_()  # the two results share nothing
    assert second[0][0].equal(lt.apply_updates(params, tx.update(grads, state, params)[0])[0])


def test_an_update_transformed_after_the_rule_and_stochastic_rounding_give_the_pure_bits():
    """A chain whose last link is not fused (scale after the learning rate) adds its updates after
    the kernel (apply_rest_); a final stochastic_rounding is fused into the donated kernel."""
    for tx in (lt.chain(TXS["adamw-8bit"](), lt.scale(0.5)), lt.chain(TXS["adamw-8bit"](), lt.stochastic_rounding(3))):
        params, grads = draw(torch.bfloat16)
        step = lt.UpdateStep(tx)
        p, s = clone(params), tx.init(params)
        pp, ps = params, tx.init(params)
        for _ in range(2):
            p, s = step(grads, s, p, donate=True)
            pp, ps = step(grads, ps, pp)
        assert all(same_bits(a, b) for a, b in zip(p, pp))


def test_a_transformation_without_a_plan_is_refused_for_donation_naming_the_fix():
    params, grads = draw(torch.float32)
    tx = lt.GradientTransformation(TXS["adamw-fp32"]().init, TXS["adamw-fp32"]().update)
    with pytest.raises(TypeError, match="in_place"):
        lt.UpdateStep(tx)(grads, tx.init(params), params, donate=True)
    with pytest.raises(TypeError, match="GradientTransformation"):
        lt.UpdateStep(lambda g: g)


def test_the_update_step_stays_pure():
    params, grads = draw(torch.bfloat16)
    tx = TXS["adamw-4bit"]()
    state = tx.init(params)
    before = [t.clone() for t in params + grads]
    _, new_state = lt.UpdateStep(tx)(grads, state, params)
    assert all(torch.equal(a, b) for a, b in zip(before, params + grads))
    assert new_state is not state


def test_a_job_row_refuses_a_new_param_it_cannot_write():
    p = torch.zeros(4, 4)
    g = torch.zeros(4, 4)
    spec = lt.kernels.StepSpec("momentum", lr=True)
    hyper = torch.zeros(lt.kernels.NHYPER)
    job = native.NativeJob(4, 4, p, g, p, spec, True, False, 0, hyper, (), new_param=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="a new param goes with the update"):
        native.job_row(job)
    job = job._replace(write=False, out=torch.zeros(4, 4), new_param=torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="in its dtype"):
        native.job_row(job)
