"""The Triton backend's step equals the native kernel's and the numpy reference's, bit for bit,
under Triton's interpreter on CPU (``TRITON_INTERPRET=1``): every declared rule and variant x
every state format (float32 params, one fused-link set each), the param dtypes with stochastic
rounding on a set of rules, zero / extreme / non-finite gradients, one launch per static
combination, and the errors for what the kernel does not have.

The interpreter executes the kernel's float32 operations with numpy (IEEE division and square
root, whatever the GPU would do); what the GPU compiles is checked by
``benchmarks/triton_compile.py`` (PTX scan)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel's module is imported (its @triton.jit)

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")]
triton = pytest.importorskip("triton")

import lowbit_tree as lt  # noqa: E402
from lowbit_tree.kernels import StepLeaf, StepSpec, native, run_step, step_hyperparams  # noqa: E402
from lowbit_tree.qtensor import QTensor  # noqa: E402
from lowbit_tree.rules import RULE_DEFS  # noqa: E402

from test_kernels_step import LINKS, clone_state, make_case, np_fma, reference_step, same  # noqa: E402

NATIVE = pytest.mark.skipif(not native.available(), reason="no C compiler")

RULES = [(name, v) for name, d in RULE_DEFS.items()
         for v in ([{}] if not d.variants else
                   [{}] + [{f: True} for f in d.variants] + ([dict.fromkeys(d.variants, True)]
                                                              if len(d.variants) > 1 else []))]
"""Every declared rule and variant (both of RMSprop's together too), from the declaration."""
RULE_IDS = ["-".join([r] + sorted(v)) for r, v in RULES]
FORMATS = ["8bit", "4bit", "nf4", "fp8", "8bit_bnb", "fp32", "bf16"]
# an odd block size (the mask path of the block maxima), partial blocks of a power of two, and a
# row of a default block size with its tail
SHAPES = [((5, 16), 7), ((3, 2, 129), 64), ((2, 301), None)]
REFERENCE_RULES = ("adam", "lion", "momentum", "ademamix", "muon")  # test_kernels_step.reference_step's
# rows of the aligned variant (every row a multiple of 32 elements, fresh tensors): several rows
# a tile (32 of 64 elements), and a row over two tiles (1024 + 32 elements)
ALIGNED_SHAPES = [((40, 64), 32), ((2, 1056), 32)]


def _interpreter_fma_rounds_once() -> bool:
    """Triton's interpreter rounded ``tl.fma`` twice (``x * y + z`` in numpy) until triton pull
    request 11424; the probe's product is cancelled by its addend, so only a fused fma is non-zero."""
    from triton.runtime import interpreter

    x, y = np.array([1.4142135], np.float32), np.array([1.7320508], np.float32)
    z = -(x * y)
    b = interpreter.InterpreterBuilder()
    got = b.create_fma(*(interpreter.TensorHandle(a, triton.language.float32) for a in (x, y, z))).data
    return bool((got == np_fma(x, y, z)).all() and got[0] != 0)


@pytest.fixture(autouse=True)
def exact_fma(monkeypatch):
    """A correctly rounded fma for the interpreter where its own is not (older triton)."""
    if not _interpreter_fma_rounds_once():
        from triton.runtime import interpreter

        def create_fma(self, x, y, z):
            return interpreter.TensorHandle(np_fma(*np.broadcast_arrays(x.data, y.data, z.data)), z.dtype.scalar)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", create_fma)
    yield


DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu")
"""Where the triton backend's steps run: the CPU under the interpreter, or with ``TRITON_INTERPRET=0``
on a CUDA machine the GPU (``benchmarks/gpu_check.sh``: the GPU's bits against native's on the CPU)."""


def _to(x, dev):
    if x is None:
        return None
    if isinstance(x, QTensor):
        return QTensor(x.codes.to(dev), x.scale.to(dev), x.shape, x.block_size, x.format)
    return x.to(dev)


def _run(backend, spec, hyper, p, g, states, *, write, inplace=False, sr_key=None, index=3, corr=None):
    """run_step on copies of the inputs (on :data:`DEVICE` for triton); returns, on the CPU, the
    param after it, the update, the new states, the states passed in (after) and the correction."""
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    pp, gg = _to(p.clone(), dev), _to(g, dev)
    ss = tuple(_to(clone_state(s), dev) for s in states)
    cc = None if corr is None else _to(corr.clone(), dev)
    outs, news = run_step(spec, _to(hyper, dev), [StepLeaf(pp, gg, ss, index, cc)], write=write, inplace=inplace,
                          sr_key=sr_key, backend=backend)
    if inplace:
        assert all(a is b for a, b in zip(news[0], ss))
    cpu = torch.device("cpu")
    return (_to(pp, cpu), _to(outs[0], cpu), tuple(_to(n, cpu) for n in news[0]), tuple(_to(s, cpu) for s in ss),
            _to(cc, cpu))


def _check(rule, variant, fmt, dtype, links_list, shapes, seed=0):
    """triton == native (== the numpy reference where it has the rule) on every case: update
    and in-place param write, pure and in place."""
    for li, links in enumerate(links_list):
        for si, (shape, bs) in enumerate(shapes):
            spec, states, p, g, hyper = make_case(rule, variant, links, fmt, dtype, shape, bs, seed + 10 * li + si)
            for write in ([False, True] if spec.lr else [False]):
                key = torch.tensor([5, 11]) if write and dtype is torch.bfloat16 else None
                results = {}
                for backend in ("native", "triton"):
                    for inplace in (False, True):
                        pp, out, news, passed, _ = _run(backend, spec, hyper, p, g, states, write=write,
                                                        inplace=inplace, sr_key=key)
                        if not inplace:
                            assert all(same(a, b) for a, b in zip(passed, states))  # untouched
                        results[backend, inplace] = (pp if write else out, news)
                where = (rule, variant, fmt, dtype, links, shape, bs, write)
                want_out, want_states = results["native", False]
                if rule in REFERENCE_RULES:
                    ref_out, ref_states = reference_step(spec, hyper, p, g, states, write=write, sr_key=key, index=3)
                    assert same(want_out, ref_out) and all(map(same, want_states, ref_states)), where
                for k, (out, new) in results.items():
                    assert same(out, want_out), (k, where)
                    assert all(same(a, b) for a, b in zip(new, want_states)), (k, where)


def count_launches(monkeypatch, what=lambda a, k: a[0]) -> list:
    """The triton backend's kernel launches from here on (one entry each: its programs, or
    ``what(args, kwargs)``)."""
    from lowbit_tree.kernels import triton_backend

    calls, real = [], triton_backend.launch_kernel
    monkeypatch.setattr(triton_backend, "launch_kernel", lambda *a, **k: (calls.append(what(a, k)), real(*a, **k))[1])
    return calls


def aligned_launches(monkeypatch) -> list:
    """Whether each triton launch from here on is the kernel's aligned variant."""
    return count_launches(monkeypatch, lambda a, k: k["ALIGNED"])


@NATIVE
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule,variant", RULES, ids=RULE_IDS)
def test_triton_step_matches_native_and_reference(rule, variant, fmt):
    """float32 params; the fused-link sets taken in turn over the combinations."""
    k = RULES.index((rule, variant)) + FORMATS.index(fmt)
    _check(rule, variant, fmt, torch.float32, [LINKS[k % len(LINKS)]], SHAPES[:2] if fmt in ("fp32", "bf16")
           else SHAPES, seed=k)


@NATIVE
@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp32", "bf16"])
@pytest.mark.parametrize("rule,variant", RULES, ids=RULE_IDS)
def test_triton_aligned_variant_matches_native_and_reference(rule, variant, fmt, monkeypatch):
    """Rows of whole vectors in fresh tensors take the aligned variant (contiguous lanes, vector
    loads on a GPU): the same bits as native; (the test above: odd rows, the general variant)."""
    k = RULES.index((rule, variant))
    seen = aligned_launches(monkeypatch)
    _check(rule, variant, fmt, torch.float32, [LINKS[k % len(LINKS)]], ALIGNED_SHAPES, seed=k)
    assert seen and all(seen)


def _offset_copy(x):
    """A copy of ``x`` that starts one element into its storage (an offset view: no address of
    it a multiple of 16 bytes)."""
    if isinstance(x, QTensor):
        return QTensor(_offset_copy(x.codes), _offset_copy(x.scale), x.shape, x.block_size, x.format)
    buf = torch.zeros(x.numel() + 1, dtype=x.dtype)
    view = buf[1:].view(x.shape)
    view.copy_(x)
    assert view.data_ptr() % 16 and view.is_contiguous()
    return view


OFFSET_CASES = [("adam", {}, "8bit", torch.float32), ("adam", {"amsgrad": True}, "4bit", torch.bfloat16),
                ("lion", {}, "fp32", torch.float32), ("muon", {}, "nf4", torch.float16)]


@NATIVE
@pytest.mark.parametrize("rule,variant,fmt,dtype", OFFSET_CASES, ids=[f"{r}-{f}" for r, _, f, _ in OFFSET_CASES])
@pytest.mark.parametrize("write", [True, False], ids=["write", "update"])
def test_triton_offset_views_take_the_general_variant_with_the_same_bits(rule, variant, fmt, dtype, write,
                                                                         monkeypatch):
    """Param, gradient and states as views one element into their storage, of a shape whose fresh
    tensors step aligned: the general variant, stepped in place in the views, the same bits as
    native (bfloat16 params rounded stochastically: the element's index in the leaf, not in the
    storage); fresh copies of the same values: the aligned variant, the same bits again."""
    spec, states, p, g, hyper = make_case(rule, variant, {"decay": True, "lr": True}, fmt, dtype, (8, 64), 32, 4)
    key = torch.tensor([5, 11]) if write and dtype is torch.bfloat16 else None
    want_p, want_out, want_states, _, _ = _run("native", spec, hyper, p, g, states, write=write, inplace=True,
                                               sr_key=key)
    seen = aligned_launches(monkeypatch)
    for form, copy in (("offset", _offset_copy), ("aligned", clone_state)):
        pp, gg, ss = copy(p), copy(g), tuple(copy(s) for s in states)
        outs, news = run_step(spec, hyper, [StepLeaf(pp, gg, ss, 3)], write=write, inplace=True, sr_key=key,
                              backend="triton")
        assert all(a is b for a, b in zip(news[0], ss))  # stepped in place, in the views
        assert same(pp, want_p) if write else same(outs[0], want_out), form
        assert all(map(same, ss, want_states)), form
    assert seen == [False, True]


def test_which_leaves_are_aligned():
    """The launch key's test: every address a multiple of 16 bytes, and the row length (the flat
    length without quantized states) a multiple of 32 and of the block unit."""
    from lowbit_tree.kernels.triton_backend import aligned

    torch.manual_seed(0)  # the values do not matter: the addresses and lengths do
    q = lt.quantize(torch.randn(4, 64), "8bit", 64, signed=True)
    g = torch.randn(4, 64)
    assert aligned(g, (q,), [torch.randn(4, 64)])
    assert not aligned(_offset_copy(g), (q,), [])  # the gradient
    assert not aligned(g, (_offset_copy(q),), [])  # the state's codes and scales
    assert not aligned(g, (q,), [g, _offset_copy(g)])  # an output or correction
    q48 = lt.quantize(torch.randn(4, 48), "8bit", 16, signed=True)
    assert not aligned(torch.randn(4, 48), (q48,), [])  # rows of 48: not whole vectors of 32
    q96 = lt.quantize(torch.randn(4, 96), "8bit", 64, signed=True)
    assert not aligned(torch.randn(4, 96), (q96,), [])  # 96: not whole blocks of 64
    assert aligned(torch.randn(3, 32), (torch.randn(3, 32),), [])  # float32 states: the flat length, 96
    assert not aligned(torch.randn(3, 11), (torch.randn(3, 11),), [])


@NATIVE
def test_a_launch_built_aligned_steps_a_later_offset_gradient_from_a_copy(monkeypatch):
    """A KernelPlan's launch is built once, aligned; a later step's gradient an offset view: the
    launch stays aligned and gives native's bits."""
    from lowbit_tree.kernels.plan import KernelPlan

    spec = StepSpec("adam", decay=True, lr=True)
    _, states, p, g, hyper = make_case("adam", {}, {"decay": True, "lr": True}, "8bit", torch.float32, (8, 64), 32, 2)
    grads = [g, _offset_copy(g * 0.5)]
    seen = aligned_launches(monkeypatch)
    got = {}
    for backend in ("native", "triton"):
        params, sts = [p.clone()], [tuple(clone_state(s) for s in states)]
        plan = KernelPlan(spec, params, sts, [0], write=True, backend=backend)
        for gr in grads:
            plan.run([gr], hyper, None)
        got[backend] = (params[0], sts[0])
    assert seen == [True, True]
    assert same(got["native"][0], got["triton"][0]) and all(map(same, got["native"][1], got["triton"][1]))


DTYPE_CASES = [("adam", {}, "8bit"), ("adam", {"amsgrad": True}, "4bit"), ("lion", {}, "fp8"), ("muon", {}, "nf4"),
               ("rmsprop", {"has_momentum": True, "centered": True}, "8bit_bnb"), ("ademamix", {}, "bf16"),
               ("adagrad", {}, "8bit"), ("momentum", {"nesterov": True}, "fp32"), ("adamax", {}, "4bit"),
               ("adadelta", {}, "fp8"), ("radam", {}, "nf4"), ("nadam", {}, "8bit")]


@NATIVE
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rule,variant,fmt", DTYPE_CASES, ids=[f"{r}-{f}" for r, _, f in DTYPE_CASES])
def test_triton_param_dtypes_and_stochastic_rounding(rule, variant, fmt, dtype):
    """bfloat16 (to nearest and stochastically: the same counter-based stream) and float16
    params, every fused-link set."""
    _check(rule, variant, fmt, dtype, LINKS, SHAPES[1:2])


@NATIVE
@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "fp32"])
@pytest.mark.parametrize("rule,variant", [("adam", {"amsgrad": True}), ("adamax", {})], ids=["amsgrad", "adamax"])
def test_triton_nonfinite_and_extreme_gradients(rule, variant, fmt):
    """Zero, huge, tiny (subnormal), infinite and NaN gradients: NaN scales and codes as native;
    then a step of finite gradients on those states (amsgrad's and Adamax's max keep a NaN state
    as cpu.c's does)."""
    spec = StepSpec(rule, **variant, decay=True, lr=True)
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(3, 70, generator=gen)
    g[0, :5] = torch.tensor([0.0, 1e30, -1e30, 1e-40, -3e-39])
    g[1, 3], g[1, 9], g[2, 64] = float("inf"), float("-inf"), float("nan")
    g[2, :64] = 0.0  # a block of zero gradients: zero scales
    _, states, p, _, hyper = make_case(rule, variant, {}, fmt, torch.float32, (3, 70), 32, 1)
    got = {}
    for backend in ("native", "triton"):
        pp, _, _, ss, _ = _run(backend, spec, hyper, p, g, states, write=True, inplace=True, index=0)
        got[backend] = (pp, ss)
    assert same(got["native"][0], got["triton"][0])
    assert all(map(same, got["native"][1], got["triton"][1]))
    assert torch.isnan(got["triton"][0]).any()  # the NaN reached the param, as on native
    finite = torch.randn(3, 70, generator=gen)
    again = {b: _run(b, spec, hyper, got["native"][0], finite, got["native"][1], write=True, inplace=True, index=0)
             for b in ("native", "triton")}
    assert same(again["native"][0], again["triton"][0])
    assert all(map(same, again["native"][3], again["triton"][3]))


def test_one_launch_per_static_combination(monkeypatch):
    """Five leaves of two static combinations (8-bit and 4-bit states): two launches, and the
    same bits as one call per leaf."""
    from lowbit_tree.kernels import triton_backend

    spec = StepSpec("adam", decay=True, lr=True)
    leaves, singles = [], []
    for i, (fmt, shape) in enumerate([("8bit", (4, 300)), ("4bit", (9, 33)), ("8bit", (700,)), ("4bit", (2, 5)),
                                      ("8bit", (3, 3, 3))]):
        _, states, p, g, hyper = make_case("adam", {}, {"decay": True, "lr": True}, fmt, torch.float32, shape, None, i)
        leaves.append(StepLeaf(p.clone(), g, tuple(clone_state(s) for s in states), i))
        singles.append(StepLeaf(p.clone(), g, tuple(clone_state(s) for s in states), i))
    launches = count_launches(monkeypatch)
    outs, news = run_step(spec, hyper, leaves, backend="triton")
    assert len(launches) == 2
    for i, leaf in enumerate(singles):
        o, n = run_step(spec, hyper, [leaf], backend="triton")
        assert same(o[0], outs[i]) and all(map(same, n[0], news[i]))


def test_a_rule_without_a_kernel_names_the_backends_that_have_it(monkeypatch):
    from lowbit_tree.kernels import triton_step

    monkeypatch.setattr(triton_step, "TRITON_RULES", tuple(r for r in triton_step.TRITON_RULES if r != "lion"))
    _, states, p, g, hyper = make_case("lion", {}, {}, "8bit", torch.float32, (2, 8), None, 0)
    with pytest.raises(NotImplementedError, match="no kernel for the lion rule; the backends that have it: "
                                                  "native, compiled, eager"):
        run_step(StepSpec("lion"), hyper, [StepLeaf(p, g, states)], backend="triton")


def test_the_kernel_has_every_declared_rule():
    from lowbit_tree.kernels import backend_choice, triton_backend, triton_step

    assert set(triton_step.TRITON_RULES) == set(RULE_DEFS)
    assert list(triton_backend.backend_rules()) == list(backend_choice.BACKENDS)


def test_rank1_records_step_on_triton_as_on_eager():
    """A rank-1 second moment under LOWBIT_TREE_BACKEND=triton (tests/test_triton_quant.py: every case)."""
    from lowbit_tree.rank1 import rank1_quantize

    torch.manual_seed(0)
    states = (lt.quantize(torch.randn(4, 6), "4bit", 128, signed=True), rank1_quantize(torch.rand(4, 6)))
    leaf = StepLeaf(None, torch.randn(4, 6), states)
    hyper = step_hyperparams(StepSpec("adam"))
    got, want = (run_step(StepSpec("adam"), hyper, [leaf], backend=b) for b in ("triton", "eager"))
    assert same(got[0][0], want[0][0]) and all(map(same, got[1][0], want[1][0]))


def test_interpreter_fma_is_correctly_rounded():
    """The fixture's fma (or triton's own, since pull request 11424) rounds once."""
    from triton.runtime import interpreter

    x, y = np.array([1.4142135], np.float32), np.array([1.7320508], np.float32)
    z = -(x * y)
    got = interpreter.InterpreterBuilder().create_fma(
        *(interpreter.TensorHandle(a, triton.language.float32) for a in (x, y, z))).data
    assert got[0] != 0 and got[0] == np_fma(x, y, z)[0]


@NATIVE
def test_functional_adamw8bit_under_triton_equals_native(monkeypatch):
    """The functional optimizer (its in-place plan and its pure update) under the triton backend."""
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 40), "b": torch.randn(40)}
    grads = [{k: torch.randn(v.shape) for k, v in params.items()} for _ in range(3)]
    from lowbit_tree.kernels import triton_backend

    results, launches = {}, count_launches(monkeypatch)
    for backend in ("native", "triton"):
        monkeypatch.setenv("LOWBIT_TREE_BACKEND", backend)
        tx = lt.adamw(1e-2, weight_decay=0.1, state_format="8bit", min_quant_size=0, block_size=32)
        p = {k: v.clone() for k, v in params.items()}
        state = tx.init(p)
        for g in grads:
            u, state = tx.update(g, state, p)
            p = lt.apply_updates(p, u)
        results[backend] = (p, state)
    assert len(launches) == 6  # two a step: w's 8-bit states, b's float32 (1-D) ones
    assert all(same(results["native"][0][k], results["triton"][0][k]) for k in params)
    import optree

    leaves = [optree.tree_leaves(results[b][1], namespace="lowbit_tree") for b in ("native", "triton")]
    assert len(leaves[0]) == len(leaves[1])
    assert all(same(a, b) for a, b in zip(*leaves))


def test_the_ptx_scan_finds_what_would_change_the_bits():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from triton_compile import scan_ptx

    assert scan_ptx("\tdiv.rn.f32 %f1, %f2, %f3;\n\tsqrt.rn.f32 %f4, %f1;", fma_allowed=False) == []
    assert scan_ptx("\tdiv.full.f32 %f1, %f2, %f3;\n\tsqrt.approx.ftz.f32 %f4, %f1;", False) == [
        ".ftz", "div.full", "sqrt.approx"]
    assert scan_ptx("\tadd.ftz.f32 %f1, %f2, %f3;", False) == [".ftz"]
    assert scan_ptx("\tadd.rn.f32 %f1, %f2, %f3; // .ftzx", False) == []
    assert scan_ptx("\tfma.rn.f32 %f1, %f2, %f3, %f4;", fma_allowed=False) == ["fma (the source writes none)"]
    assert scan_ptx("\tfma.rn.f32 %f1, %f2, %f3, %f4;", fma_allowed=True) == []


def test_the_load_widths_read_off_the_ptx():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from triton_compile import global_loads

    ptx = "\n".join(["\tld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];",
                     "\tld.global.L1::evict_last.v2.b32 {%r5, %r6}, [%rd2];", "\tld.global.b8 %rs1, [%rd3];",
                     "\tld.global.b64 %rd4, [%rd5];", "\tld.global.nc.v4.b32 {%r1,%r2,%r3,%r4}, [%rd6];",
                     "\tst.global.v4.b32 [%rd1], {%r1, %r2, %r3, %r4};"])
    assert global_loads(ptx) == {128: 2, 64: 1, 8: 1}  # the scalar 64-bit (an address) left out, stores too


def test_the_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """Two variants through the compile script (a process without the interpreter): PTX clean,
    registers from the cubin; Muon's lerps are fmas, AdamW has none; the aligned 8-bit AdamW loads
    its float32 params and gradients as 128-bit vectors without spills, the general variant as
    words."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "benchmarks/triton_compile.py", "--arch", "90", "--jobs", "1", "--cache",
                        str(tmp_path), "--only", "^(adam 8bit f32 write aligned|muon 4bit f32 write offset)$"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in r.stdout.splitlines() if "| 90 |" in line}
    adam, muon = rows["adam 8bit f32 write aligned"], rows["muon 4bit f32 write offset"]
    assert set(rows) == {"adam 8bit f32 write aligned", "muon 4bit f32 write offset"}
    assert int(adam[6]) == 0 and int(muon[6]) > 0  # fma column
    assert (int(adam[4]), int(adam[5]), int(adam[2])) == (128, 4, 0)  # widest load, 128-bit loads, spills
    assert int(muon[4]) == 32 and int(muon[5]) == 0
    assert "PTX scan: clean" in r.stdout


def test_links_are_not_specialised():
    """The fused links are a runtime int the compiled kernel takes as it is: no second compile for
    a link set whose bits are a multiple of 16 (or 1) (a process without the interpreter)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from lowbit_tree.kernels import triton_step as ts; "
            "print([p.name for p in ts.step_kernel.params if p.do_not_specialize])")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(env, PYTHONPATH=str(root)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "['links']"


@NATIVE
@pytest.mark.parametrize("write", [True, False], ids=["write", "update"])
def test_a_kernel_plan_launches_once_per_static_combination_over_tables_built_once(write, monkeypatch):
    """A KernelPlan (the bridge's and ``step_``'s in-place step) of five leaves in two static
    combinations: two launches a step, the launches' tables built at the first step only, bfloat16
    params rounded stochastically, the same bits as the native plan."""
    from lowbit_tree.kernels import triton_backend
    from lowbit_tree.kernels.plan import KernelPlan

    links = {"decay": True, "lr": True}
    spec = StepSpec("adam", **links)
    cases = [("8bit", (4, 300), torch.float32), ("4bit", (9, 33), torch.bfloat16), ("8bit", (700,), torch.float32),
             ("4bit", (2, 5), torch.bfloat16), ("8bit", (3, 3, 3), torch.float32)]
    made = [make_case("adam", {}, links, fmt, dt, shape, None, i) for i, (fmt, shape, dt) in enumerate(cases)]
    hyper = made[0][4]
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=gen).to(p.dtype) for _, _, p, _, _ in made] for _ in range(2)]
    key = torch.tensor([1, 2]) if write else None
    got = {}
    for backend in ("native", "triton"):
        params = [p.clone() for _, _, p, _, _ in made]
        states = [tuple(clone_state(s) for s in st) for _, st, _, _, _ in made]
        plan = KernelPlan(spec, params, states, list(range(len(made))), write=write, backend=backend)
        outs = []
        for step, gs in enumerate(grads):
            launches = count_launches(monkeypatch)
            outs.append(plan.run(gs, hyper, key))
            if backend == "triton":
                assert len(launches) == 2
                if step == 0:
                    held = [steps for _, steps in plan._compiled]
                else:
                    assert [steps for _, steps in plan._compiled] == held  # built once
        got[backend] = (params, states, outs)
    for a, b in zip(got["native"][0], got["triton"][0]):
        assert same(a, b)
    for sa, sb in zip(got["native"][1], got["triton"][1]):
        assert all(map(same, sa, sb))
    for oa, ob in zip(got["native"][2], got["triton"][2]):
        assert all(map(same, oa, ob))


BRIDGE_CASES = [0, 6, 16]  # AdamW 8-bit with decay; bfloat16 params rounded stochastically; SGD fp8 nesterov


@pytest.mark.parametrize("case", BRIDGE_CASES)
def test_bridge_equals_functional_under_triton(case, monkeypatch):
    """tests/test_bridge_is_core.py's check (four steps of a bridge class against the functional
    core, bit for bit) with every step on the triton backend, on smaller params."""
    import test_bridge_is_core as core

    from lowbit_tree.kernels import triton_backend

    monkeypatch.setenv("LOWBIT_TREE_BACKEND", "triton")
    monkeypatch.setattr(core, "SHAPES", [(4, 300), (7,), (2, 3, 200)])  # few rows: the interpreter's time
    launches = count_launches(monkeypatch)
    name, kw = core.CASES[case]
    core.test_bridge_equals_functional_core(name, kw, skip_nonfinite=False)
    assert len(launches) >= 8  # both sides' four steps ran on triton


@NATIVE
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rule,variant,fmt", [("adam", {}, "8bit"), ("lion", {}, "4bit"), ("muon", {}, "fp32")])
def test_triton_param_correction_matches_native(rule, variant, fmt, dtype):
    """bfloat16 / float16 params written with their int8 correction (lowbit_tree.correction): the
    corrected master plus the update, split into the param and the new correction, as native; with
    tiny, huge, zero, subnormal and non-finite params, and updates below half an ulp."""
    links = {"decay": True, "lr": True}
    spec, states, p, g, hyper = make_case(rule, variant, links, fmt, dtype, (3, 2, 129), 64, 5)
    gen = torch.Generator().manual_seed(9)
    flat = p.view(-1)
    flat[:8] = torch.tensor([0.0, -0.0, 1e-40, -1e-39, 3e38, float("inf"), float("nan"), 1e-3]).to(dtype)
    corr = torch.randint(-128, 128, p.shape, generator=gen, dtype=torch.int8)
    small = step_hyperparams(spec, count=2, b1=0.9, b2=0.99, lr=1e-6, weight_decay=0.1)  # updates below half an ulp
    for h in (hyper, small):
        got = {}
        for backend in ("native", "triton"):
            pp, _, _, ss, cc = _run(backend, spec, h, p, g, states, write=True, inplace=True, index=0, corr=corr)
            got[backend] = (pp, cc, ss)
        assert same(got["native"][0], got["triton"][0]) and torch.equal(got["native"][1], got["triton"][1])
        assert all(map(same, got["native"][2], got["triton"][2]))
        assert not torch.equal(got["triton"][1], corr)  # the corrections moved


def fsdp_triton_worker(rank, world, steps=3):
    """One rank: AdamW8bit, and AdamW8bit with bfloat16 params and their int8 correction, under
    FSDP2 stepping on the triton backend; the unsharded optimizer in this process on native; both
    fed the same global gradients: params and every gathered state equal bit for bit."""
    import copy

    import fsdp_workers as W
    from lowbit_tree.kernels import triton_backend

    launches, real = [], triton_backend.launch_kernel
    triton_backend.launch_kernel = lambda *a, **k: (launches.append(a[0]), real(*a, **k))[1]
    for fmt, dtype in (("8bit", torch.float32), ("8bitc", torch.bfloat16)):
        model = W.make_model(dtype=dtype)
        ref = copy.deepcopy(model)
        W.shard(model, world)
        opt, ref_opt = W.make_opt(model.parameters(), fmt), W.make_opt(ref.parameters(), fmt)
        for step in range(steps):
            W.set_global_grads(model, step)
            W.set_global_grads(ref, step)
            os.environ["LOWBIT_TREE_BACKEND"] = "triton"
            opt.step()
            os.environ["LOWBIT_TREE_BACKEND"] = "native"
            ref_opt.step()
        for p, rp in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), rp.detach(), rtol=0, atol=0, msg=f"{fmt} at {world} ranks")
        W.assert_states_equal(W.full_states(opt), W.full_states(ref_opt), exact=True, what=f"{fmt} at {world} ranks")
    assert len(launches) >= 2 * steps  # the sharded steps ran on triton


@NATIVE
@pytest.mark.extended  # two spawned ranks under the interpreter: a minute or two (CI's extended phase)
def test_fsdp2_two_ranks_under_triton_equal_native():
    """FSDP2 at 2 gloo ranks (uneven shards) with the triton backend == one process on native."""
    import fsdp_workers as W

    W.launch(fsdp_triton_worker, 2)
