"""benchmarks/report.py refuses a full run without the packages the page compares with, naming
them and the extras to install, before it measures or writes anything; names the CPU's vector
ISA; renders the offload sections and draws its pictures."""
from pathlib import Path

import pytest
import repo_scripts

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "report.py"


def load_report():
    return repo_scripts.load(SCRIPT)


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_full_report_refuses_without_the_anchors(tmp_path, monkeypatch, capsys):
    report = load_report()
    # Which anchors this environment happens to have must not matter: every anchor but two is "installed".
    monkeypatch.setattr(report, "version", lambda d: None if d in ("torchao", "scikit-learn") else "1.0")
    assert report.missing_anchors() == ["torchao", "scikit-learn"]
    out = tmp_path / "results.md"
    with pytest.raises(SystemExit) as e:
        report.main(["--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "torchao, scikit-learn not installed" in err and '".[parity,bench]"' in err
    assert not out.exists()


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_full_report_refuses_without_deepspeed_naming_it(tmp_path, monkeypatch, capsys):
    report = load_report()
    monkeypatch.setattr(report, "version", lambda d: None if d == "deepspeed" else "1.0")
    out = tmp_path / "results.md"
    with pytest.raises(SystemExit) as e:
        report.main(["--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "deepspeed not installed" in err and "bench" in err
    assert not out.exists()


CPUINFO_X86 = """processor\t: 0
vendor_id\t: {vendor}
model name\t: Some CPU
flags\t\t: fpu vme de pse sse sse2 {extra} lahf_lm
bugs\t\t: spectre_v1
"""


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
@pytest.mark.parametrize("text, isa", [
    (CPUINFO_X86.format(vendor="GenuineIntel", extra="avx avx2 fma avx512f avx512bw avx512_bf16"), "AVX-512+BF16"),
    (CPUINFO_X86.format(vendor="GenuineIntel", extra="avx avx2 avx512f avx512bw"), "AVX-512"),
    (CPUINFO_X86.format(vendor="AuthenticAMD", extra="avx avx2 fma"), "AVX2"),
    (CPUINFO_X86.format(vendor="AuthenticAMD", extra="avx"), "AVX"),
    (CPUINFO_X86.format(vendor="x", extra=""), "SSE only"),
    ("processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve sve2\nCPU implementer\t: 0x41\n", "SVE"),
    ("processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n", "NEON"),
    ("processor\t: 0\nmodel name\t: nothing said\n", "unknown"),
    ("", "unknown"),
])
def test_vector_isa_from_cpuinfo(text, isa):
    assert load_report().vector_isa(text) == isa


@pytest.mark.bench  # the pictures: matplotlib
@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_offload_sections_render_with_their_pictures(tmp_path, monkeypatch):
    """The two offload sections and the pictures, from small runs of their benchmarks (the report's
    own --quick run is minutes: CI's smoke, not this test)."""
    import torch

    report = load_report()
    monkeypatch.setattr(report.memory_floor.deepspeed_anchor, "version", lambda: None)  # the same page either way
    floor = report.memory_floor.run(["deepspeed-cpu-adam", "torch-fused", "bridge-8bit"], [(32, 512), (32, 512)],
                                    steps=2, runs=1, triad_mib=2)
    out = str(tmp_path / "page.md")
    picture = report.figure(out, "offload-step")
    assert picture == str(tmp_path / "page-offload-step.png")
    report.charts.step_floor_chart(floor, picture)
    text = report.offload_step_section(floor, ["--quick"], "page-offload-step.png")
    assert text.startswith("## Offloaded training: the host step against DeepSpeed and the memory floor")
    assert "share of probe" in text and "skipped: deepspeed not installed" in text and "| bridge-8bit |" in text
    assert "![ns/param per implementation, the floor of its format marked](page-offload-step.png)" in text

    threads = torch.get_num_threads()
    try:
        rows = [{**report.offload_bytes.measure(s, 32, 64, 2, 1, 4), "label": label}
                for label, s in report.offload_bytes.SETUPS.items()]
    finally:
        torch.set_num_threads(threads)
    host = report.host_bytes_section({"config": dict(d_model=32, ffn=64, heads=2, layers=1, tokens=4),
                                      "params": rows[0]["elements"], "rows": rows}, ["--layers", "1"])
    assert host.startswith("## Offloaded training: host bytes per param")
    lines = {ln.split(" | ")[0].lstrip("| "): ln for ln in host.splitlines() if ln.startswith("| ")}
    assert set(report.offload_bytes.SETUPS) <= set(lines)
    assert "| **16.000** | 1.00 |" in lines["fp32 torch.optim.AdamW"]  # 4 + 4 + 8 bytes, the reference
    for r in rows:
        assert r["tracked_peak"] >= r["between_steps"] > 0
    n = rows[0]["elements"]
    assert rows[0]["params"] == 4 * n and rows[2]["params"] == 2 * n  # float32, then bfloat16 params

    conv = {"params": 1000, "config": {"seeds": "0,1", "steps": 4}, "runs": {
        v: {s: {"eval_steps": [2, 4], "eval_curve": [3.0 + k, 2.0 + k]} for s in ("0", "1")}
        for k, v in ((0.0, "fp32"), (0.01, "8bit"), (0.02, "4bit"), (0.0, "muon-fp32"), (0.01, "muon-8bit"))}}
    line = report.convergence_picture(conv, out, "convergence")
    assert line.endswith("(page-convergence.png)")
    for name in ("page-offload-step.png", "page-convergence.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
