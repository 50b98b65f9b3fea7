"""Fast kernels are bit-identical to the reference quantizer (codes and scale bits),
and the fused Adam step equals the unfused reference composition."""
import math
import os
import platform
import subprocess
import sys

import pytest
import torch

import lowbit_tree as lt
from lowbit_tree import kernels as K
from lowbit_tree import kernels_cpu
from lowbit_tree.qtensor import QTensor, dequantize, quantize_rows

FORMAT_NAMES = sorted(lt.FORMATS)

# CPU: the native C kernel (when it builds) and the eager torch path; the compiled
# torch path on CPU is exercised on a few shapes only (compilation is slow).
CPU_BACKENDS = [
    pytest.param(dict(backend="native"), id="native",
                 marks=pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")),
    pytest.param(dict(backend="torch", compile=False), id="eager"),
]

SHAPES_BS = [((3, 1000), None), ((1, 7), 1), ((5, 33), 7), ((4, 257), 128), ((2, 4099), 256), ((1, 1), None), ((6, 2), 3)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn or a.dtype == torch.uint8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def hard_values(shape, fmt, gen):
    """Random values over many decades plus the map's exact midpoints, their
    float32 neighbours, map values, zeros, subnormals, huge values."""
    n = math.prod(shape)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 6)
    mids = fmt.midpoints.float()
    special = torch.cat([
        mids, torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(-math.inf)),
        fmt.values, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3e38, -3e38, 1.0, -1.0]),
    ])
    k = min(n, special.numel())
    pos = torch.randperm(n, generator=gen)[:k]
    x[pos] = special[torch.randint(special.numel(), (k,), generator=gen)]
    return x.reshape(shape)


def check_quantize(x2, fmt, bs, **kw):
    c0, s0 = quantize_rows(x2, fmt, bs)
    c1, s1 = K.quantize_rows_fast(x2, fmt, bs, **kw)
    assert same_bits(c0, c1), (fmt.name, x2.shape, bs)
    assert same_bits(s0, s1), (fmt.name, x2.shape, bs)
    return c0, s0


@pytest.mark.parametrize("kw", CPU_BACKENDS)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_quantize_dequantize_bit_identical(name, kw):
    fmt = lt.FORMATS[name]
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    for shape, bs in SHAPES_BS:
        bs = bs or fmt.default_block_size
        x = hard_values(shape, fmt, gen)
        # values straight on the normalized grid: a block whose absmax makes the
        # scale exactly 1 (or 448) so that midpoints hit exactly
        x_grid = hard_values(shape, fmt, gen).clamp(-1, 1) * fmt.scale_divisor
        x_grid.view(-1)[:: max(1, bs)] = fmt.scale_divisor
        for xx in (x, x_grid, x.abs(), torch.zeros(shape)):
            c, s = check_quantize(xx, fmt, bs, **kw)
            d0 = dequantize(QTensor(c, s, shape, bs, name))
            d1 = K.dequantize_rows_fast(c, s, fmt, bs, shape[1], **kw)
            assert same_bits(d0, d1)


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_native_quantize_on_random_bit_patterns(name):
    """Uniformly random float32 bit patterns (every exponent, subnormals, both
    signs), in blocks whose first element makes the scale exactly 1: the native
    kernels' bucket table, integer e4m3 rounding and 4-bit comparisons see the
    whole normalized range; codes must equal the reference's."""
    fmt = lt.FORMATS[name]
    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[x.abs() <= fmt.scale_divisor]  # drops NaN / inf / out of range (tested elsewhere)
    bs = 256
    x = x[: (x.numel() // (bs - 1)) * (bs - 1)].reshape(-1, bs - 1)
    x = torch.cat([torch.full((x.shape[0], 1), fmt.scale_divisor), x], dim=1)
    check_quantize(x, fmt, bs, backend="native")


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("name", [n for n in FORMAT_NAMES if lt.FORMATS[n].bits == 8])
def test_native_range_table_is_small_and_its_check_can_fail(name):
    """The 8-bit encode reads one row of a range table per value: rows are few
    (they must stay in L1 while params stream through: a uniform bucket table
    had ~2900 per sign), and the brute-force check lbt_prepare runs on them
    rejects a table with a row's threshold moved up by one magnitude step, or
    its count moved by one."""
    import ctypes

    st = kernels_cpu._format_struct(name)
    lib = kernels_cpu.library()
    nrows = st.rng_npos * (2 if st.is_signed else 1)
    assert 0 < st.rng_npos <= 700, st.rng_npos
    assert lib.lbt_check_tables(ctypes.byref(st)) == 1
    rows = ctypes.cast(st.packed, ctypes.POINTER(ctypes.c_uint32))
    gen = torch.Generator().manual_seed(len(name))
    with_threshold = [i for i in range(nrows) if rows[i] & 0xFFFFFF]  # row = (count << 24) - threshold
    assert len(with_threshold) == lt.FORMATS[name].values.numel() - 1
    picks = torch.randint(0, nrows, (20,), generator=gen).tolist()
    picks += with_threshold[:: max(1, len(with_threshold) // 20)]
    for i in picks:
        keep = rows[i]
        # count +-1 on any row; threshold + 1 where there is one (- 1 can be
        # harmless: a threshold at its bucket's first magnitude)
        for delta in (1 << 24, -(1 << 24)) + ((-1,) if i in with_threshold else ()):
            rows[i] = (keep + delta) & 0xFFFFFFFF
            try:
                assert lib.lbt_check_tables(ctypes.byref(st)) == 0, (i, hex(keep), delta)
            finally:
                rows[i] = keep
    assert lib.lbt_check_tables(ctypes.byref(st)) == 1


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
def test_native_linear_4bit_index_is_on_and_its_check_can_fail():
    """linear4_unsigned's thresholds are evenly spaced (1/16 apart): its native
    index is floor(x * 16 - 0.5) instead of 15 comparisons (inspectable: lin),
    dynamic4's are not; the check lbt_prepare runs rejects a slope or offset
    slightly off (one float step can be harmless: the same function)."""
    import ctypes

    lib = kernels_cpu.library()
    assert kernels_cpu._format_struct("dynamic4").lin == 0
    st = kernels_cpu._format_struct("linear4_unsigned")
    assert (st.lin, st.lin_a, st.lin_b) == (1, 16.0, 0.5)
    assert lib.lbt_check_tables(ctypes.byref(st)) == 1
    for field, deltas in (("lin_a", (2**-6, -(2**-6))), ("lin_b", (2**-6, -(2**-6)))):
        keep = getattr(st, field)
        for delta in deltas:
            setattr(st, field, keep + delta)
            try:
                assert lib.lbt_check_tables(ctypes.byref(st)) == 0, (field, delta)
            finally:
                setattr(st, field, keep)
    assert lib.lbt_check_tables(ctypes.byref(st)) == 1


@pytest.mark.parametrize("kw", CPU_BACKENDS)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_nonfinite_and_empty(name, kw):
    fmt = lt.FORMATS[name]
    x = torch.randn(3, 20)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2, 0] = -float("inf")
    x[2, 19] = -float("nan")
    check_quantize(x, fmt, 8, **kw)
    for shape in [(0, 5), (4, 0), (0, 0)]:
        check_quantize(torch.randn(shape), fmt, 4, **kw)


@pytest.mark.parametrize("name", ["dynamic8", "linear4_unsigned", "e4m3_sqrt"])
def test_compiled_torch_path_bit_identical(name):
    fmt = lt.FORMATS[name]
    gen = torch.Generator().manual_seed(1)
    for shape, bs in [((4, 300), 128), ((3, 7), 2)]:
        check_quantize(hard_values(shape, fmt, gen), fmt, bs, backend="torch", compile=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_cuda_bit_identical(name, compile):
    fmt = lt.FORMATS[name]
    gen = torch.Generator().manual_seed(2)
    for shape, bs in SHAPES_BS[:5]:
        bs = bs or fmt.default_block_size
        x = hard_values(shape, fmt, gen)
        c0, s0 = quantize_rows(x, fmt, bs)
        c1, s1 = K.quantize_rows_fast(x.cuda(), fmt, bs, compile=compile)
        assert same_bits(c0, c1.cpu()) and same_bits(s0, s1.cpu())
        d0 = dequantize(QTensor(c0, s0, shape, bs, name))
        d1 = K.dequantize_rows_fast(c0.cuda(), s0.cuda(), fmt, bs, shape[1], compile=compile)
        assert same_bits(d0, d1.cpu())


# ----------------------------------------------------------------------------- Adam

ADAM_SHAPES = [((64, 300), None), ((7,), 1), ((5, 33), 7), ((3, 2, 129), 128), ((1,), None), ((2, 5001), None)]
HP = dict(count=4, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def run_adam_case(st, shape, bs, device, with_p, **kw):
    fm, fv = lt.STATE_FORMATS[st]
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen) * 1e-2
    g.view(-1)[0] = 0.0
    m = lt.quantize(torch.randn(shape, generator=gen) * 1e-2, fm, bs)
    v = lt.quantize(torch.rand(shape, generator=gen) * 1e-4, fv, bs)
    pp = p if with_p else None
    ro, rm, rv, m32r, v32r = K.adam_step_reference(pp, g, m, v, **HP)
    to = lambda t: None if t is None else t.to(device)
    out, mc, ms, vc, vs, m32, v32 = K.adam_step_quantized(
        to(pp), to(g), to(m.codes), to(m.scale), to(v.codes), to(v.scale), fmt_m=fm, fmt_v=fv,
        block_size=(m.block_size, v.block_size), shape=shape, return_moments=True, **HP, **kw,
    )
    # the contract: codes are the reference quantization of the kernel's float32
    # moments; on CPU those moments (and the output) equal eager's exactly
    rows, r = lt.row_layout(shape)
    qm = quantize_rows(m32.cpu().reshape(rows, r), lt.FORMATS[fm], m.block_size)
    qv = quantize_rows(v32.cpu().reshape(rows, r), lt.FORMATS[fv], v.block_size)
    assert same_bits(mc.cpu(), qm[0]) and same_bits(ms.cpu(), qm[1])
    assert same_bits(vc.cpu(), qv[0]) and same_bits(vs.cpu(), qv[1])
    return (out.cpu(), mc.cpu(), ms.cpu(), vc.cpu(), vs.cpu(), m32.cpu(), v32.cpu()), (ro, rm.codes, rm.scale, rv.codes, rv.scale, m32r, v32r)


@pytest.mark.parametrize("kw", CPU_BACKENDS)
@pytest.mark.parametrize("st", sorted(lt.STATE_FORMATS))
def test_adam_step_matches_reference(st, kw):
    for shape, bs in ADAM_SHAPES:
        for with_p in (True, False):
            got, ref = run_adam_case(st, shape, bs, "cpu", with_p, **kw)
            for a, b in zip(got, ref):
                assert same_bits(a.reshape(b.shape) if a.numel() == b.numel() else a, b), (st, shape, bs, with_p)


def test_adam_step_compiled_cpu_matches_reference():
    for st in ("8bit",):
        got, ref = run_adam_case(st, (5, 33), 7, "cpu", True, backend="torch", compile=True)
        for a, b in zip(got, ref):
            assert same_bits(a.reshape(b.shape), b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("st", sorted(lt.STATE_FORMATS))
def test_adam_step_cuda(st):
    for shape, bs in ADAM_SHAPES[:4]:
        got, ref = run_adam_case(st, shape, bs, "cuda", True)
        # codes match the reference quantization of the kernel's moments (checked
        # inside); the moments themselves agree with eager to within an ulp
        torch.testing.assert_close(got[5].reshape(ref[5].shape), ref[5], rtol=1e-6, atol=0)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
def test_adam_step_in_place():
    fm, fv = lt.STATE_FORMATS["8bit"]
    p = torch.randn(9, 70)
    g = torch.randn(9, 70)
    m, v = lt.zeros(p.shape, fm), lt.zeros(p.shape, fv)
    ref = K.adam_step_quantized(p, g, m.codes, m.scale, v.codes, v.scale, fmt_m=fm, fmt_v=fv, **HP)
    p2 = p.clone()
    st = (m.codes.clone(), m.scale.clone(), v.codes.clone(), v.scale.clone())
    K.adam_step_quantized(p2, g, *st, fmt_m=fm, fmt_v=fv, out=p2, state_out=st, **HP)
    assert same_bits(p2, ref[0])
    for a, b in zip(st, ref[1:]):
        assert same_bits(a, b)


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
def test_adam_step_many_in_place_matches_one_by_one():
    """One multi-parameter call (tiles of all params shared among 2 threads, short
    rows batched into tiles, a non-contiguous param on the fallback path) writes
    the same bits as one adam_step_quantized call per parameter."""
    gen = torch.Generator().manual_seed(11)
    cases = [  # (shape, state format, block size)
        ((600, 500), "8bit", None), ((3, 4099), "4bit", None), ((257, 3), "fp8", 5), ((1,), "8bit", None),
        ((40, 33), "4bit", 7), ((0, 4), "8bit", None), ((2, 2, 9), "8bit_bnb", 4), ((50, 60), "fp8", None),
    ]
    items, expected = [], []
    for i, (shape, st, bs) in enumerate(cases):
        fm, fv = lt.STATE_FORMATS[st]
        p = torch.randn(shape, generator=gen)
        if i == 4:  # non-contiguous: a transposed view
            p = torch.randn(shape[::-1], generator=gen).t()
        g = torch.randn(shape, generator=gen) * 10.0 ** float(torch.randint(-6, 2, (), generator=gen))
        m = lt.quantize(torch.randn(shape, generator=gen) * 1e-2, fm, bs)
        v = lt.quantize(torch.rand(shape, generator=gen) * 1e-4, fv, bs)
        hyper = K.adam_hyperparams(count=i, lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.01 * i)
        ref = K.adam_step_quantized(p.clone(), g, m.codes, m.scale, v.codes, v.scale, fmt_m=fm, fmt_v=fv,
                                    block_size=(m.block_size, v.block_size), hyper=hyper, backend="torch", compile=False)
        expected.append(ref)
        items.append((p, g, m.codes.clone(), m.scale.clone(), v.codes.clone(), v.scale.clone(), fm, fv,
                      (m.block_size, v.block_size), hyper))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        K.adam_step_quantized_(items)
    finally:
        torch.set_num_threads(threads)
    for (shape, st, _), it, ref in zip(cases, items, expected):
        got = (it[0], it[2], it[3], it[4], it[5])
        for a, b in zip(got, ref):
            assert same_bits(a.contiguous().view(b.shape) if a.numel() == b.numel() else a, b), (shape, st)


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
def test_native_adam_rejects_bad_sizes_before_running_anything():
    fm, fv = lt.STATE_FORMATS["8bit"]
    p, g = torch.randn(4, 300), torch.randn(4, 300)
    m, v = lt.zeros(p.shape, fm), lt.zeros(p.shape, fv)
    hyper = K.adam_hyperparams(count=0, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8)
    good = (4, 300, p, g, p, m.codes, m.scale, v.codes, v.scale, m.codes, m.scale, v.codes, v.scale, None, None,
            hyper, fm, 256, fv, 256)
    bad = list(good)
    bad[3] = torch.randn(4, 299)  # short gradient
    before = p.clone()
    with pytest.raises(ValueError, match="grad has 1196 elements"):
        kernels_cpu.adam_many([good, tuple(bad)])
    assert torch.equal(p, before)  # the good job did not run either
    overlap = list(good)
    overlap[4] = p.view(-1)[1:].view(-1)[:1200 - 1]  # out overlapping the param, shifted
    with pytest.raises(ValueError):
        kernels_cpu.adam_many([tuple(overlap)])


@pytest.mark.slow
@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flag")
def test_native_kernels_without_avx2(tmp_path):
    """The plain-C paths (what CPUs without AVX2 run; here only block tails) built
    alone with -mno-avx2 pass the same bit-identity tests, in a fresh process."""
    env = dict(os.environ, LOWBIT_TREE_CFLAGS="-mno-avx2 -mno-avx512f", LOWBIT_TREE_CACHE=str(tmp_path))
    tests = "random_bit or adam_step_matches_reference or many_in_place or quantize_dequantize_bit_identical or fp32_native"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__, "-k", tests],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "passed" in r.stdout and list(tmp_path.glob("kernels_cpu_*.so")), r.stdout[-2000:]


@pytest.mark.parametrize("count", [0, 3, 999])
@pytest.mark.parametrize("st", ["8bit", "fp8"])
def test_adam_step_is_textbook_adamw_in_float64(st, count):
    """The fused step's float32 math (reciprocal bias corrections, one root) is
    AdamW: against a float64 textbook step on the same dequantized moments."""
    fm, fv = lt.STATE_FORMATS[st]
    gen = torch.Generator().manual_seed(count)
    shape = (9, 300)
    p = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen) * torch.logspace(-6, 0, 300)
    g[0, :5] = torch.tensor([0.0, 1e-30, -1e-30, 1e3, -1e3])
    m = lt.quantize(torch.randn(shape, generator=gen) * 1e-2, fm)
    v = lt.quantize(torch.rand(shape, generator=gen) * 1e-4, fv)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    out, _, _, _, _, m32, v32 = K.adam_step_quantized(
        p, g, m.codes, m.scale, v.codes, v.scale, fmt_m=fm, fmt_v=fv, block_size=(m.block_size, v.block_size),
        shape=shape, return_moments=True, count=count, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd,
    )
    m0, v0, g64, p64 = (lt.dequantize(m).double(), lt.dequantize(v).double(), g.double(), p.double())
    mr = b1 * m0 + (1 - b1) * g64
    vr = b2 * v0 + (1 - b2) * g64 * g64
    c = count + 1
    # float32 rounding of each term (b1 itself is rounded): error bounded by the
    # terms' magnitudes, not the result's (the two terms may cancel)
    assert ((m32.double() - mr).abs() <= 1e-6 * (b1 * m0.abs() + (1 - b1) * g64.abs())).all()
    assert ((v32.double() - vr).abs() <= 1e-6 * (b2 * v0 + (1 - b2) * g64 * g64)).all()
    # the update direction (no param given): a few float32 roundings of textbook u
    u = K.adam_step_quantized(
        None, g, m.codes, m.scale, v.codes, v.scale, fmt_m=fm, fmt_v=fv, block_size=(m.block_size, v.block_size),
        shape=shape, count=count, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd,
    )[0]
    # from the kernel's own float32 moments (their rounding is checked above)
    m64, v64 = m32.double(), v32.double()
    ur = (m64 / (1 - b1**c)) / ((v64 / (1 - b2**c)).sqrt() + eps)
    torch.testing.assert_close(u.double(), ur, rtol=2e-6, atol=0)
    pr = p64 - lr * (ur + wd * p64)
    assert ((out.double() - pr).abs() <= 4 * 2**-24 * p64.abs() + 2e-6 * lr * ur.abs()).all()


FP32_SIZES = [1, 7, 300, 2048, 2049, 5000, 0]


def fp32_case(n, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * torch.logspace(-8, 1, max(n, 1))[:n]
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-6
    if n >= 4:
        g[:4] = torch.tensor([0.0, -0.0, 1e18, -1e-30])  # g * g stays finite in float32
        v[:2] = 0.0
    return p, g, m, v


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
def test_adam_step_fp32_native_matches_eager_and_textbook():
    """Native float32-moment jobs (one call, tiles shared out) against the eager
    float32 fallback (bit for bit) and a float64 textbook AdamW (a few ulps)."""
    lr, b1, b2, eps, wd, count = 3e-3, 0.9, 0.99, 1e-8, 0.05, 2
    hyper = K.adam_hyperparams(count=count, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    cases = [fp32_case(n, i) for i, n in enumerate(FP32_SIZES)]
    nat = [tuple(t.clone() for t in c) for c in cases]
    eag = [tuple(t.clone() for t in c) for c in cases]
    K.adam_step_fp32_([(p, g, m, v, hyper) for p, g, m, v in nat])
    K.adam_step_fp32_([(p, g, m, v, hyper) for p, g, m, v in eag], backend="torch")
    for (p0, g, m0, v0), a, b in zip(cases, nat, eag):
        for x, y in zip(a, b):
            assert same_bits(x, y), len(p0)
        p64, g64, m64, v64 = (t.double() for t in (p0, g, m0, v0))
        mr = b1 * m64 + (1 - b1) * g64
        vr = b2 * v64 + (1 - b2) * g64 * g64
        assert ((a[2].double() - mr).abs() <= 1e-6 * (b1 * m64.abs() + (1 - b1) * g64.abs())).all()
        assert ((a[3].double() - vr).abs() <= 1e-6 * (b2 * v64 + (1 - b2) * g64 * g64)).all()
        m32, v32 = a[2].double(), a[3].double()
        c = count + 1
        ur = (m32 / (1 - b1**c)) / ((v32 / (1 - b2**c)).sqrt() + eps)
        pr = p64 - lr * (ur + wd * p64)
        assert ((a[0].double() - pr).abs() <= 4 * 2**-24 * p64.abs() + 2e-6 * lr * ur.abs()).all()


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
def test_adam_steps_mixed_call_matches_separate_calls():
    """Quantized and float32-moment params in one adam_steps_ call (one parallel
    region, as the bridge runs a group) write the same bits as the two kinds
    stepped separately."""
    hyper = K.adam_hyperparams(count=4, lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.01)

    def quantized_items():
        g2 = torch.Generator().manual_seed(17)
        out = []
        for shape, st in (((300, 257), "8bit"), ((33, 64), "4bit"), ((5,), "fp8")):
            fm, fv = lt.STATE_FORMATS[st]
            m = lt.quantize(torch.randn(shape, generator=g2) * 1e-2, fm)
            v = lt.quantize(torch.rand(shape, generator=g2) * 1e-4, fv)
            out.append((torch.randn(shape, generator=g2), torch.randn(shape, generator=g2) * 1e-2, m.codes, m.scale,
                        v.codes, v.scale, fm, fv, (m.block_size, v.block_size), hyper))
        return out

    fp32 = [fp32_case(n, i) for i, n in enumerate((1, 700, 5000))]
    a_q, b_q = quantized_items(), quantized_items()
    a_f = [tuple(t.clone() for t in c) + (hyper,) for c in fp32]
    b_f = [tuple(t.clone() for t in c) + (hyper,) for c in fp32]
    K.adam_steps_(a_q, a_f)
    K.adam_step_quantized_(b_q)
    K.adam_step_fp32_(b_f)
    for x, y in zip(a_q, b_q):
        for s, t in zip(x[:6], y[:6]):
            assert same_bits(s, t)
    for x, y in zip(a_f, b_f):
        for s, t in zip(x[:4], y[:4]):
            assert same_bits(s, t)


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
def test_adam_step_fp32_non_contiguous_and_bad_hyper():
    hyper = K.adam_hyperparams(count=0, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8)
    p, g, m, v = fp32_case(64, 5)
    pt, mt, vt = (t.reshape(8, 8).t() for t in (p.clone(), m.clone(), v.clone()))  # not contiguous: eager path
    K.adam_step_fp32_([(pt, g.reshape(8, 8).t(), mt, vt, hyper)])
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    K.adam_step_fp32_([(p2, g, m2, v2, hyper)])
    assert same_bits(pt.t().reshape(-1), p2) and same_bits(mt.t().reshape(-1), m2) and same_bits(vt.t().reshape(-1), v2)
    with pytest.raises(ValueError, match="hyper has 3 elements"):
        kernels_cpu.adam_many([], [(p2, g, m2, v2, torch.zeros(3))])
    with pytest.raises(ValueError, match="exp_avg_sq has 63 elements"):
        kernels_cpu.adam_many([], [(p2, g, m2, v2[:63], hyper)])
    assert same_bits(p2, p2.clone())  # nothing ran: the checks come first


def test_adam_hyperparams_tensor_count_matches_int():
    """The bridge passes a CPU step count as a number and a CUDA one as a tensor
    (no sync): both give the same float32 vector."""
    a = K.adam_hyperparams(count=7, lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    b = K.adam_hyperparams(count=torch.tensor(7), lr=torch.tensor(3e-4, dtype=torch.float64), b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    assert same_bits(a, b)
    for b1, b2 in ((0.9, 0.999), (0.8, 0.99), (0.95, 0.9999)):
        for count in [*range(300), 10**4, 10**6]:
            a = K.adam_hyperparams(count=count, lr=1e-3, b1=b1, b2=b2, eps=1e-8, weight_decay=0.01)
            b = K.adam_hyperparams(count=torch.tensor(float(count)), lr=1e-3, b1=b1, b2=b2, eps=1e-8, weight_decay=0.01)
            assert same_bits(a, b), (b1, b2, count)


def test_eager_switch(monkeypatch):
    monkeypatch.setenv("LOWBIT_TREE_EAGER", "1")
    assert not K.use_compile()
    monkeypatch.setenv("LOWBIT_TREE_EAGER", "0")
    assert K.use_compile()
    assert not K.use_compile(False)
