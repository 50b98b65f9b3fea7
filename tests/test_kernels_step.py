"""Every backend's step equals an independent reference, bit for bit, for every
rule x state format x param dtype (x stochastic rounding, x fused links).

The reference (``reference_step``) does the step's float32 operations in numpy
(each one correctly rounded, no contraction) on states dequantized and
requantized by the reference quantizer (:mod:`lowbit_tree.qtensor`, itself
tested against a brute-force search).
"""
from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

import lowbit_tree as lt
from lowbit_tree import kernels as K
from lowbit_tree.kernels import StepLeaf, StepSpec, native, run_step, step_hyperparams
from lowbit_tree.kernels.spec import HYPER_NAMES, Hyper
from lowbit_tree.qtensor import QTensor
from lowbit_tree.rank1 import Rank1QTensor, rank1_dequantize, rank1_quantize

NATIVE = pytest.mark.skipif(not native.available(), reason="no C compiler")
RULES = [
    ("adam", {}), ("adam", {"amsgrad": True}), ("lion", {}), ("momentum", {}), ("momentum", {"nesterov": True}),
    ("ademamix", {}), ("muon", {}), ("muon", {"nesterov": True}),
]
RULE_IDS = ["adam", "amsgrad", "lion", "momentum", "nesterov", "ademamix", "muon", "muon-nesterov"]
STATE_FORMATS = ["8bit", "4bit", "nf4", "fp8", "8bit_bnb", "fp32", "bf16"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LINKS = [dict(), dict(decay=True, lr=True), dict(maximize=True, l2=True, lr=True)]
# (12, 34) and (20, 33): rows shorter than a block, which the native kernel steps a tile of rows at
# a time (quantized_tile's merge; 4-bit only with even rows), with decodes of 34 and 33 codes
SHAPES = [((37, 301), None), ((5, 16), 7), ((700,), None), ((3, 2, 129), 64), ((12, 34), 64), ((20, 33), None)]


def same(a, b) -> bool:
    """Equal bits (every NaN equal to every NaN: torch's own float->bf16 conversions
    disagree on NaN payloads between its vector and scalar code)."""
    if isinstance(a, QTensor):
        return (isinstance(b, QTensor) and same(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
                and same(a.scale, b.scale) and (a.shape, a.format, a.block_size) == (b.shape, b.format, b.block_size))
    if isinstance(a, Rank1QTensor):
        return (isinstance(b, Rank1QTensor) and same(a.codes, b.codes) and same(a.row_max, b.row_max)
                and same(a.col_max, b.col_max) and a.shape == b.shape)
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(na, nb) and torch.equal(a[~na].view(bits), b[~nb].view(bits))


def _np(t):
    return t.detach().float().reshape(-1).numpy().copy()


def numpy_rule_step(spec, hyper, p, g, states, *, write, rule_math):
    """One step in numpy float32 around ``rule_math(spec, h, gf, pf, olds) -> (u, new states)``:
    the states dequantized by the reference, ``maximize`` and L2 on the gradient before, decay and
    the learning rate on the update after, then the states requantized (for the rules whose tests
    write their math beside their declaration). Returns ``(out, new states)``."""
    from lowbit_tree.kernels.spec import HYPER_NAMES

    h = dict(zip(HYPER_NAMES, hyper.numpy().astype(np.float32)))
    with np.errstate(all="ignore"):
        gf, pf = _np(g), _np(p)
        olds = [_np(lt.dequantize(s)) if isinstance(s, QTensor) else _np(s) for s in states]
        if spec.maximize:
            gf = -gf
        if spec.l2:
            gf = gf + h["l2"] * pf
        u, news = rule_math(spec, h, gf, pf, olds)
        if spec.decay:
            u = u + h["wd"] * pf
        if spec.lr:
            u = (-h["lr"]) * u
        out = torch.from_numpy(pf + u).reshape(p.shape).to(p.dtype) if write else torch.from_numpy(u).reshape(g.shape)
    new_states = []
    for s, n in zip(states, news):
        x = torch.from_numpy(n).reshape(tuple(s.shape))
        new_states.append(lt.quantize(x, s.format, s.block_size) if isinstance(s, QTensor) else x.to(s.dtype))
    return out, new_states


def assert_rule_step_is_reference(spec, hyper, p, g, states, reference, backend, where):
    """``run_step`` on ``backend`` (the update and, where the rule has a learning rate, the param
    written; out of place and in place) gives ``reference(spec, hyper, p, g, states, write=...)``'s
    bits, the new states' too."""
    from lowbit_tree.kernels import StepLeaf, run_step

    for write in ([False, True] if spec.lr else [False]):
        want_out, want_states = reference(spec, hyper, p, g, states, write=write)
        for inplace in (False, True):
            pp, ss = p.clone(), tuple(clone_state(s) for s in states)
            outs, news = run_step(spec, hyper, [StepLeaf(pp, g, ss, 3)], write=write, inplace=inplace, backend=backend)
            assert same(pp if write else outs[0], want_out), where + (write, inplace)
            assert all(same(a, b) for a, b in zip(news[0], want_states)), where + (write, inplace)


def np_fma(a, b, c):
    """float32 ``a * b + c`` with one rounding: the float64 sum, rounded to float32, is
    correctly rounded unless it sits on a float32 midpoint (double rounding); those few are
    computed exactly with fractions."""
    a, b, c = (np.broadcast_to(np.asarray(x, dtype=np.float32), np.broadcast(a, b, c).shape) for x in (a, b, c))
    r = a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)
    out = r.astype(np.float32)
    tie = np.isfinite(r) & ((r.view(np.int64) & ((1 << 29) - 1)) == (1 << 28))
    for i in zip(*np.nonzero(tie)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = np.float32(float(exact))  # nearest double, then its float32 neighbours decide
        cands = [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(-np.inf))]
        out[i] = min(cands, key=lambda x: (abs(Fraction(float(x)) - exact), int(np.float32(x).view(np.int32)) & 1))
    return out


def np_lerp(a, c, w):
    """torch.lerp's float32 result (one rounding) in numpy, for a float32 scalar ``w``."""
    w = np.float32(w)
    return np_fma(w, c - a, a) if abs(w) < 0.5 else np_fma(w - np.float32(1), c - a, c)


def reference_step(spec: StepSpec, hyper, p, g, states, *, write, sr_key=None, index=0):
    """The step of ``spec`` in numpy float32 (see lowbit_tree/kernels/spec.py):
    returns ``(out, new_states)``."""
    h = dict(zip(HYPER_NAMES, hyper.numpy().astype(np.float32)))  # the vector's entries by name
    b1, omb1, b2, omb2, rbc1, rsbc2 = h["b1"], h["omb1"], h["b2"], h["omb2"], h["rbc1"], h["rsbc2"]
    eps, lr, wd, l2, b3, omb3, alpha = h["eps"], h["lr"], h["wd"], h["l2"], h["b3"], h["omb3"], h["alpha"]
    with np.errstate(all="ignore"):
        gf = _np(g)
        pf = None if p is None else _np(p)
        olds = [_np(lt.dequantize(s)) if isinstance(s, QTensor) else
                _np(rank1_dequantize(s)) if isinstance(s, Rank1QTensor) else _np(s) for s in states]
        if spec.maximize:
            gf = -gf
        if spec.l2:
            gf = gf + l2 * pf
        if spec.rule == "adam":
            m = b1 * olds[0] + omb1 * gf
            v = b2 * olds[1] + omb2 * (gf * gf)
            news, root = [m, v], v
            if spec.amsgrad:
                root = np.maximum(olds[2], v)  # NaN if either is NaN, as torch.maximum
                news.append(root)
            u = (m * rbc1) / (np.sqrt(root) * rsbc2 + eps)
        elif spec.rule == "ademamix":
            m = b1 * olds[0] + omb1 * gf
            v = b2 * olds[1] + omb2 * (gf * gf)
            slow = b3 * olds[2] + omb3 * gf
            news = [m, v, slow]
            u = (m * rbc1 + alpha * slow) / (np.sqrt(v) * rsbc2 + eps)
        elif spec.rule == "lion":
            c = b1 * olds[0] + omb1 * gf
            u = (c > 0).astype(np.float32) - (c < 0).astype(np.float32)
            news = [b2 * olds[0] + omb2 * gf]
        elif spec.rule == "muon":
            b = np_lerp(olds[0], gf, omb1)
            u = np_lerp(gf, b, b1) if spec.nesterov else b
            news = [b]
        else:
            b = b1 * olds[0] + gf
            u = gf + b1 * b if spec.nesterov else b
            news = [b]
        if spec.decay:
            u = u + wd * pf
        if spec.lr:
            u = (-lr) * u
        if write:
            x = torch.from_numpy(pf + u).reshape(p.shape)
            out = lt.stochastic_round(x, p.dtype, sr_key, index) if sr_key is not None else x.to(p.dtype)
        else:
            out = torch.from_numpy(u).reshape(g.shape)
    new_states = []
    for s, n in zip(states, news):
        x = torch.from_numpy(n).reshape(tuple(s.shape))
        if isinstance(s, Rank1QTensor):
            new_states.append(rank1_quantize(x))
        else:
            new_states.append(lt.quantize(x, s.format, s.block_size) if isinstance(s, QTensor) else x.to(s.dtype))
    return out, new_states


def make_states(spec, shape, fmt, bs, gen):
    out = []
    for signed in spec.signed:
        x = torch.randn(shape, generator=gen) * 1e-2
        if not signed:
            x = x.abs() * 1e-2
        if fmt == "4bit-rank1" and not signed:  # the rank-1 second moments beside 4-bit first moments
            out.append(rank1_quantize(x * torch.exp(torch.randn(shape, generator=gen) * 2)))
        elif fmt == "4bit-rank1":
            out.append(lt.quantize(x, "4bit", bs, signed=True))
        elif fmt in ("fp32", "bf16"):
            out.append(x.to(torch.float32 if fmt == "fp32" else torch.bfloat16))
        else:
            out.append(lt.quantize(x, fmt, bs, signed=signed))
    return tuple(out)


def make_case(rule, variant, links, fmt, dtype, shape, bs, seed):
    gen = torch.Generator().manual_seed(seed)
    spec = StepSpec(rule, **variant, **links)
    states = make_states(spec, shape, fmt, bs, gen)
    p = torch.randn(shape, generator=gen).to(dtype)
    g = (torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)).to(dtype)
    flat = g.view(-1)
    flat[: min(3, flat.numel())] = 0.0  # zero gradients: v may shrink to the zero-free floor
    hyper = step_hyperparams(spec, count=seed % 7, b1=0.9, b2=0.999 if rule in ("adam", "ademamix") else 0.99,
                             eps=1e-8, lr=1e-2, weight_decay=0.1, l2=0.05,
                             **(dict(b3=0.9999, alpha=5.0) if rule == "ademamix" else {}),
                             **(dict(cg=0.0731, cm=7.93) if rule == "nadam" else {}))
    return spec, states, p, g, hyper


def clone_state(s):
    if isinstance(s, QTensor):
        return QTensor(s.codes.clone(), s.scale.clone(), s.shape, s.block_size, s.format)
    if isinstance(s, Rank1QTensor):
        return Rank1QTensor(s.codes.clone(), s.row_max.clone(), s.col_max.clone(), s.shape)
    return s.clone()


def check_backend(backend, rule, variant, fmt, dtype, links_list=LINKS, shapes=SHAPES, seed=0):
    for li, links in enumerate(links_list):
        for si, (shape, bs) in enumerate(shapes):
            spec, states, p, g, hyper = make_case(rule, variant, links, fmt, dtype, shape, bs, seed + 10 * li + si)
            for write in ([False, True] if spec.lr else [False]):
                keys = [None, torch.tensor([5, 11])] if write and dtype is torch.bfloat16 else [None]
                for key in keys:
                    want_out, want_states = reference_step(spec, hyper, p, g, states, write=write, sr_key=key, index=3)
                    for inplace in (False, True):
                        pp, ss = p.clone(), tuple(clone_state(s) for s in states)
                        before = (p.clone(), tuple(clone_state(s) for s in states))
                        outs, news = run_step(spec, hyper, [StepLeaf(pp, g, ss, 3)], write=write, inplace=inplace,
                                              sr_key=key, backend=backend)
                        got_out = pp if write else outs[0]
                        where = (backend, rule, variant, fmt, dtype, links, shape, bs, write, key is not None, inplace)
                        assert same(got_out, want_out), where
                        assert all(same(a, b) for a, b in zip(news[0], want_states)), where
                        if not inplace:  # pure states: nothing passed in changed (but a param written in place)
                            assert write or same(pp, before[0]), where
                            assert all(same(a, b) for a, b in zip(ss, before[1])), where
                        else:  # in place: the states passed in are the new ones
                            assert all(same(a, b) for a, b in zip(ss, want_states)), where


BACKENDS = [pytest.param("native", marks=NATIVE), "eager"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("fmt", STATE_FORMATS)
@pytest.mark.parametrize("rule,variant", RULES, ids=RULE_IDS)
def test_step_matches_reference(rule, variant, fmt, dtype, backend):
    check_backend(backend, rule, variant, fmt, dtype)


RANK1_SHAPES = [((37, 301), None), ((5, 16), 7), ((3, 2, 129), 64), ((2, 4500), None), ((1, 3), None)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rule,variant", [("adam", {}), ("adam", {"amsgrad": True})], ids=["adam", "amsgrad"])
def test_rank1_step_matches_reference(rule, variant, dtype, backend):
    """4-bit first moments and rank-1 second moments (and amsgrad's maxima): odd rows,
    short rows, rows longer than a tile, a 3-D param."""
    check_backend(backend, rule, variant, "4bit-rank1", dtype, shapes=RANK1_SHAPES)


COMPILED_CASES = [(rule, variant, "8bit") for rule, variant in RULES] + [
    ("adam", {}, fmt) for fmt in STATE_FORMATS if fmt != "8bit"]


@pytest.mark.slow  # inductor compiles each case: ~2 minutes in all on 2 busy cores
@pytest.mark.parametrize("rule,variant,fmt", COMPILED_CASES,
                         ids=[f"{r}{'-' + next(iter(v)) if v else ''}-{f}" for r, v, f in COMPILED_CASES])
def test_compiled_cpu_step_matches_reference(rule, variant, fmt):
    """torch.compile on CPU (inductor C++), bfloat16 params, one shape (rows shorter
    than a block): every rule on 8-bit states, and Adam on every other format
    (compilation takes seconds per graph; CUDA's test runs the whole matrix)."""
    check_backend("compiled", rule, variant, fmt, torch.bfloat16, links_list=[dict(decay=True, lr=True)],
                  shapes=[((9, 130), None)])


def test_compiled_single_row_runs_eagerly():
    """A single row (a 1-D param, ``(1, R)``, ``(1, 1, R)``) with quantized states: the compiled
    backend steps it eagerly, with the reference's bits. Compiled, inductor 2.13 (CPU, dynamic
    shapes) wrote all-zero codes for such rows (``torch_backend.compiles``): this test fails if
    they reach a graph again while that bug stands. Fast, since nothing compiles."""
    from lowbit_tree.kernels import torch_backend

    for shape, fmt in [((64,), "8bit"), ((1, 300), "8bit"), ((1, 1, 64), "4bit"), ((1, 40), "fp8")]:
        assert not torch_backend.compiles(shape, (("q", "dynamic8", 256),))
        check_backend("compiled", "adam", {}, fmt, torch.float32, links_list=[dict(decay=True, lr=True)],
                      shapes=[(shape, None)])
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).reshape(1, -1)
        assert same(torch_backend.quantize_rows(x, "dynamic8", 256, compile=True)[0],
                    torch_backend.quantize_rows(x, "dynamic8", 256, compile=False)[0])


@pytest.mark.xfail(strict=True, reason="pytorch issue 195582: inductor's CPU loop split drops a loop's tail; when "
                   "this passes, torch has fixed it and the workarounds it names (design.md, torch backend) can go")
def test_inductor_cpu_loop_split_keeps_the_tail():
    """The torch bug behind ``_block_index``'s clamp, the scale gather and ``compiles``: a block
    scale read by ``arange(R) // block_size`` on a one-block row, compiled for the CPU."""
    def scaled(scale, x):
        return x * scale[:, torch.arange(x.shape[1]) // 256]

    scale, x = torch.full((2, 1), 2.0), torch.ones(2, 64)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(scaled, dynamic=True)(scale, x), scaled(scale, x))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", ["compiled", "eager"])
@pytest.mark.parametrize("fmt", STATE_FORMATS)
@pytest.mark.parametrize("rule,variant", RULES, ids=RULE_IDS)
def test_cuda_step_matches_reference(rule, variant, fmt, backend):
    """On CUDA: every rule and format, bf16 and float32 params, results on the host
    equal to the CPU reference bit for bit."""
    for dtype in (torch.float32, torch.bfloat16):
        for links in LINKS:
            for shape, bs in SHAPES:
                spec, states, p, g, hyper = make_case(rule, variant, links, fmt, dtype, shape, bs, 1)
                for write in ([False, True] if spec.lr else [False]):
                    key = torch.tensor([5, 11]) if write and dtype is torch.bfloat16 else None
                    want_out, want_states = reference_step(spec, hyper, p, g, states, write=write, sr_key=key, index=3)
                    cuda = lambda s: s.cuda() if isinstance(s, torch.Tensor) else QTensor(s.codes.cuda(), s.scale.cuda(), s.shape, s.block_size, s.format)
                    pp, ss = p.cuda(), tuple(cuda(s) for s in states)
                    outs, news = run_step(spec, hyper.cuda(), [StepLeaf(pp, g.cuda(), ss, 3)], write=write,
                                          sr_key=None if key is None else key.cuda(), backend=backend)
                    got = (pp if write else outs[0]).cpu()
                    cpu = lambda s: s.cpu() if isinstance(s, torch.Tensor) else QTensor(s.codes.cpu(), s.scale.cpu(), s.shape, s.block_size, s.format)
                    assert same(got, want_out), (rule, fmt, dtype, links, shape, write)
                    assert all(same(cpu(a), b) for a, b in zip(news[0], want_states)), (rule, fmt, dtype, links, shape)


@NATIVE
def test_many_leaves_in_one_call_equal_one_by_one():
    """One native call for many leaves of every kind (quantized, plain, empty) writes
    what one call per leaf writes."""
    gen = torch.Generator().manual_seed(5)
    spec = StepSpec("adam", decay=True, lr=True)
    leaves = []
    for fmt, shape in [("8bit", (64, 300)), ("4bit", (3, 129)), ("fp32", (17,)), ("fp8", (0, 5)), ("bf16", (5, 7)),
                       ("8bit_bnb", (2, 5001))]:
        states = make_states(spec, shape, fmt, None, gen)
        leaves.append(StepLeaf(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), states))
    hyper = step_hyperparams(spec, count=2, lr=1e-3, weight_decay=0.1)
    outs, news = run_step(spec, hyper, leaves, backend="native")
    for k, leaf in enumerate(leaves):
        o1, n1 = run_step(spec, hyper, [leaf], backend="native")
        assert same(outs[k], o1[0]) and all(same(a, b) for a, b in zip(news[k], n1[0]))


@NATIVE
def test_native_rejects_bad_sizes_before_running_anything():
    spec = StepSpec("adam", lr=True)
    hyper = step_hyperparams(spec, count=0, lr=1e-3)
    good = lt.quantize(torch.zeros(4, 300), "8bit"), lt.quantize(torch.zeros(4, 300), "8bit", signed=False)
    p_ok, p_bad = torch.zeros(4, 300), torch.zeros(4, 300)
    short = QTensor(good[0].codes[:, :299].contiguous(), good[0].scale, (4, 300), 256, "dynamic8")
    jobs = [
        native.NativeJob(4, 300, p_ok, torch.ones(4, 300), p_ok, spec, True, False, 0, hyper,
                         tuple(native.NativeState(s.codes, s.codes, s.scale, s.scale, s.format, s.block_size) for s in good)),
        native.NativeJob(4, 300, p_bad, torch.ones(4, 300), p_bad, spec, True, False, 0, hyper,
                         (native.NativeState(short.codes, short.codes, short.scale, short.scale, "dynamic8", 256),
                          native.NativeState(good[1].codes, good[1].codes, good[1].scale, good[1].scale, good[1].format, 256))),
    ]
    codes0 = good[0].codes.clone()
    with pytest.raises(ValueError, match="state 0 codes has 1196 elements"):
        native.run_jobs(jobs)
    assert not p_ok.any() and torch.equal(good[0].codes, codes0)  # the good job did not run either
    half = torch.zeros(4, 300, dtype=torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.job_row(native.NativeJob(4, 300, None, torch.ones(4, 300), torch.empty(4, 300), StepSpec("momentum"),
                                        False, False, 0, hyper,
                                        (native.NativeState(half, half, None, None, None, 0),)))


@pytest.mark.slow
@NATIVE
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flag")
def test_native_kernels_without_avx2(tmp_path):
    """The plain-C paths (what CPUs without AVX2 run; here only block tails) built
    alone with -mno-avx2 pass the same bit-identity tests, in a fresh process."""
    env = dict(os.environ, LOWBIT_TREE_CFLAGS="-mno-avx2 -mno-avx512f", LOWBIT_TREE_CACHE=str(tmp_path))
    codes = os.path.join(os.path.dirname(__file__), "test_kernels_codes.py")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__, codes,
         "-k", "(step_matches_reference and native and (f32 or bf16)) or random_bit or quantize_dequantize_bit or many_leaves"],
        env=env, capture_output=True, text=True, timeout=480,  # under pytest's 600 s: this reports a hang
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "passed" in r.stdout and list(tmp_path.glob("kernels_cpu_*.so")), r.stdout[-2000:]


@pytest.mark.parametrize("count", [0, 3, 999])
def test_adamw_step_is_textbook_adamw_in_float64(count):
    """The step's float32 math (reciprocal bias corrections, one root) is AdamW:
    against a float64 textbook step. float32 moments (the other formats run the
    same math between a dequantize and a requantize: see the bit-identity tests)."""
    gen = torch.Generator().manual_seed(count)
    shape = (9, 300)
    p = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen) * torch.logspace(-6, 0, 300)
    g[0, :5] = torch.tensor([0.0, 1e-30, -1e-30, 1e3, -1e3])
    m0, v0 = torch.randn(shape, generator=gen) * 1e-2, torch.rand(shape, generator=gen) * 1e-4
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    spec = StepSpec("adam", decay=True, lr=True)
    hyper = step_hyperparams(spec, count=count, b1=b1, b2=b2, eps=eps, lr=lr, weight_decay=wd)
    out = p.clone()
    _, news = run_step(spec, hyper, [StepLeaf(out, g, (m0, v0))], write=True)
    m32, v32 = (t.double() for t in news[0])
    g64, p64, c = g.double(), p.double(), count + 1
    mr = b1 * m0.double() + (1 - b1) * g64
    vr = b2 * v0.double() + (1 - b2) * g64 * g64
    # float32 rounding of each term (b1 itself is rounded): error bounded by the
    # terms' magnitudes, not the result's (the two terms may cancel)
    assert ((m32 - mr).abs() <= 1e-6 * (b1 * m0.double().abs() + (1 - b1) * g64.abs())).all()
    assert ((v32 - vr).abs() <= 1e-6 * (b2 * v0.double() + (1 - b2) * g64 * g64)).all()
    # the update direction (no lr, no param): a few float32 roundings of textbook u
    u, _ = run_step(StepSpec("adam"), step_hyperparams(StepSpec("adam"), count=count, b1=b1, b2=b2, eps=eps),
                    [StepLeaf(None, g, (m0, v0))])
    ur = (m32 / (1 - b1**c)) / ((v32 / (1 - b2**c)).sqrt() + eps)
    torch.testing.assert_close(u[0].double(), ur, rtol=2e-6, atol=0)
    pr = p64 - lr * (ur + wd * p64)
    assert ((out.double() - pr).abs() <= 4 * 2**-24 * p64.abs() + 2e-6 * lr * ur.abs()).all()
    assert not (out.double() - pr).abs().le(0).all()  # the float32 step is not exact: the check can fail


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_hyperparams_from_numbers_and_tensors_agree(device):
    """Python numbers (built on the host) and 0-d float64 tensors give the same
    float32 vector for any count and betas, on the host path (CPU tensors) and
    the tensor path (what a GPU's tensors take; checked here by forcing it
    with a meta device argument, then comparing the values it computes on CPU)."""
    from lowbit_tree.kernels import spec as spec_mod

    for rule in ("adam", "lion", "momentum", "ademamix"):
        spec = StepSpec(rule, decay=True, lr=True)
        for b1, b2 in ((0.9, 0.999), (0.8, 0.99), (0.95, 0.9999)):
            for count in [*range(0, 300, 7), 10**4, 10**6]:
                a = step_hyperparams(spec, count=count, b1=b1, b2=b2, eps=1e-8, lr=3e-4, weight_decay=0.1)
                kw = dict(count=torch.tensor(count, dtype=torch.int32), b1=torch.tensor(b1, dtype=torch.float64),
                          b2=torch.tensor(b2, dtype=torch.float64), eps=1e-8,
                          lr=torch.tensor(3e-4, dtype=torch.float64), weight_decay=0.1)
                if device == "meta":  # the tensor path, computed on CPU
                    with torch.device("cpu"):
                        b = _tensor_path(spec_mod, spec, kw)
                else:
                    b = step_hyperparams(spec, **kw)
                assert same(a, b), (rule, b1, b2, count)
    # 1 - b2 in float64 from the value given: as accurate as float32 allows
    h = step_hyperparams(StepSpec("adam"), b1=0.9, b2=0.999)
    assert Hyper(*h).omb2.item() == np.float32(1.0 - 0.999)
    # a float32 tensor's value is its float32 value
    h32 = step_hyperparams(StepSpec("adam"), b1=torch.tensor(0.9), b2=torch.tensor(0.999))
    assert Hyper(*h32).omb2.item() == np.float32(1.0 - float(np.float32(0.999)))


def _tensor_path(spec_mod, spec, kw):
    """step_hyperparams' tensor branch (the one GPU tensors take), run on CPU tensors."""
    import unittest.mock

    with unittest.mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        return spec_mod.step_hyperparams(spec, **kw)


def test_backend_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("LOWBIT_TREE_BACKEND", "eager")
    assert K.backend_for(cpu) == "eager"
    monkeypatch.setenv("LOWBIT_TREE_BACKEND", "compiled")
    assert K.backend_for(cpu) == "compiled" and K.backend_for(torch.device("cuda")) == "compiled"
    monkeypatch.setenv("LOWBIT_TREE_BACKEND", "fast")
    with pytest.raises(ValueError, match="LOWBIT_TREE_BACKEND"):
        K.backend_for(cpu)
    monkeypatch.delenv("LOWBIT_TREE_BACKEND")
    assert K.backend_for(cpu) == ("native" if native.available() else "eager")
    assert K.backend_for(cpu, "eager") == "eager"


def test_rank1_maxima_are_completed_in_leaf_order():
    """Each rank-1 record's ``reduce`` (a collective under FSDP2 / TP) is called once per step,
    in leaf order, whichever path runs each leaf (native, a float64 param on the torch backend,
    an empty shard); the results equal one call per leaf."""
    calls = []

    def reduce_named(name):
        def reduce(row_max, col_max):
            calls.append(name)
            return row_max, col_max * 2  # visible in the result: the record keeps what reduce returns
        return reduce

    gen = torch.Generator().manual_seed(3)
    spec = StepSpec("adam", decay=True, lr=True)
    hyper = step_hyperparams(spec, count=2, lr=1e-3, weight_decay=0.1)

    def leaf(name, shape, dtype=torch.float32):
        m = lt.quantize(torch.randn(shape, generator=gen) * 1e-2, "4bit", None, signed=True)
        v = rank1_quantize(torch.rand(shape, generator=gen) * 1e-4)
        v = Rank1QTensor(v.codes, v.row_max, v.col_max, v.shape, v.format, reduce_named(name))
        return StepLeaf(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype), (m, v))

    leaves = [leaf("a", (40, 300)), leaf("b", (0, 300)), leaf("c", (7, 9), torch.float64), leaf("d", (33, 64)),
              leaf("e", (5, 2500))]
    outs, news = run_step(spec, hyper, leaves, backend="native" if native.available() else "eager")
    assert calls == ["a", "b", "c", "d", "e"]
    for k, lf in enumerate(leaves):
        o1, n1 = run_step(spec, hyper, [lf], backend="eager")
        assert same(outs[k], o1[0]) and all(same(a, b) for a, b in zip(news[k], n1[0])), k


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank1_step_with_nonfinite_gradients_matches_reference(backend):
    """A NaN and an inf in the gradient: the new second moment's maxima of their row and column
    become NaN and inf (the kernel takes them in its tiles), codes and params as the reference's."""
    spec, states, p, g, hyper = make_case("adam", {}, dict(decay=True, lr=True), "4bit-rank1", torch.float32,
                                          (37, 301), None, 11)
    g = g.clone()
    g[5, 7] = float("nan")
    g[20, 300] = float("inf")
    want_out, want_states = reference_step(spec, hyper, p, g, states, write=True)
    pp = p.clone()
    _, news = run_step(spec, hyper, [StepLeaf(pp, g, tuple(clone_state(s) for s in states))], write=True,
                       backend=backend)
    assert same(pp, want_out)
    assert all(same(a, b) for a, b in zip(news[0], want_states))
    v = news[0][1]
    assert torch.isnan(v.row_max[5]) and torch.isnan(v.col_max[7])
    assert v.row_max[20] == float("inf") and v.col_max[300] == float("inf")
    assert torch.isfinite(v.row_max[0]) and torch.isfinite(v.col_max[0])


@pytest.mark.slow  # inductor compiles one graph per static combination: 5 of them, ~1 minute on 2 busy cores
def test_compiled_kernel_plan_matches_eager():
    """A plan on the compiled backend (its leaves' arguments laid out once, one in-place call
    per chunk of a static combination) writes what the eager backend writes, over 3 steps
    whose learning rates and gradients change: 8-bit states on float32 and corrected bfloat16
    params, FP8 states on stochastically rounded bfloat16 params, float32 states, a rank-1
    record (run through run_step beside the plan), and updates returned without writing."""
    from lowbit_tree.kernels.plan import KernelPlan

    spec = StepSpec("adam", decay=True, lr=True)
    gen = torch.Generator().manual_seed(8)
    layout = [(torch.bfloat16, (9, 130), "8bit", True), (torch.float32, (5, 40), "8bit", False),
              (torch.float32, (7, 33), "8bit", False), (torch.bfloat16, (6, 20), "fp8", False),
              (torch.float32, (5,), "fp32", False), (torch.bfloat16, (20, 300), "4bit-rank1", False)]
    leaves = []
    for dtype, shape, fmt, corrected in layout:
        p = torch.randn(shape, generator=gen).to(dtype)
        c = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8) if corrected else None
        leaves.append((p, make_states(spec, shape, fmt, None, gen), c))
    for write in (True, False):
        chosen = leaves if write else [leaves[1], leaves[2]]

        def fresh():
            return ([p.clone() for p, _, _ in chosen], [tuple(clone_state(s) for s in st) for _, st, _ in chosen],
                    [None if c is None or not write else c.clone() for _, _, c in chosen])

        (ps, ss, cs), (ps2, ss2, cs2) = fresh(), fresh()
        plan = KernelPlan(spec, ps, ss, list(range(len(ps))), write=write, backend="compiled", corrections=cs)
        key = torch.tensor([3, 9]) if write else None
        for step in range(3):
            grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in ps]
            hyper = step_hyperparams(spec, count=step, lr=1e-3 * 10.0 ** -step, weight_decay=0.1)
            outs = plan.run(grads, hyper, key)
            want, _ = run_step(spec, hyper, [StepLeaf(p, g, s, i, c) for i, (p, g, s, c) in
                                             enumerate(zip(ps2, grads, ss2, cs2))],
                               write=write, inplace=True, sr_key=key, backend="eager")
            for k in range(len(ps)):
                where = (write, step, k)
                assert same(ps[k], ps2[k]), where
                assert (cs[k] is None and cs2[k] is None) or torch.equal(cs[k], cs2[k]), where
                assert all(same(a, b) for a, b in zip(ss[k], ss2[k])), where
                assert (outs[k] is None) == write and (write or same(outs[k], want[k])), where
        assert len(plan._compiled) == (4 if write else 1)


@NATIVE
@pytest.mark.parametrize("threads", [1, 2])
def test_native_step_runs_on_torch_threads(threads, monkeypatch):
    """The C kernel's parallel region has ``torch.get_num_threads()`` threads (one rank of several
    on a host, each given its share of the cores with ``torch.set_num_threads`` or
    ``OMP_NUM_THREADS``, uses that share), whether the step comes through ``run_step`` or a
    bridge optimizer's plan; a step below ``native._PARALLEL_MIN_NUMEL`` elements runs on one."""
    import bridge

    calls = []
    real = native.library()

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        def lbt_step_jobs(self, njobs, rows, nthreads):
            calls.append(nthreads)
            return real.lbt_step_jobs(njobs, rows, nthreads)

    monkeypatch.setattr(native, "library", lambda: Recording())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spec = StepSpec("adam", decay=True, lr=True)
        hyper = step_hyperparams(spec, count=0, lr=1e-3, weight_decay=0.1)
        g = torch.Generator().manual_seed(threads)
        for numel, want in ((native._PARALLEL_MIN_NUMEL, threads), (native._PARALLEL_MIN_NUMEL - 2, 1)):
            p = torch.randn(2, numel // 2, generator=g)
            states = tuple(lt.zeros(p.shape, "8bit", signed=s) for s in spec.signed)
            calls.clear()
            run_step(spec, hyper, [StepLeaf(p, torch.randn(p.shape, generator=g), states)], write=True,
                     inplace=True, backend="native")
            assert calls == [want], (numel, calls)
        p = torch.nn.Parameter(torch.randn(512, 512, generator=g))
        p.grad = torch.randn(512, 512, generator=g)
        opt = bridge.AdamW8bit([p], lr=1e-3)
        calls.clear()
        opt.step()
        opt.step()
        assert calls and set(calls) == {threads}, calls
    finally:
        torch.set_num_threads(before)
