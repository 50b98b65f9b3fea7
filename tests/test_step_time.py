"""benchmarks/step_time.py runs end to end on the small case and reports every
column the performance issue asks for (a smoke test: speed itself is never
asserted in tests, only printed by the benchmark)."""
import json
from pathlib import Path

import pytest
import repo_scripts

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_time.py"


def load():
    return repo_scripts.load(SCRIPT)


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
    mod = repo_scripts.load(AB_SCRIPT)
    # Each distinct source compiled once for both runs: 2 builds instead of 6 (the harness
    # names a build by its source's hash, so identical sources load one library anyway).
    builds, build = {}, mod.build

    def build_once(source, outdir, extra=()):
        key = (source.read_bytes(), tuple(extra))
        if key not in builds:
            builds[key] = build(source, outdir, extra)
        return builds[key]

    mod.build = build_once
    for extra in ([], ["--inplace"]):  # in place: each build steps its own copies, same count of calls
        rc = mod.main([str(kernels_cpu._SOURCE), str(kernels_cpu._SOURCE), str(altered),
                       "--formats", "8bit", "--sizes", "16x256", "--rounds", "2", *extra])
        assert rc == 0
        (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("8bit 16x256 wide")]
        assert line.count("!") == 1 and line.rstrip().endswith("!"), (extra, line)  # only the altered build



@pytest.mark.slow
@pytest.mark.extended  # two C builds of the gate's prototype: about 10 s of CPU
@pytest.mark.skipif(not AB_SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_formats_gate_prototype_has_its_torch_mirrors_bits(tmp_path):
    """kernel_ab's arithmetic-coded candidates (the formats gate): two steps through the C
    prototype give the codes and scales of the same steps in torch (the mirror the quality proxy
    uses), and a prototype whose zero-free floor is altered does not."""
    from lowbit_tree.kernels import native as kernels_cpu

    if not kernels_cpu.available():
        pytest.skip("no C compiler")
    mod = repo_scripts.load(AB_SCRIPT)
    assert mod.gate_check_bits(mod.build_gate(tmp_path)) == 0
    old = "uv[k] = (uint8_t)(c > 1 ? c : 1);"
    assert old in mod.GATE_C
    mod.GATE_C = mod.GATE_C.replace(old, "uv[k] = (uint8_t)(c > 2 ? c : 2);")
    assert mod.gate_check_bits(mod.build_gate(tmp_path / "altered")) > 0

# ----------------------------------------------------------------------------- memory_floor.py


def load_floor():
    """benchmarks/memory_floor.py as its siblings see it (one step_time and deepspeed_anchor module)."""
    import sys

    folder = str(SCRIPT.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import memory_floor

    return memory_floor


# DeepSpeedCPUAdam needs the bench extra; its C++ op builds at first use (about 2 minutes here).
needs_deepspeed = [pytest.mark.bench, pytest.mark.slow,
                   pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")]

ODD_SHAPES = [(37, 300), (5, 1001)]  # partial blocks at every block size; each over min_quant_size


def touched_bytes(opt) -> int:
    """What a step touches, counted from the live tensors: each param read and written, its gradient
    read, every state tensor (a record's codes, scales, maxima; a correction) read and written."""
    import torch

    from bridge.qstate import QState
    from lowbit_tree import records

    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            total += 2 * p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size()
            for name, v in opt.state[p].items():
                if name == "step":
                    continue
                parts = records.parts_of(v.record).values() if isinstance(v, QState) else [v]
                assert all(isinstance(t, torch.Tensor) for t in parts), name
                total += 2 * sum(t.numel() * t.element_size() for t in parts)
    return total


def check_bytes_moved(impl):
    mf = load_floor()
    st = mf.step_time.setup(impl, ODD_SHAPES, __import__("torch").device("cpu"))
    assert "skipped" not in st, st
    assert mf.TRAFFIC[impl].bytes_moved(ODD_SHAPES) == touched_bytes(st["opt"])


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
@pytest.mark.parametrize("impl", ["torch-fused", "bridge-8bit", "bridge-4bit", "bridge-fp8", "bridge-lion-8bit",
                                  "bridge-sgd-8bit", "bridge-8bit-bf16c"])
def test_bytes_moved_counts_match_the_live_tensors(impl):
    check_bytes_moved(impl)


@pytest.mark.parametrize("impl", [pytest.param(i, marks=needs_deepspeed)
                                  for i in ("deepspeed-cpu-adam", "deepspeed-cpu-adam-bf16")])
def test_bytes_moved_counts_match_deepspeeds_tensors(impl):
    check_bytes_moved(impl)


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_bytes_moved_definitions_cover_every_row_and_refuse_1d():
    mf = load_floor()
    assert set(mf.IMPLS) == set(mf.TRAFFIC) and set(mf.REFERENCES.values()) <= set(mf.TRAFFIC)
    # the definitions at case (a): 28 bytes/param for fp32 Adam, 16 + scales for 8-bit, 22 for bf16 params
    n = 2048 * 2048
    assert mf.TRAFFIC["torch-fused"].bytes_moved([(2048, 2048)]) == 28 * n
    assert mf.TRAFFIC["deepspeed-cpu-adam-bf16"].bytes_moved([(2048, 2048)]) == 22 * n
    assert mf.TRAFFIC["bridge-8bit"].bytes_moved([(2048, 2048)]) == 16 * n + 2 * 2 * 4 * 2048 * 8
    with pytest.raises(ValueError, match="2-D"):
        mf.TRAFFIC["bridge-8bit"].bytes_moved([(2048,)])


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_triad_probe_gives_a_positive_finite_rate():
    import math

    mf = load_floor()
    gbs = mf.probe_gbs(mib=4, repeats=3)
    assert math.isfinite(gbs) and gbs > 0
    with pytest.raises(ValueError, match="1 MiB"):
        mf.Triad(0)


def run_small_floor(mf, impls):
    return mf.run(impls, [(64, 512), (64, 512)], steps=2, runs=2, triad_mib=2)


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_floor_without_deepspeed_names_it_on_its_rows(monkeypatch):
    mf = load_floor()
    monkeypatch.setattr(mf.deepspeed_anchor, "version", lambda: None)
    result = run_small_floor(mf, ["deepspeed-cpu-adam", "torch-fused", "bridge-8bit"])
    rows = {r["impl"]: r for r in result["rows"]}
    assert list(rows) == ["deepspeed-cpu-adam", "torch-fused", "bridge-8bit"]  # the row kept, not dropped
    reason = rows["deepspeed-cpu-adam"]["skipped"]
    assert "deepspeed not installed" in reason and "bench" in reason
    assert rows["bridge-8bit"]["x_deepspeed"] is None and rows["bridge-8bit"]["x_torch_fused"] > 0
    assert rows["torch-fused"]["x_torch_fused"] == 1.0
    for r in (rows["torch-fused"], rows["bridge-8bit"]):
        assert r["gbs"] > 0 and r["share_of_probe"] > 0 and r["floor_ns_per_param"] > 0
        assert r["gbs"] == pytest.approx(r["bytes_per_param"] / r["ns_per_param"])
    assert len(result["probe_gbs"]) == 2 and result["deepspeed_build"] is None
    table = mf.format_table(result)
    assert "skipped: deepspeed not installed" in table and "| bridge-8bit | float32 |" in table
    with pytest.raises(ValueError, match="no byte count"):
        mf.run(["bridge-8bit-amsgrad"], [(64, 512)], 1, 1, 2)


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_floor_with_deepspeed_compares_each_row_with_its_dtypes_row():
    mf = load_floor()
    result = run_small_floor(mf, ["deepspeed-cpu-adam", "deepspeed-cpu-adam-bf16", "bridge-8bit-bf16c"])
    rows = {r["impl"]: r for r in result["rows"]}
    assert rows["deepspeed-cpu-adam"]["x_deepspeed"] == 1.0 and rows["deepspeed-cpu-adam-bf16"]["x_deepspeed"] == 1.0
    assert rows["bridge-8bit-bf16c"]["reference"] == "deepspeed-cpu-adam-bf16"
    assert rows["bridge-8bit-bf16c"]["x_deepspeed"] > 0 and result["deepspeed_build"]["seconds"] > 0


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")
def test_deepspeed_build_refuses_a_lock_a_killed_build_left(tmp_path):
    """torch waits forever on the lock file of a build that was killed; build_op names it instead."""
    anchor = load_floor().deepspeed_anchor
    lock = tmp_path / "lock"
    anchor._refuse_stale_lock(str(lock))  # no lock: nothing to refuse
    lock.touch()
    made = lock.stat().st_mtime
    anchor._refuse_stale_lock(str(lock), now=made + 60)  # a build under way: wait for it as torch does
    with pytest.raises(RuntimeError, match=f"locked by {lock}.*31 minutes ago.*delete that file"):
        anchor._refuse_stale_lock(str(lock), now=made + anchor.STALE_LOCK_S + 60)
