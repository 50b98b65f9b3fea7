"""benchmarks/step_time.py runs end to end on the small case and reports every
column the performance issue asks for (a smoke test: speed itself is never
asserted in tests, only printed by the benchmark)."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_time.py"


def load():
    spec = importlib.util.spec_from_file_location("step_time", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_step_time_case_c_reports_all_columns(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = load().main(["--case", "c", "--steps", "2", "--impl", "torch-fused", "bridge-8bit", "functional-fp8",
                      "bridge-lion-4bit-bf16", "no-such-impl", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "interleaved" in text and "x fused" in text
    (case,) = json.loads(out.read_text())["cases"]
    rows = {r["impl"]: r for r in case["results"]}
    assert rows["torch-fused"]["ratio_to_fused"] == 1.0
    for impl in ("bridge-8bit", "functional-fp8", "bridge-lion-4bit-bf16"):
        r = rows[impl]
        assert r["median_ms"] > 0 and r["first_step_s"] > 0 and r["ratio_to_fused"] > 0
        assert 1.0 < r["state_bytes_per_param"] < 8.0  # small tensors keep some fp32 state
    assert "skipped" in rows["no-such-impl"]
    assert rows["bridge-lion-4bit-bf16"]["state_bytes_per_param"] < rows["bridge-8bit"]["state_bytes_per_param"]


AB_SCRIPT = SCRIPT.with_name("kernel_ab.py")


@pytest.mark.slow  # two C builds of the kernel
@pytest.mark.skipif(not AB_SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_kernel_ab_flags_a_build_with_different_output(tmp_path, capsys):
    """Two builds of the kernel source, one with its Adam update altered: the
    harness times both and marks the altered one's output as different."""
    from lowbit_tree.kernels import native as kernels_cpu

    if not kernels_cpu.available():
        pytest.skip("no C compiler")
    src = kernels_cpu._SOURCE.read_text()
    old = "u = num / (sr * rsbc2 + eps);"
    assert old in src
    altered = tmp_path / "altered.c"
    altered.write_text(src.replace(old, "u = num / (sr * rsbc2 + 2 * eps);"))
    spec = importlib.util.spec_from_file_location("kernel_ab", AB_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # Each distinct source compiled once for both runs: 2 builds instead of 6 (the harness
    # names a build by its source's hash, so identical sources load one library anyway).
    builds, build = {}, mod.build

    def build_once(source, outdir):
        key = source.read_bytes()
        if key not in builds:
            builds[key] = build(source, outdir)
        return builds[key]

    mod.build = build_once
    for extra in ([], ["--inplace"]):  # in place: each build steps its own copies, same count of calls
        rc = mod.main([str(kernels_cpu._SOURCE), str(kernels_cpu._SOURCE), str(altered),
                       "--formats", "8bit", "--sizes", "16x256", "--rounds", "2", *extra])
        assert rc == 0
        (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("8bit 16x256 wide")]
        assert line.count("!") == 1 and line.rstrip().endswith("!"), (extra, line)  # only the altered build
