"""CI runs the README's two commands as written, the test command before any extra is installed:
.ci/run takes them from README.md through .ci/readme_commands.py (one definition), so the two
cannot drift; these tests fail when the README loses its shape or .ci/run stops using it."""
import re
from pathlib import Path

import pytest
import repo_scripts

ROOT = Path(__file__).resolve().parents[1]
readme_commands = repo_scripts.load(ROOT / ".ci" / "readme_commands.py")


def test_the_readme_opens_with_the_demo_and_the_test_command():
    demo, tests = readme_commands.readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert demo.endswith("lowbit-tree demo") and '".[demo]"' in demo
    # The newcomer's test command installs the test extra alone: what it runs must pass without the others.
    assert re.search(r'pip install -e "\.\[test\]"', tests) and "python -m pytest" in tests


@pytest.mark.parametrize("text, match", [
    ("# t\n\nSome prose first.\n\n```bash\na\nb -m pytest\n```\n", "must start"),
    ("# t\n\n```bash\nonly one -m pytest\n```\n", "exactly two"),
    ("# t\n\n```bash\npython -m pytest\nlowbit-tree demo\n```\n", "demo command first"),
])
def test_a_readme_of_another_shape_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        readme_commands.readme_commands(text)


def test_ci_runs_the_readme_test_command_before_installing_an_extra():
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    code = [line.strip() for line in run.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert any("python .ci/readme_commands.py" in line for line in code)
    test_at = code.index('bash -c "$TEST_COMMAND"')
    demo_at = code.index('bash -c "$DEMO_COMMAND"')
    installs = [i for i, line in enumerate(code) if "pip install" in line]
    assert installs and test_at < demo_at < min(installs), "an extra is installed before the README's commands"
    # No second copy of the README's test command to drift from it: the other pytest runs are the
    # one over the tests marked with an extra's name, the extended tests and the exhaustive kernel checks.
    pytest_runs = [line for line in code if "-m pytest" in line]
    assert len(pytest_runs) == 4
    assert '-m "parity or clients or demo or bench or docs or triton"' in pytest_runs[0]
    assert "--extended -m extended" in pytest_runs[1]
    assert all("--exhaustive -m exhaustive" in run for run in pytest_runs[2:])
    # The extras' tests build DeepSpeed's op into a folder of this run's own, not one a killed
    # build on the machine may have locked.
    fresh = code.index("TORCH_EXTENSIONS_DIR=$(mktemp -d)")
    assert code[fresh + 1] == "export TORCH_EXTENSIONS_DIR" and fresh < code.index(pytest_runs[0])


def test_every_extra_but_test_has_a_registered_marker_that_ci_runs():
    import conftest

    assert set(conftest.EXTRA_MARKERS) == set(conftest.EXTRAS) - {"test"}
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for extra in conftest.EXTRA_MARKERS:
        assert f'"{extra}: needs the {extra} extra' in pyproject
        assert extra in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_an_extra_is_missing_when_one_of_its_packages_is(monkeypatch):
    import importlib.metadata

    import conftest

    def version(dist):
        if dist == "bitsandbytes":
            raise importlib.metadata.PackageNotFoundError(dist)
        return "1.0"

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert conftest.missing_distributions("parity") == ["bitsandbytes"]
    assert conftest.missing_distributions("demo") == []


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_torches_ci_runs_are_the_ones_pyproject_and_the_readme_claim():
    """.ci/torch_versions.sh runs the fast tier under each torch it pins, the README's test command
    under its own (2.13.0): together they are the torches the README names, its range runs from the
    oldest to the newest of them and no wider, pyproject.toml's torch bound is that same range,
    and each pinned triton is one the triton extra admits."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11 or later)")
    script = (ROOT / ".ci" / "torch_versions.sh").read_text(encoding="utf-8")
    pins = re.findall(r'^\s*"torch==([\d.]+) triton==([\d.]+)"$', script, flags=re.M)
    assert len(pins) >= 2, "the TORCHES list of .ci/torch_versions.sh lost its shape"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    _, test_command = readme_commands.readme_commands(readme)
    (readme_torch,) = re.findall(r"torch==([\d.]+)", test_command)
    tested = {torch for torch, _ in pins} | {readme_torch}

    claim = re.search(r"torch (\d+\.\d+) to (\d+\.\d+) \(CI tests ([^)]+)\)", readme)
    assert claim, "README.md states its supported torches as 'torch A to B (CI tests X, Y and Z)'"
    named = set(re.findall(r"\d+\.\d+\.\d+", claim.group(3)))
    assert named == tested
    oldest, newest = min(tested, key=_release), max(tested, key=_release)
    assert (claim.group(1), claim.group(2)) == (oldest.rsplit(".", 1)[0], newest.rsplit(".", 1)[0])

    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    (torch_req,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    major, minor = _release(newest)[:2]
    assert {str(s) for s in torch_req.specifier} == {f">={claim.group(1)}", f"<{major}.{minor + 1}"}
    (triton_req,) = [Requirement(r) for r in project["optional-dependencies"]["triton"]]
    assert all(triton in triton_req.specifier for _, triton in pins)
    # CI runs the script, and the script runs the fast tier in each venv
    assert 'python" -m pytest -n 2 -q -p no:cacheprovider -m "not slow"' in script
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert any(line.strip() == "bash .ci/torch_versions.sh" for line in run.splitlines())
