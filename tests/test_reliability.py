"""Reliability: the native build's failure modes, GPU-style device discipline checked on CPU
(default device ``meta``), corrupted and mismatched checkpoints, non-finite gradient storms,
and a rank killed in the middle of a distributed checkpoint save.

Build tests run in fresh subprocesses (the library is loaded once per process) with their own
``LOWBIT_TREE_CACHE``.
"""
from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

# imported here, with the CPU as default device: lowbit_tree.kernels builds its code tables at
# import on the default device (see test_import_with_another_default_device)
import bridge  # noqa: F401
import lowbit_tree as lt  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTICE = "the native CPU kernel is unavailable"


def _python(code: str, env_extra: dict, *, drop=(), path=None, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra)
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


PROBE = """
    import warnings
    warnings.simplefilter("always")
    from lowbit_tree.kernels import native as kernels_cpu
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = kernels_cpu.library()
        again = kernels_cpu.library()  # cached: no second notice
    print("AVAILABLE", lib is not None)
    print("ERROR", kernels_cpu.build_error())
    for w in caught:
        print("WARNING", w.category.__name__, str(w.message).replace("\\n", " "))
"""


def _lines(out: str, tag: str) -> list[str]:
    return [line[len(tag) + 1:] for line in out.splitlines() if line.startswith(tag + " ")]


# ----------------------------------------------------------------------------
# native build (slow: each test starts a fresh interpreter, and one builds the kernel)
# ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("cc_kind", ["missing", "not_a_compiler", "failing"])
def test_broken_cc_names_cc_and_leaves_no_temp_file(tmp_path, cc_kind):
    """A CC that does not exist, is not executable as a program, or exits non-zero: the library
    is unavailable, build_error() and the one RuntimeWarning name CC, the cache holds no file."""
    cache = tmp_path / "cache"
    if cc_kind == "missing":
        cc = str(tmp_path / "no-such-compiler")
    elif cc_kind == "not_a_compiler":
        cc = str(tmp_path / "garbage")
        with open(cc, "wb") as f:
            f.write(bytes(range(64)))  # executable bit, no valid format: exec fails
        os.chmod(cc, 0o755)
    else:
        cc = str(tmp_path / "badcc")
        with open(cc, "w") as f:
            f.write(textwrap.dedent("""\
                #!/bin/sh
                # writes a partial output file, as a failing linker can, then fails
                while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
                echo partial > "$out"
                echo 'badcc: simulated failure' >&2
                exit 3
                """))
        os.chmod(cc, 0o755)
    done = _python(PROBE, {"CC": cc, "LOWBIT_TREE_CACHE": str(cache)}, drop=("LOWBIT_TREE_BACKEND"))
    assert done.returncode == 0, done.stderr
    assert _lines(done.stdout, "AVAILABLE") == ["False"], done.stdout
    err = _lines(done.stdout, "ERROR")[0]
    assert "CC" in err and cc in err, err
    if cc_kind == "failing":
        assert "exit status 3" in err and "simulated failure" in err, err
    warns = _lines(done.stdout, "WARNING")
    assert len(warns) == 1 and warns[0].startswith("RuntimeWarning"), warns
    assert NOTICE in warns[0] and "LOWBIT_TREE_BACKEND=eager" in warns[0] and "CC" in warns[0], warns
    assert not cache.exists() or list(cache.iterdir()) == [], list(cache.iterdir())


@pytest.mark.slow
def test_built_library_is_readable_by_others(tmp_path):
    """A fresh build in an empty cache: loads, and the cached .so is rwxr-xr-x (not mkstemp's 0600)."""
    cache = tmp_path / "cache"
    done = _python(PROBE, {"LOWBIT_TREE_CACHE": str(cache)}, drop=("CC"))
    assert done.returncode == 0, done.stderr
    if _lines(done.stdout, "AVAILABLE") != ["True"]:
        pytest.skip(f"no working C compiler here: {_lines(done.stdout, 'ERROR')}")
    assert _lines(done.stdout, "ERROR") == ["None"] and _lines(done.stdout, "WARNING") == []
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".so", files
    mode = stat.S_IMODE(files[0].stat().st_mode)
    assert mode in (0o644, 0o755), oct(mode)


@pytest.mark.slow
def test_disabled_library_says_why_without_a_notice(tmp_path):
    done = _python(PROBE, {"LOWBIT_TREE_BACKEND": "eager", "LOWBIT_TREE_CACHE": str(tmp_path)}, drop=("CC",))
    assert done.returncode == 0, done.stderr
    assert _lines(done.stdout, "AVAILABLE") == ["False"]
    assert "LOWBIT_TREE_BACKEND=eager" in _lines(done.stdout, "ERROR")[0]
    assert _lines(done.stdout, "WARNING") == []


def _python_only_path(tmp_path) -> str:
    """A PATH holding nothing but ``python``: this interpreter, with its environment. A script
    that execs ``sys.executable`` rather than a symlink to it: Python finds a virtual
    environment from the path it was started by (``pyvenv.cfg`` beside it), so a symlink
    elsewhere starts the base interpreter without the environment's packages."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    return str(bin_dir)


@pytest.mark.slow
def test_no_compiler_reports_it_once(tmp_path):
    """PATH holds only the interpreter and CC is unset: build_error() says there is no compiler."""
    done = _python(PROBE, {"LOWBIT_TREE_CACHE": str(tmp_path / "cache")}, drop=("CC", "LOWBIT_TREE_BACKEND"),
                   path=_python_only_path(tmp_path))
    assert done.returncode == 0, done.stderr
    assert _lines(done.stdout, "AVAILABLE") == ["False"]
    assert "no C compiler" in _lines(done.stdout, "ERROR")[0]
    warns = _lines(done.stdout, "WARNING")
    assert len(warns) == 1 and NOTICE in warns[0], warns


@pytest.mark.slow  # a demo run in a fresh interpreter (~50 s when the machine is busy)
@pytest.mark.demo  # the demo plots its curves
def test_demo_without_a_compiler(tmp_path):
    """``python -m bridge demo --tiny`` with PATH = only the interpreter and no CC: it runs to the
    end on the fallback backend and prints exactly one notice that the native kernel is missing."""
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "LOWBIT_TREE_BACKEND")}
    env.update(PATH=_python_only_path(tmp_path), LOWBIT_TREE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), MPLCONFIGDIR=str(tmp_path / "mpl"))
    done = subprocess.run([os.path.join(env["PATH"], "python"), "-m", "bridge", "demo", "--tiny", "--no-progress",
                           "--steps", "4", "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    assert text.count(NOTICE) == 1, text[-4000:]
    assert "8bit" in done.stdout and (tmp_path / "out" / "results.json").exists()


# ----------------------------------------------------------------------------
# device discipline: nothing allocates on the default device
# ----------------------------------------------------------------------------
def test_import_with_another_default_device():
    """Importing the package while the default device is not the CPU, then training on CPU
    tensors: module-level tables must still be CPU tensors. In a subprocess: on failure the
    native kernel may crash the process instead of raising."""
    done = _python("""
        import torch
        torch.set_default_device("meta")
        import bridge
        torch.set_default_device("cpu")
        torch.manual_seed(0)
        m = torch.nn.Linear(64, 48)
        opt = bridge.AdamW8bit(m.parameters(), min_quant_size=1)
        m(torch.randn(3, 64)).sum().backward()
        opt.step()
        assert torch.isfinite(m.weight).all()
        print("OK")
    """, {})
    assert done.returncode == 0 and "OK" in done.stdout, (done.returncode, done.stderr[-2000:])


@pytest.fixture
def meta_default_device():
    """``torch.set_default_device("meta")`` for the test, restored after: inputs are placed on
    the CPU explicitly, so any allocation that forgets ``device=`` lands on ``meta`` and the
    next op mixing it with CPU tensors fails, as a CPU allocation next to CUDA tensors would."""
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(before)
    assert torch.get_default_device() == before


CPU = torch.device("cpu")


def _cpu_randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device=CPU)


def _assert_on_cpu(q):
    assert q.codes.device == CPU and q.scale.device == CPU, (q.codes.device, q.scale.device)


@pytest.mark.parametrize("fmt", ["dynamic8", "dynamic8_sqrt", "dynamic4", "linear4_unsigned", "e4m3", "e4m3_sqrt"])
def test_reference_quantize_dequantize_keep_the_input_device(meta_default_device, fmt):
    signed = lt.get_format(fmt).signed
    for shape, bs in (((13, 37), 8), ((5,), 3), ((0, 7), 4), ((3, 0), 4), ((2, 3, 11), 5)):
        x = _cpu_randn(*shape, seed=sum(shape) + bs)
        x = x if signed else x.abs()
        q = lt.quantize(x, fmt, bs)
        _assert_on_cpu(q)
        y = lt.dequantize(q)
        assert y.device == CPU and y.shape == x.shape
        z = lt.zeros(shape, fmt, bs, device=CPU)
        _assert_on_cpu(z)
        assert torch.equal(lt.dequantize(z), torch.zeros(shape, device=CPU))
    # the same bits as with the CPU as default device
    torch.set_default_device("cpu")  # the comparison itself (not the code under test)
    ref = lt.dequantize(lt.quantize(x, fmt, bs))
    torch.set_default_device("meta")
    assert torch.equal(y, ref)


@pytest.mark.parametrize("fmt", ["dynamic8", "dynamic4", "e4m3"])
def test_qstate_gather_ops_on_uneven_and_empty_shards(meta_default_device, fmt):
    """What ``full_tensor()`` does to uneven shards (pad the short ones, all-gather = cat, slice
    the padding off), on rows 5+5+3 and 2+1+0 (an empty shard), with CPU inputs."""
    from bridge import QState

    aten = torch.ops.aten
    for rows, split in ((13, [5, 5, 3]), (3, [2, 1, 0])):
        x = _cpu_randn(rows, 11, seed=rows)
        whole = QState.from_float(x, fmt, 4)
        shards = torch.split(whole, split)
        assert [s.shape[0] for s in shards] == split
        width = max(split)
        padded = [aten.constant_pad_nd.default(s, [0, 0, 0, width - s.shape[0]]) for s in shards]
        for p in padded:
            _assert_on_cpu(p)
            assert p.shape == (width, 11)
        gathered = torch.cat(padded)
        _assert_on_cpu(gathered)
        back = torch.cat([gathered[i * width: i * width + n] for i, n in enumerate(split)])
        assert torch.equal(back.codes.view(torch.uint8), whole.codes.view(torch.uint8))
        assert torch.equal(back.scale, whole.scale)
        assert torch.equal(back.dequantize(), whole.dequantize())
        empty = whole.new_zeros((0, 11))
        _assert_on_cpu(empty)
        for like in (torch.zeros_like(whole), torch.empty_like(whole), whole.clone(), whole.detach(), whole.to(CPU)):
            _assert_on_cpu(like)
        z = torch.zeros_like(whole)
        z.copy_(x)  # a float32 tensor quantized into a QState
        assert torch.equal(z.scale, whole.scale)


@pytest.mark.parametrize("fmt", ["dynamic8", "dynamic4", "e4m3"])
def test_qstate_ops_allocate_on_the_state_device(fmt):
    """The same ops on states whose codes and scales live on ``meta`` (default device: CPU).
    Inside ``__torch_dispatch__`` the default-device mode does not apply, so this is the check
    that reaches a bare ``torch.zeros(...)`` there: it would be a CPU tensor next to meta ones."""
    from bridge import QState

    aten = torch.ops.aten
    meta = torch.device("meta")
    for rows, split in ((13, [5, 5, 3]), (3, [2, 1, 0])):
        whole = QState.zeros((rows, 11), fmt, 4, device=meta)
        shards = torch.split(whole, split)
        width = max(split)
        padded = [aten.constant_pad_nd.default(s, [0, 0, 0, width - s.shape[0]]) for s in shards]
        gathered = torch.cat(padded)
        back = torch.cat([gathered[i * width: i * width + n] for i, n in enumerate(split)])
        outs = padded + [gathered, back, whole.new_zeros((0, 11)), torch.zeros_like(whole), whole.clone()]
        for q in outs:
            assert q.codes.device == meta and q.scale.device == meta, (q.codes.device, q.scale.device)
        assert back.shape == whole.shape and back.codes.shape == whole.codes.shape


def test_optimizer_state_dict_round_trip_keeps_the_device(meta_default_device):
    """A bridge optimizer's state_dict / torch.save / torch.load / load_state_dict with the
    default device on meta: every loaded state is on the CPU and equal to the saved one."""
    import io

    torch.set_default_device("cpu")  # build and step outside the code under test
    model = torch.nn.Sequential(torch.nn.Linear(19, 33), torch.nn.Linear(33, 7))
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-2, min_quant_size=64, block_size=16)
    for step in range(3):
        model(_cpu_randn(5, 19, seed=step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    fresh = bridge.AdamW8bit(model.parameters(), lr=1e-2, min_quant_size=64, block_size=16)
    torch.set_default_device("meta")

    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh.load_state_dict(loaded)
    for p in model.parameters():
        for name, v in opt.state[p].items():
            w = fresh.state[p][name]
            a = v.codes.view(torch.uint8) if hasattr(v, "codes") else v
            b = w.codes.view(torch.uint8) if hasattr(w, "codes") else w
            assert b.device == CPU, (name, b.device)
            assert torch.equal(a, b), name
            if hasattr(v, "scale"):
                assert w.scale.device == CPU and torch.equal(v.scale, w.scale), name
    torch.set_default_device("cpu")
    export = opt.torch_state_dict()
    torch.set_default_device("meta")
    again = fresh.torch_state_dict()
    for i, st in export["state"].items():
        for k, v in st.items():
            assert again["state"][i][k].device == CPU and torch.equal(again["state"][i][k], v), (i, k)


# ----------------------------------------------------------------------------
# corrupted and mismatched checkpoints: a clear error, and nothing changed
# ----------------------------------------------------------------------------
def _trained(cls=None, shapes=((37, 29), (29, 11)), steps=3, seed=0, **kw):
    cls = cls or bridge.AdamW8bit
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in shapes]
    model = torch.nn.Sequential(*layers)
    opt = cls(model.parameters(), lr=1e-2, min_quant_size=64, **kw)
    for step in range(steps):
        model(_cpu_randn(4, shapes[0][0], seed=100 + step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _snapshot(opt) -> dict:
    """Every state tensor (codes as uint8, scales, fp32 states, steps) and every group option."""
    out = {}
    for gi, g in enumerate(opt.param_groups):
        for k, v in g.items():
            if k != "params":
                out[f"group{gi}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
        for pi, p in enumerate(g["params"]):
            for name, v in opt.state[p].items():
                if isinstance(v, bridge.QState):
                    out[f"{gi}/{pi}/{name}::codes"] = v.codes.view(torch.uint8).clone()
                    out[f"{gi}/{pi}/{name}::scale"] = v.scale.clone()
                    out[f"{gi}/{pi}/{name}::meta"] = (v.format, v.block_size, tuple(v.shape))
                else:
                    out[f"{gi}/{pi}/{name}"] = v.clone()
    return out


def _assert_same_snapshot(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k  # NaN-free states here
        else:
            assert a[k] == b[k], k


def _corrupt_scale(sd):
    sd["state"][0]["exp_avg_sq"]["scale"].view(-1)[3] *= -1  # what a flipped sign bit on disk gives


def _drop_codes(sd):
    del sd["state"][0]["exp_avg"]["codes"]


def _float_codes(sd):
    sd["state"][0]["exp_avg"]["codes"] = sd["state"][0]["exp_avg"]["codes"].float()


def _nan_step(sd):
    sd["state"][1]["step"] = torch.tensor(float("nan"))


def _other_version(sd):
    sd["param_groups"][0]["lowbit_tree_version"] = 99


CORRUPTIONS = {
    "negative scale": (_corrupt_scale, "invalid block scales"),
    "codes missing": (_drop_codes, "'exp_avg' has entries ['scale'], expected ['codes', 'scale']"),
    "float codes": (_float_codes, "expected torch.uint8"),
    "NaN step": (_nan_step, "'step' is nan"),
    "other version": (_other_version, "format version 99"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_state_dict_raises_and_changes_nothing(case):
    _, src = _trained(seed=1)
    _, opt = _trained(seed=2)  # other values than src: a partial load would show
    corrupt, message = CORRUPTIONS[case]
    sd = src.state_dict()
    corrupt(sd)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(sd)
    _assert_same_snapshot(before, _snapshot(opt))


@pytest.mark.parametrize("version", [2, 1])
def test_codes_without_scale_is_named(version):
    """A record missing its scale, in the current (nested) layout and in version 1's keys."""
    from bridge.state_dict import as_version_1

    _, src = _trained(seed=1)
    _, opt = _trained(seed=2)
    sd = src.state_dict()
    if version == 2:
        del sd["state"][0]["exp_avg"]["scale"]
        message = "'exp_avg' has entries ['codes'], expected ['codes', 'scale']"
    else:
        sd = as_version_1(sd)
        del sd["state"][0]["exp_avg::scale"]
        message = "has ['exp_avg::codes'] without 'exp_avg::scale'"
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(sd)
    _assert_same_snapshot(before, _snapshot(opt))


MISMATCHES = {
    # (what the checkpoint was written by, substring of the error)
    "another model (same param count, other shapes)": (lambda: _trained(shapes=((29, 37), (37, 11)), seed=3)[1],
                                                       "do not match"),
    "another model (other param count)": (lambda: _trained(shapes=((37, 29), (29, 11), (11, 5)), seed=3)[1],
                                          "parameter groups|params"),
    "4-bit into 8-bit": (lambda: _trained(bridge.AdamW4bit, seed=3)[1], "state_format='4bit'"),
    "fp8 into 8-bit": (lambda: _trained(bridge.AdamWFp8, seed=3)[1], "state_format='fp8'"),
    "another block size": (lambda: _trained(seed=3, block_size=16)[1], "block_size=16"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_state_dict_of_another_model_or_format_raises_and_changes_nothing(case):
    make, message = MISMATCHES[case]
    sd = make().state_dict()
    _, opt = _trained(seed=2)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    _assert_same_snapshot(before, _snapshot(opt))


def test_truncated_and_bit_flipped_files(tmp_path):
    """A truncated file fails to read with an error naming it; a file whose scale bytes were
    flipped (sign bit) reads, and load_state_dict rejects it; the optimizer is unchanged."""
    from bridge.state_dict import read_state_dict

    _, src = _trained(seed=1)
    _, opt = _trained(seed=2)
    path = tmp_path / "opt.pt"
    torch.save(src.state_dict(), path)
    data = path.read_bytes()
    before = _snapshot(opt)
    for cut in (len(data) // 3, len(data) - 100, 10):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"{bad}.*truncated or corrupted"):
            read_state_dict(str(bad))
    scale = src.state_dict()["state"][0]["exp_avg"]["scale"]
    at = data.find(scale.numpy().tobytes())
    assert at > 0
    flipped = bytearray(data)
    flipped[at + 4 * 5 + 3] ^= 0x80  # sign bit of the 6th scale (little-endian float32)
    bad = tmp_path / "flipped.pt"
    bad.write_bytes(bytes(flipped))
    sd = read_state_dict(str(bad))
    with pytest.raises(ValueError, match="exp_avg.scale.*invalid block scales"):
        opt.load_state_dict(sd)
    _assert_same_snapshot(before, _snapshot(opt))
    opt.load_state_dict(read_state_dict(str(path)))  # the intact file loads: the test can fail
    _assert_same_snapshot(_snapshot(src), _snapshot(opt))


# ----------------------------------------------------------------------------
# non-finite gradient storms
# ----------------------------------------------------------------------------
STORM_SHAPES = ((23, 71), (71,), (13, 9), (5, 300))


def _storm_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, device=CPU)) for s in STORM_SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9000 + step)
    return [torch.randn(s, generator=g, device=CPU) * 10.0 ** torch.randint(-4, 2, (), generator=g).item()
            for s in STORM_SHAPES]


def _all_states(opt) -> list[torch.Tensor]:
    out = []
    for p in opt.param_groups[0]["params"]:
        for name, v in sorted(opt.state[p].items()):
            if isinstance(v, bridge.QState):  # a record of any kind: its parts' bits
                out += [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in v.parts.values()]
            else:
                out.append(v)
    return out


@pytest.mark.slow  # ~20 s each: 1,000 steps x 2 runs
@pytest.mark.parametrize("cls", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_nonfinite_storm_is_skipped_bit_for_bit(cls):
    """1,000 steps; every 7th step ALL gradients are NaN or +-inf. With skip_nonfinite=True the
    params and every state tensor equal, bit for bit, a run that never saw those steps."""
    make = getattr(bridge, cls)
    kw = dict(lr=3e-3, weight_decay=0.1, min_quant_size=64, block_size=32, skip_nonfinite=True)
    stormy, clean = _storm_params(), _storm_params()
    opt_s, opt_c = make(stormy, **kw), make(clean, **kw)
    sched_s = torch.optim.lr_scheduler.CosineAnnealingLR(opt_s, 1000)
    clean_step = 0
    poison = [float("nan"), float("inf"), float("-inf")]
    skipped = 0
    for step in range(1000):
        if step % 7 == 6:
            bad = poison[step % 3]
            for p, g in zip(stormy, _grads(clean_step)):
                p.grad = torch.full_like(g, bad)
            opt_s.step()
            skipped += 1
            continue
        grads = _grads(clean_step)
        for p, q, g in zip(stormy, clean, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_s.step()
        opt_c.step()
        sched_s.step()  # the schedule follows taken steps only: same lr in both runs
        for gs, gc in zip(opt_s.param_groups, opt_c.param_groups):
            gc["lr"] = gs["lr"]
        clean_step += 1
    assert skipped == 142 and clean_step == 858
    for a, b in zip(stormy, clean):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    sa, sb = _all_states(opt_s), _all_states(opt_c)
    assert len(sa) == len(sb) > 0
    for a, b in zip(sa, sb):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert any(isinstance(v, bridge.QState) for st in opt_s.state.values() for v in st.values())


@pytest.mark.parametrize("cls,rank1", [("AdamW8bit", None), ("AdamW4bit", False), ("AdamW4bit", True),
                                       ("AdamWFp8", None)], ids=["AdamW8bit", "AdamW4bit-block", "AdamW4bit", "AdamWFp8"])
def test_nan_without_skip_poisons_only_its_block(cls, rank1):
    """skip_nonfinite=False: one NaN in one element of one param's gradient. The other params
    equal a clean run bit for bit; in the hit param exactly the elements of the NaN's block are
    NaN after the step, the rest equal the clean run. With a rank-1 second moment the NaN
    poisons its row's and column's maxima, the next step every column's: the whole param."""
    make = getattr(bridge, cls)
    kw = dict(lr=3e-3, weight_decay=0.1, min_quant_size=64, block_size=32)
    if rank1 is not None:
        kw["rank1_normalization"] = rank1
    hit, clean = _storm_params(), _storm_params()
    opt_h, opt_c = make(hit, **kw), make(clean, **kw)
    row, col = 3, 250  # param 3, shape (5, 300): block 250 // 32 = 7 of row 3
    for step in range(5):
        grads = _grads(step)
        for p, q, g in zip(hit, clean, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 2:
            hit[3].grad[row, col] = float("nan")
        opt_h.step()
        opt_c.step()
    for i in range(3):
        assert torch.equal(hit[i], clean[i]), i
    nan = torch.isnan(hit[3].detach())
    block = torch.zeros_like(nan)
    block[row, 7 * 32: 8 * 32] = True
    if rank1:
        assert nan.all()
        return
    assert torch.equal(nan, block), nan.nonzero()
    assert torch.equal(hit[3][~block], clean[3][~block])
    assert torch.isfinite(clean[3]).all()


# ----------------------------------------------------------------------------
# a rank killed in the middle of a distributed checkpoint save
# ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_rank_killed_during_dcp_save_keeps_the_previous_checkpoint(tmp_path):
    """examples/fsdp_train.py's save_checkpoint at 2 ranks: step 3 saved, then rank 1 is
    SIGKILLed inside dcp.save of step 6. The launch fails (the death is not hidden); `latest`
    still names step-3, step-6 exists only as step-6.tmp; a new 2-rank run loads step-3 bit for
    bit and repeats the uninterrupted run's next 3 losses exactly."""
    import torch.multiprocessing as mp

    import fsdp_workers as W

    root = tmp_path / "ckpt"
    with pytest.raises(mp.ProcessExitedException):
        W.launch(W.kill_during_save_worker, 2, str(root), "save")
    assert (tmp_path / "killed").exists(), "rank 1 did not reach the kill"
    assert (root / "latest").read_text().strip() == "step-3"
    assert (root / "step-3" / ".metadata").exists()
    assert (root / "step-6.tmp").exists() and not (root / "step-6").exists()
    W.launch(W.kill_during_save_worker, 2, str(root), "resume")


@pytest.mark.slow
@pytest.mark.demo  # the demo plots its curves
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_demo_fsdp_ranks_exit_with_their_status(tmp_path):
    """`torchrun -m bridge demo --fsdp` at 2 ranks: every rank leaves through os._exit, with
    status 0 after a run (table printed, files written) and non-zero after a failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MPLCONFIGDIR=str(tmp_path / "mpl"))

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "bridge",
               "demo", "--fsdp", "--tiny", "--steps", "3", "--no-progress", "--out", str(tmp_path / "out"), *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))

    ok = torchrun("--formats", "fp32,8bit")
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-4000:]
    assert "FSDP2 x 2" in ok.stdout and "8bit" in ok.stdout and (tmp_path / "out" / "results.json").exists()
    bad = torchrun("--formats", "8bit,nonsense")
    assert bad.returncode != 0 and "unknown setup 'nonsense'" in bad.stderr, (bad.stdout + bad.stderr)[-4000:]


# ----------------------------------------------------------------------------
# inspect: the header's block size is the one the rows show
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls, block_size", [("AdamW8bit", None), ("AdamW4bit", None), ("AdamWFp8", 48)])
def test_inspect_header_block_size_matches_rows(tmp_path, cls, block_size):
    import re

    from bridge.tools.inspect_state import inspect_path

    kw = {} if block_size is None else {"block_size": block_size}
    _, opt = _trained(getattr(bridge, cls), **kw)
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    text = inspect_path(str(path)).render()
    header = text.splitlines()[0]
    assert "block_size=None" not in header, header
    shown = re.search(r"block_size=(\d+)", header)
    assert shown, header
    row_blocks = {line.split()[2] for line in text.splitlines()[3:] if re.match(r"^\d+/exp_avg", line)
                  and not line.split()[1] == "fp32" and not line.split()[1].startswith("rank1_")}  # rank-1: no blocks
    expected = {block_size or lt.get_format(opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].format).default_block_size}
    assert row_blocks == {str(b) for b in expected} == {shown[1]}, (header, row_blocks)


@pytest.mark.parametrize("cls", ["AdamW8bit", "AdamW4bit", "AdamWFp8", "Lion8bit", "SGD8bit", "AdamW"])
def test_optimizer_step_keeps_the_device(meta_default_device, cls):
    """Steps with the default device on meta: params, grads and states are CPU tensors, so any
    step-path allocation without device= fails here; the result equals a step taken with the
    CPU as default device."""
    torch.set_default_device("cpu")
    models = [torch.nn.Sequential(torch.nn.Linear(37, 29), torch.nn.Linear(29, 5)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [getattr(bridge, cls)(m.parameters(), lr=1e-2, **({} if cls == "AdamW" else {"min_quant_size": 64}))
            for m in models]
    for step in range(3):
        x = _cpu_randn(4, 37, seed=step)
        for i, (m, o) in enumerate(zip(models, opts)):
            torch.set_default_device("cpu")
            m(x).square().mean().backward()
            torch.set_default_device("meta" if i == 0 else "cpu")
            o.step()
            o.zero_grad()
    torch.set_default_device("meta")
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert p.device == CPU and torch.equal(p, q)
    for st in opts[0].state.values():
        for v in st.values():
            assert (v.codes.device if isinstance(v, bridge.QState) else v.device) == CPU
