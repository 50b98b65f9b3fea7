"""Compile every variant of the Triton step kernel for sm_80 and sm_90 without a GPU, scan the
PTX for instructions that would change the bits, and print a table of each variant's registers,
spills, shared memory, widest global load and bytes moved per param element.

    python benchmarks/triton_compile.py [--arch 80,90] [--jobs 2] [--limit N] [--cache DIR] [--json FILE]

A variant is one constexpr combination of ``lowbit_tree/kernels/triton_step.py``'s kernel
(``triton_backend.launch_key``): every declared rule and variant x every state format (each
state in its format's default block size) with float32 params written in place, plus bfloat16
params (stochastic rounding; the int8 param correction) and the float32 update (the functional form) for each rule with
8-bit states; each in its aligned form (every address a multiple of 16 bytes, rows a multiple of
32 elements: loads may be vectors) and its general one (``offset``: any view, any row length).
The fused links are runtime flags (not specialised): one variant serves every link set.

Fails (exit 1) on a compile error or, in any variant's PTX, on ``div.full`` / ``div.approx``
(Triton's ``/``), ``sqrt.approx`` / ``rsqrt.approx`` (``tl.sqrt``), ``ex2.approx`` /
``lg2.approx``, ``.ftz`` (subnormals flushed to zero), or an ``fma`` in a variant whose source
writes none (only Muon's and centered RMSprop's lerps call ``tl.fma``), or an aligned 8-bit AdamW
with float32 params whose params and gradients do not load as 128-bit vectors or that spills
(:data:`VECTOR_CHECK`). The widest global load is read off the PTX (``ld.global.v4.b32``: 128 bits;
the table's 64-bit addresses left out), registers and spills (local memory bytes) off the cubin
(``cuobjdump --dump-resource-usage``). Cubins, their resources and their PTX (which every run
scans again, so a change of the scan needs no compile) are cached under ``--cache`` (default
``$LOWBIT_TREE_CACHE/triton`` or ``~/.cache/lowbit_tree/triton``) by the sha256 of the kernel's
source, the variant, the target and the triton version.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BANNED = ("div.full", "div.approx", "sqrt.approx", "rsqrt.approx", "ex2.approx", "lg2.approx", ".ftz")
FMA_RULES = {("muon", 0), ("muon", 1), ("rmsprop", 2), ("rmsprop", 3)}  # (rule, VAR) whose source calls tl.fma
SIGNATURE = {"leaves": "*i64", "tile_leaf": "*i32", "hyper": "*fp32", "ftab": "*fp32", "etab": "*u8",
             "links": "i32"}
VECTOR_CHECK = ("adam 8bit f32 write aligned", 4)
"""The common variant whose params and gradients must load as 128-bit vectors, without spills:
1024 float32 of each a tile over 128 threads, two 128-bit loads a thread each (its codes are
bytes, its scales one per block, so no other stream of it loads 128 bits)."""
POINTER_ATTRS = {(i,): [["tt.divisibility", 16]] for i in range(5)}
"""What a launch specialises its five tensor arguments to (their 16-byte aligned addresses), so the
cubins here are the ones a launch compiles."""


def variants() -> list[tuple[str, dict, str, dict]]:
    """(name, StepSpec kwargs, state format, launch options) of every variant compiled."""
    from lowbit_tree.rules import RULE_DEFS

    rules = []
    for name, d in RULE_DEFS.items():
        vs = [{}] + [{f: True} for f in d.variants] + ([dict.fromkeys(d.variants, True)] if len(d.variants) > 1 else [])
        rules += [(name, v) for v in vs]
    out = []
    for rule, v in rules:
        for aligned in (True, False):
            for fmt in ("8bit", "4bit", "nf4", "fp8", "8bit_bnb", "fp32", "bf16"):
                out.append((rule, v, fmt, dict(pdt="f32", write=True, aligned=aligned)))
            out.append((rule, v, "8bit", dict(pdt="bf16", write=True, sr=True, aligned=aligned)))
            out.append((rule, v, "8bit", dict(pdt="bf16", write=True, corr=True, aligned=aligned)))
            out.append((rule, v, "8bit", dict(pdt="f32", write=False, aligned=aligned)))
    return out


def variant_name(rule: str, variant: dict, fmt: str, opts: dict) -> str:
    return ("-".join([rule] + sorted(variant)) + f" {fmt} {opts['pdt']}" + (" write" if opts["write"] else " update")
            + (" sr" if opts.get("sr") else "") + (" corrected" if opts.get("corr") else "")
            + (" aligned" if opts.get("aligned") else " offset"))


def constexprs(rule: str, variant: dict, fmt: str, opts: dict) -> dict:
    import torch

    from lowbit_tree.formats import FORMATS, STATE_FORMATS
    from lowbit_tree.kernels import triton_backend as tb
    from lowbit_tree.kernels import triton_step as ts
    from lowbit_tree.kernels.spec import StepSpec

    spec = StepSpec(rule, **variant, decay=True, lr=True)
    storages = []
    for signed in spec.signed:
        if fmt in ("fp32", "bf16"):
            storages.append((ts.STORAGE_F32 if fmt == "fp32" else ts.STORAGE_BF16, 0))
        else:
            f = FORMATS[STATE_FORMATS[fmt][0 if signed else 1]]
            storages.append((ts.STORAGE_Q4 if f.bits == 4 else ts.STORAGE_Q8, f.default_block_size))
    dt = {"f32": ts.DT_F32, "bf16": ts.DT_BF16}[opts["pdt"]]
    key = (tuple(storages), dt, dt, opts["write"], opts.get("sr", False), opts.get("corr", False),
           opts.get("aligned", False))
    del torch
    cx = tb._constexprs(spec, key)
    cx.pop("UNIT")  # the launcher's row padding, not a kernel argument
    return cx


def bytes_per_param(cx: dict) -> float:
    """Bytes read and written per param element: gradient, param (read; written in place or the
    float32 update), each state's codes or values read and written plus its scales."""
    size = {0: 4, 1: 2, 2: 2}
    b = size[cx["GDT"]] + (size[cx["PDT"]] if cx["P"] else 0) + (size[cx["PDT"]] if cx["WRITE"] else 4)
    b += 2 if cx["CORR"] else 0  # the correction byte read and written
    for i in range(cx["NS"]):
        k, bs = cx[f"K{i}"], cx[f"BS{i}"]
        b += 2 * {0: 4, 1: 2, 8: 1, 4: 0.5}[k] + (2 * 4 / bs if k in (4, 8) else 0)
    return b


def _resources(cubin: bytes) -> dict:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"lbt_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    try:
        text = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                              check=True).stdout
    finally:
        path.unlink()
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    return dict(regs=int(m[1]), stack=int(m[2]), shared=int(m[3]), spills=int(m[4]))


_LOAD = re.compile(r"\bld\.global((?:\.[\w:]+)*)")


def global_loads(ptx: str) -> dict[int, int]:
    """The data loads of ``ptx`` by width in bits (``ld.global.v4.b32``: 128): {bits: count}; the
    scalar 64-bit loads left out (the kernel's only 64-bit values are its table's addresses)."""
    out: dict[int, int] = {}
    for m in _LOAD.finditer(ptx):
        parts = m[1].split(".")
        vec = next((int(q[1:]) for q in parts if re.fullmatch(r"v\d+", q)), 1)
        size = next(int(q[1:]) for q in reversed(parts) if re.fullmatch(r"[bufs]\d+", q))
        if vec > 1 or size < 64:
            out[vec * size] = out.get(vec * size, 0) + 1
    return out


def scan_ptx(ptx: str, fma_allowed: bool) -> list[str]:
    """The banned instructions in ``ptx`` (each once)."""
    found = sorted({op for op in BANNED if re.search(rf"{re.escape(op)}(?!\w)"
                                                     if op.startswith(".") else rf"\b{re.escape(op)}\b", ptx)})
    if not fma_allowed and re.search(r"\bfma\.", ptx):
        found.append("fma (the source writes none)")
    return found


def compile_one(args: tuple) -> dict:
    name, rule, variant, fmt, opts, arch, cache = args
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lowbit_tree.kernels import triton_step as ts

    cx = constexprs(rule, variant, fmt, opts)
    source = Path(ts.__file__).read_bytes()
    key = hashlib.sha256(source + json.dumps([cx, arch, triton.__version__, str(POINTER_ATTRS)],
                                             sort_keys=True).encode()).hexdigest()
    entry, ptx_file = Path(cache) / f"{key}.json", Path(cache) / f"{key}.ptx.gz"
    if entry.exists() and ptx_file.exists():
        res = json.loads(entry.read_text())
        return dict(res, **_ptx_facts(gzip.decompress(ptx_file.read_bytes()).decode(), rule, cx), name=name,
                    arch=arch, cached=True)
    t0 = time.perf_counter()
    sig = dict(SIGNATURE, **{k: "constexpr" for k in cx})
    try:
        k = triton.compile(ASTSource(ts.step_kernel, sig, cx, POINTER_ATTRS), target=GPUTarget("cuda", arch, 32),
                           options={"enable_fp_fusion": False, "num_warps": 4})
    except Exception as e:  # a compile error fails the run, with its text
        return dict(name=name, arch=arch, error=f"{type(e).__name__}: {e}"[:2000], cached=False)
    seconds = time.perf_counter() - t0
    res = dict(seconds=round(seconds, 2), bytes=bytes_per_param(cx), **_resources(k.asm["cubin"]))
    Path(cache).mkdir(parents=True, exist_ok=True)
    (Path(cache) / f"{key}.cubin").write_bytes(k.asm["cubin"])
    ptx_file.write_bytes(gzip.compress(k.asm["ptx"].encode()))
    entry.write_text(json.dumps(res))
    return dict(res, **_ptx_facts(k.asm["ptx"], rule, cx), name=name, arch=arch, cached=False)


def _ptx_facts(ptx: str, rule: str, cx: dict) -> dict:
    """What the table reads off a variant's PTX (each run: the cache keeps the PTX, so a change
    of the scan needs no compile)."""
    loads = global_loads(ptx)
    return dict(banned=scan_ptx(ptx, (rule, cx["VAR"]) in FMA_RULES), widest_load=max(loads, default=0),
                loads_128=loads.get(128, 0), fma_count=len(re.findall(r"\bfma\.rn\.f32\b", ptx)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="80,90")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="compile only the first N variants (a smoke run)")
    ap.add_argument("--only", default="", help="compile only the variants whose name matches this regex")
    default_cache = Path(os.environ.get("LOWBIT_TREE_CACHE", Path.home() / ".cache" / "lowbit_tree")) / "triton"
    ap.add_argument("--cache", default=str(default_cache))
    ap.add_argument("--json", default="", help="also write every compile's result and the run's totals to this file")
    a = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
    todo = variants()[: a.limit or None]
    jobs, seen = [], {}
    for rule, v, fmt, opts in todo:
        name = variant_name(rule, v, fmt, opts)
        if a.only and not re.search(a.only, name):
            continue
        # formats differ at run time only by their table (8bit, 8bit_bnb and fp8 are one variant)
        same_as = seen.setdefault(json.dumps(constexprs(rule, v, fmt, opts), sort_keys=True), name)
        if same_as != name:
            continue
        for arch in (int(x) for x in a.arch.split(",")):
            jobs.append((name, rule, v, fmt, opts, arch, a.cache))
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(a.jobs) as ex:
        results = list(ex.map(compile_one, jobs))
    wall = time.perf_counter() - t0
    for r in results:
        if r["name"] == VECTOR_CHECK[0] and not r.get("error") and (r["loads_128"] < VECTOR_CHECK[1] or r["spills"]):
            r["banned"] = r["banned"] + [f"{r['loads_128']} 128-bit loads (params and gradients want "
                                         f"{VECTOR_CHECK[1]}), {r['spills']} bytes spilled"]
    failed = [r for r in results if r.get("error") or r.get("banned")]
    print("| variant | sm | regs | spills | shared | widest load | 128-bit loads | fma | bytes/param | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("error"):
            print(f"| {r['name']} | {r['arch']} | compile error: {r['error'][:200]} |")
            continue
        print(f"| {r['name']} | {r['arch']} | {r['regs']} | {r['spills']} | {r['shared']} | {r['widest_load']} | "
              f"{r['loads_128']} | {r['fma_count']} | {r['bytes']:.2f} | "
              f"{'cached' if r['cached'] else r['seconds']} |")
    print(f"\n{len(results)} compiles ({len(jobs) // len(a.arch.split(','))} variants x {len(a.arch.split(','))} targets), "
          f"{sum(not r['cached'] for r in results)} not cached, {wall:.1f} s wall with {a.jobs} processes")
    for r in failed:
        print(f"FAIL {r['name']} sm_{r['arch']}: {r.get('error') or 'banned PTX: ' + ', '.join(r['banned'])}")
    if a.json:
        import triton

        with open(a.json, "w") as f:
            json.dump(dict(results=results, wall_s=wall, jobs=a.jobs, triton=triton.__version__,
                           load=[load0, os.getloadavg()[0]], cores=os.cpu_count(), archs=a.arch.split(","),
                           failed=len(failed)), f, indent=1)
    print(f"load average (1 min) {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
          f"{os.cpu_count()} cores (this machine's other work included)")
    print("PTX scan: " + ("clean" if not failed else f"{len(failed)} failing") + f" (banned: {', '.join(BANNED)}; "
          "fma only where the source writes tl.fma)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
