"""A/B timing of builds of the native CPU kernel (``lowbit_tree/kernels/cpu.c``).

Each C source given is built with the library's own flags and generated ABI
header (``native.abi_header``: the rule ids, flags and job layout of this
checkout's ``spec.py``) and loaded side by side, and prepares its own format
structs (so builds whose code tables differ compare fairly; the struct's fields
must be this checkout's); every (build, state
format, size, data) combination then runs one step of ``--rule`` (AdamW by
default; param written in place with its decay and learning rate, as the bridge
does) through ``lbt_step_jobs`` directly, out of place on
fixed inputs (``--inplace``: on the build's own copies of param and states,
updated in place as the bridge does), and the timed calls are interleaved in
rounds, so a slow period of a shared machine hits all builds alike. Prints min
and median ns per element, and ``!`` where a build's output (param, codes,
scales) differs from the first build's.

Sizes: ``128x256`` fits in L2 (compute cost), ``2048x2048`` streams from memory.
Data ``wide``: normal gradients (moments spread over many octaves of each block's
absmax); ``narrow``: |g| in [0.5, 1] (a few octaves, few table lines touched).

Usage: python benchmarks/kernel_ab.py [SOURCE.c[+FLAG...] ...] [--formats 8bit,fp8]
       [--sizes 128x256,2048x2048] [--data wide] [--threads 1] [--rounds 12] [--show] [--inplace]
       [--rule adamw|amsgrad|lion|momentum|ademamix] [--dtype float32|bfloat16] [--functional]
       [--correct] [--bridge]
       python benchmarks/kernel_ab.py --formats-gate [--threads 2] [--runs 3] [--rounds 7] [--gate-parts quality,phases,steps] [--gate-sizes a,big]
``--correct`` (with ``--dtype bfloat16``, not with ``--functional``): the param is written with its
int8 correction (``param_correction``), the correction compared like the other outputs.
``--formats`` takes ``fp32`` too (plain float32 states).
``--bridge``: the bridge classes (``BRIDGE_CASES``) against ``torch.optim.AdamW(fused=True)`` on
the same params in one process (``bridge_ratios``), with the library built from the one SOURCE
given (default: this checkout's): compare builds by their ratios.
With no source, the library's own source (one build: absolute figures only). ``SOURCE.c+FLAG``
builds that source with extra compiler flags (``cpu.c+-mno-avx512f``: its AVX2 paths).

Per-phase profile of the quantized AdamW step (2026-12-03; a 2-core AVX-512 Xeon VM under other
load, load average 2-4; no hardware counters, and valgrind without AVX-512, so each phase is
timed as a variant: the step without that phase, kernel_ab interleaved, ``128x256`` in L2,
1 thread, in place, min of 11 rounds, ns/element). ``before``: the kernel at fa52c07.

=====================  =====  ======  ================  ==========  ======  ====
format, rule           total  decode  encode (its div)  sqrt + div  maxima  rest
=====================  =====  ======  ================  ==========  ======  ====
8bit AdamW, before     1.64   0.38    0.82 (0.09)
8bit AdamW             1.47   0.25    0.66 (0.14)       0.22        0.03    0.31
4bit AdamW, before     1.59   0.28    0.86
4bit AdamW (blocks)    1.36   0.18    0.61 (0.12)       0.19        0.06    0.32
fp8 AdamW, before      1.43   0.35    0.64
fp8 AdamW              1.33   0.25    0.54 (0.10)       0.18        0.00    0.36
8bit Lion              0.80   0.12    0.34                          0.04    0.30
8bit SGD momentum      0.72   0.14    0.36                          0.03    0.19
=====================  =====  ======  ================  ==========  ======  ====

``rest``: loads and stores of param, gradient and scratch, and the rule's other arithmetic.
Encode (a block's codes from its new values: the division by its scale, the range-table key and
gather, or the e4m3 / 4-bit index, the byte store) is still the largest phase, then the divider
(the rule's sqrt and division and the encoders' divisions: 0.36 of 8-bit AdamW's 1.47), all
ALU-bound. Streamed (``2048x2048``) the same build runs 8bit 1.50, fp8 1.37, 4bit 1.29
ns/element on 1 thread and 8bit 0.88 on 2, where torch's fused fp32 AdamW takes about 0.62
ns/param on 2 threads (5.2 ms for two 2048x2048 params on the machine at load 2: 45 GB/s): the
quantized step is compute-bound, not at the memory floor. The rank-1 4-bit second moment
(AdamW4bit's default) takes two jobs, 0.41 (maxima) + 1.37-1.55 (step) ns/element (2048x2048,
1 thread; before 0.57 + 1.69), and the bfloat16 step with ``param_correction`` spends 0.5 of its
2.06 in the corrected write.

``--formats-gate`` (the gate before building such formats): block formats coded by arithmetic, prototyped in C
(``GATE_C``, the library's flags; not the library's code), checked bit for bit against the same
steps in torch (``mirror_*``: 0 codes or scales differ, both builds), each candidate's step
also timed without one phase (decode, encode, absmax) as above, against the library's ``8bit``
and ``fp8`` steps, a plain float32 AdamW loop (``fp32``: DeepSpeedCPUAdam's 28 bytes a param),
torch's fused AdamW and a bandwidth probe, both ISA builds in one process. Candidates: the
first moment m as ``round(Q f(m / absmax))`` with f = ``sqrt``: sign(x) sqrt|x| (decode
t |t|), ``lin``: x, ``soft``: 2x / (1 + |x|) (FlashOptim's form, decode z / (2 - |z|)); the
second moment through r = sqrt(v), which the rule computes anyway, as ``sqrt``: a linear code of
r / absmax(r) or ``qrt``: of sqrt(r / absmax(r)) (v^(1/4)), zero-free (code >= 1). ``A8``/``A4``:
AdamW, 8-bit (blocks of 256) / 4-bit (blocks of 128, two codes a byte); ``L8``: Lion.

2026-12-04, the same 2-core AVX-512 VM (L3 260 MiB) on a shared, loaded machine, load
average 8-13 at every figure: absolute times are 2-7x the quiet machine's, so ratios only.
``python benchmarks/kernel_ab.py --formats-gate --gate-parts phases,steps --threads 2 --runs 3
--rounds 7`` and the same with ``--threads 1``; medians of the 3 runs. Phases (1 thread,
``128x256`` in L2, min of 56 rounds, ns/element; ``fp32`` the float32 loop):

===================  ======  ======  ======  ======  ====  =========  ======
build, step          total   decode  encode  absmax  rest  current 8bit  fp8
===================  ======  ======  ======  ======  ====  =========  ======
avx512 fp32          0.62                                  1.91       1.62
avx512 A8 sqrt/sqrt  0.95    0.11    0.33    0.12    0.53
avx512 A8 sqrt/qrt   1.17    0.11    0.54    0.10    0.53
avx512 A8 lin/sqrt   0.78    0.06    0.20    0.09    0.53
avx512 A8 soft/sqrt  1.04    0.20    0.30    0.05    0.53
avx512 A4 sqrt/sqrt  1.09    0.11    0.40    0.10    0.56
avx512 A4 sqrt/qrt   1.23    0.14    0.56    0.08    0.56
avx512 L8 sqrt       0.65    0.04    0.23    0.06    0.27
avx2 fp32            0.60                                  2.29       2.26
avx2 A8 sqrt/sqrt    1.15    0.17    0.49    0.12    0.55
avx2 A8 lin/sqrt     0.96    0.11    0.35    0.13    0.56
avx2 A4 sqrt/sqrt    1.21    0.15    0.50    0.13    0.56
avx2 L8 sqrt         0.86    0.05    0.37    0.07    0.33
===================  ======  ======  ======  ======  ====  =========  ======

(the current 8bit and fp8 in this load: 1.91 and 1.62 where the quiet table above has 1.47 and
1.33.) Whole steps, in place, x the fp32 loop of the same build in the same rounds (min of 7
rounds; case (a): two 2048x2048 params as one 4096x2048, 134 MB moved by an 8-bit step, in
L3; ``big``: 4 x 4096x4096 as 16384x4096, 1.07 GB); ``GB/s``: bytes moved over the time, x
torch fused AdamW's in the same rounds; ``floor``: the step's bytes (16 a param for 8-bit
states, 14 for 4-bit and for Lion) at the probe's bandwidth (``a[i] += s b[i]`` over p, g, m,
v), x fp32:

============================  ========  ========  ========  ========  ============================
step, build                   a, 2 thr  big, 2    a, 1 thr  big, 1    big GB/s x torch, 2 / 1 thr
============================  ========  ========  ========  ========  ============================
torch fused, avx512 fp32 ref  1.11      1.01      1.01      1.02      1.00
current 8bit, avx512            1.70      1.72      1.76      1.73      0.34 / 0.34
current fp8, avx512             1.68      1.60      1.77      1.62      0.36 / 0.36
A8 sqrt/sqrt, avx512          0.98      1.01      0.92      0.93      0.61 / 0.63
A8 lin/sqrt, avx512           1.04      0.85      0.86      0.87      0.72 / 0.67
A4 sqrt/sqrt, avx512          0.98      1.04      1.02      0.94      0.51 / 0.54
L8 sqrt, avx512               0.95      0.80      0.72      0.71      0.66 / 0.72
current 8bit, avx2              1.79      1.99      2.24      1.99      0.28 / 0.27
A8 sqrt/sqrt, avx2            1.01      1.04      1.20      1.06      0.54 / 0.55
A4 sqrt/sqrt, avx2            0.95      1.01      1.20      1.03      0.48 / 0.47
L8 sqrt, avx2                 0.87      0.88      0.86      0.84      0.58 / 0.57
floor (8-bit / 4-bit, L8)     0.73/.64  0.67/.59  0.59/.51  0.60/.52
============================  ========  ========  ========  ========  ============================

So the arithmetic codes take 0.55-0.6x the current 8bit step (1.7x faster, both builds), but stay
near the fp32 step (0.92-1.04x, where the target is 0.8x; 0.61x torch fused's bandwidth where it
asks 0.8x): the step is not at its floor. Its compute alone (0.95 ns/element in L2) is 1.5x the
fp32 loop's (0.62): the rest (0.53: the AdamW arithmetic with its sqrt and division, param and
gradient) is the fp32 step's, and decode + encode + absmax add 0.4-0.6; streamed, the time is
compute plus most of the memory time (a 512-element prefetch of param, gradient and codes, as
cpu.c's, changed nothing: 0.90 against 0.90x). Quality (relative RMS error of the AdamW update
with both states quantized; moments of a small MLP after 300 AdamW steps, and of 300 steps of
Student-t(3) gradients with log-normal row and column scales): current 8bit 0.011 / 0.021,
A8 sqrt/sqrt 0.007 / 0.015, sqrt/qrt 0.008 / 0.013, lin/sqrt 0.007 / 0.028, soft/sqrt 0.006 /
0.018; current 4bit (block-wise) 0.15 / 0.34, A4 sqrt/sqrt 0.125 / 0.23, sqrt/qrt 0.13 / 0.21.
Against the targets (8-bit AdamW <= 0.8x the fp32 step, bandwidth >= 0.8x torch fused's, 4-bit <= 0.8x, Lion/SGD <= 0.65x, bf16 + correction <= 1.0x) (x fp32 above; the results page's figures scaled by the phases where
a step was not prototyped): 8-bit AdamW <= 0.8x: 0.92-1.04x (its compute alone 0.95 / 0.62 of
the fp32 loop's compute; 0.64x of the quiet page's DeepSpeedCPUAdam, 1.48 thread-ns/param, only
if memory time hid wholly behind it); bandwidth >= 0.8x torch fused's: 0.61-0.63x; 4-bit <=
0.8x: 0.94-1.04x; Lion <= 0.65x: 0.71-0.95x (the page's 0.89x x 0.65 / 0.80 = 0.72x); AdamW +
``param_correction`` on bf16 <= 1.0x: about 1.4x (the page's 2.06x less the corrected write's
0.5, times 0.58, plus 0.5). None is met by the prototype.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import lowbit_tree as lt
from lowbit_tree.kernels import StepLeaf, StepSpec, run_step, step_hyperparams
from lowbit_tree.kernels import native as KC
from lowbit_tree.kernels.spec import job_row_index
from lowbit_tree.kernels.tables import cpu_code_table

RULES = {
    "adamw": StepSpec("adam", decay=True, lr=True),
    "amsgrad": StepSpec("adam", amsgrad=True, decay=True, lr=True),
    "lion": StepSpec("lion", decay=True, lr=True),
    "momentum": StepSpec("momentum", lr=True),
    "ademamix": StepSpec("ademamix", decay=True, lr=True),
}


def build(source: Path, outdir: Path, extra: tuple = ()):
    """Compile ``source`` like the library does (its flags, its generated header, plus ``extra``
    flags) and load it."""
    key = hashlib.sha256(source.read_bytes() + " ".join(extra).encode()).hexdigest()[:12]
    so = outdir / f"ab_{key}.so"
    try:  # without the AMD option if the compiler rejects it (GCC-only)
        KC._build(KC._compiler(), KC._FLAGS + (KC._AMD_FLAGS if KC._is_amd() else []) + list(extra), so, source)
    except KC.BuildError as e:
        raise RuntimeError(f"could not build {source}: {e}") from e
    lib = ctypes.CDLL(str(so))
    lib.lbt_step_jobs.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.lbt_step_jobs.restype = None
    lib.lbt_prepare.argtypes = [ctypes.POINTER(KC._Format)]
    lib.lbt_prepare.restype = ctypes.c_int
    lib.formats = {}
    return lib


def lib_format(lib, name: str) -> int:
    """Address of ``name``'s format struct prepared by ``lib`` itself, so that
    builds whose tables differ in content each get their own (the struct's
    fields are this checkout's ``native._Format``)."""
    if name not in lib.formats:
        fmt, tab = lt.formats.FORMATS[name], cpu_code_table(name)
        st = KC._Format(
            fmt.bits, int(fmt.signed), int(fmt.sqrt), int(fmt.float8), float(fmt.scale_divisor), tab.last,
            tab.decode.data_ptr(), tab.encode.data_ptr(), tab.thresholds.data_ptr(), None,
        )
        if lib.lbt_prepare(ctypes.byref(st)) != 0:
            raise RuntimeError(f"lbt_prepare of this build rejected {name}")
        lib.formats[name] = st
    return ctypes.addressof(lib.formats[name])


def make_case(spec: StepSpec, state_format: str, rows: int, cols: int, data: str, dtype: torch.dtype):
    """Inputs after a few real steps (non-trivial states), fixed for every call."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(rows, cols, generator=gen).to(dtype)
    g = torch.randn(rows, cols, generator=gen) * 1e-2
    if data == "narrow":
        g = (torch.rand(rows, cols, generator=gen) * 0.5 + 0.5) * g.sign() * 1e-2
    g = g.to(dtype)
    if state_format == "fp32":  # plain float32 states
        states = tuple(torch.zeros(rows, cols) for _ in spec.signed)
    else:
        states = tuple(lt.zeros(p.shape, state_format, signed=s) for s in spec.signed)
    extra = dict(b3=0.9999, alpha=5.0) if spec.rule == "ademamix" else {}
    hyper = step_hyperparams(spec, count=3, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, **extra)
    for _ in range(5):
        run_step(spec, hyper, [StepLeaf(p, g, states)], write=True, inplace=True, backend="native")
    return p, g, states, hyper


BRIDGE_CASES = ("AdamW8bit", "AdamW4bit", "AdamWFp8", "Lion8bit", "SGD8bit", "AdamW8bit+correction bf16")


def bridge_ratios(source, threads: int, rounds: int, n: int = 2048) -> int:
    """The bridge's step against ``torch.optim.AdamW(fused=True)`` (fp32 states; about
    DeepSpeedCPUAdam's time on the same params), both on two ``n x n`` params in one process,
    timed in interleaved rounds of 5 steps: per class its median ms and its ratio to the fused
    step's median (bfloat16 rows: to the fused step on the same bfloat16 params). ``source``:
    the C source the bridge's library is built from (default: this checkout's), so that builds
    compare by their ratios, each from its own run."""
    import bridge

    if source is not None:
        KC._SOURCE = Path(source)  # before the library's first use: built from this source
    if not KC.available():
        print("native CPU kernels unavailable")
        return 1
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)

    def params(dtype):
        ps = [torch.nn.Parameter(torch.randn(n, n, generator=gen).to(dtype)) for _ in range(2)]
        for p in ps:
            p.grad = (torch.randn(n, n, generator=gen) * 1e-2).to(dtype)
        return ps

    opts = {"torch fused": torch.optim.AdamW(params(torch.float32), lr=1e-3, fused=True),
            "torch fused bf16": torch.optim.AdamW(params(torch.bfloat16), lr=1e-3, fused=True)}
    for name in BRIDGE_CASES:
        if name == "AdamW8bit+correction bf16":
            opts[name] = bridge.AdamW8bit(params(torch.bfloat16), lr=1e-3, param_correction=True)
        elif name == "SGD8bit":
            opts[name] = bridge.SGD8bit(params(torch.float32), lr=1e-3, momentum=0.9)
        else:
            opts[name] = getattr(bridge, name)(params(torch.float32), lr=1e-3)
    for opt in opts.values():
        for _ in range(3):
            opt.step()
    ms: dict = {k: [] for k in opts}
    for _ in range(rounds):
        for k, opt in opts.items():
            t0 = time.perf_counter()
            for _ in range(5):
                opt.step()
            ms[k].append((time.perf_counter() - t0) / 5 * 1e3)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"{KC._SOURCE}, {threads} thread(s), two {n}x{n} params, median of {rounds} rounds of 5 steps")
    for k, m in med.items():
        ref = med["torch fused bf16" if k.endswith("bf16") else "torch fused"]
        print(f"{k:28s} {m:8.2f} ms {m / ref:6.2f}x {m * 1e6 / (2 * n * n):6.2f} ns/param")
    return 0


# ----------------------------------------------------------------------------- --formats-gate
# The formats gate: block formats coded by arithmetic (the block's absmax, a multiply by its
# reciprocal scale, a companding function, a round to nearest even, a store; decoding the
# inverse), prototyped here in C with the library's flags, timed against the library's own
# ``8bit`` and ``fp8`` steps, and measured for quality by GATE_MIRROR (the same math in torch).
GATE_C = r"""/* kernel_ab --formats-gate: arithmetic-coded block formats, a timing prototype (not the library's). */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAGIC 12582912.0f /* 1.5 * 2^23: (y + MAGIC) - MAGIC is y rounded to nearest even, |y| < 2^22 */
static inline int32_t f2i(float x) { int32_t i; memcpy(&i, &x, 4); return i; }
static inline float i2f(int32_t i) { float x; memcpy(&x, &i, 4); return x; }
static inline float rne(float y) { return (y + MAGIC) - MAGIC; }

enum { M_LIN = 0, M_SQRT = 1, M_SOFT = 2 };   /* first-moment companders (signed) */
enum { V_SQRT = 0, V_QRT = 1 };               /* second moment: linear code of sqrt(v), or of v^(1/4) */
enum { R_ADAM = 0, R_LION = 1 };

typedef struct { float b1, omb1, b2, omb2, rbc1, rsbc2, eps, nlr, wd; } hyp;
#define MAXB 512

/* One thread's blocks [b0, b1) of B elements: decode (DEC), rule, absmax (AMAX), encode (ENC);
 * a phase left out is replaced by what costs nothing (constant states, fixed scales, no store). */
static inline __attribute__((always_inline)) void step_blocks(
    int64_t b0, int64_t b1, int64_t B, float *restrict p, const float *restrict g,
    uint8_t *restrict mc, float *restrict ms, uint8_t *restrict vc, float *restrict vs, const hyp *H,
    const int RULE, const int BITS, const int MF, const int VF, const int DEC, const int ENC, const int AMAX) {
    const float QM = BITS == 8 ? 127.0f : 7.0f, QV = BITS == 8 ? 255.0f : 15.0f;
    const float b1_ = H->b1, omb1 = H->omb1, b2 = H->b2, omb2 = H->omb2, rbc1 = H->rbc1, rsbc2 = H->rsbc2;
    const float eps = H->eps, nlr = H->nlr, wd = H->wd;
    float bm[MAXB], bv[MAXB];
    int8_t um[MAXB];
    uint8_t uv[MAXB];
    for (int64_t b = b0; b < b1; b++) {
        const int64_t o = b * B;
        float *restrict pb = p + o;
        const float *restrict gb = g + o;
        const int8_t *restrict cm;
        const uint8_t *restrict cv;
        if (BITS == 8) {
            cm = (const int8_t *)mc + o, cv = vc + o;
        } else { /* nibbles: the even element low; signed m as c + 8 */
            const uint8_t *restrict pm = mc + o / 2, *restrict pv = vc + o / 2;
            for (int64_t j = 0; j < B / 2; j++) {
                um[2 * j] = (int8_t)((pm[j] & 15) - 8), um[2 * j + 1] = (int8_t)((pm[j] >> 4) - 8);
                uv[2 * j] = pv[j] & 15, uv[2 * j + 1] = pv[j] >> 4;
            }
            cm = um, cv = uv;
        }
        const float sm = ms[b], sv = vs[b];
        int32_t am = 0, av = 0;
        for (int64_t k = 0; k < B; k++) {
            const float gi = gb[k];
            float m0, v0 = 0.0f;
            if (DEC) {
                const float t = (float)cm[k];
                if (MF == M_LIN) m0 = t * sm;
                else if (MF == M_SQRT) m0 = (t * fabsf(t)) * sm;
                else { const float z = t * (1.0f / QM); m0 = (z / (2.0f - fabsf(z))) * sm; }
                if (RULE == R_ADAM) {
                    const float w = (float)cv[k];
                    const float r = VF == V_SQRT ? w * sv : (w * w) * sv; /* sqrt(v0) */
                    v0 = r * r;
                }
            } else {
                m0 = 0.5f * gi, v0 = gi * gi;
            }
            float u, mn, rn = 0.0f;
            if (RULE == R_ADAM) {
                mn = b1_ * m0 + omb1 * gi;
                const float v = b2 * v0 + omb2 * (gi * gi);
                rn = sqrtf(v);
                u = (mn * rbc1) / (rn * rsbc2 + eps);
            } else {
                const float c = b1_ * m0 + omb1 * gi;
                u = (float)((c > 0.0f) - (c < 0.0f));
                mn = b2 * m0 + omb2 * gi;
            }
            pb[k] = pb[k] + nlr * (u + wd * pb[k]);
            bm[k] = mn;
            if (RULE == R_ADAM) bv[k] = rn;
            if (AMAX) {
                const int32_t a = f2i(mn) & 0x7FFFFFFF, c = f2i(rn) & 0x7FFFFFFF;
                am = a > am ? a : am;
                av = c > av ? c : av;
            }
        }
        /* the block's scales: one division each (NaN / inf absmax -> NaN scale) */
        float A = AMAX ? i2f(am) : 1.0f, S = AMAX ? i2f(av) : 1.0f;
        A = am >= 0x7F800000 ? NAN : (A > 0.0f ? A : 1.0f);
        S = av >= 0x7F800000 ? NAN : (S > 0.0f ? S : 1.0f);
        const float rm = MF == M_LIN ? QM / A : (MF == M_SQRT ? (QM * QM) / A : 1.0f / A);
        const float rv = VF == V_SQRT ? QV / S : (QV * QV) / S;
        ms[b] = MF == M_LIN ? A / QM : (MF == M_SQRT ? A / (QM * QM) : A);
        if (RULE == R_ADAM) vs[b] = VF == V_SQRT ? S / QV : S / (QV * QV);
        if (!ENC) continue;
        for (int64_t k = 0; k < B; k++) {
            const float x = bm[k];
            float y;
            if (MF == M_LIN) y = x * rm;
            else if (MF == M_SQRT) y = copysignf(sqrtf(fabsf(x) * rm), x);
            else { const float q = x * rm; y = ((2.0f * q) / (1.0f + fabsf(q))) * QM; }
            um[k] = (int8_t)(int32_t)rne(y);
            if (RULE == R_ADAM) {
                const float z = bv[k] * rv;
                const int32_t c = (int32_t)rne(VF == V_SQRT ? z : sqrtf(z));
                uv[k] = (uint8_t)(c > 1 ? c : 1); /* zero-free: v never decodes to 0 */
            }
        }
        if (BITS == 8) {
            memcpy(mc + o, um, B);
            if (RULE == R_ADAM) memcpy(vc + o, uv, B);
        } else {
            uint8_t *restrict pm = mc + o / 2, *restrict pv = vc + o / 2;
            for (int64_t j = 0; j < B / 2; j++) {
                pm[j] = (uint8_t)((um[2 * j] + 8) | ((um[2 * j + 1] + 8) << 4));
                if (RULE == R_ADAM) pv[j] = (uint8_t)(uv[2 * j] | (uv[2 * j + 1] << 4));
            }
        }
    }
}

#define ARGS int64_t b0, int64_t b1, int64_t B, float *p, const float *g, uint8_t *mc, float *ms, uint8_t *vc, \
             float *vs, const hyp *H
#define PASS b0, b1, B, p, g, mc, ms, vc, vs, H
typedef void (*step_fn)(ARGS);
/* each candidate in 5 variants: full, no decode, no encode, no absmax, none of the three */
#define CAND(N, RULE, BITS, MF, VF) \
    static void N##_0(ARGS) { step_blocks(PASS, RULE, BITS, MF, VF, 1, 1, 1); } \
    static void N##_1(ARGS) { step_blocks(PASS, RULE, BITS, MF, VF, 0, 1, 1); } \
    static void N##_2(ARGS) { step_blocks(PASS, RULE, BITS, MF, VF, 1, 0, 1); } \
    static void N##_3(ARGS) { step_blocks(PASS, RULE, BITS, MF, VF, 1, 1, 0); } \
    static void N##_4(ARGS) { step_blocks(PASS, RULE, BITS, MF, VF, 0, 0, 0); }
#define ROW(N) {N##_0, N##_1, N##_2, N##_3, N##_4}
CAND(c0, R_ADAM, 8, M_SQRT, V_SQRT)
CAND(c1, R_ADAM, 8, M_SQRT, V_QRT)
CAND(c2, R_ADAM, 8, M_LIN, V_SQRT)
CAND(c3, R_ADAM, 8, M_SOFT, V_SQRT)
CAND(c4, R_ADAM, 4, M_SQRT, V_QRT)
CAND(c5, R_ADAM, 4, M_SQRT, V_SQRT)
CAND(c6, R_LION, 8, M_SQRT, V_SQRT)
static const step_fn CANDS[][5] = {ROW(c0), ROW(c1), ROW(c2), ROW(c3), ROW(c4), ROW(c5), ROW(c6)};
int gate_ncands(void) { return (int)(sizeof CANDS / sizeof CANDS[0]); }

/* One step of candidate `cand` (variant `var`) over n elements (a multiple of B), in place. */
void gate_step(int cand, int var, int64_t n, int64_t B, float *p, const float *g, uint8_t *mc, float *ms,
               uint8_t *vc, float *vs, const float *h, int nt) {
    const hyp H = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8]};
    const step_fn fn = CANDS[cand][var];
    const int64_t nb = n / B;
#pragma omp parallel num_threads(nt)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), T = omp_get_num_threads();
#endif
        fn(nb * t / T, nb * (t + 1) / T, B, p, g, mc, ms, vc, vs, &H);
    }
}

/* Plain float32 AdamW (DeepSpeedCPUAdam's work: 28 bytes a param), in place. */
void gate_fp32_adamw(int64_t n, float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                     const float *h, int nt) {
    const float b1 = h[0], omb1 = h[1], b2 = h[2], omb2 = h[3], rbc1 = h[4], rsbc2 = h[5], eps = h[6];
    const float nlr = h[7], wd = h[8];
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i], mn = b1 * m[i] + omb1 * gi, vn = b2 * v[i] + omb2 * (gi * gi);
        m[i] = mn, v[i] = vn;
        p[i] = p[i] + nlr * ((mn * rbc1) / (sqrtf(vn) * rsbc2 + eps) + wd * p[i]);
    }
}

/* The bandwidth probe: a[i] += s * b[i] in place (two streams read, one written back to lines
 * already read: the step's access pattern, no write-allocate), 12 bytes an element. */
void gate_probe(int64_t n, float *restrict a, const float *restrict b, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < n; i++) a[i] = a[i] + 1e-7f * b[i];
}
"""

# (name, rule, bits, block, m compander, v compander): GATE_C's CANDS, in order
GATE_CANDS = (
    ("A8 m:sqrt v:sqrt", "adam", 8, 256, "sqrt", "sqrt"),
    ("A8 m:sqrt v:qrt", "adam", 8, 256, "sqrt", "qrt"),
    ("A8 m:lin v:sqrt", "adam", 8, 256, "lin", "sqrt"),
    ("A8 m:soft v:sqrt", "adam", 8, 256, "soft", "sqrt"),
    ("A4 m:sqrt v:qrt", "adam", 4, 128, "sqrt", "qrt"),
    ("A4 m:sqrt v:sqrt", "adam", 4, 128, "sqrt", "sqrt"),
    ("L8 m:sqrt", "lion", 8, 256, "sqrt", None),
)
GATE_PHASES = ("full", "-decode", "-encode", "-absmax", "-all three")
GATE_HYPER = dict(count=3, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


def build_gate(outdir: Path, extra: tuple = ()):
    """GATE_C compiled with the library's flags (plus ``extra``) and loaded."""
    outdir.mkdir(parents=True, exist_ok=True)
    src = outdir / f"gate{'_'.join(extra).replace('-', '')}.c"
    src.write_text(GATE_C)
    so = src.with_suffix(".so")
    KC._build(KC._compiler(), KC._FLAGS + list(extra), so, src)
    lib = ctypes.CDLL(str(so))
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gate_step.argtypes = [i32, i32, i64, i64, vp, vp, vp, vp, vp, vp, vp, i32]
    lib.gate_fp32_adamw.argtypes = [i64, vp, vp, vp, vp, vp, i32]
    lib.gate_probe.argtypes = [i64, vp, vp, i32]
    for f in (lib.gate_step, lib.gate_fp32_adamw, lib.gate_probe):
        f.restype = None
    assert lib.gate_ncands() == len(GATE_CANDS)
    return lib


def gate_hyper(rule: str) -> torch.Tensor:
    """GATE_C's hyperparameters: b1, 1-b1, b2, 1-b2, 1/bc1, 1/sqrt(bc2), eps, -lr, wd (the library's
    values for AdamW, or Lion's)."""
    h = step_hyperparams(RULES["adamw" if rule == "adam" else "lion"], **GATE_HYPER)[:9].clone()
    h[7] = -h[7]
    return h.contiguous()


def _q(bits):
    return (127.0, 255.0) if bits == 8 else (7.0, 15.0)


def _f32(x):
    return torch.tensor(x, dtype=torch.float32)


def _div(a, b):
    """a / b elementwise, b as a full tensor: torch divides by a scalar as a multiply by its
    reciprocal, which is not C's division"""
    a, b = torch.broadcast_tensors(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32))
    return a.contiguous() / b.contiguous()


def _sqrt(x):
    """correctly rounded float32 sqrt (eager CPU torch.sqrt(float32) is not)"""
    return torch.sqrt(x.double()).float()


def mirror_encode_m(x: torch.Tensor, comp: str, bits: int):
    """GATE_C's first-moment encoder in torch (the same float32 operations): rows of one block ->
    (integer codes -Q..Q, decode multiplier of each block)."""
    qm = _f32(_q(bits)[0])
    am = x.abs().amax(1, keepdim=True)  # (NaN handling not mirrored: finite inputs only)
    a = torch.where(am > 0, am, _f32(1.0))
    if comp == "lin":
        rm, s = _div(qm, a), _div(a, qm)
        y = x * rm
    elif comp == "sqrt":
        rm, s = _div(qm * qm, a), _div(a, qm * qm)
        y = torch.copysign(_sqrt(x.abs() * rm), x)
    else:
        rm, s = _div(1.0, a), a
        q = x * rm
        y = _div(2.0 * q, 1.0 + q.abs()) * qm
    return torch.round(y), s


def mirror_decode_m(c: torch.Tensor, s: torch.Tensor, comp: str, bits: int):
    if comp == "lin":
        return c * s
    if comp == "sqrt":
        return (c * c.abs()) * s
    z = c * _div(1.0, _q(bits)[0])
    return _div(z, 2.0 - z.abs()) * s


def mirror_encode_v(r: torch.Tensor, comp: str, bits: int):
    """The second moment's encoder, on r = sqrt(v): codes 1..Q (zero-free), decode multipliers."""
    qv = _f32(_q(bits)[1])
    am = r.amax(1, keepdim=True)
    a = torch.where(am > 0, am, _f32(1.0))
    if comp == "sqrt":
        rv, s = _div(qv, a), _div(a, qv)
        y = r * rv
    else:
        rv, s = _div(qv * qv, a), _div(a, qv * qv)
        y = _sqrt(r * rv)
    return torch.round(y).clamp(min=1.0), s


def mirror_decode_v(c: torch.Tensor, s: torch.Tensor, comp: str):
    """codes -> v (through sqrt(v), as GATE_C decodes)"""
    r = c * s if comp == "sqrt" else (c * c) * s
    return r * r


def gate_check_bits(lib, nt: int = 2) -> int:
    """Two steps of each AdamW candidate through GATE_C against GATE_MIRROR's same steps in torch
    from the same codes: the count of code bytes and scales that differ (0: the same bits)."""
    gen = torch.Generator().manual_seed(3)
    bad = 0
    for ci, (name, rule, bits, B, mf, vf) in enumerate(GATE_CANDS):
        if rule != "adam":
            continue
        n = 64 * B
        p = torch.randn(n, generator=gen)
        h = gate_hyper(rule)
        b1, omb1, b2, omb2, rbc1, rsbc2, eps, nlr, wd = h.tolist()
        cm, cv = torch.zeros(n * bits // 8, dtype=torch.uint8), torch.zeros(n * bits // 8, dtype=torch.uint8)
        if bits == 8:
            cm.fill_(0)
            cv.fill_(1)
        else:
            cm.fill_(0x88)
            cv.fill_(0x11)
        sm, sv = torch.zeros(n // B), torch.zeros(n // B)
        qm, qv = torch.zeros(n // B, B), torch.ones(n // B, B)
        pm, ps = sm.view(-1, 1).clone(), sv.view(-1, 1).clone()
        for _ in range(2):
            g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2) * 1e-2
            lib.gate_step(ci, 0, n, B, p.data_ptr(), g.data_ptr(), cm.data_ptr(), sm.data_ptr(), cv.data_ptr(),
                          sv.data_ptr(), h.data_ptr(), nt)
            g2 = g.view(-1, B)
            m0, v0 = mirror_decode_m(qm, pm, mf, bits), mirror_decode_v(qv, ps, vf)
            m = _f32(b1) * m0 + _f32(omb1) * g2
            r = _sqrt(_f32(b2) * v0 + _f32(omb2) * (g2 * g2))
            qm, pm = mirror_encode_m(m, mf, bits)
            qv, ps = mirror_encode_v(r, vf, bits)
            if bits == 8:
                got_m, got_v = cm.view(torch.int8).view(-1, B).float(), cv.view(-1, B).float()
            else:
                got_m = torch.stack([(cm & 15).int() - 8, (cm >> 4).int() - 8], 1).view(-1, B).float()
                got_v = torch.stack([cv & 15, cv >> 4], 1).view(-1, B).float()
            bad += int((got_m != qm).sum() + (got_v != qv).sum() + (sm != pm.view(-1)).sum() + (sv != ps.view(-1)).sum())
    return bad


def gate_moments(seed: int = 0):
    """Adam moments to quantize: (name, m, v, step) from 300 AdamW steps of a small MLP
    (teacher-student regression) and from 300 steps of heavy-tailed gradients (Student t, 3
    degrees of freedom, log-normal row and column scales)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    teacher = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(300):
        x = torch.randn(128, 256, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for i, w in ((0, model[0].weight), (2, model[2].weight)):
        st = opt.state[w]
        out.append((f"MLP layer {i} {tuple(w.shape)}", st["exp_avg"].clone(), st["exp_avg_sq"].clone(), 300))
    rs = torch.exp(torch.randn(256, 1, generator=gen))
    cs = torch.exp(torch.randn(1, 1024, generator=gen) * 0.5)
    td = torch.distributions.StudentT(torch.tensor(3.0))
    torch.manual_seed(seed)
    m, v = torch.zeros(256, 1024), torch.zeros(256, 1024)
    for _ in range(300):
        g = td.sample((256, 1024)) * rs * cs * 1e-3
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=1e-3)
    out.append(("heavy-tailed t3 (256, 1024)", m, v, 300))
    return out


def gate_quality() -> list:
    """Relative RMS error of m, of v and of the AdamW update m^/(sqrt(v^)+eps) with both states
    quantized, per format (GATE_MIRROR's candidates; the library's 8bit, 4bit (block-wise) and
    fp8), on each of gate_moments."""
    rows = []
    fmts = [(n, b, B, mf, vf) for n, r, b, B, mf, vf in GATE_CANDS if r == "adam"]
    fmts += [("A8 m:cbrt v:qrt (py only)", 8, 256, "cbrt", "qrt")]
    for src, m, v, t in gate_moments():
        bc1, bc2 = 1 - 0.9 ** t, 1 - 0.999 ** t

        def upd(mm, vv):
            return (mm / bc1) / (torch.sqrt(vv / bc2) + 1e-8)

        u = upd(m, v)

        def rel(a, b):
            return float((a - b).norm() / b.norm())

        res = {}
        for name in ("8bit", "4bit", "fp8"):
            fm = lt.formats.STATE_FORMATS[name]
            qm = lt.dequantize(lt.quantize(m, fm[0]))
            qv = lt.dequantize(lt.quantize(v, fm[1]))
            res[f"current {name}"] = (qm, qv)
        for name, bits, B, mf, vf in fmts:
            mb, vb = m.reshape(-1, B), v.reshape(-1, B)
            if mf == "cbrt":  # sign(x) |x|^(1/3) (needs a cube root to encode: not in GATE_C)
                qmax = _f32(127.0)
                a = mb.abs().amax(1, keepdim=True).clamp_min(1e-30)
                c = torch.round(torch.sign(mb) * (mb.abs() / a) ** (1 / 3) * qmax)
                qm = ((c / qmax) ** 3 * a).reshape(m.shape)
            else:
                c, s = mirror_encode_m(mb, mf, bits)
                qm = mirror_decode_m(c, s, mf, bits).reshape(m.shape)
            c, s = mirror_encode_v(torch.sqrt(vb), vf, bits)
            res[name] = (qm, mirror_decode_v(c, s, vf).reshape(v.shape))
        for name, (qm, qv) in res.items():
            rows.append((src, name, rel(qm, m), rel(qv, v), rel(upd(qm, qv), u)))
    return rows


def _lib_step(lib, sf: str, p: torch.Tensor, g: torch.Tensor, rows: int, cols: int):
    """The library's AdamW step on (rows, cols), param p updated in place, its states ``sf`` (in
    place): a callable that takes the thread count."""
    spec = RULES["adamw"]
    hyper = step_hyperparams(spec, **GATE_HYPER)
    states = tuple(lt.zeros((rows, cols), sf, signed=s) for s in spec.signed)
    sts = tuple(KC.NativeState(s.codes.view(torch.uint8), s.codes.view(torch.uint8), s.scale, s.scale, s.format,
                               s.block_size) for s in states)
    pv, gv = p.view(rows, cols), g.view(rows, cols)
    row = KC.job_row(KC.NativeJob(rows, cols, pv, gv, pv, spec, True, False, 0, hyper, sts, None))
    for i, s in enumerate(states):
        row[job_row_index("f", i)] = lib_format(lib, s.format)
    table = torch.tensor(row)
    keep = (states, sts, hyper, table)
    return lambda nt, _k=keep: lib.lbt_step_jobs(1, _k[3].data_ptr(), nt)


def _timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in __import__("os").getloadavg())


def formats_gate(args) -> int:
    """--formats-gate: the bits check, the quality proxy, the per-phase profile (1 thread, in L2) and
    the whole steps (``--threads``, case (a) and a case over the last-level cache) with the
    bandwidth probe, for the AVX-512 build and the AVX2 one (``-mno-avx512f``) in one process."""
    if not KC.available():
        print("native CPU kernels unavailable (no working C compiler)")
        return 1
    isas = [("avx512", ()), ("avx2", ("-mno-avx512f",))]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        gates = {k: build_gate(Path(tmp), e) for k, e in isas}
        libs = {k: build(KC._SOURCE, Path(tmp), e) for k, e in isas}
        for k, gl in gates.items():
            print(f"bits: {k} build against the torch mirror: {gate_check_bits(gl)} codes or scales differ")
        if "quality" in args.gate_parts:
            print("\nquality: relative RMS error (m, v, AdamW update with both quantized)")
            for src, name, em, ev, eu in gate_quality():
                print(f"  {src:28s} {name:28s} m {em:.4f}  v {ev:.4f}  update {eu:.4f}")
        for run in range(args.runs):
            if "phases" in args.gate_parts:
                _gate_phases(gates, libs, args, run)
            if "steps" in args.gate_parts:
                _gate_steps(gates, libs, args, run)
    return 0


def _gate_phases(gates, libs, args, run):
    """Each candidate's step in its five variants (GATE_PHASES), and the library's 8bit and fp8
    steps, 1 thread on 128x256 (in L2), interleaved rounds: ns/element, min over the rounds."""
    rows, cols = 128, 256
    n = rows * cols
    gen = torch.Generator().manual_seed(0)
    cfgs = []
    for isa in gates:
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
        for ci, (name, rule, bits, B, mf, vf) in enumerate(GATE_CANDS):
            cm, cv = torch.zeros(n * bits // 8, dtype=torch.uint8), torch.ones(n * bits // 8, dtype=torch.uint8)
            sm, sv, h = torch.zeros(n // B), torch.zeros(n // B), gate_hyper(rule)
            for var in range(len(GATE_PHASES)):
                def fn(ci=ci, var=var, B=B, t=(p, g, cm, sm, cv, sv, h), gl=gates[isa]):
                    gl.gate_step(ci, var, n, B, *(x.data_ptr() for x in t), 1)
                for _ in range(3):
                    fn()
                cfgs.append(dict(key=(isa, name, GATE_PHASES[var]), fn=fn, ns=[]))
        for sf in ("8bit", "fp8"):
            st = _lib_step(libs[isa], sf, p, g, rows, cols)
            cfgs.append(dict(key=(isa, f"current {sf}", "full"), fn=lambda st=st: st(1), ns=[]))
        m, v, h = torch.zeros(n), torch.zeros(n), gate_hyper("adam")
        cfgs.append(dict(key=(isa, "fp32 AdamW loop", "full"), ns=[],
                         fn=lambda t=(p, g, m, v, h), gl=gates[isa]: gl.gate_fp32_adamw(n, *(x.data_ptr() for x in t), 1)))
    calls = max(1, int(2.5e5 // n))  # short windows: some fall between the other processes' slices
    rounds = 8 * args.rounds  # cheap: 1 thread in L2
    for _ in range(rounds):
        for c in cfgs:
            c["ns"].append(_timed(c["fn"], calls) / n * 1e9)
    print(f"\nphases, run {run + 1}: ns/element, 1 thread, {rows}x{cols} (in L2), min of {rounds} rounds; "
          f"{_load()}")
    print(f"  {'isa':7s}{'format':22s}" + "".join(f"{h:>9s}" for h in ("total", "decode", "encode", "absmax", "rest")))
    res = {c["key"]: min(c["ns"]) for c in cfgs}
    for isa in gates:
        for name in [c[0] for c in GATE_CANDS] + ["current 8bit", "current fp8", "fp32 AdamW loop"]:
            t = res[(isa, name, "full")]
            if name.startswith("current") or name.startswith("fp32"):
                print(f"  {isa:7s}{name:22s}{t:9.2f}")
                continue
            d, e, a, r = (t - res[(isa, name, "-decode")], t - res[(isa, name, "-encode")],
                          t - res[(isa, name, "-absmax")], res[(isa, name, "-all three")])
            print(f"  {isa:7s}{name:22s}{t:9.2f}{d:9.2f}{e:9.2f}{a:9.2f}{r:9.2f}")


GATE_SIZES = {"a": (2 * 2048, 2048), "big": (4 * 4096, 4096)}


def _gate_steps(gates, libs, args, run):
    """Whole steps, ``args.threads`` threads, in place, interleaved rounds, on each of GATE_SIZES:
    the candidates' full steps, the library's 8bit and fp8 AdamW, GATE_C's fp32 AdamW loop (the
    DeepSpeedCPUAdam stand-in), torch's fused AdamW and the bandwidth probe; ms a step, median of
    the rounds, each against the fp32 loop of its build."""
    nt = args.threads
    for case in args.gate_sizes.split(","):
        rows, cols = GATE_SIZES[case]
        n = rows * cols
        gen = torch.Generator().manual_seed(0)
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
        m, v = torch.zeros(n), torch.zeros(n)
        h = gate_hyper("adam")
        cfgs = []
        step_t = torch.tensor(3.0)
        cfgs.append(dict(key=("torch", "torch fused AdamW"), bpp=28.0,
                         fn=lambda: torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=1e-3, beta1=0.9,
                                                        beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                                                        maximize=False)))
        for isa, gl in gates.items():
            cfgs.append(dict(key=(isa, "fp32 AdamW loop"), bpp=28.0,
                             fn=lambda gl=gl: gl.gate_fp32_adamw(n, p.data_ptr(), g.data_ptr(), m.data_ptr(),
                                                                 v.data_ptr(), h.data_ptr(), nt)))
            cfgs.append(dict(key=(isa, "probe"), bpp=24.0,  # two passes of 12 bytes an element
                             fn=lambda gl=gl: (gl.gate_probe(n, m.data_ptr(), v.data_ptr(), nt),
                                               gl.gate_probe(n, p.data_ptr(), g.data_ptr(), nt))))
            for sf in ("8bit", "fp8"):
                st = _lib_step(libs[isa], sf, p, g, rows, cols)
                cfgs.append(dict(key=(isa, f"current {sf}"), bpp=16.0, fn=lambda st=st: st(nt)))
            for ci, (name, rule, bits, B, mf, vf) in enumerate(GATE_CANDS):
                nb = n * bits // 8
                cm = torch.zeros(nb, dtype=torch.uint8)
                cv = torch.ones(nb, dtype=torch.uint8) if rule == "adam" else cm
                sm, sv, hh = torch.zeros(n // B), torch.zeros(n // B), gate_hyper(rule)
                bpp = 12.0 + (2 if rule == "adam" else 1) * 2 * bits / 8
                cfgs.append(dict(key=(isa, name), bpp=bpp,
                                 fn=lambda ci=ci, B=B, gl=gl, t=(p, g, cm, sm, cv, sv, hh):
                                 gl.gate_step(ci, 0, n, B, *(x.data_ptr() for x in t), nt)))
        for c in cfgs:
            c["ms"] = []
            for _ in range(2):
                c["fn"]()
        calls = max(1, int(3e7 // n))
        for _ in range(args.rounds):
            for c in cfgs:
                c["ms"].append(_timed(c["fn"], calls) * 1e3)
        for stat in (min, statistics.median):
            _gate_step_table(cfgs, {c["key"]: stat(c["ms"]) for c in cfgs}, rows, cols, nt,
                             f"{stat.__name__} of {args.rounds} rounds", run)


def _gate_step_table(cfgs, med, rows, cols, nt, how, run):
    """One table of _gate_steps: ``med`` each step's ms (a statistic of its rounds)."""
    n = rows * cols
    print(f"\nsteps, run {run + 1}: {rows}x{cols} ({n / 1e6:.1f}M elements), {nt} threads, {how}; {_load()}")
    print(f"  {'isa':7s}{'step':22s}{'ms':>8s}{'ns/el':>8s}{'B/el':>6s}{'GB/s':>7s}{'x fp32':>8s}"
          f"{'x torch':>8s}{'GB/s x torch':>13s}{'floor x fp32':>13s}")
    tf = med[("torch", "torch fused AdamW")]
    for c in cfgs:
        isa, name = c["key"]
        t = med[c["key"]]
        ref = med[(isa if isa != "torch" else "avx512", "fp32 AdamW loop")]
        bw_probe = 24.0 * n / (med[(isa if isa != "torch" else "avx512", "probe")] * 1e-3)
        floor = c["bpp"] * n / bw_probe * 1e3  # ms at the probe's bandwidth
        gbs = c["bpp"] * n / (t * 1e-3) / 1e9
        print(f"  {isa:7s}{name:22s}{t:8.2f}{t * 1e6 / n:8.3f}{c['bpp']:6.1f}{gbs:7.1f}{t / ref:8.2f}"
              f"{t / tf:8.2f}{c['bpp'] / t / (28.0 / tf):13.2f}{floor / ref:13.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="*", type=Path)
    ap.add_argument("--formats", default="8bit,fp8")
    ap.add_argument("--sizes", default="128x256,2048x2048")
    ap.add_argument("--data", default="wide", help="wide, narrow or both (comma-separated)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--show", action="store_true", help="print every round's figure")
    ap.add_argument("--inplace", action="store_true",
                    help="update param and states in place, as the bridge does (each build on its own copies)")
    ap.add_argument("--rule", default="adamw", choices=sorted(RULES))
    ap.add_argument("--functional", action="store_true",
                    help="write the update and leave the param (tx.update's mode) instead of writing the param")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--correct", action="store_true", help="write the param with its int8 correction")
    ap.add_argument("--bridge", action="store_true",
                    help="time the bridge classes against torch.optim.AdamW(fused=True) instead (see bridge_ratios)")
    ap.add_argument("--formats-gate", action="store_true",
                    help="the formats gate: arithmetic-coded format candidates against 8bit and fp8 (see formats_gate)")
    ap.add_argument("--gate-parts", default="quality,phases,steps", help="--formats-gate: which parts to run")
    ap.add_argument("--gate-sizes", default="a,big", help="--formats-gate: step cases, of GATE_SIZES (a: two 2048x2048, big: 4 x 4096x4096)")
    ap.add_argument("--runs", type=int, default=3, help="--formats-gate: measurement sets, each its own figures")
    args = ap.parse_args(argv)
    if args.formats_gate:
        return formats_gate(args)
    if args.bridge:
        if len(args.sources) > 1:
            ap.error("--bridge runs one build (the library's own source, or the one SOURCE given)")
        return bridge_ratios(args.sources[0] if args.sources else None, args.threads, args.rounds)
    if args.correct and (args.dtype != "bfloat16" or args.functional):
        ap.error("--correct writes a bfloat16 param: give --dtype bfloat16, without --functional")
    if not KC.available():
        print("native CPU kernels unavailable (no working C compiler)")
        return 1
    # SOURCE.c+FLAG+FLAG: that source built with extra flags (e.g. cpu.c+-mno-avx512f)
    builds = [(Path(str(s).split("+")[0]), tuple(str(s).split("+")[1:])) for s in (args.sources or [KC._SOURCE])]
    sources = [Path(str(s)) for s in (args.sources or [KC._SOURCE])]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(s, Path(tmp), extra) for s, extra in builds]
        cfgs = []
        for sf in args.formats.split(","):
            for size in args.sizes.split(","):
                rows, cols = (int(x) for x in size.split("x"))
                for data in args.data.split(","):
                    spec = RULES[args.rule]
                    p, g, states, hyper = make_case(spec, sf, rows, cols, data, getattr(torch, args.dtype))
                    corr = (torch.randint(-128, 128, (rows, cols), dtype=torch.int8,
                                          generator=torch.Generator().manual_seed(1)) if args.correct else None)
                    for li in range(len(libs)):
                        # out of place: the param is written in place (the bridge's mode), or with
                        # --functional an update is written and the param only read (tx.update's
                        # mode); --inplace also updates the states in place
                        pp = p.clone()
                        plain = sf == "fp32"
                        if plain:
                            new = tuple(s.clone() for s in states)
                        else:
                            new = tuple(lt.QTensor(s.codes.clone(), s.scale.clone(), s.shape, s.block_size, s.format)
                                        for s in states)
                        ins = new if args.inplace else states
                        if plain:
                            sts = tuple(KC.NativeState(i, o, None, None, None, 0) for i, o in zip(ins, new))
                        else:
                            sts = tuple(KC.NativeState(i.codes.view(torch.uint8), o.codes.view(torch.uint8), i.scale,
                                                       o.scale, o.format, o.block_size) for i, o in zip(ins, new))
                        target = torch.empty(rows, cols) if args.functional else pp
                        cc = corr.clone() if args.correct else None
                        row = KC.job_row(KC.NativeJob(rows, cols, pp, g, target, spec, not args.functional, False, 0,
                                                      hyper, sts, cc))
                        for i, s in enumerate(new if not plain else ()):  # this build's own format structs
                            row[job_row_index("f", i)] = lib_format(libs[li], s.format)
                        out = (target,) + (new if plain else tuple(t for s in new for t in (s.codes.view(torch.uint8), s.scale)))
                        out += (cc,) if args.correct else ()
                        # the row holds raw addresses: keep every tensor it names alive (pp is not in out
                        # with --functional)
                        cfgs.append(dict(key=f"{sf} {size} {data}", lib=libs[li], table=torch.tensor(row), out=out, keep=(pp, sts),
                                         inputs=(p, g, states, hyper), n=rows * cols, ns=[]))
        for _ in range(args.rounds):
            for c in cfgs:
                calls = max(1, int(2e6 // c["n"]))
                fn, ptr = c["lib"].lbt_step_jobs, c["table"].data_ptr()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(1, ptr, args.threads)
                c["ns"].append((time.perf_counter() - t0) / calls / c["n"] * 1e9)
    names = [s.name for s in sources]
    print(f"ns/element, min / median over {args.rounds} rounds, {args.threads} thread(s); ! = output differs from {names[0]}")
    print(f"{'case':28s}" + "".join(f"{n:>18s}" for n in names))
    for key in dict.fromkeys(c["key"] for c in cfgs):
        cs = [c for c in cfgs if c["key"] == key]
        same = [all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cs[0]["out"], c["out"])) for c in cs]
        print(f"{key:28s}" + "".join(f"{min(c['ns']):9.2f} /{statistics.median(c['ns']):6.2f}{' ' if ok else '!'}"
                                     for c, ok in zip(cs, same)))
        if args.show:
            for c in cs:
                print("    " + " ".join(f"{x:.1f}" for x in c["ns"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
