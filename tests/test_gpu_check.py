"""benchmarks/gpu_check.sh, the GPU check in one command, rehearsed on the CPU (``--rehearse``):
every step leaves its file and its line in ``summary.txt``; an injected bit mismatch, a must-run
step whose tests skip, a step past its budget, a failed preflight and wheels for another Python
each end the run with its non-zero code and the output kept; the timed benchmarks import the tree
they sit in; the budget table in docs/guide/gpu.md is the script's."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_gpu_check():
    """benchmarks/gpu_check.py as a module (registered: its dataclasses look their module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load_gpu_check()
STEPS = [s.name for s in gpu_check.STEPS]
TESTS_SELECTION = '-k "matches_native_and_reference and lion"'  # seven tests of the bits step: seconds


def _run(res: Path, *args, env=None, timeout=420):
    """gpu_check.sh --rehearse ARGS RES, with no PYTHONPATH (the script puts the carried tree on the
    path itself) and no test hook but those in ``env``."""
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("GPU_CHECK_")}
    full.update(PYTHON=sys.executable, **(env or {}))
    return subprocess.run(["bash", "benchmarks/gpu_check.sh", "--rehearse", *args, str(res)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)


def _summary(res: Path) -> dict:
    """step -> (status, rc, detail) from summary.txt."""
    out = {}
    for line in (res / "summary.txt").read_text().splitlines():
        m = re.match(r"(\w+)\s+(ok|failed|timed out|skipped|not run)\s+(-?\d*)\s+[\d.]+\s+\d+\s*(.*)$", line)
        if m and m[1] in STEPS:
            out[m[1]] = (m[2], m[3], m[4])
    return out


# ----------------------------------------------------------------------------- no subprocess


def test_the_docs_budget_table_is_the_scripts():
    doc = (ROOT / "docs" / "guide" / "gpu.md").read_text(encoding="utf-8")
    table = gpu_check.budget_table()
    assert table in doc, "docs/guide/gpu.md's budget table differs from `python benchmarks/gpu_check.py --budget-table`"
    assert sum(s.budget_s for s in gpu_check.STEPS) <= 7 * 60
    assert [s.name for s in gpu_check.STEPS[:3]] == ["preflight", "install", "preflight_tree"]
    assert STEPS.index("bits") < STEPS.index("step_time") < STEPS.index("bandwidth") < STEPS.index("compile_scan")


def _junit(path: Path, passed: int, failed: int, skips: list) -> None:
    cases = [f'<testcase classname="t" name="p{i}"/>' for i in range(passed)]
    cases += [f'<testcase classname="t" name="f{i}"><failure message="x"/></testcase>' for i in range(failed)]
    cases += [f'<testcase classname="t" name="s{i}"><skipped message="{m}"/></testcase>' for i, m in enumerate(skips)]
    path.write_text(f'<testsuites><testsuite tests="{passed + failed + len(skips)}" failures="{failed}" errors="0" '
                    f'skipped="{len(skips)}">{"".join(cases)}</testsuite></testsuites>')


@pytest.mark.parametrize("passed, failed, skips, rc, timed_out, rehearse, want", [
    (5, 0, [], 0, False, False, "ok"),
    (5, 0, ["CPU tensors need the interpreter"], 0, False, False, "ok"),
    (5, 0, ["no C compiler"], 0, False, False, "skipped"),
    (5, 0, ["no CUDA device"], 0, False, False, "skipped"),
    (0, 0, ["no CUDA device"], 0, False, True, "ok"),  # the rehearsal's CPU stand-in
    (0, 0, [], 0, False, False, "skipped"),  # nothing passed on the GPU
    (4, 1, [], 1, False, False, "failed"),
    (5, 0, [], 2, True, False, "timed out"),
])
def test_a_must_run_pytest_steps_status(tmp_path, passed, failed, skips, rc, timed_out, rehearse, want):
    run = gpu_check.Run(res=tmp_path, rehearse=rehearse, python=sys.executable, tmp=tmp_path, wheels=None, nproc=1)
    step = next(s for s in gpu_check.STEPS if s.name == "bits")
    _junit(tmp_path / "bits.xml", passed, failed, skips)
    r = gpu_check.judge(step, run, rc, timed_out, 1.0, 130)
    assert r.status == want, r.detail
    assert r.failed == (want != "ok")


def test_a_step_past_its_budget_is_interrupted_then_killed(tmp_path, monkeypatch):
    """SIGINT first (pytest prints its summary on it), then SIGKILL to the process group."""
    monkeypatch.setattr(gpu_check, "GRACE_S", 2)
    log = tmp_path / "log.txt"
    code = ("import signal, time, sys\n"
            "def h(*a): print('interrupted, summary printed', flush=True); sys.exit(2)\n"
            "signal.signal(signal.SIGINT, h)\nprint('started', flush=True)\ntime.sleep(60)\n")
    rc, timed_out, secs = gpu_check.run_command([sys.executable, "-c", code], dict(os.environ), log, 2, echo=False)
    assert timed_out and rc == 2 and secs < 20
    text = log.read_text()
    assert "started" in text and "interrupted, summary printed" in text and "past its budget of 2 s" in text
    deaf = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)\n"
    rc, timed_out, secs = gpu_check.run_command([sys.executable, "-c", deaf], dict(os.environ), log, 1, echo=False)
    assert timed_out and rc == -9 and secs < 1 + gpu_check.GRACE_S + 5


# ----------------------------------------------------------------------------- one script or test collection


@pytest.mark.slow  # one interpreter with torch, a few seconds
def test_step_time_imports_the_tree_it_sits_in(tmp_path):
    """Run as a script from elsewhere, with no PYTHONPATH: it times this tree, not an installed copy."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--case", "t", "--steps", "1",
                        "--impl", "torch-fused", "bridge-8bit", "--json", str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = Path(json.loads(out.read_text())["lowbit_tree"]).resolve()
    assert ROOT in got.parents, got
    assert f"from {got.parent}" in r.stdout


@pytest.mark.slow  # collects the suite (seconds)
def test_the_cuda_step_names_every_file_with_a_cuda_test():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                        "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    files = {line.split("::")[0] for line in r.stdout.splitlines() if "::" in line}
    assert files, r.stdout[-2000:]
    assert files <= set(gpu_check.CUDA_TEST_FILES), files - set(gpu_check.CUDA_TEST_FILES)


# ----------------------------------------------------------------------------- the rehearsal itself


@pytest.fixture(scope="module")
def core_wheels(tmp_path_factory):
    """The wheels folder gpu_wheels.sh makes for this Python, without the anchors (pip's cache)."""
    out = tmp_path_factory.mktemp("wheels")
    pyv = f"{sys.version_info.major}.{sys.version_info.minor}"
    r = subprocess.run(["bash", "benchmarks/gpu_wheels.sh", "--core", "--python-version", pyv, str(out)], cwd=ROOT,
                       env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """A whole rehearsal: CI's own (.ci/run sets GPU_CHECK_REHEARSAL to the folder of the one it
    ran, of this tree) or a fresh one, whose wheels gpu_wheels.sh makes for this Python."""
    given = os.environ.get("GPU_CHECK_REHEARSAL")
    if given and f"tree: {ROOT}" in (Path(given) / "summary.txt").read_text():
        return Path(given), None
    res = tmp_path_factory.mktemp("rehearsal")
    r = _run(res, timeout=900)
    return res, r


@pytest.mark.extended  # the whole device script on the CPU: about 3 minutes on 2 cores
def test_the_rehearsal_runs_every_step_and_leaves_its_files(rehearsal):
    res, r = rehearsal
    if r is not None:
        assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-2000:])
    summary = _summary(res)
    assert list(summary) == STEPS, (res / "summary.txt").read_text()
    assert all(status == "ok" and rc == "0" for status, rc, _ in summary.values()), summary
    assert "exit: 0" in (res / "summary.txt").read_text()
    for name in STEPS:
        assert (res / f"{name}.txt").stat().st_size > 0, name
    for step in gpu_check.STEPS:
        if step.pytest:
            counts = gpu_check.junit_counts(res / f"{step.name}.xml")
            assert counts is not None and counts["tests"] > 0, step.name
    assert gpu_check.junit_counts(res / "bits.xml")["failures"] == 0
    assert "CPU stand-in" in (res / "preflight.txt").read_text()
    assert "ok   carried tree" in (res / "preflight_tree.txt").read_text()
    for name in ("step_time", "anchors", "first_step"):  # the timed benchmarks import the carried tree
        got = json.loads((res / f"{name}.json").read_text())
        assert ROOT in Path(got["lowbit_tree"]).resolve().parents, (name, got["lowbit_tree"])
        assert any("median_ms" in row for case in got["cases"] for row in case["results"]), name
    assert json.loads((res / "step_time.json").read_text())["backend_env"] == "triton"  # under the interpreter
    assert json.loads((res / "bandwidth.json").read_text())["rows"]
    assert json.loads((res / "compile_scan.json").read_text())["failed"] == 0
    assert "take optree" in (res / "install.txt").read_text()  # the image lacks it: installed offline


@pytest.mark.extended
@pytest.mark.parametrize("how, status, evidence", [
    ({"GPU_CHECK_INJECT": "bits", "GPU_CHECK_PYTEST_ARGS": TESTS_SELECTION}, "failed", "AssertionError"),
    ({"GPU_CHECK_INJECT": "skip", "GPU_CHECK_PYTEST_ARGS": TESTS_SELECTION}, "skipped", "no C compiler"),
    ({"GPU_CHECK_INJECT": "hang", "GPU_CHECK_PYTEST_ARGS": TESTS_SELECTION, "GPU_CHECK_BUDGETS": "bits=40"},
     "timed out", "KeyboardInterrupt"),
], ids=["bit-mismatch", "skipped-must-run-step", "past-its-budget"])
def test_a_broken_must_run_step_ends_the_run_non_zero_with_its_output_kept(tmp_path, core_wheels, how, status,
                                                                           evidence):
    res = tmp_path / "res"
    r = _run(res, "--wheels", str(core_wheels), "--only", "bits", env=how)
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-2000:])
    summary = _summary(res)
    assert summary["bits"][0] == status, summary
    assert [s for s in summary] == ["preflight", "install", "preflight_tree", "bits"]
    assert all(summary[s][0] == "ok" for s in ("preflight", "install", "preflight_tree"))
    assert "exit: 1" in (res / "summary.txt").read_text()
    log = (res / "bits.txt").read_text()
    assert evidence in log
    if status == "timed out":  # pytest's own summary line, printed on SIGINT
        assert re.search(r"(no tests ran|passed|failed).* in [\d.]+s", log), log[-2000:]


@pytest.mark.extended
def test_a_failed_preflight_stops_the_run_with_its_code_and_one_line(tmp_path):
    res = tmp_path / "res"
    empty = tmp_path / "wheels"
    empty.mkdir()
    r = _run(res, "--wheels", str(empty), env={"CC": "/nonexistent/cc"}, timeout=300)
    assert r.returncode == 3, (r.stdout[-3000:], r.stderr)
    assert "preflight failed: FAIL C compiler: no C compiler (CC=/nonexistent/cc" in r.stderr
    summary = _summary(res)
    assert summary["preflight"][0] == "failed"
    assert all(summary[s][0] == "not run" for s in STEPS[1:]), summary


@pytest.mark.extended
def test_wheels_for_another_python_fail_the_install_with_its_code(tmp_path):
    res = tmp_path / "res"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "optree-0.20.0-cp399-cp399-manylinux_2_28_x86_64.whl").write_bytes(b"")
    r = _run(res, "--wheels", str(wheels), "--only", "bits", timeout=300)
    assert r.returncode == 4, (r.stdout[-3000:], r.stderr)
    assert "the wheels are for cp399" in r.stderr and "--python-version" in r.stderr
    assert _summary(res)["bits"][0] == "not run"
