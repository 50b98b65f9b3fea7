"""Native CPU backend for :mod:`lowbit_tree.kernels`: ``cpu.c`` built on first use
with the system C compiler and called through ctypes.

Why not inductor on CPU: it turns the table gathers of the nearest-code search
into scalar loops with bounds checks and splits the fused step into several
passes (measured ~15x fused fp32 AdamW); the C kernel does one pass per tile of
whole blocks and is built in about a second (no torch headers).

The library is cached under ``$LOWBIT_TREE_CACHE`` (default
``~/.cache/lowbit_tree``), keyed by the source, the generated ABI header, the flags
and the CPU's feature flags. The header (:func:`abi_header`) carries what crosses the
boundary, generated from :mod:`.spec` (rule ids, flag bits, dtype ids, the
hyperparameter vector's names, the job row's layout); the build writes it to a
temporary file and force-includes it (``-include``) into ``cpu.c``, which declares
none of these numbers itself and checks ``lbt_job``'s layout against it at build
time. ``LOWBIT_TREE_BACKEND=eager`` or ``compiled`` runs the torch backend
instead (see :mod:`lowbit_tree.kernels`); ``LOWBIT_TREE_CFLAGS`` adds compiler
flags, ``CC`` chooses the compiler. :func:`available` says whether it can be used,
:func:`build_error` why not; the first time it is unavailable (other than by
choice) a ``RuntimeWarning`` says so, naming the switch and what to do.
"""
from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import operator
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from ..formats import FORMATS as _FORMATS
from ..rules import RULE_DEFS
from .setting import backend_setting
from . import spec
from .spec import (
    DTYPE_IDS, JOB_HEADER, NHYPER, RANK1_BLOCK, RULE_IDS, STATE_FIELDS, STATE_SLOTS, StepSpec, flag_bits,
)
from .tables import cpu_code_table

__all__ = [
    "available", "build_error", "library", "quantize", "dequantize", "apply", "rank1_encode",
    "NativeState", "NativeJob", "run_jobs", "run_rows", "RULE_IDS", "abi_header",
]

_SOURCE = Path(__file__).with_name("cpu.c")
# -ffp-contract=off: no FMA contraction (GCC's default for GNU C is "fast"), so
# every multiply and add rounds like torch's eager float32 ops.
# -fno-trapping-math only lets GCC vectorize comparisons (no FP exception flags
# are read anywhere); it changes no result.
# -Werror=implicit-function-declaration: an undeclared function returns int in C99,
# so a pointer it returns would be cut to 32 bits; refuse to build instead.
# -mprefer-vector-width=512: on CPUs with AVX-512, GCC vectorizes the plain loops (the rules,
# bfloat16 loads and stores, the corrected write) with 512-bit vectors instead of its default
# 256 (kernel_ab, 128x256, 1 thread: the 8-bit AdamW step on bfloat16 params with param_correction
# 2.45 -> 2.06 ns/element, Lion8bit 0.83 -> 0.70); elementwise and integer-max work, so the bits
# do not depend on the width. Ignored without AVX-512 (and with -mno-avx512f).
_FLAGS = [
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC",
    "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=gnu99",
    "-Werror=implicit-function-declaration",
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
        ("planes", ctypes.c_void_p),
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


def _c_name(prefix: str, name: str) -> str:
    c = f"{prefix}{name.upper()}"
    if not c.isidentifier():
        raise ValueError(f"{name!r} does not make a C name")
    return c


def _variant_expression() -> str:
    """The C expression of a job's variant from its ``rule`` and ``flags``: for each rule that
    declares variants, the sum of ``1 << i`` over its set flags, ``i`` the flag's place in
    :attr:`RuleDef.variants <lowbit_tree.rules.RuleDef.variants>`; 0 for the other rules."""
    out = "0"
    for rule, d in reversed(list(RULE_DEFS.items())):
        if d.variants:
            bits = " | ".join(f"(((flags) & {_c_name('LBT_', v)}) ? {1 << i} : 0)" for i, v in enumerate(d.variants))
            out = f"((rule) == {_c_name('LBT_', rule)} ? ({bits}) : {out})"
    return out


@functools.lru_cache(maxsize=1)
def abi_header() -> str:
    """The C header ``cpu.c`` is compiled with, generated from :mod:`.spec`: the rule ids
    (``LBT_ADAM``...), dtype ids (``LBT_F32``...), flag bits (``LBT_MAXIMIZE``...), the rank-1
    marker, the hyperparameter indices (``LBT_H_B1``..., ``LBT_NHYPER``), the job row's field
    indices (``LBT_JOB_ROWS``..., ``LBT_STATE_IN``...) and counts, a job's variant from its rule
    and flags (``LBT_JOB_VARIANT``, from the rules' declared variants), X-macros listing the
    fields with their indices (``LBT_JOB_LAYOUT(X)``, ``LBT_STATE_LAYOUT(X)``) for cpu.c's
    layout checks, and the compiled rule combinations (``LBT_ALL_RULES``, ``spec.instances``)."""
    lines = ["/* Generated by lowbit_tree/kernels/native.py from lowbit_tree/kernels/spec.py. Do not edit:",
             " * change spec.py. */", "#pragma once"]
    names = []

    def section(what: str, pairs, enum: bool = False) -> None:
        pairs = list(pairs)
        names.extend(name for name, _ in pairs)
        lines.extend(["", f"/* {what} */"])
        if enum:
            lines.append("enum { " + ", ".join(f"{name} = {value}" for name, value in pairs) + " };")
        else:
            lines.extend(f"#define {name} {value}" for name, value in pairs)

    section("rule ids (spec.RULES)", [(_c_name("LBT_", n), i) for i, n in enumerate(spec.RULES)], enum=True)
    section("param, gradient and plain-state dtype ids (spec.DTYPES)",
            [(_c_name("LBT_", n), i) for i, (n, _) in enumerate(spec.DTYPES)], enum=True)
    section("flag bits (spec.FLAGS)", [(_c_name("LBT_", n), 1 << i) for i, n in enumerate(spec.FLAGS)])
    section("the block size of a rank-1 record's state (spec.RANK1_BLOCK)",
            [("LBT_RANK1", f"({spec.RANK1_BLOCK})")])
    section("the float32 hyperparameter vector's entries (spec.HYPER_NAMES)",
            [(_c_name("LBT_H_", n), i) for i, n in enumerate(spec.HYPER_NAMES)] + [("LBT_NHYPER", spec.NHYPER)])
    header, state = spec.JOB_HEADER, spec.STATE_FIELDS
    section("the job row, one int64 each: the header fields (spec.JOB_HEADER), then LBT_STATE_SLOTS states "
            "(spec.STATE_FIELDS)",
            [(_c_name("LBT_JOB_", n), i) for i, n in enumerate(header)] + [("LBT_JOB_FIELDS", len(header))]
            + [(_c_name("LBT_STATE_", n), i) for i, n in enumerate(state)] + [("LBT_STATE_FIELDS", len(state))]
            + [("LBT_STATE_SLOTS", spec.STATE_SLOTS), ("LBT_JOB_INT64S", spec.JOB_ROW)])
    section("the fields with their indices, for cpu.c's layout checks: X(member, index)",
            [(f"{macro}(X)", " ".join(f"X({n}, {_c_name(prefix, n)})" for n in fields))
             for macro, prefix, fields in (("LBT_JOB_LAYOUT", "LBT_JOB_", header),
                                           ("LBT_STATE_LAYOUT", "LBT_STATE_", state))])
    section("a job's variant, rule_run's VAR: bit i is the rule's i-th variant flag (rules.RuleDef.variants)",
            [("LBT_JOB_VARIANT(rule, flags)", _variant_expression())])
    runs = [" ".join(f"LBT_RUN({_c_name('LBT_', r)}, {v}, {tr}, {dec}, {epw})" for r, v, tr, dec, epw in spec.instances()
                     if r == rule) for rule in spec.RULES]
    section("the compiled rule_run combinations, LBT_RUN(rule, VAR, TR, DEC, EPW) each (spec.INSTANCES); "
            "cpu.c defines LBT_RUN before each expansion", [("LBT_ALL_RULES", " \\\n    ".join(runs))])
    if len(set(names)) != len(names):
        raise ValueError(f"spec.py's names make equal C names: {sorted(n for n in names if names.count(n) > 1)}")
    return "\n".join(lines) + "\n"


def _compile(cc: str, flags: list[str], out: str, source: Path, header: str) -> None:
    """Build ``source`` (``cpu.c``) with ``header`` force-included into ``out``; :class:`BuildError` with
    the compiler's message if it fails."""
    where = "CC" if os.environ.get("CC", "").strip() else "found on PATH"
    try:
        done = subprocess.run([cc, *flags, "-include", str(header), str(source), "-o", out, "-lm"],
                              capture_output=True, text=True)
    except OSError as e:  # exists but cannot be run (not an executable format, no permission)
        raise BuildError(f"the C compiler {cc!r} ({where}) could not be run: {e}") from e
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise BuildError(f"the C compiler {cc!r} ({where}) failed with exit status {done.returncode}"
                         + (": " + " | ".join(tail) if tail else ""))


def _build(cc: str, flags: list[str], so: Path, source: Path = _SOURCE) -> None:
    """Compile ``source`` with :func:`abi_header` (a temporary file) to a temporary file next to
    ``so``, make that readable by everyone (0o755; mkstemp creates 0o600), then rename it into
    place: concurrent processes never load a partial file, and a build leaves no other file
    behind."""
    so.parent.mkdir(parents=True, exist_ok=True)
    fd, header = tempfile.mkstemp(prefix=so.stem + ".", suffix=".tmp.h", dir=so.parent)
    os.close(fd)
    fd, tmp = tempfile.mkstemp(prefix=so.stem + ".", suffix=".tmp.so", dir=so.parent)
    os.close(fd)
    try:
        Path(header).write_text(abi_header())
        try:
            _compile(cc, flags, tmp, source, header)
        except BuildError:
            if not (_is_amd() and any(f in flags for f in _AMD_FLAGS)):
                raise
            # the AMD tuning option is GCC-only: retry without it
            _compile(cc, [f for f in flags if f not in _AMD_FLAGS], tmp, source, header)
        os.chmod(tmp, 0o755)
        os.replace(tmp, so)
    finally:
        for path in (tmp, header):
            if os.path.exists(path):
                os.unlink(path)


_FALLBACK_NOTICE = (
    "lowbit_tree: the native CPU kernel is unavailable ({why}). The CPU path falls back to the "
    "eager torch backend (LOWBIT_TREE_BACKEND=eager; set it to choose that explicitly and silence "
    "this notice), which is slower. For the fast kernel install gcc or clang, or set CC to a "
    "working C compiler."
)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """(library, None), or (None, why it is unavailable). The first time it is unavailable for a
    reason other than an explicit choice (``LOWBIT_TREE_BACKEND=eager`` or ``compiled``), one
    ``RuntimeWarning`` says so and what to do."""
    chosen = backend_setting()
    if chosen in ("eager", "compiled"):
        return None, f"not used: LOWBIT_TREE_BACKEND={chosen}"
    try:
        lib = _build_and_load()
    except BuildError as e:
        why = str(e)
    except OSError as e:  # the cache is not writable, or the built file does not load
        why = f"{type(e).__name__}: {e}"
    else:
        return lib, None
    warnings.warn(_FALLBACK_NOTICE.format(why=why), RuntimeWarning, stacklevel=3)
    return None, why


def reset() -> None:
    """Forget the load (:func:`.backend_choice.reset_backend_setting` calls it): the next use loads
    again, under the setting then in force, and warns again if the library cannot be built."""
    _load.cache_clear()


def library():
    """The loaded ctypes library, or ``None`` when it cannot be built or is disabled
    (:func:`build_error` says why)."""
    return _load()[0]


def build_error() -> Optional[str]:
    """Why the native library is unavailable (no compiler, a broken ``CC``, the compiler's
    error, ``LOWBIT_TREE_BACKEND=eager|compiled``), or ``None`` when it is available."""
    return _load()[1]


def _library_path(cc: str, flags: list[str], header: str) -> Path:
    """Where the library built from ``cpu.c`` with ``header``, ``cc`` and ``flags`` for this CPU is
    cached: the name hashes all four, so a changed spec.py builds a new library."""
    key = hashlib.sha256(_SOURCE.read_bytes() + header.encode() + " ".join([cc] + flags).encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LOWBIT_TREE_CACHE", Path.home() / ".cache" / "lowbit_tree"))
    return cache / f"kernels_cpu_{key}.so"


def _build_and_load() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise BuildError("no C compiler: none of cc, gcc, clang is on PATH and CC is not set")
    # LOWBIT_TREE_CFLAGS: extra compiler flags (e.g. "-mno-avx2" to build and test
    # the plain-C paths that CPUs without AVX2 run)
    flags = _FLAGS + (_AMD_FLAGS if _is_amd() else []) + os.environ.get("LOWBIT_TREE_CFLAGS", "").split()
    so = _library_path(cc, flags, abi_header())
    if not so.exists():
        _build(cc, flags, so)
    lib = ctypes.CDLL(str(so))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fptr = ctypes.POINTER(_Format)
    lib.lbt_quantize.argtypes = [i64, i64, ptr, ptr, ptr, fptr, i64, i32]
    lib.lbt_dequantize.argtypes = [i64, i64, ptr, ptr, ptr, fptr, i64, i32]
    for f in (lib.lbt_quantize, lib.lbt_dequantize):
        f.restype = None
    lib.lbt_step_jobs.argtypes = [i64, ptr, i32]
    lib.lbt_step_jobs.restype = None
    lib.lbt_apply.argtypes = [i64, ptr, i64, ptr, ptr, i32]
    lib.lbt_apply.restype = None
    lib.lbt_rank1_encode.argtypes = [i64, i64, ptr, ptr, ptr, fptr, ptr, i32]
    lib.lbt_rank1_encode.restype = None
    lib.lbt_lowrank_expand.argtypes = [i64, i64, i64, ptr, ptr, ptr, i32]
    lib.lbt_lowrank_expand.restype = None
    lib.lbt_prepare.argtypes = [fptr]
    lib.lbt_prepare.restype = ctypes.c_int
    lib.lbt_check_tables.argtypes = [fptr]
    lib.lbt_check_tables.restype = ctypes.c_int
    lib.lbt_vector_paths.argtypes = []
    lib.lbt_vector_paths.restype = ctypes.c_int
    lib.lbt_abi_layout.argtypes = [ctypes.POINTER(i64), i64]
    lib.lbt_abi_layout.restype = i64
    built, want = abi_layout(lib), expected_abi_layout()
    if built != want:  # cpu.c checks this at build time: only a foreign file in the cache gets here
        raise BuildError(f"{so} was not built with this spec.py's job layout: {built} != {want}")
    return lib


def expected_abi_layout() -> list[int]:
    """What :func:`abi_layout` returns for a library built with :func:`abi_header`: byte sizes
    and offsets, every field 8 bytes wide at ``8 *`` its index in :mod:`.spec`."""
    header, state = len(spec.JOB_HEADER), len(spec.STATE_FIELDS)
    return ([8 * spec.JOB_ROW] + [8 * i for i in range(header)] + [8 * header]
            + [8 * state] + [8 * i for i in range(state)])


def abi_layout(lib) -> list[int]:
    """The job layout a built library has: ``sizeof(lbt_job)``, the offset of each
    ``spec.JOB_HEADER`` field, the offset of its states, ``sizeof(lbt_state)``, the offset of
    each ``spec.STATE_FIELDS`` field (``lbt_abi_layout`` in cpu.c)."""
    n = lib.lbt_abi_layout(None, 0)
    out = (ctypes.c_int64 * n)()
    lib.lbt_abi_layout(out, n)
    return list(out)


def available() -> bool:
    return library() is not None


_VECTOR_PATHS = ("avx2", "avx512", "avx512vbmi")


def vector_paths() -> tuple[str, ...]:
    """The vector paths the loaded library was built with, of ``("avx2", "avx512", "avx512vbmi")``
    (the last: the 8-bit table decode's byte planes): what the build targets (``-march=native``,
    ``LOWBIT_TREE_CFLAGS`` such as ``-mno-avx512f``), not what the CPU has. Empty: plain C."""
    bits = library().lbt_vector_paths()
    return tuple(name for i, name in enumerate(_VECTOR_PATHS) if bits & (1 << i))


@functools.lru_cache(maxsize=None)
def _format_struct(name: str) -> _Format:
    fmt, tab = _FORMATS[name], cpu_code_table(name)
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


def _check_size(t: torch.Tensor, dtype: torch.dtype, numel: int, what: str) -> None:
    _check(t, dtype, what)
    if t.numel() != numel:
        raise ValueError(f"native CPU kernel: {what} has {t.numel()} elements, expected {numel}")


def quantize(x2: torch.Tensor, fmt_name: str, block_size: int, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """float32 contiguous (rows, R) -> fills uint8 ``codes`` and float32 ``scale`` (sizes checked)."""
    rows, r = x2.shape
    cols = (r + 1) // 2 if _FORMATS[fmt_name].bits == 4 else r
    _check(x2, torch.float32, "x")
    _check_size(codes, torch.uint8, rows * cols, "codes")
    _check_size(scale, torch.float32, rows * -(-r // block_size), "scale")
    library().lbt_quantize(rows, r, _ptr(x2), _ptr(codes), _ptr(scale), _format_struct(fmt_name), block_size, _threads(rows * r))


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt_name: str, block_size: int, r: int, out: torch.Tensor) -> None:
    """uint8 ``codes`` and float32 ``scale`` of a (rows, r) view -> fills float32 ``out`` (sizes checked)."""
    rows = codes.shape[0]
    cols = (r + 1) // 2 if _FORMATS[fmt_name].bits == 4 else r
    _check_size(codes, torch.uint8, rows * cols, "codes")
    _check_size(scale, torch.float32, rows * -(-r // block_size), "scale")
    _check_size(out, torch.float32, rows * r, "out")
    library().lbt_dequantize(rows, r, _ptr(codes), _ptr(scale), _ptr(out), _format_struct(fmt_name), block_size, _threads(rows * r))


def apply(p: torch.Tensor, u: torch.Tensor, out: torch.Tensor) -> None:
    """``out = p + u`` rounded once to ``p``'s dtype (float32 or bfloat16; ``u`` float32), as
    ``torch.add(p, u, out=out)`` computes it, with non-temporal stores into ``out``."""
    _check(u, torch.float32, "update")
    if p.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"native CPU kernel: apply takes float32 or bfloat16 params, got {p.dtype}")
    _check_size(p, p.dtype, u.numel(), "param")
    _check_size(out, p.dtype, u.numel(), "out")
    library().lbt_apply(u.numel(), _ptr(p), DTYPE_IDS[p.dtype], _ptr(u), _ptr(out), _threads(u.numel()))


def lowrank_expand(p: torch.Tensor, rt: torch.Tensor, out: torch.Tensor) -> None:
    """Fills float32 ``out`` ``(m, n)`` with ``p @ rt`` summed over ``k`` in order (``p`` float32
    ``(m, K)``, ``rt`` float32 ``(K, n)``, both holding bfloat16 values): the bits of
    :func:`lowbit_tree.lowrank.lowrank_expand`'s torch ops."""
    m, k = p.shape
    n = rt.shape[1]
    _check(p, torch.float32, "row factor")
    _check(rt, torch.float32, "column factor")
    _check_size(rt, torch.float32, k * n, "column factor")
    _check_size(out, torch.float32, m * n, "out")
    library().lbt_lowrank_expand(m, n, k, _ptr(p), _ptr(rt), _ptr(out), _threads(m * n * k))


def _rank1_check(rows: int, r: int, codes: torch.Tensor, row_max: torch.Tensor, col_max: torch.Tensor,
                 x: torch.Tensor) -> None:
    _check_size(codes, torch.uint8, rows * ((r + 1) // 2), "rank-1 codes")
    _check_size(row_max, torch.float32, rows, "rank-1 row_max")
    _check_size(col_max, torch.float32, r, "rank-1 col_max")
    _check_size(x, torch.float32, rows * r, "rank-1 values")


def rank1_encode(x: torch.Tensor, row_max, col_max, fmt_name: str, codes: torch.Tensor) -> None:
    """Fills ``codes`` with float32 ``x`` ``(rows, r)`` coded against the given maxima,
    bit-identical to :func:`lowbit_tree.rank1.rank1_quantize`'s codes."""
    rows, r = x.shape
    _rank1_check(rows, r, codes, row_max, col_max, x)
    library().lbt_rank1_encode(rows, r, _ptr(x), _ptr(row_max), _ptr(col_max), _format_struct(fmt_name),
                               _ptr(codes), _threads(rows * r))


# --------------------------------------------------------------------------- steps

# RULE_IDS, DTYPE_IDS (param, gradient and plain-state dtypes the kernel reads and writes) and
# RANK1_BLOCK (the block_size of a NativeState that is a rank-1 record) come from spec.py.
_PLAIN_STATE_DTYPES = (torch.float32, torch.bfloat16)


class NativeState(NamedTuple):
    """One state of a leaf as the kernel sees it. Quantized: ``src``/``dst`` are the
    codes (uint8 views) and ``scale_src``/``scale_dst`` the scales; plain: float32
    or bfloat16 values and no scales. ``dst`` may be ``src`` (in place). A rank-1 record
    (``block_size`` :data:`RANK1_BLOCK`): ``src`` its codes, ``scale_src``/``scale_dst`` its
    row and column maxima (read), ``dst`` its new codes (may be ``src``), ``row_max_new`` /
    ``col_max_new`` the maxima of its new values (those of
    :func:`lowbit_tree.rank1.rank1_quantize`): a ``maxima`` job writes them, the caller completes
    them across shards, and the step job encodes the new values with them."""

    src: torch.Tensor
    dst: torch.Tensor
    scale_src: Optional[torch.Tensor]
    scale_dst: Optional[torch.Tensor]
    format: Optional[str]
    block_size: int
    row_max_new: Optional[torch.Tensor] = None  # rank-1: the new values' row maxima
    col_max_new: Optional[torch.Tensor] = None  # and their column maxima


class NativeJob(NamedTuple):
    """One leaf's step: the ``(rows, r)`` view of param and gradient, where the
    result goes (``out``: the param itself with ``write``, else a float32 update),
    the step's hyperparameter vector and the leaf's states; with ``write``, a bfloat16 /
    float16 param's int8 ``correction`` (:mod:`lowbit_tree.correction`), read and written in
    place. ``maxima``: the job only computes its rank-1 states' new maxima (the first of a
    rank-1 step's two jobs; ``write``, ``stochastic`` and ``correction`` off, ``out`` unused).
    ``new_param`` (without ``write``): a new tensor of the param's dtype and size that gets
    ``p + u`` rounded once (to nearest), the sum ``apply_updates`` computes, in the same pass."""

    rows: int
    r: int
    param: Optional[torch.Tensor]
    grad: torch.Tensor
    out: torch.Tensor
    spec: StepSpec
    write: bool
    stochastic: bool
    sr_hash: int
    hyper: torch.Tensor
    states: tuple
    correction: Optional[torch.Tensor] = None
    maxima: bool = False
    new_param: Optional[torch.Tensor] = None


@functools.lru_cache(maxsize=256)
def _spec_flags(s: StepSpec, write: bool, stochastic: bool, corrected: bool, maxima: bool, new_param: bool) -> int:
    return flag_bits(maximize=s.maximize, l2=s.l2, decay=s.decay, lr=s.lr, **s.variants,
                     write_param=write, stochastic=stochastic, param_correction=corrected, maxima=maxima, new_param=new_param)


def _flags(job: NativeJob) -> int:
    return _spec_flags(job.spec, job.write, job.stochastic, job.correction is not None, job.maxima,
                       job.new_param is not None)


@functools.lru_cache(maxsize=None)
def _format_address(name: str) -> int:
    return ctypes.addressof(_format_struct(name))


def _addr(t: torch.Tensor, dtypes: tuple, numel: int, what: str, rows: int, r: int) -> int:
    """``t``'s address after the checks the C code relies on: a contiguous CPU tensor
    of one of ``dtypes`` with ``numel`` elements (else a ValueError naming it)."""
    if t.dtype not in dtypes or not t.is_cpu or not t.is_contiguous():
        _check(t, dtypes[0] if t.dtype not in dtypes else t.dtype, what)
    if t.numel() != numel:
        raise ValueError(f"native CPU kernel: {what} has {t.numel()} elements, expected {numel} (rows={rows}, R={r})")
    return t.data_ptr()


_F32, _U8, _I8 = (torch.float32,), (torch.uint8,), (torch.int8,)
_DTS = tuple(DTYPE_IDS)
_CORRECTED = (torch.bfloat16, torch.float16)  # the param dtypes of the corrected write (correction.CORRECTED_DTYPES)
# a job row from its fields by name, in spec.py's order (a field spec.py adds and job_row does
# not fill is a KeyError, never a silent 0)
_HEADER_ROW = operator.itemgetter(*JOB_HEADER)
_STATE_ROW = operator.itemgetter(*STATE_FIELDS)
_EMPTY_STATE = (0,) * len(STATE_FIELDS)


def job_row(job: NativeJob, hyper_ptr: Optional[int] = None) -> list[int]:
    """Checks one job's tensors and returns its ``lbt_job`` row (``spec.JOB_ROW`` int64). The C
    code trusts these sizes: they are checked here, so it never reads or writes out
    of bounds. A tensor passed twice (in place) is checked once; ``hyper_ptr``: the
    address of a hyperparameter vector the caller checked already."""
    rows, r = job.rows, job.r
    n = rows * r
    spec = job.spec
    if job.maxima:
        if job.write or job.stochastic or job.correction is not None or spec.rule not in ("adam", "ademamix"):
            raise ValueError("native CPU kernel: a maxima job is Adam's or AdEMAMix's and writes nothing")
        if not any(st.block_size == RANK1_BLOCK for st in job.states[1:]):
            raise ValueError("native CPU kernel: a maxima job needs a rank-1 second moment")
    elif job.write:
        if job.param is None or job.out is not job.param:
            raise ValueError("native CPU kernel: writing the param needs out to be the param itself")
        if job.stochastic and job.param.dtype is not torch.bfloat16:
            raise ValueError("native CPU kernel: stochastic rounding is for bfloat16 params")
    elif job.out.dtype is not torch.float32:
        raise ValueError("native CPU kernel: the update is float32")
    pout = 0
    if job.new_param is not None:
        if job.write or job.maxima or job.param is None or job.new_param.dtype is not job.param.dtype:
            raise ValueError("native CPU kernel: a new param goes with the update (not write or maxima), from the "
                             "param, in its dtype")
        pout = _addr(job.new_param, (job.param.dtype,), n, "new param", rows, r)
    corr = 0
    if job.correction is not None:
        if not job.write or job.stochastic or job.param.dtype not in _CORRECTED:
            raise ValueError("native CPU kernel: a correction goes with a bfloat16 / float16 param written in place "
                             "(rounded to nearest)")
        corr = _addr(job.correction, _I8, n, "correction", rows, r)
    if spec.needs_param and job.param is None:
        raise ValueError(f"native CPU kernel: {spec} needs the param")
    if len(job.states) != spec.nstates or spec.nstates > STATE_SLOTS:
        raise ValueError(f"native CPU kernel: {spec.rule} takes {spec.nstates} states (a job row holds up to "
                         f"{STATE_SLOTS}), got {len(job.states)}")
    p = 0 if job.param is None else _addr(job.param, _DTS, n, "param", rows, r)
    g = _addr(job.grad, _DTS, n, "grad", rows, r)
    o = 0 if job.maxima else p if job.write else _addr(job.out, _F32, n, "out", rows, r)
    h = hyper_ptr if hyper_ptr is not None else _addr(job.hyper, _F32, NHYPER, "hyper", 1, NHYPER)
    row = list(_HEADER_ROW({
        "rows": rows, "R": r, "p": p, "g": g, "out": o, "pout": pout, "rule": RULE_IDS[spec.rule], "flags": _flags(job),
        "pdt": DTYPE_IDS[job.param.dtype] if job.param is not None else 0, "gdt": DTYPE_IDS[job.grad.dtype],
        "hyper": h, "sr_hash": job.sr_hash & 0xFFFFFFFF, "corr": corr, "nstates": len(job.states),
    }))
    if job.states and job.states[0].format is None and any(st.format is not None for st in job.states):
        raise ValueError("native CPU kernel: plain states go beside quantized ones only after a quantized first state")
    for i, st in enumerate(job.states):
        what = f"state {i}"
        if st.format is None:
            dt = st.src.dtype
            if dt not in _PLAIN_STATE_DTYPES or st.dst.dtype is not dt:
                raise ValueError(f"native CPU kernel: plain {what} must be float32 or bfloat16, got {dt}")
            src = _addr(st.src, (dt,), n, what, rows, r)
            dst = src if st.dst is st.src else _addr(st.dst, (dt,), n, what + " out", rows, r)
            fields = {"in": src, "out": dst, "scale_in": 0, "scale_out": 0, "f": 0, "bs": DTYPE_IDS[dt],
                      "rmax_new": 0, "cmax_new": 0}
        elif st.block_size == RANK1_BLOCK:  # a rank-1 record: codes and maxima in, new codes out
            if _FORMATS[st.format].bits != 4:
                raise ValueError(f"native CPU kernel: rank-1 {what} needs 4-bit codes")
            cols = rows * ((r + 1) // 2)
            src = _addr(st.src, _U8, cols, what + " codes", rows, r)
            dst = src if st.dst is st.src else _addr(st.dst, _U8, cols, what + " codes out", rows, r)
            rmax = _addr(st.scale_src, _F32, rows, what + " row_max", rows, r)
            cmax = _addr(st.scale_dst, _F32, r, what + " col_max", rows, r)
            if st.row_max_new is None or st.col_max_new is None:
                raise ValueError(f"native CPU kernel: rank-1 {what} needs tensors for its new maxima")
            rnew = _addr(st.row_max_new, _F32, rows, what + " new row_max", rows, r)
            cnew = _addr(st.col_max_new, _F32, r, what + " new col_max", rows, r)
            fields = {"in": src, "out": dst, "scale_in": rmax, "scale_out": cmax, "f": _format_address(st.format),
                      "bs": RANK1_BLOCK, "rmax_new": rnew, "cmax_new": cnew}
        else:
            fmt = _FORMATS[st.format]
            cols = (r + 1) // 2 if fmt.bits == 4 else r
            nb = rows * -(-r // st.block_size)
            src = _addr(st.src, _U8, rows * cols, what + " codes", rows, r)
            dst = src if st.dst is st.src else _addr(st.dst, _U8, rows * cols, what + " codes out", rows, r)
            ssrc = _addr(st.scale_src, _F32, nb, what + " scale", rows, r)
            sdst = ssrc if st.scale_dst is st.scale_src else _addr(st.scale_dst, _F32, nb, what + " scale out", rows, r)
            fields = {"in": src, "out": dst, "scale_in": ssrc, "scale_out": sdst, "f": _format_address(st.format),
                      "bs": int(st.block_size), "rmax_new": 0, "cmax_new": 0}
        row += _STATE_ROW(fields)
    row += _EMPTY_STATE * (STATE_SLOTS - len(job.states))
    return row


def run_jobs(jobs: list) -> None:
    """Many leaves' steps in one call and one parallel region (the tiles of all jobs
    are shared out among the threads): per leaf, one row of ``spec.JOB_ROW`` integers, not one
    foreign call and one thread wake-up. All jobs are checked before any runs."""
    if not jobs:
        return
    flat = array.array("q")  # int64 rows; building a tensor from a list costs ~20 us per 100 jobs
    total = 0
    hypers: dict = {}  # id -> checked address (jobs of a call usually share one vector)
    for job in jobs:
        h = hypers.get(id(job.hyper))
        if h is None:
            h = hypers[id(job.hyper)] = _addr(job.hyper, _F32, NHYPER, "hyper", 1, NHYPER)
        flat.extend(job_row(job, h))
        total += job.rows * job.r
    library().lbt_step_jobs(len(jobs), flat.buffer_info()[0], _threads(total))


def run_rows(rows: array.array, njobs: int, numel: int) -> None:
    """Run ``njobs`` rows built by :func:`job_row` (and since rewritten only where a step
    changes them: :class:`lowbit_tree.kernels.plan.KernelPlan`), over ``numel`` elements."""
    library().lbt_step_jobs(njobs, rows.buffer_info()[0], _threads(numel))
