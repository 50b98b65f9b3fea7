"""param_correction (lowbit_tree/correction.py): a bfloat16 / float16 param plus an int8
correction, ``master = p + c * ulp(p) / 256``.

- its arithmetic (``correction_scale``, ``master_value``, ``split_master``) against a float64
  reference built from the dtype's bit patterns (``numpy.frexp`` exponents, nearest-even rounding
  by a search of every value of the dtype), on every value of the dtype and on edge values;
- the C kernel's corrected write against the torch backend, bit for bit (params, corrections,
  states), for every rule, state format and corrected dtype, with zeros, subnormals, huge
  values, non-finite gradients and corrections at their clamp edges, alone and in a kernel plan;
- the fused in-place step (``lowbit_tree.step_``) against the pure ``update`` + ``apply_updates``;
- the bridge against the functional core;
- what it is for: updates below half an ulp move the master value, as they move a float32 param.
"""
from __future__ import annotations

import numpy as np
import optree
import pytest
import torch

import bridge
import lowbit_tree as lt
from lowbit_tree.correction import ParamCorrectionState, correction_scale, master_value, split_master
from lowbit_tree.kernels import StepLeaf, StepSpec, native, native_ok, run_step, step_hyperparams
from lowbit_tree.kernels.plan import KernelPlan
from lowbit_tree.kernels.spec import flag_bits, job_row_index
from lowbit_tree.transform import ScaleByAdamState
from test_kernels_step import RULE_IDS, RULES, clone_state, make_states, same

NATIVE = pytest.mark.skipif(not native.available(), reason="no C compiler")
CORRECTED = [torch.bfloat16, torch.float16]
DT_IDS = ["bf16", "f16"]

# ----------------------------------------------------------------------------- the reference

# per dtype: mantissa bits, smallest normal exponent, largest finite exponent (the reference's own
# numbers: IEEE binary16 and bfloat16's layouts, not correction.CORRECTED_DTYPES)
LAYOUT = {torch.bfloat16: (7, -126, 127), torch.float16: (10, -14, 15)}


def decode(bits: np.ndarray, dtype) -> np.ndarray:
    """float64 values of 16-bit patterns of ``dtype`` (numpy only, no torch conversion)."""
    bits = np.asarray(bits, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns
        if dtype is torch.bfloat16:
            return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return bits.view(np.float16).astype(np.float64)


def all_bits() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def ref_scale(v: np.ndarray, dtype) -> np.ndarray:
    """ulp(v) / 256 in float64 for finite values of ``dtype``: 2 ** (e - mant - 8), ``e`` the
    binade of ``v`` (``frexp``'s exponent - 1), at least the smallest normal exponent."""
    mant, emin, _ = LAYOUT[dtype]
    e = np.frexp(np.abs(v))[1] - 1
    e = np.where(v == 0, emin, np.maximum(e, emin))
    return np.ldexp(1.0, e - mant - 8)


def ref_round(x: np.ndarray, dtype) -> np.ndarray:
    """float32 ``x`` -> the 16-bit patterns of ``dtype`` nearest to it (ties to the even pattern,
    past the largest finite value to infinity as IEEE rounding does; NaN -> a NaN pattern)."""
    _, _, emax = LAYOUT[dtype]
    inf_bits = 0x7F80 if dtype is torch.bfloat16 else 0x7C00
    pos = np.arange(inf_bits + 1, dtype=np.uint32)  # +0 .. the largest finite, then +inf
    vals = decode(pos, dtype)
    vals[-1] = 2.0 ** (emax + 1)  # where infinity sits for rounding: the next binade's start (even pattern)
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(vals, a, side="left"), 0, len(vals) - 1)
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(pos[lo] % 2 == 0, lo, hi)))
    pick = np.where(vals[hi] == a, hi, pick)
    pick = np.where(np.isinf(a), len(vals) - 1, pick)
    bits = pos[pick] | np.where(np.signbit(x), 0x8000, 0)
    quiet_nan = inf_bits | (0x40 if dtype is torch.bfloat16 else 0x200)
    return np.where(np.isnan(x), quiet_nan, bits).astype(np.uint16)


def ref_split(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``x`` -> (bits of p', c'): p' nearest (ties to even), c' = round-half-even((x - p') /
    scale(p')); where c' would be +128, p' is the next value above (when finite) and c' is taken
    against it; then clamped to [-128, 127], 0 where p' is not finite. float64 arithmetic, exact."""
    bits = ref_round(x, dtype)
    p = decode(bits, dtype)
    finite = np.isfinite(p)
    with np.errstate(all="ignore"):
        rest = np.round((x.astype(np.float64) - p) / ref_scale(np.where(finite, p, 1.0), dtype))
    # the next value above p' by value: its pattern from a search over every finite value
    everything = decode(all_bits(), dtype)
    order = np.argsort(np.where(np.isfinite(everything), everything, np.inf), kind="stable")
    ordered = everything[order]
    up_index = np.searchsorted(ordered, np.where(finite, p, 0.0), side="right")
    up_index = np.minimum(up_index, len(ordered) - 1)
    up_bits, up = all_bits()[order][up_index], ordered[up_index]
    up_bits = np.where((up == 0) & (p < 0), 0x8000, up_bits)  # from a negative value up to zero: -0
    move = finite & (rest > 127) & np.isfinite(up)
    bits = np.where(move, up_bits, bits).astype(np.uint16)
    p = np.where(move, up, p)
    with np.errstate(all="ignore"):
        rest = np.where(move, np.round((x.astype(np.float64) - p) / ref_scale(np.where(finite, p, 1.0), dtype)), rest)
    c = np.where(finite, np.clip(rest, -128, 127), 0)
    return bits, c.astype(np.int8)


def to_torch(bits: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.int16)).view(dtype)


def torch_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().astype(np.uint16)


# ----------------------------------------------------------------------------- (1) the arithmetic


@pytest.mark.parametrize("dtype", CORRECTED, ids=DT_IDS)
def test_correction_scale_is_an_ulp_over_256_on_every_value(dtype):
    bits = all_bits()
    v = decode(bits, dtype)
    finite = np.isfinite(v)
    got = correction_scale(to_torch(bits[finite], dtype)).double().numpy()
    want = ref_scale(v[finite], dtype)
    assert np.array_equal(got, want)
    # spot values: zeros and subnormals share the smallest normal binade's spacing
    mant, emin, _ = LAYOUT[dtype]
    for value, e in ((0.0, emin), (-0.0, emin), (2.0 ** (emin - mant), emin), (1.0, 0), (1.5, 0), (-2.0, 1)):
        got = correction_scale(torch.tensor([value], dtype=dtype)).item()
        assert got == 2.0 ** (e - mant - 8), (value, got)


@pytest.mark.parametrize("dtype", CORRECTED, ids=DT_IDS)
def test_master_value_is_exact(dtype):
    """``p + c * scale(p)`` for every finite ``p`` and corrections at the edges and between: the
    float32 result equals the exact float64 sum. Non-finite params stay what they are."""
    bits = all_bits()
    v = decode(bits, dtype)
    finite = np.isfinite(v)
    p = to_torch(bits[finite], dtype)
    for c in (-128, -127, -64, -1, 0, 1, 63, 127):
        got = master_value(p, torch.full(p.shape, c, dtype=torch.int8)).double().numpy()
        want = v[finite] + c * ref_scale(v[finite], dtype)
        assert np.array_equal(got, want), c
    odd = to_torch(bits[~finite], dtype)
    got = master_value(odd, torch.zeros(odd.shape, dtype=torch.int8))
    assert torch.equal(torch.isnan(got), torch.isnan(odd.float())) and torch.equal(torch.isinf(got), torch.isinf(odd))


def edge_masters(dtype, gen: np.random.Generator) -> np.ndarray:
    """float32 values to split: around zero, subnormals, the smallest normal, powers of two, the
    largest finite value and past it; each at exact ties of the correction's steps and between
    them; infinities, NaN, float32's extremes; and random values over the whole range."""
    mant, emin, emax = LAYOUT[dtype]
    largest = (2 - 2.0 ** -mant) * 2.0 ** emax
    bases = [0.0, 2.0 ** (emin - mant), 2.0 ** (emin - 1), 2.0 ** emin - 2.0 ** (emin - mant), 2.0 ** emin,
             2.0 ** -10, 0.75, 1.0, 1.0 + 2.0 ** -mant, 2.0, 3.0, 1024.0, 2.0 ** (emax - 1), 2.0 ** emax, largest]
    out = []
    for b in bases:
        s = float(ref_scale(np.array([b]), dtype)[0])
        for k in range(-300, 301):  # steps of half a correction unit: ties of c, and half-ulp ties of p
            out += [b + k * s / 2, -(b + k * s / 2)]
    out += [largest + 128 * float(ref_scale(np.array([largest]), dtype)[0]), 3.0e38, 3.4028235e38, 1e-45, -1e-45,
            np.inf, -np.inf, np.nan, -0.0]
    x = np.array(out, dtype=np.float64)
    x = x[np.abs(x) <= np.finfo(np.float32).max].astype(np.float32)  # exactly representable ones stay exact
    x = np.concatenate([x, np.array([np.inf, -np.inf, np.nan], dtype=np.float32)])
    rand = gen.standard_normal(20000) * np.exp2(gen.standard_normal(20000) * (emax / 3))  # 3 sigma: the largest binade
    rand = np.clip(rand, -np.finfo(np.float32).max, np.finfo(np.float32).max).astype(np.float32)
    return np.concatenate([x, rand])


@pytest.mark.parametrize("dtype", CORRECTED, ids=DT_IDS)
def test_split_master_rounds_to_nearest_and_keeps_the_rest(dtype):
    x = edge_masters(dtype, np.random.default_rng(7))
    p, c = split_master(torch.from_numpy(x), dtype)
    want_bits, want_c = ref_split(x, dtype)
    nan = np.isnan(x)
    assert np.array_equal(torch_bits(p)[~nan], want_bits[~nan])
    assert torch.isnan(p[torch.from_numpy(nan)]).all()
    assert np.array_equal(c.numpy(), want_c)
    # the checks can fail: the reference's clamp and tie rules are exercised
    assert (want_c == 127).any() and (want_c == -128).any() and (want_c == 0).any()
    assert np.isinf(decode(want_bits, dtype)).any()


# ----------------------------------------------------------------------------- (2) native == torch

FORMATS = ["fp32", "bf16", "8bit", "4bit", "4bit-rank1", "fp8", "nf4", "8bit_bnb"]
LINKS = [dict(lr=True), dict(decay=True, lr=True), dict(maximize=True, l2=True, decay=True, lr=True)]
SHAPES = [((37, 301), None), ((5, 16), 7), ((3, 2, 129), 64)]
LRS = [1e-2, 1e-5, 1e35]  # around an ulp, below half an ulp (the correction alone moves), overflowing


def corrected_leaf(dtype, shape, gen):
    """(p, g, c) with edge values in front: zeros, subnormals, the smallest normal, the largest
    finite value, huge values, non-finite gradients, corrections at -128 and 127."""
    mant, emin, emax = LAYOUT[dtype]
    largest = (2 - 2.0 ** -mant) * 2.0 ** emax
    p = (torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)).to(dtype)
    g = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    c = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    edges = [0.0, -0.0, 2.0 ** (emin - mant), -(2.0 ** (emin - 1)), 2.0 ** emin, largest, -largest, largest / 2,
             1.0, -1.0, 2.0 ** -mant, 3.0]
    n = min(len(edges), p.numel())
    p.view(-1)[:n] = torch.tensor(edges[:n], dtype=torch.float64).to(dtype)
    c.view(-1)[:n] = torch.tensor([127, -128, 127, -128, -128, 127, -128, 127, -128, 127, 0, -1][:n], dtype=torch.int8)
    flat = g.view(-1)
    if flat.numel() > 20:
        flat[12:20] = torch.tensor([0.0, 0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 1e-30])
    return p, g, c


def step_both(spec, hyper, p, g, c, states, *, inplace):
    """The corrected write on the native backend and on the eager torch backend: per backend
    ``(param, correction, new states)``; asserts the native kernel took the leaf."""
    out = {}
    for backend in ("native", "eager"):
        pp, cc, ss = p.clone(), c.clone(), tuple(clone_state(s) for s in states)
        leaf = StepLeaf(pp, g, ss, 3, cc)
        if backend == "native":
            assert native_ok(leaf, True)
        _, news = run_step(spec, hyper, [leaf], write=True, inplace=inplace, backend=backend)
        out[backend] = (pp, cc, news[0])
    return out["native"], out["eager"]


def check_native_equals_torch(rule, variant, fmt, dtype):
    moved = 0
    for li, links in enumerate(LINKS):
        for si, (shape, bs) in enumerate(SHAPES):
            seed = 100 * li + 10 * si + len(fmt)
            gen = torch.Generator().manual_seed(seed)
            spec = StepSpec(rule, **variant, **links)
            states = make_states(spec, shape, fmt, bs, gen)
            p, g, c = corrected_leaf(dtype, shape, gen)
            hyper = step_hyperparams(spec, count=seed % 5, b1=0.9, b2=0.999 if rule in ("adam", "ademamix") else 0.99,
                                     lr=LRS[(li + si) % len(LRS)], weight_decay=0.1, l2=0.05,
                                     **(dict(b3=0.9999, alpha=5.0) if rule == "ademamix" else {}))
            (pn, cn, sn), (pe, ce, se) = step_both(spec, hyper, p, g, c, states, inplace=bool(si % 2))
            where = (rule, variant, fmt, dtype, links, shape, bs)
            assert same(pn, pe), where
            assert torch.equal(cn, ce), where
            assert all(same(a, b) for a, b in zip(sn, se)), where
            moved += int((cn != c).sum())
    assert moved > 0  # the corrections were written


@NATIVE
@pytest.mark.parametrize("dtype", CORRECTED, ids=DT_IDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule,variant", RULES, ids=RULE_IDS)
def test_native_corrected_write_equals_torch_backend(rule, variant, fmt, dtype):
    if fmt == "4bit-rank1" and rule != "adam":
        pytest.skip("rank-1 second moments are Adam's")
    check_native_equals_torch(rule, variant, fmt, dtype)


@NATIVE
@pytest.mark.parametrize("dtype", CORRECTED, ids=DT_IDS)
def test_native_corrected_write_on_every_value(dtype):
    """Every bit pattern of the param dtype (zeros, subnormals, every binade, infinities, NaN)
    with corrections at the edges and between, and updates of 0, exact half correction units
    (ties of ``c'`` and of ``p'``) and large random ones: the kernel's param and correction
    equal the float64 reference of the float32 sum ``x = master + d`` (and the torch backend).
    The step is SGD momentum from a zero buffer with lr 1, so ``d = -g`` exactly."""
    spec = StepSpec("momentum", lr=True)
    hyper = step_hyperparams(spec, b1=0.9, lr=1.0)
    bits = all_bits()
    v = decode(bits, dtype)
    finite = np.isfinite(v)
    scale = np.where(finite, ref_scale(np.where(finite, v, 1.0), dtype), 0.0)
    rng = np.random.default_rng(5)
    p = to_torch(bits, dtype).reshape(256, 256)
    for c0 in (-128, -127, -1, 0, 1, 127, None):
        c = (torch.from_numpy(rng.integers(-128, 128, 1 << 16).astype(np.int8)) if c0 is None
             else torch.full((1 << 16,), c0, dtype=torch.int8))
        for kind in ("zero", "half-units", "large"):
            if kind == "zero":
                d = np.zeros(1 << 16)
            elif kind == "half-units":
                d = rng.integers(-600, 601, 1 << 16) * scale / 2
            else:  # past the largest finite value too (infinite d included)
                d = rng.standard_normal(1 << 16) * np.where(finite, np.abs(v), 0.0) * 0.5
            with np.errstate(all="ignore"):
                g = -d.astype(np.float32)
                d = np.float32(-1) * (np.float32(0) + g)  # the kernel's d = (-lr) * (0.9 * 0 + g): a zero is -0
                # exact (test_master_value_is_exact)
                master = (v + c.numpy().astype(np.float64) * scale).astype(np.float32)
                x = master + d  # float32, one rounding
            want_bits, want_c = ref_split(x, dtype)
            g = torch.from_numpy(g).reshape(256, 256)
            (pn, cn, _), (pe, ce, _) = step_both(spec, hyper, p, g, c.reshape(256, 256), (torch.zeros(256, 256),),
                                                 inplace=True)
            nan = np.isnan(x)
            where = (dtype, c0, kind)
            assert np.array_equal(torch_bits(pn).reshape(-1)[~nan], want_bits[~nan]), where
            assert torch.isnan(pn.reshape(-1)[torch.from_numpy(nan)]).all(), where
            assert np.array_equal(cn.reshape(-1).numpy(), want_c), where
            assert same(pn, pe) and torch.equal(cn, ce), where


@NATIVE
@pytest.mark.parametrize("dtype", CORRECTED, ids=DT_IDS)
def test_native_corrected_write_at_every_rounding_edge(dtype):
    """New master values ``x`` at the edges of every value of the dtype: each 16-bit pattern's
    float32 bits with the float32 bits below the dtype's mantissa set to 0, 1, a rest of exactly
    127.5 units (where ``p'`` moves to the neighbour above) and one step either side, the midpoint
    (a tie of ``p'``) and one step either side, and all ones; both signs, subnormals, the largest
    finite values, infinities and NaN payloads included. From ``p = 0`` and ``c = 0`` the step
    makes ``x = d`` exactly; the kernel's param and correction equal the float64 reference."""
    mant = LAYOUT[dtype][0]
    low = 23 - mant  # float32 bits under the dtype's mantissa
    unit = 1 << (low - 8)  # float32 steps per correction unit, in a shared binade
    half, up = 1 << (low - 1), 255 * unit // 2  # the midpoint; a rest of 127.5 units
    if dtype is torch.bfloat16:
        high = all_bits().astype(np.uint32) << 16
    else:  # float16's patterns as float32 bits (its binades inside float32's)
        with np.errstate(invalid="ignore"):
            high = decode(all_bits(), dtype).astype(np.float32).view(np.uint32)
        high = high & ~np.uint32((1 << low) - 1)
    offsets = np.array([0, 1, up - 1, up, up + 1, half - 1, half, half + 1, (1 << low) - 1], dtype=np.uint32)
    x = (high[:, None] | offsets[None, :]).reshape(-1).view(np.float32)
    spec = StepSpec("momentum", lr=True)
    hyper = step_hyperparams(spec, b1=0.9, lr=1.0)
    g = torch.from_numpy(-x).reshape(-1, 256)
    with np.errstate(all="ignore"):
        x = np.float32(0) + np.float32(-1) * (np.float32(0) + -x)  # the kernel's x = p + c * scale + d
    want_bits, want_c = ref_split(x, dtype)
    p = torch.zeros(g.shape, dtype=dtype)
    c = torch.zeros(g.shape, dtype=torch.int8)
    (pn, cn, _), (pe, ce, _) = step_both(spec, hyper, p, g, c, (torch.zeros(g.shape),), inplace=True)
    nan = np.isnan(x)
    assert np.array_equal(torch_bits(pn).reshape(-1)[~nan], want_bits[~nan])
    assert torch.isnan(pn.reshape(-1)[torch.from_numpy(nan)]).all()
    assert np.array_equal(cn.reshape(-1).numpy(), want_c)
    assert same(pn, pe) and torch.equal(cn, ce)


@NATIVE
def test_corrected_write_is_not_the_plain_write():
    """The corrected write is not the plain one: with updates below half an ulp the plain
    nearest-even write leaves params the corrected write moves, and the corrections change."""
    spec = StepSpec("adam", decay=True, lr=True)
    gen = torch.Generator().manual_seed(1)
    p, g, c = corrected_leaf(torch.bfloat16, (37, 301), gen)
    states = make_states(spec, (37, 301), "8bit", None, gen)
    hyper = step_hyperparams(spec, count=2, lr=1e-5, weight_decay=0.1)
    (pn, cn, _), _ = step_both(spec, hyper, p, g, c, states, inplace=True)
    plain = p.clone()
    run_step(spec, hyper, [StepLeaf(plain, g, tuple(clone_state(s) for s in states), 3)], write=True, inplace=True,
             backend="native")
    assert not same(pn, plain) and not torch.equal(cn, c)


@NATIVE
def test_kernel_plan_keeps_corrected_leaves_in_its_rows():
    """A plan over corrected bfloat16 and float16 leaves (with plain ones beside them) puts them
    in its native rows, with the correction's address and the ``correct`` flag, and over
    several steps writes what the torch backend writes."""
    spec = StepSpec("adam", decay=True, lr=True)
    gen = torch.Generator().manual_seed(4)
    layout = [(torch.bfloat16, (64, 300), "8bit", True), (torch.float16, (33, 130), "fp32", True),
              (torch.bfloat16, (7,), "bf16", False), (torch.float32, (5, 40), "4bit", False),
              (torch.bfloat16, (20, 300), "4bit-rank1", True)]
    leaves = []
    for dtype, shape, fmt, corrected in layout:
        p, _, c = corrected_leaf(dtype, shape, gen) if dtype is not torch.float32 else (
            torch.randn(shape, generator=gen), None, None)
        leaves.append((p, make_states(spec, shape, fmt, None, gen), c if corrected else None))

    def fresh():
        return ([p.clone() for p, _, _ in leaves], [tuple(clone_state(s) for s in st) for _, st, _ in leaves],
                [None if c is None else c.clone() for _, _, c in leaves])

    ps, ss, cs = fresh()
    plan = KernelPlan(spec, ps, ss, list(range(len(ps))), write=True, backend="native", corrections=cs)
    ps2, ss2, cs2 = fresh()
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in ps]
        hyper = step_hyperparams(spec, count=step, lr=1e-3 * 10.0 ** -step, weight_decay=0.1)
        plan.run(grads, hyper)
        run_step(spec, hyper, [StepLeaf(p, g, s, i, c) for i, (p, g, s, c) in enumerate(zip(ps2, grads, ss2, cs2))],
                 write=True, inplace=True, backend="eager")
        for k in range(len(ps)):
            assert same(ps[k], ps2[k]), (step, k)
            assert (cs[k] is None and cs2[k] is None) or torch.equal(cs[k], cs2[k]), (step, k)
            assert all(same(a, b) for a, b in zip(ss[k], ss2[k])), (step, k)
    assert plan._native == [0, 1, 2, 3]  # rank-1 records run through run_step (native too)
    w = plan._width
    for j, k in enumerate(plan._native):
        corr, flags = plan._rows[j * w + job_row_index("corr")], plan._rows[j * w + job_row_index("flags")]
        if cs[k] is None:
            assert corr == 0 and not flags & flag_bits(param_correction=True)
        else:
            assert corr == cs[k].data_ptr() and flags & flag_bits(param_correction=True)


@NATIVE
def test_native_rejects_what_it_cannot_correct():
    """A correction goes with a bfloat16 / float16 param written in place, rounded to nearest,
    and is a contiguous int8 tensor of its size; a non-contiguous one takes the torch backend,
    with the same result."""
    spec = StepSpec("momentum", lr=True)
    hyper = step_hyperparams(spec, lr=1e-2)
    shape = (6, 50)

    def job(p, c, *, write=True, stochastic=False):
        b = torch.zeros(shape)
        return native.NativeJob(6, 50, p, torch.ones(shape), p if write else torch.empty(shape), spec, write,
                                stochastic, 0, hyper, (native.NativeState(b, b, None, None, None, 0),), c)

    bf, c8 = torch.ones(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.int8)
    native.job_row(job(bf, c8))  # the good one
    for bad in (job(torch.ones(shape), c8), job(bf, c8, stochastic=True), job(bf, c8, write=False)):
        with pytest.raises(ValueError, match="correction goes with"):
            native.job_row(bad)
    for c, what in ((torch.zeros(shape, dtype=torch.int16), "int8"), (torch.zeros(5, 50, dtype=torch.int8), "elements"),
                    (torch.zeros(50, 6, dtype=torch.int8).t(), "contiguous")):
        with pytest.raises(ValueError, match=what):
            native.job_row(job(bf, c))
    strided = torch.zeros(6, 100, dtype=torch.int8)[:, ::2]
    p = torch.randn(shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert not native_ok(StepLeaf(p, torch.ones(shape), (torch.zeros(shape),), 0, strided), True)
    assert native_ok(StepLeaf(p, torch.ones(shape), (torch.zeros(shape),), 0, strided.contiguous()), True)
    results = []
    for c in (strided, strided.contiguous()):
        pp, cc = p.clone(), c.clone()
        run_step(spec, hyper, [StepLeaf(pp, torch.ones(shape) * 1e-3, (torch.zeros(shape),), 0, cc)], write=True,
                 inplace=True)
        results.append((pp, cc))
    assert same(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# ----------------------------------------------------------------------------- (3) step_ == pure

TXS = {
    "adamw-8bit": lambda: lt.adamw(1e-3, weight_decay=0.1, state_format="8bit", param_correction=True),
    "adamw-4bit": lambda: lt.adamw(1e-3, weight_decay=0.1, state_format="4bit", param_correction=True),
    "lion-8bit": lambda: lt.lion(1e-4, weight_decay=0.1, state_format="8bit", param_correction=True),
    "sgd-8bit": lambda: lt.sgd(1e-2, 0.9, True, 1e-3, state_format="8bit", param_correction=True),
    "ademamix-8bit": lambda: lt.ademamix(1e-3, 0.9, 0.999, 0.9999, 5.0, 1e-8, 0.1, state_format="8bit",
                                         param_correction=True),
    "ademamix-4bit": lambda: lt.ademamix(1e-3, 0.9, 0.999, 0.9999, 5.0, 1e-8, 0.1, state_format="4bit",
                                         param_correction=True),
}
TREE = [((64, 300), torch.bfloat16), ((33, 130), torch.float16), ((7,), torch.bfloat16), ((40, 130), torch.float32)]


def tensors(tree) -> list:
    return [x for x in optree.tree_leaves(tree, none_is_leaf=False) if isinstance(x, torch.Tensor)]


@NATIVE
@pytest.mark.parametrize("name", list(TXS))
def test_step_in_place_equals_pure_update(name):
    """``lowbit_tree.step_`` (the correction fused into the rule's kernel, native) leaves the
    params and every state tensor (corrections included) where the pure path (the rule's
    update, then param_correction's, then apply_updates) does, step after step."""
    gen = torch.Generator().manual_seed(len(name))
    init = [(torch.randn(s, generator=gen) * 3).to(d) for s, d in TREE]
    tx = TXS[name]()
    pure, live = [t.clone() for t in init], [t.clone() for t in init]
    state, live_state = tx.init(pure), tx.init(live)
    for step in range(4):
        grads = [(torch.randn(s, generator=gen) * 10.0 ** (step - 2)).to(d) for s, d in TREE]
        updates, state = tx.update(grads, state, pure)
        pure = lt.apply_updates(pure, updates)
        lt.step_(tx, grads, live_state, live)
        for i, (a, b) in enumerate(zip(live, pure)):
            assert same(a, b), (name, step, i)
        sa, sb = tensors(live_state), tensors(state)
        assert len(sa) == len(sb) and all(same(a, b) for a, b in zip(sa, sb)), (name, step)
    corrections = [c for c in tensors(state) if c.dtype is torch.int8]
    assert len(corrections) == 3 and any(c.any() for c in corrections)


# ----------------------------------------------------------------------------- (4) the bridge


def correction_state(state) -> ParamCorrectionState:
    (found,) = [n for n in optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, ParamCorrectionState))
                if isinstance(n, ParamCorrectionState)]
    return found


@NATIVE
@pytest.mark.parametrize("cls,fmt", [(bridge.AdamW8bit, "8bit"), (bridge.AdamW4bit, "4bit")], ids=["8bit", "4bit"])
def test_bridge_equals_functional_core(cls, fmt):
    """``bridge.AdamW8bit(params, param_correction=True)`` on bfloat16 params: params, moments and
    corrections equal ``lowbit_tree.adamw(..., param_correction=True)``'s functional run."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(64, 300), (7,), (33, 130)]
    init = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = cls(params, lr=1e-3, weight_decay=0.1, min_quant_size=1024, param_correction=True)
    tx = lt.adamw(1e-3, 0.9, 0.999, 1e-8, 0.1, state_format=fmt, min_quant_size=1024, param_correction=True)
    fparams = [t.clone() for t in init]
    state = tx.init(fparams)
    for step in range(4):
        grads = [(torch.randn(s, generator=gen) * 10.0 ** (step - 2)).bfloat16() for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        updates, state = tx.update(grads, state, fparams)
        fparams = lt.apply_updates(fparams, updates)
    corr = correction_state(state).correction
    for i, (p, q) in enumerate(zip(params, fparams)):
        assert same(p.detach(), q), i
        assert torch.equal(opt.state[p]["param_correction"], corr[i]), i
    (adam,) = [n for n in optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, ScaleByAdamState))
               if isinstance(n, ScaleByAdamState)]
    mu, nu = adam.mu, adam.nu
    for i, p in enumerate(params):
        for live, leaf in ((opt.state[p]["exp_avg"], mu[i]), (opt.state[p]["exp_avg_sq"], nu[i])):
            assert same(live.record if hasattr(live, "record") else live, leaf), i
    assert any(c.any() for c in corr)


# ----------------------------------------------------------------------------- (5) what it is for


@NATIVE
def test_updates_below_half_an_ulp_move_the_master_value():
    """With updates below half a bfloat16 ulp, plain bfloat16 params never move; corrected ones
    follow a float32-param run of the same optimizer (same gradients and states) to within the
    master value's rounding (at most 2**-16 of |p| a step; on average well under 2**-15)."""
    gen = torch.Generator().manual_seed(2)
    shape, steps, lr = (64, 300), 4, 2e-4  # |update| = lr * |Adam's u| ~ 2e-4 < 2**-8, half an ulp in [1, 2)
    init = ((1 + torch.rand(shape, generator=gen)) * torch.randn(shape, generator=gen).sign()).bfloat16()
    drift = torch.randn(shape, generator=gen).sign()  # a steady gradient sign per element: the params drift
    runs = {}
    for name, dtype, corr in (("plain", torch.bfloat16, False), ("corrected", torch.bfloat16, True),
                              ("fp32", torch.float32, False)):
        p = torch.nn.Parameter(init.to(dtype))
        runs[name] = (p, bridge.AdamW8bit([p], lr=lr, weight_decay=0.0, param_correction=corr))
    g_gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        g = (drift + 0.3 * torch.randn(shape, generator=g_gen)).bfloat16()
        for name, (p, opt) in runs.items():
            p.grad = g.to(p.dtype)
            opt.step()
    plain, corrected, fp32 = (runs[n][0].detach() for n in ("plain", "corrected", "fp32"))
    assert torch.equal(plain.view(torch.int16), init.view(torch.int16))  # never moved
    master = master_value(corrected, runs["corrected"][1].state[runs["corrected"][0]]["param_correction"]).double()
    ref = fp32.double()
    rel = ((master - ref).abs() / ref.abs())
    rel_plain = ((plain.double() - ref).abs() / ref.abs())
    # each step rounds the master value by at most half a correction unit (2**-16 of |p|; the
    # float32 roundings of both runs add 2**-7 of that)
    assert rel.max() <= steps * 2.0 ** -16 * (1 + 2.0 ** -6)
    assert rel.mean() <= 2.0 ** -15
    assert rel_plain.mean() >= 2.0 ** -12 and rel.mean() * 16 < rel_plain.mean()  # the plain params lag behind
