"""The results page's pictures, drawn from the benchmarks' results (matplotlib, PNG): the host
step of each implementation against its memory floor (``memory_floor.py``), and the convergence
curves of each format against its reference (``convergence.py``'s JSON), and SOAP's training
curves beside the other optimizers' (``soap_quality.py``'s JSON)."""
from __future__ import annotations

import math
import statistics


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step_floor_chart(result: dict, path: str) -> None:
    """One bar per implementation, its ns/param (median over the runs), and a mark at the floor of
    its format (the bytes its step moves at the probe's GB/s); skipped rows are named, without a
    bar."""
    plt = _pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(rows) + 1.6))
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        if "skipped" not in r:
            color = "tab:gray" if r["impl"].startswith(("deepspeed", "torch")) else "tab:blue"
            ax.barh(y, r["ns_per_param"], color=color, height=0.6)
            ax.text(max(r["ns_per_param"], r["floor_ns_per_param"]), y, f"  {r['ns_per_param']:.2f}", va="center",
                    fontsize=8)
        else:
            ax.text(0, y, "  skipped: " + r["skipped"][:60], va="center", fontsize=7, color="tab:red")
        ax.plot([r["floor_ns_per_param"]], [y], marker="|", markersize=16, mew=2.5, color="k")
    ax.plot([], [], marker="|", ls="none", markersize=12, mew=2.5, color="k",
            label="floor: bytes moved / probe GB/s")
    ax.set_yticks(ys, [r["impl"] for r in rows], fontsize=8)
    ax.set_xlabel("ns per param per step (median of the runs)")
    probe = statistics.median(result["probe_gbs"])
    ax.set_title(f"host step vs memory floor: {result['params'] / 1e6:.2f}M params, {result['threads']} threads, "
                 f"triad probe {probe:.1f} GB/s", fontsize=9)
    ax.legend(fontsize=8, loc="best")
    ax.set_xlim(0, 1.12 * max([r.get("ns_per_param", 0) for r in rows] + [r["floor_ns_per_param"] for r in rows]))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean_curve(by_seed: dict, seeds: list[str]) -> tuple[list[int], list[float]]:
    runs = [by_seed[s] for s in seeds]
    steps = runs[0]["eval_steps"]
    return steps, [statistics.mean(r["eval_curve"][i] for r in runs) for i in range(len(steps))]


def convergence_chart(conv: dict, reference_of, tolerance: dict, path: str) -> None:
    """Per format a panel of its held-out loss relative to its reference (``reference_of``) at each
    evaluation, in % (one thin line per seed, the mean thick, the target dashed where
    ``tolerance`` names one); the first panel, the references' own held-out loss curves."""
    plt = _pyplot()
    runs = conv["runs"]
    variants = [v for v in runs if reference_of(v) != v and reference_of(v) in runs]
    refs = [v for v in runs if any(reference_of(u) == v for u in runs)]  # a reference of a variant here
    cols = min(4, len(variants) + 1)
    rows_n = math.ceil((len(variants) + 1) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.4 * cols, 2.7 * rows_n), squeeze=False)
    flat = [a for row in axes for a in row]
    first = flat[0]
    for ref in refs:
        steps, mean = _mean_curve(runs[ref], list(runs[ref]))
        first.plot(steps, mean, marker=".", lw=1.2, label=ref)
    first.set_title("references: held-out loss", fontsize=9)
    first.set_xlabel("step", fontsize=8)
    first.legend(fontsize=7)
    for ax, v in zip(flat[1:], variants):
        ref = reference_of(v)
        seeds = [s for s in runs[v] if s in runs[ref]]
        per_seed = []
        for s in seeds:
            a, b = runs[v][s], runs[ref][s]
            rel = [100.0 * (x / y - 1.0) for x, y in zip(a["eval_curve"], b["eval_curve"])]
            per_seed.append(rel)
            ax.plot(a["eval_steps"], rel, lw=0.6, alpha=0.5, color="tab:blue")
        steps = runs[v][seeds[0]]["eval_steps"]
        ax.plot(steps, [statistics.mean(c[i] for c in per_seed) for i in range(len(steps))], lw=2, color="tab:blue")
        ax.axhline(0, color="k", lw=0.8)
        if tolerance.get(v) is not None:
            ax.axhline(tolerance[v], color="tab:red", ls="--", lw=1)
        ax.set_title(f"{v} vs {ref}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in flat[len(variants) + 1:]:
        ax.axis("off")
    flat[min(1, len(flat) - 1)].set_ylabel("held-out loss vs reference, %", fontsize=8)
    fig.suptitle(f"held-out loss during training, {conv['params']:,} params, seeds "
                 f"{conv['config']['seeds']}, {conv['config']['steps']} steps (red dashed: the target)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def soap_chart(result: dict, names: dict, path: str, window: int = 20) -> None:
    """Per variant its training loss per step, the mean over seeds in a running mean of ``window``
    steps (left); per variant and seed its final held-out loss relative to fp32 SOAP's of the same
    seed, in % (right, the mean as a bar)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    variants = result["variants"]
    for v in variants:
        runs = result["curves"][v]
        mean = [statistics.fmean(r[i] for r in runs) for i in range(len(runs[0]))]
        smooth = [statistics.fmean(mean[max(0, i - window + 1): i + 1]) for i in range(len(mean))]
        left.plot(range(1, len(smooth) + 1), smooth, lw=1.3, label=names.get(v, v))
    left.set_xlabel("step", fontsize=8)
    left.set_ylabel(f"training loss (mean over seeds, running mean of {window})", fontsize=8)
    left.set_ylim(top=min(4.0, left.get_ylim()[1]))
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    ref = result["losses"]["soap"]
    others = [v for v in variants if v != "soap"]
    for x, v in enumerate(others):
        rel = [100.0 * (a / b - 1.0) for a, b in zip(result["losses"][v], ref)]
        right.bar(x, statistics.fmean(rel), color="tab:blue", alpha=0.35)
        right.plot([x] * len(rel), rel, ".", color="tab:blue")
    right.axhline(0, color="k", lw=0.8)
    right.set_xticks(range(len(others)), [names.get(v, v) for v in others], fontsize=7, rotation=20)
    right.set_ylabel("final held-out loss vs fp32 SOAP, % (a dot a seed)", fontsize=8)
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(f"byte-level GPT, {result['config']['steps']} steps, seeds {result['seeds']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
