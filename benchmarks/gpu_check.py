"""The GPU check in one command: steps ordered by what they are worth, each in a process of its
own with a budget of seconds, its output streamed into the results folder as it goes, a
``summary.txt`` with each step's status, exit code and seconds (rewritten after every step, so a
run cut short still has one), and an exit status that says whether the figures can be trusted.

    benchmarks/gpu_check.sh [--wheels DIR] [--rehearse] [--only STEP,...] [RESULTS]
    python benchmarks/gpu_check.py --budget-table      (the table docs/guide/gpu.md mirrors)

RESULTS: the results folder ($OUT, else ./gpu_check_results, when not given). --wheels: the folder
``benchmarks/gpu_wheels.sh`` made where there is a network; what this Python lacks of it is
installed offline (``pip install --no-index --no-deps --target``) into a folder of the run's own,
put on ``PYTHONPATH`` after the repository, so every step imports the tree this script sits in
(the preflight checks that it does). ``--only``: run these steps and the three the others need
(preflight, install, preflight_tree).

``--rehearse``: every step on the CPU, end to end, in a fresh virtual environment that sees this
machine's torch and triton (``venv --system-site-packages``): the same preflight (a CPU stand-in
reported in place of the CUDA device), the same offline install (from a folder ``gpu_wheels.sh``
makes for this Python, unless --wheels gives one; the wheels the GPU image lacks are installed
even where this machine has them), the same result files and summary, with the Triton kernels
under Triton's interpreter and small sizes in place of the CUDA runs; each step's limit is three
times its planned seconds, at least a minute (REHEARSAL_FACTOR).

Exit status: 0 every step passed; 1 a step failed (a GPU-vs-CPU bit comparison among them) or ran
past its budget, or a step that must run skipped (a test skipped for a reason not on its list of
expected ones); 2 bad arguments, or a rehearsal's setup (its venv, its wheels) failed; 3 the
preflight failed; 4 the offline install failed. A failed preflight or install stops the run there,
with one line saying which check and why.

Test hooks (environment variables; tests/test_gpu_check.py uses them):
  GPU_CHECK_INJECT=bits          the pytest steps flip one bit of a state after every Triton step
  GPU_CHECK_INJECT=skip          the pytest steps see the native kernel as missing (its tests skip)
  GPU_CHECK_INJECT=hang          every test of the pytest steps sleeps an hour first (past any budget)
  GPU_CHECK_BUDGETS=bits=5,...   a step's budget in seconds in place of the table's
  GPU_CHECK_PYTEST_ARGS="..."    more arguments for every pytest step (a selection, -x)

Only the standard library here: the driver runs before anything is installed.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
THIS = Path(__file__).resolve()

EXIT_FAILED, EXIT_USAGE, EXIT_PREFLIGHT, EXIT_INSTALL = 1, 2, 3, 4
GRACE_S = 15
"""After a step's budget, SIGINT to the step's process group (pytest prints its summary and writes
its junit file); after this many seconds more, SIGKILL to it."""
REHEARSAL_FACTOR, REHEARSAL_MIN_S = 3, 60
"""A rehearsal's limit for a step: its planned seconds times this, at least REHEARSAL_MIN_S. A
shared CPU runs the Triton kernels under the interpreter: the rehearsal checks the machinery,
not the timings (GPU_CHECK_BUDGETS overrides both)."""
IMAGE_LACKS = ("optree", "pytest-xdist", "execnet", "torchao", "bitsandbytes", "flashoptim")
"""What the known GPU image (python 3.12, torch 2.11.0, triton 3.6.0) lacks of the wheels folder:
a rehearsal installs these from it even where the machine has them, so the install is exercised."""
TRITON_RANGE = ((3, 6), (3, 10))
"""The triton extra's range (pyproject.toml: ``triton>=3.6,<3.10``)."""
OURS = ["torch-fused", "bridge-8bit", "bridge-4bit", "bridge-fp8", "bridge-8bit-amsgrad", "bridge-lion-8bit",
        "torch-fused-bf16", "bridge-8bit-bf16", "bridge-8bit-bf16sr", "bridge-8bit-bf16c"]
ANCHORS = ["torch-fused", "torchao-8bit", "torchao-4bit", "bnb-8bit", "torch-fused-bf16", "flashoptim-bf16c"]
FIRST = ["torch-fused", "bridge-8bit", "bridge-4bit", "bridge-fp8", "bridge-8bit-bf16"]
BITS_TESTS = ["-m", "triton", "tests/test_triton.py", "tests/test_triton_quant.py", "tests/test_backend_choice.py"]
REHEARSAL_BITS = ["-k", "8bit"]
"""A rehearsal's sample of the bit tests (those of 8-bit states, about a fifth): under the
interpreter they all run in CI's triton step already; the rehearsal checks the machinery."""
CUDA_TEST_FILES = ["tests/test_backend_choice.py", "tests/test_bridge_state_dict.py", "tests/test_kernels_codes.py",
                   "tests/test_kernels_step.py", "tests/test_master_params.py", "tests/test_muon.py",
                   "tests/test_qtensor.py", "tests/test_records.py"]
"""Every file with a test marked ``cuda`` (tests/test_gpu_check.py checks the list against a
collection): named rather than ``tests``, so that a module skipped whole for a missing extra
(a skip at collection, which the selection does not see) cannot fail the step."""
EXPECTED_SKIPS = ("run with --extended", "CPU tensors need the interpreter", "x86 flag")
"""Skip reasons a must-run step may show on a GPU: the extended tier, the interpreter-only tests."""
REHEARSAL_SKIPS = ("no CUDA device", "needs a CUDA device")
"""... and, on the rehearsal's CPU stand-in, the tests that need a CUDA device."""


@dataclasses.dataclass
class Run:
    """One run's settings, which the steps' commands are made from."""
    res: Path
    rehearse: bool
    python: str
    tmp: Path
    wheels: Optional[Path]
    nproc: int
    facts: dict = dataclasses.field(default_factory=dict)  # what the preflight found (preflight.json)

    @property
    def device(self) -> str:
        return "cpu" if self.rehearse else "cuda"

    @property
    def target(self) -> Path:
        return self.tmp / "site"

    def env(self) -> dict:
        """The steps' environment: the carried tree first on the path, then what the install put
        in the target folder; the interpreter only in a rehearsal; caches of the run's own."""
        env = dict(os.environ)
        path = [str(ROOT), str(self.target)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if os.environ.get("GPU_CHECK_INJECT"):
            path.append(str(HERE))  # gpu_check_inject, the pytest plugin the test hooks load
        env.update(PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1",
                   TRITON_INTERPRET="1" if self.rehearse else "0",
                   TRITON_CACHE_DIR=str(self.tmp / "triton_cache"),
                   TORCHINDUCTOR_CACHE_DIR=str(self.tmp / "inductor_cache"))
        env.pop("LOWBIT_TREE_BACKEND", None)  # the automatic choice, unless a step sets one
        return env


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    must: bool
    proves: str
    command: Callable[[Run], tuple[list, dict]]
    """-> (argv, environment variables to set for it)."""
    fail_code: int = EXIT_FAILED
    """A step whose fail_code is not EXIT_FAILED stops the run when it fails (the preflight, the install)."""
    pytest: bool = False


def _pytest(run: Run, name: str, selection: list) -> list:
    inject = ["-p", "gpu_check_inject"] if os.environ.get("GPU_CHECK_INJECT") else []
    # -v: each test's outcome streams into the log as it comes, kept however the step ends
    return ([run.python, "-m", "pytest", "-v", "--tb=short", "-rs", "-p", "no:cacheprovider", *inject,
             "-n", str(run.nproc),
             f"--junitxml={run.res / (name + '.xml')}", *selection]
            + shlex.split(os.environ.get("GPU_CHECK_PYTEST_ARGS", "")))


def _step_time(run: Run, impls: list, json_name: str, case_gpu: str, steps_gpu: int) -> list:
    case, steps = ("t", 2) if run.rehearse else (case_gpu, steps_gpu)
    return [run.python, str(HERE / "step_time.py"), "--device", run.device, "--case", case, "--steps", str(steps),
            "--impl", *impls, "--json", str(run.res / json_name)]


def _ours_env(run: Run) -> dict:
    """In a rehearsal our rows step through the Triton kernel (under the interpreter), as on CUDA."""
    return {"LOWBIT_TREE_BACKEND": "triton"} if run.rehearse else {}


def _first_step_env(run: Run) -> dict:
    cold = run.tmp / "cold"  # caches of its own, empty: the first step compiles
    return dict(_ours_env(run), TRITON_CACHE_DIR=str(cold / "triton"), TORCHINDUCTOR_CACHE_DIR=str(cold / "inductor"))


def _compile_scan(run: Run) -> list:
    arch = str(run.facts.get("arch") or 90)
    small = ["--limit", "3"] if run.rehearse else []
    return [run.python, str(HERE / "triton_compile.py"), "--arch", arch, "--jobs", str(run.nproc), *small,
            "--cache", str(run.tmp / "compile_cache"), "--json", str(run.res / "compile_scan.json")]


STEPS = [
    Step("preflight", 20, True,
         "python, pip, a C compiler, Python.h, torch and triton in range, a CUDA device, a one-element Triton launch",
         lambda r: ([r.python, str(THIS), "--probe", "machine", str(r.res)] + (["--rehearse"] if r.rehearse else []),
                    {}),
         fail_code=EXIT_PREFLIGHT),
    Step("install", 10, True,
         "what the image lacks, from the wheels folder offline (--no-index --no-deps) into the run's own folder",
         lambda r: ([r.python, str(THIS), "--install", str(r.wheels or ""), str(r.target)]
                    + (["--rehearse"] if r.rehearse else []), {}),
         fail_code=EXIT_INSTALL),
    Step("preflight_tree", 15, True,
         "the carried tree imported (not an installed copy), the native C kernel built, pytest-xdist",
         lambda r: ([r.python, str(THIS), "--probe", "tree", str(r.res)], {}), fail_code=EXIT_PREFLIGHT),
    Step("bits", 120, True,
         "the Triton kernel on the GPU equals the native kernel on the CPU bit for bit: every rule x format, "
         "param dtypes, non-finite gradients, the automatic choice launching it (its compilations spread over "
         "the cores by pytest -n)",
         lambda r: (_pytest(r, "bits", BITS_TESTS + (REHEARSAL_BITS if r.rehearse else [])), {}), pytest=True),
    Step("cuda_bits", 60, True,
         "the torch backends and records on CUDA against the CPU reference: every rule x format, the fast "
         "quantizers, moving states between devices",
         lambda r: (_pytest(r, "cuda_bits", ["-m", "cuda", *CUDA_TEST_FILES]), {"TORCHINDUCTOR_COMPILE_THREADS": "1"}),
         pytest=True),
    Step("step_time", 35, False,
         "ms a step, 67M params: the bridge's formats and rules (float32 and bfloat16 params) against torch's "
         "fused AdamW",
         lambda r: (_step_time(r, OURS, "step_time.json", "g", 20), _ours_env(r))),
    Step("anchors", 60, False,
         "ms a step, same params: torchao, bitsandbytes, FlashOptim (their wheels permitting) against torch's "
         "fused AdamW",
         lambda r: (_step_time(r, ANCHORS, "anchors.json", "g", 20), {})),
    Step("bandwidth", 15, False,
         "bytes a param each step moves and the share of the card's memory bandwidth it reaches",
         lambda r: ([r.python, str(HERE / "gpu_bandwidth.py"), "--device", r.device, "--json",
                     str(r.res / "bandwidth.json"), str(r.res / "step_time.json"), str(r.res / "anchors.json")], {})),
    Step("first_step", 40, False,
         "the first step's seconds with empty compile caches (Triton's compilations), GPT-like mixed shapes",
         lambda r: (_step_time(r, FIRST, "first_step.json", "b", 3), _first_step_env(r))),
    Step("compile_scan", 35, False,
         "every kernel variant compiled with the image's triton for the card's arch: PTX scan, registers, spills",
         lambda r: (_compile_scan(r), {})),
]
STOP_CODES = {EXIT_PREFLIGHT, EXIT_INSTALL}


def budget_table() -> str:
    """The budget table, as docs/guide/gpu.md has it."""
    rows = ["| step | seconds planned | must run | what it proves |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.budget_s} | {'yes' if s.must else 'no'} | {s.proves} |" for s in STEPS]
    rows.append(f"| total | {sum(s.budget_s for s in STEPS)} | | at most 7 minutes on an H100 |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- running a step


@dataclasses.dataclass
class Result:
    name: str
    status: str  # ok, failed, timed out, skipped, not run
    rc: Optional[int] = None
    seconds: float = 0.0
    budget_s: int = 0
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status not in ("ok", "not run")


def _budgets() -> dict:
    out = {}
    for item in filter(None, os.environ.get("GPU_CHECK_BUDGETS", "").split(",")):
        name, _, secs = item.partition("=")
        if name not in {s.name for s in STEPS} or not secs.strip().isdigit():
            raise ValueError(f"GPU_CHECK_BUDGETS: {item!r} is not STEP=SECONDS with a step of "
                             f"{', '.join(s.name for s in STEPS)}")
        out[name] = int(secs)
    return out


def run_command(argv: list, env: dict, log: Path, budget_s: float, echo: bool = True) -> tuple[int, bool, float]:
    """Runs ``argv`` in a process group of its own, its output (stdout and stderr) streamed line by
    line into ``log`` (and to this process's stdout); past ``budget_s``: SIGINT to the command, then
    after GRACE_S SIGKILL to its group. -> (exit code, timed out, seconds)."""
    t0 = time.monotonic()
    with open(log, "ab", buffering=0) as f:
        f.write(("$ " + shlex.join(argv) + "\n").encode())
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=os.setpgrp)

        def pump():
            for line in iter(proc.stdout.readline, b""):
                f.write(line)
                if echo:
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            f.write(f"\n[gpu_check] past its budget of {budget_s:g} s: SIGINT to its process group\n".encode())
            try:  # as Ctrl-C (and `timeout -s INT`) would: xdist's workers stop their tests too
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                f.write(f"[gpu_check] still running {GRACE_S} s later: SIGKILL to its process group\n".encode())
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what it left behind (xdist workers, compile pools)
            except ProcessLookupError:
                pass
            proc.wait()
            reader.join(timeout=5)
            proc.stdout.close()
    return proc.returncode, timed_out, time.monotonic() - t0


def junit_counts(path: Path) -> Optional[dict]:
    """tests, failures, errors, skipped and the skip reasons of a pytest junit file (None: none written)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    reasons: dict = {}
    for sk in root.iter("skipped"):
        msg = (sk.get("message") or "").strip()
        reasons[msg] = reasons.get(msg, 0) + 1
    out["reasons"] = reasons
    return out


def judge(step: Step, run: Run, rc: int, timed_out: bool, seconds: float, budget: int) -> Result:
    res = Result(step.name, "ok", rc, seconds, budget)
    notes = []
    if step.pytest:
        counts = junit_counts(run.res / f"{step.name}.xml")
        if counts is None:
            notes.append("no junit file")
            res.status = "failed"  # timed out or failed below, or else a pytest that wrote none: not a pass
        else:
            passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
            notes.append(f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
                         f"{counts['skipped']} skipped")
            allowed = EXPECTED_SKIPS + (REHEARSAL_SKIPS if run.rehearse else ())
            unexpected = {m: n for m, n in counts["reasons"].items() if not any(a in m for a in allowed)}
            if step.must and unexpected:
                res.status = "skipped"
                notes.append("unexpected skips: " + "; ".join(f"{n} x {m!r}" for m, n in unexpected.items()))
            if step.must and passed == 0 and not run.rehearse:
                res.status = "skipped"
                notes.append("no test passed")
    if timed_out:
        res.status = "timed out"
        notes.append(f"stopped after its budget of {budget} s")
    elif rc != 0:
        res.status = "failed"
        if not step.pytest:
            last = _last_line(run.res / f"{step.name}.txt")
            notes.append(last)
    res.detail = "; ".join(n for n in notes if n)
    return res


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    fails = [ln for ln in lines if ln.startswith("FAIL ")]
    return (fails or lines or [""])[-1][:300]


def write_summary(run: Run, results: list, started: float, code: Optional[int]) -> None:
    device = run.facts.get("device", "?")
    lines = [f"gpu_check: {'rehearsal on the CPU' if run.rehearse else 'device run'}; device: {device}",
             f"tree: {ROOT}", f"python: {run.python}",
             f"exit: {code if code is not None else '(running)'}; {time.monotonic() - started:.0f} s of "
             f"{sum(s.budget_s for s in STEPS)} planned",
             "", f"{'step':<16}{'status':<11}{'rc':>4}{'seconds':>9}{'budget':>8}  detail"]
    for r in results:
        rc = "" if r.rc is None else str(r.rc)
        lines.append(f"{r.name:<16}{r.status:<11}{rc:>4}{r.seconds:>9.1f}{r.budget_s:>8}  {r.detail}")
    tmp = run.res / "summary.txt.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(run.res / "summary.txt")


# ----------------------------------------------------------------------------- the whole run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", default=None)
    ap.add_argument("--wheels", default=os.environ.get("GPU_CHECK_WHEELS") or None)
    ap.add_argument("--rehearse", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated steps (the preflight and install run anyway)")
    ap.add_argument("--budget-table", action="store_true", help="print the budget table and exit")
    ap.add_argument("--probe", choices=["machine", "tree"], help=argparse.SUPPRESS)
    ap.add_argument("--install", nargs=2, metavar=("WHEELS", "TARGET"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.budget_table:
        print(budget_table())
        return 0
    if a.probe:
        return probe(a.probe, Path(a.results), a.rehearse)
    if a.install:
        return install(a.install[0], Path(a.install[1]), a.rehearse)

    only = {s for s in a.only.split(",") if s}
    names = [s.name for s in STEPS]
    if only - set(names):
        print(f"--only: no step {', '.join(sorted(only - set(names)))} (steps: {', '.join(names)})", file=sys.stderr)
        return EXIT_USAGE
    try:
        budgets = _budgets()
    except ValueError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    wheels = Path(a.wheels).resolve() if a.wheels else None
    if wheels is not None and not wheels.is_dir():
        print(f"--wheels {wheels}: no such folder (benchmarks/gpu_wheels.sh DIR makes it where there is a network)",
              file=sys.stderr)
        return EXIT_USAGE
    res = Path(a.results or os.environ.get("OUT") or "gpu_check_results").resolve()
    res.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    run = Run(res=res, rehearse=a.rehearse, python=os.environ.get("PYTHON") or sys.executable, tmp=tmp,
              wheels=wheels, nproc=nproc)
    started = time.monotonic()
    try:
        if a.rehearse:
            setup = rehearsal_setup(run)
            if setup:
                return setup
        return run_steps(run, only, budgets, started)
    finally:
        if not os.environ.get("GPU_CHECK_KEEP_TMP"):
            shutil.rmtree(tmp, ignore_errors=True)


def rehearsal_setup(run: Run) -> int:
    """A fresh virtual environment that sees this machine's packages, and (without --wheels) the
    wheels folder for this Python: what a GPU image and its carried folder would be."""
    log = run.res / "rehearsal_setup.txt"
    venv = run.tmp / "venv"
    cmds = [[sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)]]
    if run.wheels is None:
        run.wheels = run.tmp / "wheels"
        pyv = f"{sys.version_info.major}.{sys.version_info.minor}"
        cmds.append(["bash", str(HERE / "gpu_wheels.sh"), "--python-version", pyv, str(run.wheels)])
    for cmd in cmds:
        rc, _, secs = run_command(cmd, dict(os.environ, PYTHON=sys.executable), log, 600, echo=False)
        if rc != 0:
            print(f"rehearsal setup failed: {shlex.join(cmd)} exited {rc} (see {log})", file=sys.stderr)
            return EXIT_USAGE
    run.python = str(venv / "bin" / "python")
    # --system-site-packages gives the base interpreter's packages: where this Python is itself a
    # virtual environment (CI's), its own site-packages (torch, triton) are added by a .pth file.
    out = subprocess.run([run.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    import site

    mine = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(out.stdout.strip(), "gpu_check_running_python.pth").write_text("\n".join(mine) + "\n")
    with open(log, "a") as f:
        f.write(f"{run.python}: sees {', '.join(mine)} (gpu_check_running_python.pth) and the base interpreter's\n")
    return 0


def run_steps(run: Run, only: set, budgets: dict, started: float) -> int:
    results: list = []
    code = 0
    print(f"gpu_check: {'rehearsal on the CPU' if run.rehearse else 'on the GPU'}; results in {run.res}; "
          f"{sum(s.budget_s for s in STEPS)} s planned; {run.nproc} cores", flush=True)
    for i, step in enumerate(STEPS):
        if only and step.name not in only and step.fail_code == EXIT_FAILED:
            continue
        budget = budgets.get(step.name) or (max(REHEARSAL_FACTOR * step.budget_s, REHEARSAL_MIN_S) if run.rehearse
                                            else step.budget_s)
        argv, extra = step.command(run)
        env = dict(run.env(), **extra)
        log = run.res / f"{step.name}.txt"
        log.write_bytes(b"")
        print(f"\n== {step.name} (at most {budget} s): {step.proves}", flush=True)
        rc, timed_out, secs = run_command(argv, env, log, budget)
        r = judge(step, run, rc, timed_out, secs, budget)
        results.append(r)
        if step.name == "preflight":
            run.facts = _read_json(run.res / "preflight.json")
        print(f"-- {step.name}: {r.status} (exit {rc}, {secs:.1f} s){': ' + r.detail if r.detail else ''}", flush=True)
        if r.failed and step.fail_code in STOP_CODES:
            code = step.fail_code
            for later in STEPS[i + 1:]:
                if not only or later.name in only or later.fail_code != EXIT_FAILED:
                    results.append(Result(later.name, "not run", budget_s=later.budget_s,
                                          detail=f"{step.name} failed"))
            print(f"gpu_check: {step.name} failed: {r.detail}", file=sys.stderr)
            break
        write_summary(run, results, started, None)
    if code == 0 and any(r.failed for r in results):
        code = EXIT_FAILED
    write_summary(run, results, started, code)
    print("\n" + (run.res / "summary.txt").read_text(), end="")
    return code


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# ----------------------------------------------------------------------------- preflight probes


class Fail(Exception):
    pass


def _check(name: str, fn: Callable[[], str]) -> None:
    try:
        said = fn()
    except Fail as e:
        print(f"FAIL {name}: {e}", flush=True)
        raise
    except Exception as e:  # noqa: BLE001 - any error of a check is its failure, named
        print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        raise Fail(str(e)) from e
    print(f"ok   {name}: {said}", flush=True)


def probe(which: str, res: Path, rehearse: bool) -> int:
    """The preflight's checks in the steps' Python, in order, stopping at the first that fails
    (its line starts with FAIL): ``machine`` before the install, ``tree`` after it."""
    facts: dict = {}
    checks = _machine_checks(facts, rehearse) if which == "machine" else _tree_checks(facts)
    try:
        for name, fn in checks:
            _check(name, fn)
    except Fail:
        return EXIT_PREFLIGHT
    finally:
        if which == "machine":
            (res / "preflight.json").write_text(json.dumps(facts, indent=1))
    return 0


def _machine_checks(facts: dict, rehearse: bool) -> list:
    def python():
        v = sys.version_info
        facts["python"] = f"{v.major}.{v.minor}.{v.micro}"
        if v < (3, 10):
            raise Fail(f"python {facts['python']}: the project needs 3.10 or later")
        return f"{facts['python']} ({sys.executable})"

    def pip():
        out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
        if out.returncode != 0:
            raise Fail(f"{sys.executable} -m pip does not run (the offline install needs it): "
                       f"{(out.stderr.strip().splitlines() or [''])[-1]}")
        return out.stdout.split(" from ")[0]

    def compiler():
        cc = os.environ.get("CC", "")
        names = [cc.split()[0]] if cc else ["cc", "gcc", "clang"]
        found = next(filter(None, map(shutil.which, names)), None)
        if not found:
            raise Fail(f"no C compiler ({'CC=' + cc if cc else 'cc, gcc, clang'} not on PATH): the native kernel "
                       "and Triton's launcher are built with one")
        return found

    def python_h():
        import sysconfig

        inc = Path(sysconfig.get_paths()["include"])
        if not (inc / "Python.h").exists():
            raise Fail(f"no Python.h in {inc} (install python{sys.version_info.major}.{sys.version_info.minor}-dev): "
                       "Triton builds its launcher against it")
        return str(inc / "Python.h")

    def torch_version():
        import torch

        facts["torch"] = torch.__version__
        return f"{torch.__version__} (CUDA {torch.version.cuda})"

    def triton_version():
        import triton

        facts["triton"] = triton.__version__
        v = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
        lo, hi = TRITON_RANGE
        if not lo <= v < hi:
            raise Fail(f"triton {triton.__version__} is outside the supported {lo[0]}.{lo[1]} to <{hi[0]}.{hi[1]}")
        return triton.__version__

    def device():
        import torch

        if rehearse:
            facts.update(device="CPU stand-in (rehearsal)", arch=90)
            return "CPU stand-in (rehearsal: no CUDA device is used; the Triton kernels run under the interpreter)"
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            raise Fail("no CUDA device visible to torch (torch.cuda.is_available() is False)")
        p = torch.cuda.get_device_properties(0)
        facts.update(device=p.name, arch=p.major * 10 + p.minor, memory_gib=round(p.total_memory / 2**30, 1),
                     count=torch.cuda.device_count())
        return f"{p.name}, sm_{facts['arch']}, {facts['memory_gib']} GiB"

    def triton_launch():
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr):
            tl.store(x_ptr, tl.load(x_ptr) + 1.0)

        dev = "cpu" if rehearse else "cuda"
        x = torch.zeros(1, device=dev)
        t0 = time.perf_counter()
        add_one[(1,)](x)
        if dev == "cuda":
            torch.cuda.synchronize()
        if x.item() != 1.0:
            raise Fail(f"a one-element Triton kernel stored {x.item()}, not 1.0")
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        where = f"{dev} under the interpreter" if interp else dev
        return f"ok on {where} ({time.perf_counter() - t0:.1f} s with its compile)"

    return [("python", python), ("pip", pip), ("C compiler", compiler), ("Python.h", python_h),
            ("torch", torch_version), ("triton", triton_version), ("device", device), ("triton launch", triton_launch)]


def _tree_checks(facts: dict) -> list:
    def imports(mod):
        def check():
            m = __import__(mod)
            return f"{getattr(m, '__version__', '')} ({Path(m.__file__).parent})"
        return check

    def carried():
        import bridge
        import lowbit_tree

        for m in (lowbit_tree, bridge):
            where = Path(m.__file__).resolve()
            if ROOT not in where.parents:
                raise Fail(f"{m.__name__} imported from {where.parent}, not the carried tree {ROOT}: PYTHONPATH must "
                           "start with it")
        return str(ROOT)

    def native_kernel():
        from lowbit_tree.kernels import native

        if not native.available():
            raise Fail(f"the native C kernel is unavailable ({native.build_error()}): the GPU's bits are checked "
                       "against it")
        return ", ".join(native.vector_paths()) or "plain C"

    return [("optree", imports("optree")), ("numpy", imports("numpy")), ("carried tree", carried),
            ("native kernel", native_kernel), ("pytest", imports("pytest")), ("pytest-xdist", imports("xdist"))]


# ----------------------------------------------------------------------------- the offline install


def _dist(wheel: str) -> tuple[str, str, str]:
    """(normalized distribution name, version, python tag) from a wheel's file name."""
    parts = wheel[:-4].split("-")
    return re.sub(r"[-_.]+", "-", parts[0]).lower(), parts[1], parts[-3]


def _installed(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def install(wheels_dir: str, target: Path, rehearse: bool) -> int:
    """What this Python lacks of the wheels folder (in a rehearsal also what the GPU image lacks),
    offline, without dependencies, into ``target``; never the project's own wheel (the carried
    tree is imported instead)."""
    if not wheels_dir:
        print("no wheels folder given (--wheels DIR): nothing installed; the steps use what this Python has")
        return 0
    folder = Path(wheels_dir)
    wheels = sorted(p.name for p in folder.glob("*.whl"))
    if not wheels:
        print(f"FAIL install: no wheels in {folder} (benchmarks/gpu_wheels.sh makes them)")
        return EXIT_INSTALL
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    tags = {w: _dist(w)[2] for w in wheels}  # a CPython tag other than this one's: built for another Python
    wrong = [w for w, t in tags.items() if t.startswith("cp") and t != here and "abi3" not in w]
    if wrong:
        print(f"FAIL install: the wheels are for {', '.join(sorted({tags[w] for w in wrong}))}, this is python "
              f"{sys.version_info.major}.{sys.version_info.minor}: make them with benchmarks/gpu_wheels.sh "
              f"--python-version {sys.version_info.major}.{sys.version_info.minor} DIR")
        return EXIT_INSTALL
    chosen = []
    for w in wheels:
        dist, version, _ = _dist(w)
        have = _installed(dist)
        if dist == "lowbit-tree":
            print(f"skip {w}: the carried tree is imported instead")
        elif have is None or (rehearse and dist in IMAGE_LACKS):
            chosen.append(w)
            print(f"take {w}" + (f" (this Python has {have}; the GPU image lacks it)" if have else ""))
        else:
            print(f"skip {w}: this Python has {dist} {have}")
    if not chosen:
        print("nothing to install")
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--target", str(target)] + [str(folder / w) for w in chosen]
    print("$ " + shlex.join(cmd), flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(out.stdout, end="")
    if out.returncode != 0:
        print(f"FAIL install: pip exited {out.returncode}: {(out.stdout.strip().splitlines() or [''])[-1]}")
        return EXIT_INSTALL
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    print(f"installed {len(chosen)} wheels into {target} ({size / 2**20:.1f} MiB unpacked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
