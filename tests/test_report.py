"""benchmarks/report.py refuses a full run without the packages the page compares with, naming
them and the extras to install, before it measures or writes anything."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "report.py"


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_full_report_refuses_without_the_anchors(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("report", SCRIPT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
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
