"""The sums a native update step leaves for apply_updates (lowbit_tree.kernels.sums): the bits
of torch.add, taken only for the very update and param they were made from, unmodified."""
import pytest
import torch

import lowbit_tree as lt
from lowbit_tree.kernels import native, sums

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernel not built here")

SHAPES = [(257, 301), (5, 7)]  # one over sums.MIN_NUMEL (odd: partial blocks and tiles), one under


@pytest.fixture(autouse=True)
def _sums_on(monkeypatch):
    monkeypatch.delenv("LOWBIT_TREE_PRESUM", raising=False)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TXS))
def test_a_taken_sum_has_torch_adds_bits(name, dtype):
    params, grads = draw(dtype)
    tx = TXS[name]()
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        assert sums.pending() == 1  # the large leaf's; the small one is summed by apply_updates
        want = added(params, updates)
        params = lt.apply_updates(params, updates)
        assert sums.pending() == 0
        for got, ref in zip(params, want):
            assert got.dtype is dtype and same_bits(got, ref)


def test_a_modified_update_or_param_is_summed_again():
    params, grads = draw(torch.float32)
    tx = TXS["adamw-8bit"]()
    updates, _ = tx.update(grads, tx.init(params), params)
    updates[0].mul_(2.0)  # in place: its version counter moves
    assert torch.equal(lt.apply_updates(params, updates)[0], params[0] + updates[0])

    updates, _ = tx.update(grads, tx.init(params), params)
    params[0].add_(1.0)
    assert torch.equal(lt.apply_updates(params, updates)[0], params[0] + updates[0])

    updates, _ = tx.update(grads, tx.init(params), params)
    other = [p.clone() for p in params]  # equal values, another tensor: not the param the sum was made from
    other[0][0, 0] = 5.0
    assert torch.equal(lt.apply_updates(other, updates)[0], other[0] + updates[0])
    assert sums.pending() == 0


def test_a_sum_is_handed_out_once_and_goes_with_its_update():
    params, grads = draw(torch.float32)
    tx = TXS["adamw-fp32"]()
    updates, _ = tx.update(grads, tx.init(params), params)
    first = lt.apply_updates(params, updates)
    second = lt.apply_updates(params, updates)
    assert first[0] is not second[0] and torch.equal(first[0], second[0])
    first[0].zero_()  # the two results share nothing
    assert torch.equal(second[0], params[0] + updates[0])

    updates, _ = tx.update(grads, tx.init(params), params)
    assert sums.pending() == 1
    del updates  # never applied: its sum goes with it
    assert sums.pending() == 0


def test_an_update_transformed_after_the_step_is_summed_by_apply_updates():
    params, grads = draw(torch.float32)
    tx = lt.chain(TXS["adamw-8bit"](), lt.scale(0.5))
    updates, _ = tx.update(grads, tx.init(params), params)
    assert sums.pending() == 0  # the kernel's own update was dropped inside the chain, its sum with it
    assert torch.equal(lt.apply_updates(params, updates)[0], params[0] + updates[0])


def test_stochastic_rounding_ignores_the_sum(monkeypatch):
    def run():
        params, grads = draw(torch.bfloat16)
        tx = TXS["adamw-8bit"]()
        updates, state = tx.update(grads, tx.init(params), params)
        return lt.apply_updates(params, updates, stochastic_round=True, key=torch.tensor([3, 4]))

    with_sums = run()
    monkeypatch.setenv("LOWBIT_TREE_PRESUM", "0")
    for a, b in zip(with_sums, run()):
        assert same_bits(a, b)


def test_the_switch_turns_sums_off_and_refuses_other_values(monkeypatch):
    params, grads = draw(torch.float32)
    tx = TXS["adamw-8bit"]()
    monkeypatch.setenv("LOWBIT_TREE_PRESUM", "0")
    updates, _ = tx.update(grads, tx.init(params), params)
    assert sums.pending() == 0
    assert torch.equal(lt.apply_updates(params, updates)[0], params[0] + updates[0])
    monkeypatch.setenv("LOWBIT_TREE_PRESUM", "yes")
    with pytest.raises(ValueError, match="LOWBIT_TREE_PRESUM must be 0 or 1"):
        tx.update(grads, tx.init(params), params)


def test_the_update_step_stays_pure():
    params, grads = draw(torch.bfloat16)
    tx = TXS["adamw-4bit"]()
    state = tx.init(params)
    before = [t.clone() for t in params + grads]
    _, new_state = tx.update(grads, state, params)
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
