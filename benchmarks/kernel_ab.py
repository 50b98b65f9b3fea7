"""A/B timing of builds of the native CPU kernel (``lowbit_tree/kernels/cpu.c``).

Each C source given is built with the library's own flags and generated ABI
header (``native.abi_header``: the rule ids, flags and job layout of this
checkout's ``spec.py``) and loaded side by side, and prepares its own format
structs (so builds whose code tables differ compare fairly; the struct's fields
must be this checkout's); every (build, state
format, size, data) combination then runs one step of ``--rule`` (AdamW by
default; param written in place with its decay and learning rate, as the bridge
does) through ``lbt_step_jobs`` directly, out of place on
fixed inputs (``--inplace``: on the build's own copies of param and states,
updated in place as the bridge does), and the timed calls are interleaved in
rounds, so a slow period of a shared machine hits all builds alike. Prints min
and median ns per element, and ``!`` where a build's output (param, codes,
scales) differs from the first build's.

Sizes: ``128x256`` fits in L2 (compute cost), ``2048x2048`` streams from memory.
Data ``wide``: normal gradients (moments spread over many octaves of each block's
absmax); ``narrow``: |g| in [0.5, 1] (a few octaves, few table lines touched).

Usage: python benchmarks/kernel_ab.py [SOURCE.c[+FLAG...] ...] [--formats 8bit,fp8]
       [--sizes 128x256,2048x2048] [--data wide] [--threads 1] [--rounds 12] [--show] [--inplace]
       [--rule adamw|amsgrad|lion|momentum|ademamix] [--dtype float32|bfloat16] [--functional]
       [--correct] [--bridge]
``--correct`` (with ``--dtype bfloat16``, not with ``--functional``): the param is written with its
int8 correction (``param_correction``), the correction compared like the other outputs.
``--formats`` takes ``fp32`` too (plain float32 states).
``--bridge``: the bridge classes (``BRIDGE_CASES``) against ``torch.optim.AdamW(fused=True)`` on
the same params in one process (``bridge_ratios``), with the library built from the one SOURCE
given (default: this checkout's): compare builds by their ratios.
With no source, the library's own source (one build: absolute figures only). ``SOURCE.c+FLAG``
builds that source with extra compiler flags (``cpu.c+-mno-avx512f``: its AVX2 paths).

Per-phase profile of the quantized AdamW step (2026-12-03; a 2-core AVX-512 Xeon VM under other
load, load average 2-4; no hardware counters, and valgrind without AVX-512, so each phase is
timed as a variant: the step without that phase, kernel_ab interleaved, ``128x256`` in L2,
1 thread, in place, min of 11 rounds, ns/element). ``before``: the kernel at fa52c07.

=====================  =====  ======  ================  ==========  ======  ====
format, rule           total  decode  encode (its div)  sqrt + div  maxima  rest
=====================  =====  ======  ================  ==========  ======  ====
8bit AdamW, before     1.64   0.38    0.82 (0.09)
8bit AdamW             1.47   0.25    0.66 (0.14)       0.22        0.03    0.31
4bit AdamW, before     1.59   0.28    0.86
4bit AdamW (blocks)    1.36   0.18    0.61 (0.12)       0.19        0.06    0.32
fp8 AdamW, before      1.43   0.35    0.64
fp8 AdamW              1.33   0.25    0.54 (0.10)       0.18        0.00    0.36
8bit Lion              0.80   0.12    0.34                          0.04    0.30
8bit SGD momentum      0.72   0.14    0.36                          0.03    0.19
=====================  =====  ======  ================  ==========  ======  ====

``rest``: loads and stores of param, gradient and scratch, and the rule's other arithmetic.
Encode (a block's codes from its new values: the division by its scale, the range-table key and
gather, or the e4m3 / 4-bit index, the byte store) is still the largest phase, then the divider
(the rule's sqrt and division and the encoders' divisions: 0.36 of 8-bit AdamW's 1.47), all
ALU-bound. Streamed (``2048x2048``) the same build runs 8bit 1.50, fp8 1.37, 4bit 1.29
ns/element on 1 thread and 8bit 0.88 on 2, where torch's fused fp32 AdamW takes about 0.62
ns/param on 2 threads (5.2 ms for two 2048x2048 params on the machine at load 2: 45 GB/s): the
quantized step is compute-bound, not at the memory floor. The rank-1 4-bit second moment
(AdamW4bit's default) takes two jobs, 0.41 (maxima) + 1.37-1.55 (step) ns/element (2048x2048,
1 thread; before 0.57 + 1.69), and the bfloat16 step with ``param_correction`` spends 0.5 of its
2.06 in the corrected write.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import lowbit_tree as lt
from lowbit_tree.kernels import StepLeaf, StepSpec, run_step, step_hyperparams
from lowbit_tree.kernels import native as KC
from lowbit_tree.kernels.spec import job_row_index
from lowbit_tree.kernels.tables import cpu_code_table

RULES = {
    "adamw": StepSpec("adam", decay=True, lr=True),
    "amsgrad": StepSpec("adam", amsgrad=True, decay=True, lr=True),
    "lion": StepSpec("lion", decay=True, lr=True),
    "momentum": StepSpec("momentum", lr=True),
    "ademamix": StepSpec("ademamix", decay=True, lr=True),
}


def build(source: Path, outdir: Path, extra: tuple = ()):
    """Compile ``source`` like the library does (its flags, its generated header, plus ``extra``
    flags) and load it."""
    key = hashlib.sha256(source.read_bytes() + " ".join(extra).encode()).hexdigest()[:12]
    so = outdir / f"ab_{key}.so"
    try:  # without the AMD option if the compiler rejects it (GCC-only)
        KC._build(KC._compiler(), KC._FLAGS + (KC._AMD_FLAGS if KC._is_amd() else []) + list(extra), so, source)
    except KC.BuildError as e:
        raise RuntimeError(f"could not build {source}: {e}") from e
    lib = ctypes.CDLL(str(so))
    lib.lbt_step_jobs.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.lbt_step_jobs.restype = None
    lib.lbt_prepare.argtypes = [ctypes.POINTER(KC._Format)]
    lib.lbt_prepare.restype = ctypes.c_int
    lib.formats = {}
    return lib


def lib_format(lib, name: str) -> int:
    """Address of ``name``'s format struct prepared by ``lib`` itself, so that
    builds whose tables differ in content each get their own (the struct's
    fields are this checkout's ``native._Format``)."""
    if name not in lib.formats:
        fmt, tab = lt.formats.FORMATS[name], cpu_code_table(name)
        st = KC._Format(
            fmt.bits, int(fmt.signed), int(fmt.sqrt), int(fmt.float8), float(fmt.scale_divisor), tab.last,
            tab.decode.data_ptr(), tab.encode.data_ptr(), tab.thresholds.data_ptr(), None,
        )
        if lib.lbt_prepare(ctypes.byref(st)) != 0:
            raise RuntimeError(f"lbt_prepare of this build rejected {name}")
        lib.formats[name] = st
    return ctypes.addressof(lib.formats[name])


def make_case(spec: StepSpec, state_format: str, rows: int, cols: int, data: str, dtype: torch.dtype):
    """Inputs after a few real steps (non-trivial states), fixed for every call."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(rows, cols, generator=gen).to(dtype)
    g = torch.randn(rows, cols, generator=gen) * 1e-2
    if data == "narrow":
        g = (torch.rand(rows, cols, generator=gen) * 0.5 + 0.5) * g.sign() * 1e-2
    g = g.to(dtype)
    if state_format == "fp32":  # plain float32 states
        states = tuple(torch.zeros(rows, cols) for _ in spec.signed)
    else:
        states = tuple(lt.zeros(p.shape, state_format, signed=s) for s in spec.signed)
    extra = dict(b3=0.9999, alpha=5.0) if spec.rule == "ademamix" else {}
    hyper = step_hyperparams(spec, count=3, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, **extra)
    for _ in range(5):
        run_step(spec, hyper, [StepLeaf(p, g, states)], write=True, inplace=True, backend="native")
    return p, g, states, hyper


BRIDGE_CASES = ("AdamW8bit", "AdamW4bit", "AdamWFp8", "Lion8bit", "SGD8bit", "AdamW8bit+correction bf16")


def bridge_ratios(source, threads: int, rounds: int, n: int = 2048) -> int:
    """The bridge's step against ``torch.optim.AdamW(fused=True)`` (fp32 states; about
    DeepSpeedCPUAdam's time on the same params), both on two ``n x n`` params in one process,
    timed in interleaved rounds of 5 steps: per class its median ms and its ratio to the fused
    step's median (bfloat16 rows: to the fused step on the same bfloat16 params). ``source``:
    the C source the bridge's library is built from (default: this checkout's), so that builds
    compare by their ratios, each from its own run."""
    import bridge

    if source is not None:
        KC._SOURCE = Path(source)  # before the library's first use: built from this source
    if not KC.available():
        print("native CPU kernels unavailable")
        return 1
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)

    def params(dtype):
        ps = [torch.nn.Parameter(torch.randn(n, n, generator=gen).to(dtype)) for _ in range(2)]
        for p in ps:
            p.grad = (torch.randn(n, n, generator=gen) * 1e-2).to(dtype)
        return ps

    opts = {"torch fused": torch.optim.AdamW(params(torch.float32), lr=1e-3, fused=True),
            "torch fused bf16": torch.optim.AdamW(params(torch.bfloat16), lr=1e-3, fused=True)}
    for name in BRIDGE_CASES:
        if name == "AdamW8bit+correction bf16":
            opts[name] = bridge.AdamW8bit(params(torch.bfloat16), lr=1e-3, param_correction=True)
        elif name == "SGD8bit":
            opts[name] = bridge.SGD8bit(params(torch.float32), lr=1e-3, momentum=0.9)
        else:
            opts[name] = getattr(bridge, name)(params(torch.float32), lr=1e-3)
    for opt in opts.values():
        for _ in range(3):
            opt.step()
    ms: dict = {k: [] for k in opts}
    for _ in range(rounds):
        for k, opt in opts.items():
            t0 = time.perf_counter()
            for _ in range(5):
                opt.step()
            ms[k].append((time.perf_counter() - t0) / 5 * 1e3)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"{KC._SOURCE}, {threads} thread(s), two {n}x{n} params, median of {rounds} rounds of 5 steps")
    for k, m in med.items():
        ref = med["torch fused bf16" if k.endswith("bf16") else "torch fused"]
        print(f"{k:28s} {m:8.2f} ms {m / ref:6.2f}x {m * 1e6 / (2 * n * n):6.2f} ns/param")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="*", type=Path)
    ap.add_argument("--formats", default="8bit,fp8")
    ap.add_argument("--sizes", default="128x256,2048x2048")
    ap.add_argument("--data", default="wide", help="wide, narrow or both (comma-separated)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--show", action="store_true", help="print every round's figure")
    ap.add_argument("--inplace", action="store_true",
                    help="update param and states in place, as the bridge does (each build on its own copies)")
    ap.add_argument("--rule", default="adamw", choices=sorted(RULES))
    ap.add_argument("--functional", action="store_true",
                    help="write the update and leave the param (tx.update's mode) instead of writing the param")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--correct", action="store_true", help="write the param with its int8 correction")
    ap.add_argument("--bridge", action="store_true",
                    help="time the bridge classes against torch.optim.AdamW(fused=True) instead (see bridge_ratios)")
    args = ap.parse_args(argv)
    if args.bridge:
        if len(args.sources) > 1:
            ap.error("--bridge runs one build (the library's own source, or the one SOURCE given)")
        return bridge_ratios(args.sources[0] if args.sources else None, args.threads, args.rounds)
    if args.correct and (args.dtype != "bfloat16" or args.functional):
        ap.error("--correct writes a bfloat16 param: give --dtype bfloat16, without --functional")
    if not KC.available():
        print("native CPU kernels unavailable (no working C compiler)")
        return 1
    # SOURCE.c+FLAG+FLAG: that source built with extra flags (e.g. cpu.c+-mno-avx512f)
    builds = [(Path(str(s).split("+")[0]), tuple(str(s).split("+")[1:])) for s in (args.sources or [KC._SOURCE])]
    sources = [Path(str(s)) for s in (args.sources or [KC._SOURCE])]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(s, Path(tmp), extra) for s, extra in builds]
        cfgs = []
        for sf in args.formats.split(","):
            for size in args.sizes.split(","):
                rows, cols = (int(x) for x in size.split("x"))
                for data in args.data.split(","):
                    spec = RULES[args.rule]
                    p, g, states, hyper = make_case(spec, sf, rows, cols, data, getattr(torch, args.dtype))
                    corr = (torch.randint(-128, 128, (rows, cols), dtype=torch.int8,
                                          generator=torch.Generator().manual_seed(1)) if args.correct else None)
                    for li in range(len(libs)):
                        # out of place: the param is written in place (the bridge's mode), or with
                        # --functional an update is written and the param only read (tx.update's
                        # mode); --inplace also updates the states in place
                        pp = p.clone()
                        plain = sf == "fp32"
                        if plain:
                            new = tuple(s.clone() for s in states)
                        else:
                            new = tuple(lt.QTensor(s.codes.clone(), s.scale.clone(), s.shape, s.block_size, s.format)
                                        for s in states)
                        ins = new if args.inplace else states
                        if plain:
                            sts = tuple(KC.NativeState(i, o, None, None, None, 0) for i, o in zip(ins, new))
                        else:
                            sts = tuple(KC.NativeState(i.codes.view(torch.uint8), o.codes.view(torch.uint8), i.scale,
                                                       o.scale, o.format, o.block_size) for i, o in zip(ins, new))
                        target = torch.empty(rows, cols) if args.functional else pp
                        cc = corr.clone() if args.correct else None
                        row = KC.job_row(KC.NativeJob(rows, cols, pp, g, target, spec, not args.functional, False, 0,
                                                      hyper, sts, cc))
                        for i, s in enumerate(new if not plain else ()):  # this build's own format structs
                            row[job_row_index("f", i)] = lib_format(libs[li], s.format)
                        out = (target,) + (new if plain else tuple(t for s in new for t in (s.codes.view(torch.uint8), s.scale)))
                        out += (cc,) if args.correct else ()
                        # the row holds raw addresses: keep every tensor it names alive (pp is not in out
                        # with --functional)
                        cfgs.append(dict(key=f"{sf} {size} {data}", lib=libs[li], table=torch.tensor(row), out=out, keep=(pp, sts),
                                         inputs=(p, g, states, hyper), n=rows * cols, ns=[]))
        for _ in range(args.rounds):
            for c in cfgs:
                calls = max(1, int(2e6 // c["n"]))
                fn, ptr = c["lib"].lbt_step_jobs, c["table"].data_ptr()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(1, ptr, args.threads)
                c["ns"].append((time.perf_counter() - t0) / calls / c["n"] * 1e9)
    names = [s.name for s in sources]
    print(f"ns/element, min / median over {args.rounds} rounds, {args.threads} thread(s); ! = output differs from {names[0]}")
    print(f"{'case':28s}" + "".join(f"{n:>18s}" for n in names))
    for key in dict.fromkeys(c["key"] for c in cfgs):
        cs = [c for c in cfgs if c["key"] == key]
        same = [all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cs[0]["out"], c["out"])) for c in cs]
        print(f"{key:28s}" + "".join(f"{min(c['ns']):9.2f} /{statistics.median(c['ns']):6.2f}{' ' if ok else '!'}"
                                     for c, ok in zip(cs, same)))
        if args.show:
            for c in cs:
                print("    " + " ".join(f"{x:.1f}" for x in c["ns"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
