"""QState's dispatch table, one process: every op DTensor / DCP / the state-dict helpers call
(see bridge/qstate.py) acts on rows of codes and scale, exactly like the same op on the
float tensor followed by quantization."""
from __future__ import annotations

import io

import pytest
import torch

import lowbit_tree as lt
from bridge import QState

aten = torch.ops.aten
FORMATS = ["dynamic8", "dynamic4", "e4m3"]


def _q(fmt, shape=(7, 5), block_size=3, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x, QState.from_float(x, fmt, block_size)


def _same(a: QState, b: QState):
    assert (a.format, a.block_size, tuple(a.shape)) == (b.format, b.block_size, tuple(b.shape))
    assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_ops_equal_quantizing_the_rows(fmt):
    x, q = _q(fmt)
    _same(q[2:5], QState.from_float(x[2:5], fmt, 3))                 # aten.slice dim 0
    _same(aten.slice.Tensor(q, 1, 0, 5), q)                          # full-range inner slice: alias
    parts = torch.split(q, [4, 3])                                   # aten.split_with_sizes
    _same(parts[1], QState.from_float(x[4:], fmt, 3))
    _same(torch.cat(list(parts)), q)                                 # aten.cat dim 0
    padded = torch.nn.functional.pad(q[4:], (0, 0, 0, 1))            # constant_pad_nd, dim-0 high side
    assert padded.shape == (4, 5) and torch.equal(padded.dequantize()[3], torch.zeros(5))
    with pytest.raises(NotImplementedError):
        aten.slice.Tensor(q, 1, 1, 3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_aliasing_and_copies(fmt):
    x, q = _q(fmt)
    v = q.view(7, 5)
    assert v.codes.data_ptr() == q.codes.data_ptr() and v.scale.data_ptr() == q.scale.data_ptr()
    d = q.detach()
    assert d.codes.data_ptr() == q.codes.data_ptr()
    c = q.clone()
    assert c.codes.data_ptr() != q.codes.data_ptr()
    _same(c, q)
    moved = q.to("cpu", copy=True)                                   # aten._to_copy
    _same(moved, q)
    assert moved.codes.data_ptr() != q.codes.data_ptr()
    assert not q.is_pinned()
    z = torch.empty_like(q)
    z.copy_(q)                                                       # QState <- QState
    _same(z, q)
    y = torch.zeros_like(q)
    y.copy_(x)                                                       # QState <- float: quantizes
    _same(y, q)
    out = torch.empty(7, 5)
    out.copy_(q)                                                     # float <- QState: dequantizes
    assert torch.equal(out, q.dequantize())
    with pytest.raises(ValueError):
        QState.zeros((7, 5), fmt, 4).copy_(q)                       # other block size


def test_new_zeros_unknown_ops_and_dtypes():
    _, q = _q("dynamic8")
    e = q.new_zeros((0, 5))
    assert isinstance(e, QState) and e.shape == (0, 5) and e.codes.shape[0] == 0
    with pytest.raises(NotImplementedError, match="QState"):
        torch.sin(q)
    with pytest.raises(NotImplementedError):
        q.to(torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_flatten_and_torch_save(fmt):
    _, q = _q(fmt, shape=(4, 9), block_size=4)
    names, meta = q.__tensor_flatten__()
    again = QState.__tensor_unflatten__({n: getattr(q, n) for n in names}, meta, q.shape, q.stride())
    _same(again, q)
    buf = io.BytesIO()
    torch.save({"s": q}, buf)
    buf.seek(0)
    _same(torch.load(buf, weights_only=True)["s"], q)


def test_empty_shard_record():
    q = QState(lt.zeros((0, 12), "dynamic4", 8))
    assert q.codes.shape == (0, 6) and q.scale.shape == (0, 2)
    assert q.dequantize().shape == (0, 12)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [2, 4])
def test_column_ops_on_block_boundaries_equal_quantizing_the_columns(fmt, block_size):
    """Tensor parallel's Shard(1): columns cut on block boundaries are the record of those
    columns (the reference: quantizing the float columns), cat joins them back, the pad adds
    zero blocks, and a one-row state merges rows with a view; a cut inside a block raises."""
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(block_size))
    whole = QState.from_float(x, fmt, block_size)
    cuts = [0, 4, 8, 12]
    parts = [QState.from_float(x[:, a:b].contiguous(), fmt, block_size) for a, b in zip(cuts, cuts[1:])]
    for got, want in zip(torch.split(whole, 4, dim=1), parts):
        _same(got, want)
    for got, want in zip(torch.chunk(whole, 3, dim=1), parts):
        _same(got, want)
    _same(whole.narrow(1, 4, 8), QState.from_float(x[:, 4:].contiguous(), fmt, block_size))
    _same(torch.cat(parts, dim=1), whole)
    padded = torch.nn.functional.pad(parts[0], (0, 4))
    assert tuple(padded.shape) == (5, 8) and torch.equal(padded.dequantize()[:, 4:], torch.zeros(5, 4))
    _same(padded.narrow(1, 0, 4), parts[0])
    _same(whole.view(1, 60), QState.from_float(x.reshape(1, 60), fmt, block_size))
    _same(whole.view(1, 60).view(5, 12), whole)
    with pytest.raises(NotImplementedError, match="cuts a block"):
        whole.narrow(1, 1, 4)
    with pytest.raises(NotImplementedError, match="ends inside a block"):
        torch.cat([QState.from_float(x[:, :3].contiguous(), fmt, block_size), parts[1]], dim=1)
    with pytest.raises(NotImplementedError):
        QState.from_float(x[:, :3].contiguous(), fmt, block_size).view(1, 15)


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_gather_keeps_one_collective_in_flight(fmt, monkeypatch):
    """A state's gather is two all-gathers (codes, scales); the second is issued only after
    the first is waited (two in flight corrupt gloo's heap, design.md "One collective in
    flight"). A fake collective (2 ranks: this one's rows twice) records what is in flight."""
    import types

    import bridge.qstate as qs

    x, q = _q(fmt, shape=(3, 7))
    in_flight, events = set(), []

    def gather(t, world, group):
        assert not in_flight, f"all-gather issued while {len(in_flight)} other(s) in flight"
        out = torch.cat([t] * world)
        in_flight.add(out.data_ptr())
        events.append(("gather", t.dtype))
        return out

    def wait(t):
        in_flight.discard(t.data_ptr())
        events.append(("wait", t.dtype))
        return t

    monkeypatch.setattr(qs, "_c10d_functional", types.SimpleNamespace(wait_tensor=types.SimpleNamespace(default=wait)))
    handler = QState._OPS[torch.ops._c10d_functional.all_gather_into_tensor.default]
    g = handler(gather, (), (q, 2, "fake"), {})
    assert not in_flight and [e for e, _ in events] == ["gather", "wait", "gather", "wait"]
    _same(g, QState.from_float(torch.cat([x, x]), fmt, 3))


# ---- read-only ops answer on the float32 value; writes keep raising ----
def _stepped_states(cls, seed, shape=(33, 20)):
    """A named class's states after two steps (block, rank-1 and e4m3 records by class)."""
    import bridge

    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(shape, generator=g))
    opt = cls([p], lr=1e-2, min_quant_size=1)
    for _ in range(2):
        p.grad = torch.randn(shape, generator=g)
        opt.step()
    return {k: v for k, v in opt.state[p].items() if isinstance(v, QState)}


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_comparison_tools_compare_states_by_value(name):
    """torch.testing.assert_close (what torch's own optimizer tests call on two optimizers'
    states) passes on equal states and reports a mismatch, as an AssertionError, on others."""
    import bridge

    cls = getattr(bridge, name)
    a, b, other = _stepped_states(cls, 0), _stepped_states(cls, 0), _stepped_states(cls, 1)
    assert len(a) == 2
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for k in a:
        with pytest.raises(AssertionError, match="not close|not equal"):
            torch.testing.assert_close(a[k], other[k])


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_only_ops_run_on_the_dequantized_value(fmt):
    x, q = _q(fmt, shape=(6, 10), block_size=4)
    q.codes.view(torch.uint8)[0, 0] = 0  # a zero or a large code: whatever it maps to, both sides agree
    v = q.dequantize()
    v2 = _q(fmt, shape=(6, 10), block_size=4, seed=1)[1]
    for op in (torch.isnan, torch.isfinite, torch.isinf, torch.abs, torch.neg, torch.sum, torch.mean,
               torch.amax, torch.amin, torch.max, torch.min, torch.linalg.vector_norm):
        got = op(q)
        assert type(got) is torch.Tensor and torch.equal(got, op(v)), op
    assert torch.equal(q.sum(dim=1), v.sum(dim=1)) and torch.equal(q.mean(dim=0), v.mean(dim=0))
    assert torch.equal(q - v2, v - v2.dequantize()) and torch.equal(q * 2, v * 2) and torch.equal(q / 2, v / 2)
    assert torch.equal(q < 0, v < 0) and torch.equal(q >= v2, v >= v2.dequantize())
    assert torch.equal(torch.isclose(q, v), torch.ones_like(v, dtype=torch.bool)) and torch.allclose(q, v)
    assert torch.equal(q.isnan().any(), torch.tensor(False)) and bool(q.isfinite().all())
    assert torch.equal(q.flatten(), v.flatten())


@pytest.mark.parametrize("write", [lambda q: q.add_(1), lambda q: q.mul_(2), lambda q: q.zero_(),
                                   lambda q: q.abs_()],
                         ids=["add_", "mul_", "zero_", "abs_"])
def test_ops_that_write_into_a_state_still_raise(write):
    _, q = _q("dynamic8")
    codes = q.codes.clone()
    with pytest.raises((NotImplementedError, RuntimeError)):
        write(q)
    assert torch.equal(q.codes, codes)
