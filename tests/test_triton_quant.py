"""The triton quantizers and the rank-1 step under Triton's interpreter (``TRITON_INTERPRET=1``):
the same bits as the native kernel and the references (:mod:`lowbit_tree.qtensor`,
:mod:`lowbit_tree.rank1`): every block format and several block sizes, odd shapes, empty rows,
non-finite and bfloat16 inputs; the rank-1 step pure and in place, with bfloat16 params,
non-finite gradients and a shard's reduce.

And the acceptance of the GPU path: with the automatic choice made as for a CUDA device (CPU
tensors taken for CUDA ones, so triton runs under the interpreter) and every way into inductor
and the torch backend raising, every public optimizer class of ``bridge`` and every public
transformation of ``lowbit_tree`` (both found by introspection) steps its states in triton."""
from __future__ import annotations

import inspect
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported (their @triton.jit)

import pytest
import torch

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")]
triton = pytest.importorskip("triton")

import bridge  # noqa: E402
import lowbit_tree as lt  # noqa: E402
from lowbit_tree.formats import FORMATS, STATE_FORMATS, get_format  # noqa: E402
from lowbit_tree.kernels import (StepLeaf, dequantize_fast, dequantize_rows_fast, native, quantize_rows_fast,  # noqa: E402
                                 run_step)
from lowbit_tree.qtensor import QTensor, quantize_rows  # noqa: E402
from lowbit_tree.rank1 import Rank1QTensor, rank1_quantize  # noqa: E402
from lowbit_tree.record_base import Record  # noqa: E402

from test_kernels_step import clone_state, make_case, reference_step, same  # noqa: E402
from test_triton import DEVICE, exact_fma  # noqa: E402,F401  (exact_fma: an autouse fixture)

NATIVE = pytest.mark.skipif(not native.available(), reason="no C compiler")


def _to(x, dev):
    if x is None:
        return None
    if isinstance(x, Record):
        return x.with_parts({name: getattr(x, name).to(dev) for name in x.CHILDREN})
    return x.to(dev)


def _native_quantize(x2, fmt, bs):
    rows, r = x2.shape
    codes = torch.empty(rows, (r + 1) // 2 if fmt.bits == 4 else r, dtype=torch.uint8)
    scale = torch.empty(rows, -(-r // bs), dtype=torch.float32)
    if x2.numel():
        native.quantize(x2.float().contiguous(), fmt.name, bs, codes, scale)
    else:
        codes.zero_(), scale.zero_()
    return codes, scale


# ------------------------------------------------------------------------- the fast quantizers
QUANT_FORMATS = sorted(FORMATS) + sorted(STATE_FORMATS)
"""Every concrete format and every optimizer-level name (its first-moment format)."""
QUANT_SHAPES = [((5, 37), 16), ((3, 300), 256), ((7, 13), 7), ((2, 1000), 128), ((4, 129), 64), ((0, 40), 32),
                ((3, 0), 32), ((1, 1), 256), ((6, 50), 100)]
"""Odd rows, partial last blocks, rows shorter and longer than a tile, empty rows and empty
columns, block sizes from 7 to 256 (odd ones take the masked block maxima)."""


def _input(shape, fmt, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)
    if not fmt.signed:
        x = x.abs()
    flat = x.view(-1)
    if flat.numel() > 40:  # non-finite inputs: their blocks' scales become NaN
        flat[3], flat[17], flat[33] = float("nan"), float("inf"), -float("inf")
        flat[5] = -1.0  # a negative value of an unsigned format: its block is NaN too
        flat[21] = 0.0
    return x.to(dtype)


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", QUANT_FORMATS)
def test_fast_quantizers_match_native_and_reference(name, dtype):
    fmt = get_format(name)
    for i, (shape, bs) in enumerate(QUANT_SHAPES):
        x = _input(shape, fmt, dtype, i)
        codes, scale = quantize_rows_fast(_to(x, DEVICE), name, bs, backend="triton")
        codes, scale = _to(codes, "cpu"), _to(scale, "cpu")
        assert codes.dtype == fmt.code_dtype and scale.dtype is torch.float32
        ref_codes, ref_scale = quantize_rows(x, fmt, bs)
        nat_codes, nat_scale = _native_quantize(x, fmt, bs)
        where = (name, shape, bs, dtype)
        assert same(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and same(scale, ref_scale), where
        assert torch.equal(codes.view(torch.uint8), nat_codes), where
        assert torch.equal(scale.view(torch.int32), nat_scale.view(torch.int32)), where  # NaN bits too
        got = _to(dequantize_rows_fast(_to(codes, DEVICE), _to(scale, DEVICE), name, bs, shape[1], backend="triton"),
                  "cpu")
        want = torch.empty(shape, dtype=torch.float32)
        if x.numel():
            native.dequantize(nat_codes, nat_scale, fmt.name, bs, shape[1], want)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), where
        q = QTensor(ref_codes, ref_scale, shape, bs, fmt.name)
        assert same(got, lt.dequantize(q)), where
        got_q = dequantize_fast(_to(q, DEVICE), torch.bfloat16, backend="triton")
        assert same(_to(got_q, "cpu"), lt.dequantize(q, torch.bfloat16)), where


def test_fast_quantizers_name_a_block_too_long_for_the_tile():
    x = torch.ones(2, 10000)
    with pytest.raises(ValueError, match="block_size=8193 does not fit the triton kernels' tile"):
        quantize_rows_fast(x, "8bit", 8193, backend="triton")


# ----------------------------------------------------------------------------- the rank-1 step
RANK1_SHAPES = [((37, 301), None), ((5, 16), 7), ((3, 2, 129), 64), ((2, 2100), None), ((1, 3), None),
                ((0, 9), None)]
"""Odd rows and columns, short rows, a 3-D param, rows longer than a rank-1 program, one
element, no rows."""


def _rank1_run(backend, spec, hyper, p, g, states, *, write, inplace, sr_key=None):
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    pp, gg = _to(p.clone(), dev), _to(g, dev)
    ss = tuple(_to(clone_state(s), dev) for s in states)
    outs, news = run_step(spec, _to(hyper, dev), [StepLeaf(pp, gg, ss, 3)], write=write, inplace=inplace,
                          sr_key=sr_key, backend=backend)
    if inplace:
        assert all(a is b for a, b in zip(news[0], ss))
    return (_to(pp, "cpu") if write else _to(outs[0], "cpu")), tuple(_to(n, "cpu") for n in news[0]), \
        tuple(_to(s, "cpu") for s in ss)


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", [{}, {"amsgrad": True}], ids=["adam", "amsgrad"])
def test_rank1_step_matches_native_and_reference(variant, dtype):
    """4-bit first moments and rank-1 second moments (amsgrad's maxima rank-1 too): the update, the
    param written in place (stochastically rounded bfloat16 too), the new records, pure and in
    place; gradients with a NaN and an inf (NaN and inf maxima of their row and column)."""
    for si, (shape, bs) in enumerate(RANK1_SHAPES):
        spec, states, p, g, hyper = make_case("adam", variant, dict(decay=True, lr=True), "4bit-rank1", dtype,
                                              shape, bs, 20 + si)
        if g.numel() > 40:
            g = g.clone()
            g.view(-1)[7], g.view(-1)[-5] = float("nan"), float("inf")
        for write in (False, True):
            key = torch.tensor([5, 11]) if write and dtype is torch.bfloat16 else None
            want_out, want_states = reference_step(spec, hyper, p, g, states, write=write, sr_key=key, index=3)
            for inplace in (False, True):
                results = {}
                for backend in ("native", "triton"):
                    out, news, passed = _rank1_run(backend, spec, hyper, p, g, states, write=write, inplace=inplace,
                                                   sr_key=key)
                    if not inplace:
                        assert all(same(a, b) for a, b in zip(passed, states))  # untouched
                    results[backend] = out, news
                where = (variant, dtype, shape, bs, write, inplace)
                (n_out, n_news), (t_out, t_news) = results["native"], results["triton"]
                assert same(t_out, n_out) and same(t_out, want_out), where
                assert all(map(same, t_news, n_news)) and all(map(same, t_news, want_states)), where
                for a, b in zip(t_news, n_news):  # the maxima's bits, NaN's included
                    if isinstance(a, Rank1QTensor):
                        assert torch.equal(a.row_max.view(torch.int32), b.row_max.view(torch.int32)), where
                        assert torch.equal(a.col_max.view(torch.int32), b.col_max.view(torch.int32)), where


def test_rank1_reduce_is_called_in_leaf_order_on_triton():
    """Each rank-1 record's reduce (a collective across shards) once per step, in leaf order, an
    empty shard's too; the records keep what it returns, as the reference's rank1_quantize does."""
    calls = []

    def reduce_named(name):
        def reduce(row_max, col_max):
            calls.append(name)
            return row_max, col_max * 2
        return reduce

    gen = torch.Generator().manual_seed(4)
    spec, hyper = make_case("adam", {}, dict(decay=True, lr=True), "4bit-rank1", torch.float32, (2, 2), None, 0)[::4]
    leaves = []
    for name, shape in (("a", (6, 40)), ("b", (0, 40)), ("c", (9, 7))):
        m = lt.quantize(torch.randn(shape, generator=gen) * 1e-2, "4bit", None, signed=True)
        v = rank1_quantize(torch.rand(shape, generator=gen) * 1e-4)
        v = Rank1QTensor(v.codes, v.row_max, v.col_max, v.shape, v.format, reduce_named(name))
        leaves.append(StepLeaf(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), (m, v)))
    outs, news = run_step(spec, hyper, leaves, backend="triton")
    assert calls == ["a", "b", "c"]
    for k, leaf in enumerate(leaves):
        want_out, want_states = run_step(spec, hyper, [leaf], backend="eager")
        assert same(outs[k], want_out[0]) and all(map(same, news[k], want_states[0])), k


# ------------------------------------------------------------ acceptance: nothing reaches inductor
class ReachedTorchBackend(AssertionError):
    pass


@pytest.fixture
def cuda_choice(monkeypatch):
    """The automatic backend choice made as for a CUDA device (CPU tensors taken for CUDA ones:
    triton runs them under the interpreter), torch.compile and the torch backend's entry points
    raising (compiled: inductor, whose float32 division is not div_rn; eager: on CUDA checked by
    no test); yields the list of triton launches (kernel names) made."""
    if os.environ.get("TRITON_INTERPRET") != "1":  # on a GPU the real CUDA choice runs in the bit tests
        pytest.skip("CPU tensors need the interpreter")
    from lowbit_tree.kernels import backend_choice, torch_backend

    real_for, real_auto = backend_choice.backend_for, backend_choice.auto_triton
    cuda = torch.device("cuda")

    def as_cuda(device):
        return cuda if torch.device(device).type == "cpu" else device

    fakes = {"backend_for": (real_for, lambda device, backend=None: real_for(as_cuda(device), backend)),
             "auto_triton": (real_auto, lambda device, backend: real_auto(as_cuda(device), backend))}
    for mod in list(sys.modules.values()):  # every module that holds them (imported by name too)
        if getattr(mod, "__name__", "").startswith(("lowbit_tree", "bridge")):
            for name, (real, fake) in fakes.items():
                if getattr(mod, name, None) is real:
                    monkeypatch.setattr(mod, name, fake)
    monkeypatch.delenv("LOWBIT_TREE_BACKEND", raising=False)

    def refuse(what):
        def f(*args, **kwargs):
            raise ReachedTorchBackend(f"{what} was called: on CUDA the torch backend runs it (through inductor "
                                      "where it compiles), not the triton kernels")
        return f

    monkeypatch.setattr(torch, "compile", refuse("torch.compile"))
    for name in ("_compiled", "_run", "step_leaves", "CompiledSteps"):  # compiled, and eager where it is not
        monkeypatch.setattr(torch_backend, name, refuse(f"torch_backend.{name}"))
    launches = []
    from triton.runtime.interpreter import InterpretedFunction

    real_run = InterpretedFunction.run

    def run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    yield launches


def _bridge_classes() -> list:
    return sorted((name for name, obj in vars(bridge).items()
                   if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer) and not name.startswith("_")))


def _transformations() -> list:
    """The public functions of lowbit_tree that make a transformation from numbers alone (the
    combinators, which take transformations, are stepped through the optimizers' own)."""
    out = []
    for name in lt.__all__:
        obj = getattr(lt, name)
        if not inspect.isfunction(obj):
            continue
        sig = inspect.signature(obj)
        if "GradientTransformation" not in str(sig.return_annotation):
            continue
        if any("GradientTransformation" in str(p.annotation) or p.kind is p.VAR_POSITIONAL
               for p in sig.parameters.values()):
            continue
        out.append(name)
    return out


REQUIRED = {"learning_rate": 1e-2, "step_size": 0.5, "momentum": 0.9, "max_norm": 1.0}
"""What a transformation's required arguments get (by name); one not here fails the test."""
EXTRA = {"SOAP": dict(precondition_frequency=2), "SOAP4bit": dict(precondition_frequency=2),
         "SOAP8bit": dict(precondition_frequency=2), "soap": dict(precondition_frequency=2),
         "scale_by_soap": dict(precondition_frequency=2), "SGD": dict(momentum=0.9), "SGD8bit": dict(momentum=0.9)}
"""SOAP's bases refreshed every 2 steps (the first step makes them); SGD with a momentum state."""
VARIANTS = {"Muon8bit": [{}, dict(momentum_rank=4)], "Muon4bit": [{}, dict(momentum_rank=4)],
            "muon": [{}, dict(momentum_rank=4)], "scale_by_muon": [{}, dict(momentum_rank=4)]}
"""Muon's low-rank buffers (their residual through the fast quantizers) beside its defaults."""


STEPS = 2
"""Steps of each: the first creates the states (SOAP its bases), the second steps them."""
MIN_QUANT = 256
"""Quantized states from 256 elements: the matrices below get them (the interpreter is slow)."""


def _params():
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(24, 40, generator=gen) * 0.1, "v": torch.randn(40, 24, generator=gen) * 0.1,
            "b": torch.randn(40, generator=gen) * 0.1}


def _grads(step):
    gen = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=gen) * 0.01 for k, v in _params().items()}


def _step_class(name: str, kwargs: dict) -> None:
    cls = getattr(bridge, name)
    ps = {k: torch.nn.Parameter(v) for k, v in _params().items()}
    params = list(ps.values())
    if "Muon" in name:  # its matrices, and the bias in a group of its AdamW
        params = [{"params": [ps["w"], ps["v"]]}, {"params": [ps["b"]], "use_muon": False}]
    if cls is bridge.LowBitOptimizer:
        opt = cls(params, lambda lr: lt.adamw(lr, state_format="4bit", min_quant_size=MIN_QUANT), {"lr": 1e-2})
    else:
        opt = cls(params, lr=1e-2, min_quant_size=MIN_QUANT, **EXTRA.get(name, {}), **kwargs)
    for step in range(STEPS):
        for k, p in ps.items():
            p.grad = _grads(step)[k]
        opt.step()
    assert all(torch.isfinite(p).all() for p in ps.values())


def _step_transformation(name: str, kwargs: dict) -> None:
    fn = getattr(lt, name)
    args = dict(kwargs, **EXTRA.get(name, {}))
    sig = inspect.signature(fn).parameters
    if "min_quant_size" in sig:
        args.setdefault("min_quant_size", MIN_QUANT)
    for pname, prm in sig.items():
        if prm.default is prm.empty and pname not in args:
            assert pname in REQUIRED, f"{name} requires {pname!r}: give it a value in REQUIRED"
            args[pname] = REQUIRED[pname]
    tx = fn(**args)
    params = _params()
    if name in ("muon", "scale_by_muon"):
        params.pop("b")  # Muon takes matrices
    state = tx.init(params)
    for step in range(STEPS):
        grads = {k: v for k, v in _grads(step).items() if k in params}
        updates, state = tx.update(grads, state, params)
        params = lt.apply_updates(params, updates)
    assert all(torch.isfinite(v).all() for v in params.values())


CLASS_CASES = [(n, kw) for n in _bridge_classes() for kw in VARIANTS.get(n, [{}])]
TRANSFORM_CASES = [(n, kw) for n in _transformations()
                   for kw in VARIANTS.get(n, [{}]) + ([dict(state_format="4bit")] if "state_format" in
                                                      inspect.signature(getattr(lt, n)).parameters and n not in
                                                      ("soap", "scale_by_soap") else [])]


def test_the_walk_finds_the_public_classes_and_transformations():
    assert {"AdamW4bit", "SOAP8bit", "Muon8bit", "LowBitOptimizer", "SGD"} <= set(_bridge_classes())
    assert {"adamw", "muon", "soap", "scale_by_adam", "trace", "scale_by_learning_rate"} <= set(_transformations())


@pytest.mark.parametrize("name,kwargs", CLASS_CASES, ids=[n + "".join(f"-{k}" for k in kw) for n, kw in CLASS_CASES])
def test_public_class_on_cuda_steps_in_triton(cuda_choice, name, kwargs):
    """Two steps of the class (a float32 matrix given quantized states, its transpose, a bias) with the automatic choice made as for CUDA: nothing compiles, and triton runs."""
    _step_class(name, kwargs)
    if name.endswith(("8bit", "4bit", "Fp8")):  # quantized states: their steps launch triton
        assert cuda_choice, "no triton launch: the simulated CUDA choice did not take effect"


@pytest.mark.parametrize("name,kwargs", TRANSFORM_CASES,
                         ids=[n + "".join(f"-{k}={v}" for k, v in kw.items()) for n, kw in TRANSFORM_CASES])
def test_public_transformation_on_cuda_steps_in_triton(cuda_choice, name, kwargs):
    """Two steps of each transformation (tx.update, then apply_updates) as for CUDA."""
    _step_transformation(name, kwargs)


def test_the_walk_fails_where_the_torch_backend_is_reached(cuda_choice, monkeypatch):
    """The check can fail: the fast quantizers sent to the compiled backend reach the refusal (as
    they did before the triton quantizers, and AdamW4bit's rank-1 step, on the eager torch backend)."""
    from lowbit_tree.kernels import fast_quant

    monkeypatch.setattr(fast_quant, "_backend", lambda device, backend, block_size: "compiled")
    with pytest.raises(ReachedTorchBackend):
        _step_class("SOAP8bit", {})
