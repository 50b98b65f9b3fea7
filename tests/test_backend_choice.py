"""The automatic backend choice per leaf: on CUDA triton where its kernel has the rule and every
state's kind, compiled otherwise (rank-1 and low-rank records), native on CPU, and
``LOWBIT_TREE_BACKEND`` / ``backend=`` overriding it.

No GPU here: the choice is asked for the device ``cuda`` with CPU tensors (the choice reads the
device's type only), and the split of one step between triton and the torch backend runs on CPU
tensors under Triton's interpreter with the CUDA test patched in. What this cannot show: that a
real CUDA step launches triton (``benchmarks/gpu_check.sh`` runs the step on a GPU)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel's module is imported (its @triton.jit)

import pytest
import torch

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]
pytest.importorskip("triton")

import lowbit_tree as lt  # noqa: E402
from lowbit_tree.kernels import RULES, StepLeaf, StepSpec, backend_choice, native, run_step, step_backend  # noqa: E402
from lowbit_tree.kernels import triton_backend  # noqa: E402
from lowbit_tree.lowrank import lowrank_zeros  # noqa: E402

from test_kernels_step import LINKS, make_case, same  # noqa: E402
from test_triton import count_launches  # noqa: E402

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it


def _leaf(rule, fmt, shape=(5, 40), bs=None, seed=0):
    spec, states, p, g, hyper = make_case(rule, {}, LINKS[1], fmt, torch.float32, shape, bs, seed)
    return spec, StepLeaf(p, g, tuple(states), 3), hyper


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("LOWBIT_TREE_BACKEND", raising=False)


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "fp32", "bf16"])
def test_cuda_picks_triton_for_the_rules_its_kernel_has(fmt, monkeypatch):
    for rule in RULES:  # the kernel has every declared rule (test_triton.py holds that)
        spec, leaf, _ = _leaf(rule, fmt)
        assert step_backend(spec, leaf, True, device=CUDA) == "triton", (rule, fmt)
        assert step_backend(spec, leaf, False, device=CUDA) == "triton", (rule, fmt)
    from lowbit_tree.kernels import triton_step

    # A rule the kernel lacked would take the compiled backend on CUDA.
    monkeypatch.setattr(triton_step, "TRITON_RULES", tuple(r for r in triton_step.TRITON_RULES if r != "lion"))
    spec, leaf, _ = _leaf("lion", fmt)
    assert step_backend(spec, leaf, True, device=CUDA) == "compiled"


def test_cuda_picks_triton_for_rank1_and_compiled_for_lowrank_records():
    spec, leaf, _ = _leaf("adam", "4bit-rank1")
    assert step_backend(spec, leaf, True, device=CUDA) == "triton"  # stepped as its float32 values
    muon = StepSpec("muon", lr=True)
    torch.manual_seed(0)
    g = torch.randn(8, 16)
    low = StepLeaf(torch.randn(8, 16), g, (lowrank_zeros((8, 16), 2, "4bit", 64),))
    assert step_backend(muon, low, True, device=CUDA) == "compiled"
    plain = StepLeaf(low.param, g, (lt.quantize(torch.zeros(8, 16), "4bit", 64, signed=True),))
    assert step_backend(muon, plain, True, device=CUDA) == "triton"  # the same leaf with a block record


def test_cuda_picks_compiled_for_leaves_the_kernel_does_not_take():
    spec, leaf, _ = _leaf("adam", "fp32")
    strided = tuple(s.t().contiguous().t() for s in leaf.states)  # non-contiguous states
    assert step_backend(spec, leaf._replace(states=strided), True, device=CUDA) == "compiled"
    p = torch.randn(40, 5, generator=torch.Generator().manual_seed(0)).t()  # a non-contiguous param written in place
    assert step_backend(spec, leaf._replace(param=p), True, device=CUDA) == "compiled"
    assert step_backend(spec, leaf._replace(param=p), False, device=CUDA) == "triton"


def test_cpu_picks_native_and_the_environment_overrides(monkeypatch):
    spec, leaf, _ = _leaf("adam", "8bit")
    rank1 = _leaf("adam", "4bit-rank1")[1]
    assert step_backend(spec, leaf, True) == ("native" if native.available() else "eager")
    for name in ("compiled", "eager", "triton"):
        monkeypatch.setenv("LOWBIT_TREE_BACKEND", name)
        assert step_backend(spec, leaf, True, device=CUDA) == name
        assert step_backend(spec, rank1, True, device=CUDA) == name  # named: every leaf, or its error
    monkeypatch.delenv("LOWBIT_TREE_BACKEND")
    assert step_backend(spec, leaf, True, device=CUDA, backend="compiled") == "compiled"


INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the interpreter")


def _to(s, device):
    """A copy of state ``s`` on ``device``."""
    if isinstance(s, torch.Tensor):
        return s.clone().to(device)
    return s.with_parts({k: getattr(s, k).clone().to(device) for k in s.CHILDREN})


def _copies(leaves, device):
    return [StepLeaf(x.param.clone().to(device), x.grad.clone().to(device), tuple(_to(s, device) for s in x.states),
                     x.index) for x in leaves]


def _same_leaves(leaves, ref, got, want):
    for x, y, gs, ws in zip(leaves, ref, got, want):
        assert same(x.param.cpu(), y.param.cpu())
        for s, t in zip(gs, ws):
            assert same((s.dequantize() if hasattr(s, "dequantize") else s).cpu(),
                        (t.dequantize() if hasattr(t, "dequantize") else t).cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(not native.available(), reason="no C compiler")
def test_a_cuda_step_launches_triton_by_itself_with_the_cpu_bits(monkeypatch):
    """What the tests above cannot show: on a GPU, with nothing asked for, the block-record leaf
    launches the triton kernel, the rank-1 leaf runs compiled, and the bits are the CPU's."""
    spec, a, hyper = _leaf("adam", "8bit", seed=1)
    b = _leaf("adam", "4bit-rank1", shape=(6, 33), seed=2)[1]._replace(index=4)
    launches = count_launches(monkeypatch)
    leaves = _copies((a, b), "cuda")
    _, got = run_step(spec, hyper.cuda(), leaves, write=True)
    assert len(launches) == 1
    ref = _copies((a, b), "cpu")
    _, want = run_step(spec, hyper, ref, write=True, backend="native")
    _same_leaves(leaves, ref, got, want)


@INTERPRETED
@pytest.mark.skipif(not native.available(), reason="no C compiler")
def test_one_step_takes_block_and_rank1_leaves_on_triton_with_the_same_bits(monkeypatch):
    """The CUDA choice on CPU tensors: the block-record leaf and the rank-1 leaf on triton
    (interpreted), in one call, equal to the native kernel's step bit for bit."""
    spec, a, hyper = _leaf("adam", "8bit", seed=1)
    b = _leaf("adam", "4bit-rank1", shape=(6, 33), seed=2)[1]._replace(index=4)
    monkeypatch.setattr(backend_choice, "auto_triton", lambda device, backend: True)
    launches = count_launches(monkeypatch)
    leaves = _copies((a, b), "cpu")
    _, got = run_step(spec, hyper, leaves, write=True, backend="compiled")
    assert len(launches) == 2  # a step launch per static combination: 8-bit states, 4-bit + rank-1 values
    ref = _copies((a, b), "cpu")
    _, want = run_step(spec, hyper, ref, write=True, backend="native")
    _same_leaves(leaves, ref, got, want)
