"""lowbit_tree.kernels.pure_rows: a pure step's job rows, built once per structure and written with
each call's addresses, give run_step's bits in new tensors, and give way to run_step where the
structure or layout changes."""
from __future__ import annotations

import pytest
import torch

import lowbit_tree as lt
from lowbit_tree.kernels import StepLeaf, StepSpec, native, run_step, step_hyperparams
from lowbit_tree.kernels.pure_rows import PureRows
from lowbit_tree.moments import init_moment
from lowbit_tree.record_base import KERNEL_BLOCKS

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernel not built here")

SHAPES = [(67, 129), (300,), (5, 7), (33, 65)]


def _bits(x):
    if isinstance(x, torch.Tensor):
        return [x.view(torch.uint8) if x.dtype.is_floating_point and x.ndim else x]
    return [t.view(torch.uint8) if t.dtype.is_floating_point and t.ndim else t
            for t in (x.codes, x.scale)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b)))


def _leaves(seed, fmt, shapes=SHAPES, states=None, rank1=False):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(shapes):
        p = torch.randn(s, generator=gen)
        g = torch.randn(s, generator=gen) * 1e-2
        st = states[i] if states is not None else tuple(
            init_moment(p, fmt, signed=signed, min_quant_size=64, rank1=rank1 and not signed)
            for signed in (True, False))
        out.append(StepLeaf(p, g, st, i))
    return out


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "8bit", "fp8", "4bit"])
def test_rows_built_once_give_run_steps_bits_in_new_tensors(fmt):
    """Four calls, each on new params and gradients and the states the last call made (values,
    not the zeros of init): each gives run_step's bits, in tensors none of its inputs hold."""
    spec = StepSpec("adam", decay=True, lr=True)
    rows = PureRows()
    states = None
    for step in range(4):
        leaves = _leaves(step, fmt, states=states)
        hyper = step_hyperparams(spec, count=step, b1=0.9, b2=0.999, eps=1e-8, lr=1e-2, weight_decay=0.1)
        got = rows.run(spec, hyper, leaves)
        want = run_step(spec, hyper, leaves, backend="native")
        for o, w in zip(got[0], want[0]):
            assert _same(o, w)
        for ns, ws, lf in zip(got[1], want[1], leaves):
            assert all(_same(a, b) for a, b in zip(ns, ws))
            olds = {t.data_ptr() for s in lf.states for t in _bits(s)}
            assert not olds & {t.data_ptr() for s in ns for t in _bits(s)}
        states = got[1]
    assert rows.builds == 1


def test_rank1_records_are_left_to_run_step():
    spec = StepSpec("adam", lr=True)
    leaves = _leaves(0, "4bit", rank1=True)
    assert any(not isinstance(s, torch.Tensor) and s.KERNEL != KERNEL_BLOCKS for lf in leaves for s in lf.states)
    assert PureRows().run(spec, step_hyperparams(spec, lr=1e-2), leaves) is None


def test_a_new_structure_builds_again_and_a_layout_the_rows_refuse_gives_way():
    spec = StepSpec("adam", lr=True)
    hyper = step_hyperparams(spec, count=0, lr=1e-2)
    rows = PureRows()
    assert rows.run(spec, hyper, _leaves(0, "8bit")) is not None and rows.builds == 1
    other = _leaves(1, "8bit", shapes=SHAPES[:3] + [(65, 33)])
    got = rows.run(spec, hyper, other)
    assert rows.builds == 2 and all(_same(a, b) for a, b in zip(got[0], run_step(spec, hyper, other)[0]))
    strided = [lf._replace(grad=lf.grad.t().contiguous().t()) if lf.grad.ndim == 2 else lf for lf in other]
    assert rows.run(spec, hyper, strided) is None  # a transposed gradient: run_step's own path
    assert rows.builds == 2
    assert rows.run(spec, hyper, other) is not None and rows.builds == 2  # the rows are still those of `other`


def test_a_transformations_update_reuses_its_rows():
    from lowbit_tree.combine import _link_tag

    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    link = lt.scale_by_adam(state_format="8bit", min_quant_size=64)
    pure_rows = _link_tag(link)[1]["pure_rows"]
    state = link.init(params)
    for _ in range(3):
        _, state = link.update([torch.randn(p.shape, generator=gen) for p in params], state, params)
    assert pure_rows.builds == 1
