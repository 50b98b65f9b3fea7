"""Native CPU backend for :mod:`lowbit_tree.kernels`: ``kernels_cpu.c`` built on
first use with the system C compiler and called through ctypes.

Why not inductor on CPU: it turns the table gathers of the nearest-code search
into scalar loops with bounds checks and splits the fused step into several
passes (measured ~15x fused fp32 AdamW); the C kernel does one pass per tile of
whole blocks and is built in about a second (no torch headers).

The library is cached under ``$LOWBIT_TREE_CACHE`` (default
``~/.cache/lowbit_tree``), keyed by the source, the flags and the CPU's feature
flags. Set ``LOWBIT_TREE_NATIVE=0`` to never build or use it (the torch path
then runs), ``LOWBIT_TREE_CFLAGS`` to add compiler flags, ``CC`` to choose the
compiler. :func:`available` says whether it can be used, :func:`build_error` why not;
the first time it is unavailable (other than by choice) a ``RuntimeWarning`` says so.
"""
from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

from .formats import FORMATS as _FORMATS

__all__ = ["available", "build_error", "library", "quantize", "dequantize", "adam", "adam_many"]

_SOURCE = Path(__file__).with_name("kernels_cpu.c")
# -ffp-contract=off: no FMA contraction (GCC's default for GNU C is "fast"), so
# every multiply and add rounds like torch's eager float32 ops.
# -fno-trapping-math only lets GCC vectorize comparisons (no FP exception flags
# are read anywhere); it changes no result.
_FLAGS = [
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
    "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=gnu99",
]
# AMD Zen: AVX2 gathers are microcoded and slower than scalar loads; GCC then
# vectorizes the table lookups with emulated gathers (~10% faster fused step,
# same results). GCC-only option: the build retries without it if rejected.
_AMD_FLAGS = ["-mtune-ctrl=^use_gather_2parts,^use_gather_4parts,^use_gather"]


def _is_amd() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "AuthenticAMD" in f.read(4096)
    except OSError:
        return False


class _Format(ctypes.Structure):
    _fields_ = [
        ("bits", ctypes.c_int32),
        ("is_signed", ctypes.c_int32),
        ("sqrt_", ctypes.c_int32),
        ("float8", ctypes.c_int32),
        ("divisor", ctypes.c_float),
        ("last", ctypes.c_int32),
        ("decode", ctypes.c_void_p),
        ("encode", ctypes.c_void_p),
        ("sorted", ctypes.c_void_p),
        ("packed", ctypes.c_void_p),
        ("encode_mode", ctypes.c_int32),
        ("encode_arg", ctypes.c_int32),
        ("e4m3_arith", ctypes.c_int32),
        ("rng_adj", ctypes.c_int32 * 8),
        ("rng_sh", ctypes.c_int32 * 8),
        ("rng_elow", ctypes.c_int32),
        ("rng_kmin", ctypes.c_int32),
        ("rng_kmax", ctypes.c_int32),
        ("rng_npos", ctypes.c_int32),
        ("lin", ctypes.c_int32),
        ("lin_a", ctypes.c_float),
        ("lin_b", ctypes.c_float),
    ]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


class BuildError(RuntimeError):
    """Why the native library cannot be built or loaded (see :func:`build_error`)."""


def _compiler() -> Optional[str]:
    """The C compiler to build with: ``$CC`` if set (it must name one executable, as a path or a
    name on ``PATH``; a ``CC`` that does not is an error, never skipped), else the first of
    ``cc``, ``gcc``, ``clang`` on ``PATH``; ``None`` if there is none."""
    cc = os.environ.get("CC")
    if cc is not None and cc.strip():
        found = shutil.which(cc.strip())
        if found is None:
            raise BuildError(f"CC={cc!r} does not name an executable (not found on PATH, or not executable)")
        return found
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _compile(cc: str, flags: list[str], out: str) -> None:
    """Build ``kernels_cpu.c`` into ``out``; :class:`BuildError` with the compiler's message if it fails."""
    where = "CC" if os.environ.get("CC", "").strip() else "found on PATH"
    try:
        done = subprocess.run([cc, *flags, str(_SOURCE), "-o", out, "-lm"], capture_output=True, text=True)
    except OSError as e:  # exists but cannot be run (not an executable format, no permission)
        raise BuildError(f"the C compiler {cc!r} ({where}) could not be run: {e}") from e
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise BuildError(f"the C compiler {cc!r} ({where}) failed with exit status {done.returncode}"
                         + (": " + " | ".join(tail) if tail else ""))


def _build(cc: str, flags: list[str], so: Path) -> None:
    """Compile to a temporary file next to ``so``, make it readable by everyone (0o755; mkstemp
    creates 0o600), then rename it into place: concurrent processes never load a partial
    file, and a failed build leaves no file behind."""
    so.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=so.stem + ".", suffix=".tmp.so", dir=so.parent)
    os.close(fd)
    try:
        try:
            _compile(cc, flags, tmp)
        except BuildError:
            if not (_is_amd() and any(f in flags for f in _AMD_FLAGS)):
                raise
            # the AMD tuning option is GCC-only: retry without it
            _compile(cc, [f for f in flags if f not in _AMD_FLAGS], tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_FALLBACK_NOTICE = (
    "lowbit_tree: the native CPU kernel is unavailable ({why}). The CPU path falls back to the "
    "eager torch backend (LOWBIT_TREE_BACKEND=eager; set it to choose that explicitly and silence "
    "this notice), which is slower. For the fast kernel install gcc or clang, or set CC to a "
    "working C compiler."
)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """(library, None), or (None, why it is unavailable). The first time it is unavailable for a
    reason other than an explicit choice (``LOWBIT_TREE_NATIVE=0``, ``LOWBIT_TREE_BACKEND=eager``),
    one ``RuntimeWarning`` says so and what to do."""
    if os.environ.get("LOWBIT_TREE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by LOWBIT_TREE_NATIVE=0"
    try:
        lib = _build_and_load()
    except BuildError as e:
        why = str(e)
    except OSError as e:  # the cache is not writable, or the built file does not load
        why = f"{type(e).__name__}: {e}"
    else:
        return lib, None
    if os.environ.get("LOWBIT_TREE_BACKEND", "").strip().lower() != "eager":
        warnings.warn(_FALLBACK_NOTICE.format(why=why), RuntimeWarning, stacklevel=3)
    return None, why


def library():
    """The loaded ctypes library, or ``None`` when it cannot be built or is disabled
    (:func:`build_error` says why)."""
    return _load()[0]


def build_error() -> Optional[str]:
    """Why the native library is unavailable (no compiler, a broken ``CC``, the compiler's
    error, ``LOWBIT_TREE_NATIVE=0``), or ``None`` when it is available."""
    return _load()[1]


def _build_and_load() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise BuildError("no C compiler: none of cc, gcc, clang is on PATH and CC is not set")
    src = _SOURCE.read_bytes()
    # LOWBIT_TREE_CFLAGS: extra compiler flags (e.g. "-mno-avx2" to build and test
    # the plain-C paths that CPUs without AVX2 run)
    flags = _FLAGS + (_AMD_FLAGS if _is_amd() else []) + os.environ.get("LOWBIT_TREE_CFLAGS", "").split()
    key = hashlib.sha256(src + " ".join([cc] + flags).encode() + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LOWBIT_TREE_CACHE", Path.home() / ".cache" / "lowbit_tree"))
    so = cache / f"kernels_cpu_{key}.so"
    if not so.exists():
        _build(cc, flags, so)
    lib = ctypes.CDLL(str(so))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fptr = ctypes.POINTER(_Format)
    lib.lbt_quantize.argtypes = [i64, i64, ptr, ptr, ptr, fptr, i64, i32]
    lib.lbt_dequantize.argtypes = [i64, i64, ptr, ptr, ptr, fptr, i64, i32]
    for f in (lib.lbt_quantize, lib.lbt_dequantize):
        f.restype = None
    lib.lbt_adam_jobs.argtypes = [i64, ptr, i32]
    lib.lbt_adam_jobs.restype = None
    lib.lbt_prepare.argtypes = [fptr]
    lib.lbt_prepare.restype = ctypes.c_int
    lib.lbt_check_tables.argtypes = [fptr]
    lib.lbt_check_tables.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


@functools.lru_cache(maxsize=None)
def _format_struct(name: str) -> _Format:
    from .formats import FORMATS
    from .kernels import _cpu_code_table

    fmt, tab = FORMATS[name], _cpu_code_table(name)
    st = _Format(
        fmt.bits, int(fmt.signed), int(fmt.sqrt), int(fmt.float8), float(fmt.scale_divisor), tab.last,
        tab.decode.data_ptr(), tab.encode.data_ptr(), tab.thresholds.data_ptr(),
        None,  # packed: the range table, built by lbt_prepare
    )
    rc = library().lbt_prepare(ctypes.byref(st))
    if rc != 0:  # a table the C kernel's assumptions do not hold for: a bug, never silent
        raise RuntimeError(f"lbt_prepare rejected the code table of {name!r} (error {rc})")
    return st


# Below this many elements a call runs on one thread: an OpenMP parallel region
# costs a wake-up of every thread (ms on a busy machine), like torch's own grain size.
_PARALLEL_MIN_NUMEL = 1 << 18


def _threads(numel: int) -> int:
    return 1 if numel < _PARALLEL_MIN_NUMEL else torch.get_num_threads()


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """The C code reads raw pointers: CPU, ``dtype``, contiguous, or a clear error."""
    if t.dtype is not dtype or not t.is_cpu or not t.is_contiguous():
        raise ValueError(
            f"native CPU kernel: {what} must be a contiguous {dtype} CPU tensor, got "
            f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"
        )


def quantize(x2: torch.Tensor, fmt_name: str, block_size: int, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """float32 contiguous (rows, R) -> fills uint8 ``codes`` and float32 ``scale``."""
    rows, r = x2.shape
    _check(x2, torch.float32, "x")
    library().lbt_quantize(rows, r, _ptr(x2), _ptr(codes), _ptr(scale), _format_struct(fmt_name), block_size, _threads(rows * r))


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt_name: str, block_size: int, r: int, out: torch.Tensor) -> None:
    rows = codes.shape[0]
    _check(codes, torch.uint8, "codes")
    _check(scale, torch.float32, "scale")
    library().lbt_dequantize(rows, r, _ptr(codes), _ptr(scale), _ptr(out), _format_struct(fmt_name), block_size, _threads(rows * r))


def _adam_job_row(rows: int, r: int, p, g, out, mc, ms, vc, vs, mc_out, ms_out, vc_out, vs_out, m_out, v_out, hyper,
                  fmt_m: str, bs_m: int, fmt_v: str, bs_v: int) -> list[int]:
    """Checks one job's tensors and returns its ``lbt_adam_job`` row (20 int64).
    The C code trusts these sizes: they are checked here, it never writes out of
    bounds. In-place jobs pass the same tensor twice; each is checked once."""
    cm, cv = (r + 1) // 2 if _FORMATS[fmt_m].bits == 4 else r, (r + 1) // 2 if _FORMATS[fmt_v].bits == 4 else r
    n, nbm, nbv = rows * r, rows * -(-r // bs_m), rows * -(-r // bs_v)
    expect = (
        ("param", p, torch.float32, n), ("grad", g, torch.float32, n), ("out", out, torch.float32, n),
        ("m_codes", mc, torch.uint8, rows * cm), ("m_scale", ms, torch.float32, nbm),
        ("v_codes", vc, torch.uint8, rows * cv), ("v_scale", vs, torch.float32, nbv),
        ("m_codes_out", mc_out, torch.uint8, rows * cm), ("m_scale_out", ms_out, torch.float32, nbm),
        ("v_codes_out", vc_out, torch.uint8, rows * cv), ("v_scale_out", vs_out, torch.float32, nbv),
        ("m_out", m_out, torch.float32, n), ("v_out", v_out, torch.float32, n), ("hyper", hyper, torch.float32, 9),
    )
    ptrs = []
    seen = {}  # id -> data_ptr of the tensors checked (alive: they are arguments)
    for what, t, dtype, numel in expect:
        if t is None:
            ptrs.append(0)
            continue
        ptr = seen.get(id(t))
        if ptr is None:
            _check(t, dtype, what)
            if t.numel() != numel:
                raise ValueError(f"lbt_adam: {what} has {t.numel()} elements, expected {numel} (rows={rows}, R={r})")
            ptr = seen[id(t)] = t.data_ptr()
        ptrs.append(ptr)
    if p is not None and ptrs[2] != ptrs[0]:
        lo, hi = sorted((ptrs[2], ptrs[0]))
        if hi < lo + 4 * n:
            raise ValueError("lbt_adam: out must be the param itself or not overlap it")
    return [rows, r, *ptrs, ctypes.addressof(_format_struct(fmt_m)), ctypes.addressof(_format_struct(fmt_v)), bs_m, bs_v]


def adam(rows: int, r: int, p, g, out, mc, ms, vc, vs, mc_out, ms_out, vc_out, vs_out, m_out, v_out, hyper,
         fmt_m: str, bs_m: int, fmt_v: str, bs_v: int) -> None:
    """The fused step (see ``lbt_adam_job`` in kernels_cpu.c); all plain contiguous CPU tensors."""
    adam_many([(rows, r, p, g, out, mc, ms, vc, vs, mc_out, ms_out, vc_out, vs_out, m_out, v_out, hyper,
                fmt_m, bs_m, fmt_v, bs_v)])


# Tile of a float32-moment job (elements; any size works, results do not depend on it).
_FP32_TILE = 2048


def _adam_fp32_job_row(p, g, m, v, hyper) -> list[int]:
    """One float32-moment job's row: param, grad, m, v float32 contiguous, same numel;
    p, m and v are updated in place."""
    n = p.numel()
    for what, t, numel in (("param", p, n), ("grad", g, n), ("exp_avg", m, n), ("exp_avg_sq", v, n), ("hyper", hyper, 9)):
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous() or t.numel() != numel:
            _check(t, torch.float32, what)
            raise ValueError(f"lbt_adam: {what} has {t.numel()} elements, expected {numel}")
    pp = p.data_ptr()
    return [1, n, pp, g.data_ptr(), pp, m.data_ptr(), 0, v.data_ptr(), 0, 0, 0, 0, 0, 0, 0, hyper.data_ptr(),
            0, 0, _FP32_TILE, _FP32_TILE]


def adam_many(jobs: list[tuple], fp32_jobs: list[tuple] = ()) -> None:
    """Several fused steps in one call and one parallel region (the tiles of all
    jobs are shared out among the threads): per-parameter overhead is one row of
    20 integers, not one foreign call and one thread wake-up per parameter. Each
    job is the argument tuple of :func:`adam`; each of ``fp32_jobs`` is
    ``(p, g, m, v, hyper)`` for plain float32 moments (the same update, in place).
    All jobs are checked before any runs."""
    if not jobs and not fp32_jobs:
        return
    flat = array.array("q")  # int64 rows; building a tensor from a list costs ~20 us per 100 jobs
    total = 0
    for job in jobs:
        flat.extend(_adam_job_row(*job))
        total += job[0] * job[1]
    for job in fp32_jobs:
        flat.extend(_adam_fp32_job_row(*job))
        total += job[0].numel()
    library().lbt_adam_jobs(len(jobs) + len(fp32_jobs), flat.buffer_info()[0], _threads(total))
