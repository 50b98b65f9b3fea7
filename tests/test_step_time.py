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
    rc = load().main(["--case", "c", "--steps", "2", "--impl", "torch-fused", "bridge-8bit", "kernels-fp8",
                      "no-such-impl", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "interleaved" in text and "x fused" in text
    (case,) = json.loads(out.read_text())["cases"]
    rows = {r["impl"]: r for r in case["results"]}
    assert rows["torch-fused"]["ratio_to_fused"] == 1.0
    for impl in ("bridge-8bit", "kernels-fp8"):
        r = rows[impl]
        assert r["median_ms"] > 0 and r["first_step_s"] > 0 and r["ratio_to_fused"] > 0
        assert 2.0 < r["state_bytes_per_param"] < 8.0  # small tensors keep some fp32 state
    assert "skipped" in rows["no-such-impl"]
