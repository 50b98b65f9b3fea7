"""Compile every variant of the Triton step kernel for sm_80 and sm_90 without a GPU, scan the
PTX for instructions that would change the bits, and print a table of each variant's registers,
spills, shared memory and bytes moved per param element.

    python benchmarks/triton_compile.py [--arch 80,90] [--jobs 2] [--limit N] [--cache DIR] [--json FILE]

A variant is one constexpr combination of ``lowbit_tree/kernels/triton_step.py``'s kernel
(``triton_backend.launch_key``): every declared rule and variant x every state format (each
state in its format's default block size) with float32 params written in place, plus bfloat16
params (stochastic rounding; the int8 param correction) and the float32 update (the functional form) for each rule with
8-bit states. The fused links are runtime flags: one variant serves every link set.

Fails (exit 1) on a compile error or, in any variant's PTX, on ``div.full`` / ``div.approx``
(Triton's ``/``), ``sqrt.approx`` / ``rsqrt.approx`` (``tl.sqrt``), ``ex2.approx`` /
``lg2.approx``, or an ``fma`` in a variant whose source writes none (only Muon's and centered
RMSprop's lerps call ``tl.fma``). Cubins and their scan results are cached under ``--cache``
(default ``$LOWBIT_TREE_CACHE/triton`` or ``~/.cache/lowbit_tree/triton``) by the sha256 of the
kernel's source, the variant, the target and the triton version.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BANNED = ("div.full", "div.approx", "sqrt.approx", "rsqrt.approx", "ex2.approx", "lg2.approx")
FMA_RULES = {("muon", 0), ("muon", 1), ("rmsprop", 2), ("rmsprop", 3)}  # (rule, VAR) whose source calls tl.fma
SIGNATURE = {"leaves": "*i64", "tile_leaf": "*i32", "hyper": "*fp32", "ftab": "*fp32", "etab": "*u8",
             "links": "i32"}


def variants() -> list[tuple[str, dict, str, dict]]:
    """(name, StepSpec kwargs, state format, launch options) of every variant compiled."""
    from lowbit_tree.rules import RULE_DEFS

    rules = []
    for name, d in RULE_DEFS.items():
        vs = [{}] + [{f: True} for f in d.variants] + ([dict.fromkeys(d.variants, True)] if len(d.variants) > 1 else [])
        rules += [(name, v) for v in vs]
    out = []
    for rule, v in rules:
        for fmt in ("8bit", "4bit", "nf4", "fp8", "8bit_bnb", "fp32", "bf16"):
            out.append((rule, v, fmt, dict(pdt="f32", write=True)))
        out.append((rule, v, "8bit", dict(pdt="bf16", write=True, sr=True)))
        out.append((rule, v, "8bit", dict(pdt="bf16", write=True, corr=True)))
        out.append((rule, v, "8bit", dict(pdt="f32", write=False)))
    return out


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
    key = (tuple(storages), dt, dt, opts["write"], opts.get("sr", False), opts.get("corr", False))
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


def scan_ptx(ptx: str, fma_allowed: bool) -> list[str]:
    """The banned instructions in ``ptx`` (each once)."""
    found = sorted({op for op in BANNED if re.search(rf"\b{re.escape(op)}\b", ptx)})
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
    key = hashlib.sha256(source + json.dumps([cx, arch, triton.__version__], sort_keys=True).encode()).hexdigest()
    entry = Path(cache) / f"{key}.json"
    if entry.exists():
        return dict(json.loads(entry.read_text()), name=name, arch=arch, cached=True)
    t0 = time.perf_counter()
    sig = dict(SIGNATURE, **{k: "constexpr" for k in cx})
    try:
        k = triton.compile(ASTSource(ts.step_kernel, sig, cx), target=GPUTarget("cuda", arch, 32),
                           options={"enable_fp_fusion": False, "num_warps": 4})
    except Exception as e:  # a compile error fails the run, with its text
        return dict(name=name, arch=arch, error=f"{type(e).__name__}: {e}"[:2000], cached=False)
    seconds = time.perf_counter() - t0
    fma = (rule, cx["VAR"]) in FMA_RULES
    res = dict(name=name, arch=arch, seconds=round(seconds, 2), banned=scan_ptx(k.asm["ptx"], fma),
               fma_count=len(re.findall(r"\bfma\.rn\.f32\b", k.asm["ptx"])), bytes=bytes_per_param(cx),
               **_resources(k.asm["cubin"]))
    Path(cache).mkdir(parents=True, exist_ok=True)
    (Path(cache) / f"{key}.cubin").write_bytes(k.asm["cubin"])
    entry.write_text(json.dumps(res))
    return dict(res, cached=False)


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
        name = "-".join([rule] + sorted(v)) + f" {fmt} {opts['pdt']}" + (" write" if opts["write"] else " update") + (
            " sr" if opts.get("sr") else "") + (" corrected" if opts.get("corr") else "")
        if a.only and not re.search(a.only, name):
            continue
        # formats differ at run time only by their table (8bit, 8bit_bnb and fp8 are one variant)
        same_as = seen.setdefault(json.dumps(constexprs(rule, v, fmt, opts), sort_keys=True), name)
        if same_as != name:
            continue
        for arch in (int(x) for x in a.arch.split(",")):
            jobs.append((name, rule, v, fmt, opts, arch, a.cache))
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(a.jobs) as ex:
        results = list(ex.map(compile_one, jobs))
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.get("error") or r.get("banned")]
    print(f"| variant | sm | regs | spills | shared | fma | bytes/param | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("error"):
            print(f"| {r['name']} | {r['arch']} | compile error: {r['error'][:200]} |")
            continue
        print(f"| {r['name']} | {r['arch']} | {r['regs']} | {r['spills']} | {r['shared']} | {r['fma_count']} | {r['bytes']:.2f} | "
              f"{'cached' if r['cached'] else r['seconds']} |")
    print(f"\n{len(results)} compiles ({len(jobs) // len(a.arch.split(','))} variants x {len(a.arch.split(','))} targets), "
          f"{sum(not r['cached'] for r in results)} not cached, {wall:.1f} s wall with {a.jobs} processes")
    for r in failed:
        print(f"FAIL {r['name']} sm_{r['arch']}: {r.get('error') or 'banned PTX: ' + ', '.join(r['banned'])}")
    if a.json:
        import triton

        with open(a.json, "w") as f:
            json.dump(dict(results=results, wall_s=wall, jobs=a.jobs, triton=triton.__version__,
                           archs=a.arch.split(","), failed=len(failed)), f, indent=1)
    print("PTX scan: " + ("clean" if not failed else f"{len(failed)} failing") + f" (banned: {', '.join(BANNED)}; "
          "fma only where the source writes tl.fma)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
