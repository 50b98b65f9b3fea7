"""The fast quantizers of every backend are bit-identical to the reference quantizer
(codes and scale bits), and the native kernel's load-time table checks can fail."""
import math
import os
import platform
import subprocess
import sys

import pytest
import torch

import lowbit_tree as lt
from lowbit_tree import kernels as K
from lowbit_tree.kernels import native as kernels_cpu
from lowbit_tree.qtensor import QTensor, dequantize, quantize_rows

FORMAT_NAMES = sorted(lt.FORMATS)

# CPU: the native C kernel (when it builds) and the eager torch path; the compiled
# torch path on CPU is exercised on a few shapes only (compilation is slow).
CPU_BACKENDS = [
    pytest.param(dict(backend="native"), id="native",
                 marks=pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")),
    pytest.param(dict(backend="eager"), id="eager"),
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
    gen = torch.Generator().manual_seed(FORMAT_NAMES.index(name))  # stable (hash() is salted per process)
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
def test_native_vector_paths_follow_the_build_target():
    """The library's AVX-512 and AVX2 paths are chosen at build time (-march=native): on a CPU with
    AVX-512F/BW/DQ/VL the default build has the AVX-512 ones, and LOWBIT_TREE_CFLAGS=-mno-avx512f
    builds (and so tests) the AVX2 ones instead."""
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    paths = kernels_cpu.vector_paths()
    cflags = os.environ.get("LOWBIT_TREE_CFLAGS", "").split()
    if "-mno-avx512f" in cflags or "-mno-avx2" in cflags:
        assert "avx512" not in paths and "avx512vbmi" not in paths, paths
    elif {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        assert "avx512" in paths, paths
    if "-mno-avx2" not in cflags and "avx2" in flags:
        assert "avx2" in paths, paths


@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("name", [n for n in FORMAT_NAMES if lt.FORMATS[n].bits == 8])
def test_native_decode_planes_are_the_decode_table(name):
    """The AVX-512 VBMI decode reads byte planes lbt_prepare derives from the format's decode
    table (tables.cpu_code_table, their one source): plane k holds byte k of every entry. Set on
    CPUs with VBMI for the 8-bit table formats (not the e4m3 ones decoded by arithmetic)."""
    import ctypes

    st = kernels_cpu._format_struct(name)
    if not st.planes:
        # a build for VBMI (not merely a VBMI CPU: LOWBIT_TREE_CFLAGS=-mno-avx512f builds the AVX2 paths)
        vbmi = "avx512vbmi" in kernels_cpu.vector_paths()
        assert st.e4m3_arith or not vbmi, "a VBMI build without the planes: the kernel checks rejected them"
        return
    assert not st.e4m3_arith
    planes = torch.tensor(list(ctypes.cast(st.planes, ctypes.POINTER(ctypes.c_uint8))[:1024]), dtype=torch.uint8)
    table = K.tables.cpu_code_table(name).decode.contiguous().view(torch.uint8).reshape(256, 4)
    assert torch.equal(planes.reshape(4, 256), table.T.contiguous())  # little-endian floats


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
    torch.manual_seed(0)
    fmt = lt.FORMATS[name]
    x = torch.randn(3, 20)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2, 0] = -float("inf")
    x[2, 19] = -float("nan")
    check_quantize(x, fmt, 8, **kw)
    for shape in [(0, 5), (4, 0), (0, 0)]:
        check_quantize(torch.randn(shape), fmt, 4, **kw)


@pytest.mark.slow  # inductor compiles a graph per shape: ~20 s each on 2 busy cores
@pytest.mark.parametrize("name", ["dynamic8", "linear4_unsigned", "e4m3_sqrt"])
def test_compiled_torch_path_bit_identical(name):
    fmt = lt.FORMATS[name]
    gen = torch.Generator().manual_seed(1)
    for shape, bs in [((4, 300), 128), ((3, 7), 2), ((9, 130), 256)]:  # the last: rows shorter than a block
        c, s = check_quantize(hard_values(shape, fmt, gen), fmt, bs, backend="compiled")
        d = K.dequantize_rows_fast(c, s, fmt, bs, shape[1], backend="compiled")
        assert same_bits(d, dequantize(QTensor(c, s, shape, bs, name)))


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
        c1, s1 = K.quantize_rows_fast(x.cuda(), fmt, bs, backend="compiled" if compile else "eager")
        assert same_bits(c0, c1.cpu()) and same_bits(s0, s1.cpu())
        d0 = dequantize(QTensor(c0, s0, shape, bs, name))
        d1 = K.dequantize_rows_fast(c0.cuda(), s0.cuda(), fmt, bs, shape[1], backend="compiled" if compile else "eager")
        assert same_bits(d0, d1.cpu())


_EXHAUSTIVE_C = r"""
/* every float32 bit pattern through encode_block at scale 1 against a binary-search count of the
 * thresholds <= x (NaN -> last); prints the mismatches' count */
#include <stdio.h>
static int32_t count_le(const float *t, int32_t n, float x) {
    if (x != x) return n;
    int32_t lo = 0, hi = n;
    while (lo < hi) { int32_t mid = (lo + hi) / 2; if (t[mid] <= x) lo = mid + 1; else hi = mid; }
    return lo;
}
int main(int argc, char **argv) {
    FILE *fh = fopen(argv[1], "rb");
    int32_t hdr[6];
    lbt_format f;
    float dec[256], thr[256];
    uint8_t enc[256];
    memset(&f, 0, sizeof f);
    if (fread(hdr, 4, 6, fh) != 6) return 2;
    f.bits = hdr[0], f.is_signed = hdr[1], f.sqrt_ = hdr[2], f.float8 = hdr[3], f.last = hdr[5];
    memcpy(&f.divisor, &hdr[4], 4);
    if (fread(dec, 4, 256, fh) != 256 || fread(enc, 1, f.last + 1, fh) != (size_t)f.last + 1
        || fread(thr, 4, f.last, fh) != (size_t)f.last) return 2;
    fclose(fh);
    f.decode = dec, f.encode = enc, f.sorted = thr;
    if (lbt_prepare(&f) != 0) return 3;
    static float x[4096];
    static uint8_t codes[4096];
    static int32_t s1[4096], s2[4096];
    unsigned long long bad = 0;
    for (uint64_t base = 0; base < (1ull << 32); base += 4096) {
        int64_t n = 0;
        for (int64_t i = 0; i < 4096; i++) {
            uint32_t b = (uint32_t)(base + i);
            float v;
            memcpy(&v, &b, 4);
            if (f.is_signed || !(v < 0.0f)) x[n++] = v; /* an unsigned encoder never sees a negative value */
        }
        encode_block(x, n, 1.0f, &f, codes, s1, s2);
        for (int64_t i = 0; i < n; i++) {
            int32_t want = count_le(thr, f.last, x[i]);
            int32_t got = f.bits == 4 ? (codes[i / 2] >> (4 * (i & 1))) & 15 : codes[i];
            bad += got != (f.bits == 4 ? want : enc[want]);
        }
    }
    printf("%llu\n", bad);
    return 0;
}
"""


@pytest.mark.slow
@pytest.mark.skipif(not kernels_cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_native_encoder_on_every_float(name, tmp_path):
    """The block encoder the library's build uses (AVX-512, AVX2 or plain C, as LOWBIT_TREE_CFLAGS
    chooses), at scale 1, on all 2**32 float32 bit patterns (the non-negative ones for unsigned
    formats), against a count of the thresholds <= x by binary search: the same code for every
    input (about 45 s a format on one core)."""
    import struct

    fmt, tab = lt.FORMATS[name], K.tables.cpu_code_table(name)
    data = tmp_path / "format.bin"
    data.write_bytes(struct.pack("iiiifi", fmt.bits, int(fmt.signed), int(fmt.sqrt), int(fmt.float8),
                                 float(fmt.scale_divisor), tab.last)
                     + tab.decode.contiguous().numpy().tobytes()
                     + tab.encode.contiguous().numpy().tobytes()[: tab.last + 1]
                     + tab.thresholds.contiguous().numpy().tobytes()[: 4 * tab.last])
    harness, header, exe = tmp_path / "harness.c", tmp_path / "abi.h", tmp_path / "harness"
    header.write_text(kernels_cpu.abi_header())
    harness.write_text(f'#include "{kernels_cpu._SOURCE}"\n' + _EXHAUSTIVE_C)
    flags = [f for f in kernels_cpu._FLAGS if f not in ("-shared", "-fPIC")]
    flags += os.environ.get("LOWBIT_TREE_CFLAGS", "").split()
    subprocess.run([kernels_cpu._compiler(), *flags, "-include", str(header), str(harness), "-o", str(exe), "-lm"],
                   check=True, capture_output=True)
    done = subprocess.run([str(exe), str(data)], capture_output=True, text=True)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.strip() == "0", f"{done.stdout.strip()} float32 inputs get another code than the count"
