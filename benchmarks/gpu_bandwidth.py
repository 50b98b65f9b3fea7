"""Bytes a param each optimizer step moves and the share of the device's memory bandwidth it
reaches, from benchmarks/step_time.py's results (``--json`` files): the last step of
benchmarks/gpu_check.py's figures.

    python benchmarks/gpu_bandwidth.py [--device cuda] [--json OUT] STEP_TIME_JSON ...

Bytes a param: the floor of a fused step's traffic, read from each row's own figures: the gradient
read, the param read and written (each at the param's element size), every state byte read and
written once (``state_bytes_per_param`` of the row, scales and padding included). Bandwidth
reached: those bytes x params / the row's median step time. It is given as a share of two
ceilings: a device-to-device copy measured here (what a kernel can reach), and, for the cards
named in :data:`PEAK`, the nominal peak of their memory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

PEAK = {  # name fragment -> nominal memory bandwidth, bytes a second (vendors' data sheets), first match wins
    "H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "GH200": 4.0e12,
    "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12,
}


def peak_for(name: str):
    return next((bw for frag, bw in PEAK.items() if frag in name), None)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes a second of a same-device copy (read and written: 2 x nbytes a copy), best of ``reps``."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def rows(results: list, copy_bw: float, peak) -> list:
    out = []
    for case in results:
        n = case["params"]
        for r in case["results"]:
            if "median_ms" not in r:
                out.append({"case": case["case"], "impl": r["impl"], "skipped": r.get("skipped", "")})
                continue
            per_param = 3 * r["param_element_bytes"] + 2 * r["state_bytes_per_param"]
            reached = per_param * n / (r["median_ms"] / 1e3)
            out.append({"case": case["case"], "impl": r["impl"], "params": n, "median_ms": r["median_ms"],
                        "bytes_per_param": per_param, "bytes_per_s": reached, "share_of_copy": reached / copy_bw,
                        "share_of_peak": None if peak is None else reached / peak})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="step_time.py --json files")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cases, missing = [], []
    for path in a.inputs:
        if not os.path.exists(path):
            missing.append(path)
            continue
        with open(path) as f:
            cases += json.load(f)["cases"]
    if not cases:
        print(f"no step times to read: {', '.join(missing)} missing (the step_time / anchors steps write them)")
        return 1
    for path in missing:
        print(f"note: {path} missing: its rows are left out")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_for(name) if device.type == "cuda" else None
    copy_bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    table = rows(cases, copy_bw, peak)
    print(f"device {name}: copy {copy_bw / 1e9:.0f} GB/s measured"
          + (f", nominal peak {peak / 1e9:.0f} GB/s" if peak else ", nominal peak unknown"))
    print(f"  {'case':<5}{'impl':<22}{'ms/step':>9}{'B/param':>9}{'GB/s':>8}{'of copy':>9}{'of peak':>9}")
    for r in table:
        if "skipped" in r:
            print(f"  {r['case']:<5}{r['impl']:<22}  skipped: {r['skipped']}")
            continue
        share = "" if r["share_of_peak"] is None else f"{r['share_of_peak']:.0%}"
        print(f"  {r['case']:<5}{r['impl']:<22}{r['median_ms']:>9.3f}{r['bytes_per_param']:>9.2f}"
              f"{r['bytes_per_s'] / 1e9:>8.0f}{r['share_of_copy']:>9.0%}{share:>9}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "copy_bytes_per_s": copy_bw, "peak_bytes_per_s": peak, "rows": table}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
