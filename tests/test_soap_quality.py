"""benchmarks/soap_quality.py's byte counts, the results page's SOAP table: ours from the state
report and HeavyBall's from its states, each against the layout written out by hand."""
import pytest
import repo_scripts

SCRIPT = repo_scripts.ROOT / "benchmarks" / "soap_quality.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ not in this checkout")


def load():
    return repo_scripts.load(SCRIPT)


def soap_fp32_bytes(m: int, n: int) -> float:
    """fp32 SOAP a param: two float32 moments, per dimension d a basis and a coupling (d x d) and
    d eigenvalues, all float32; three int32 counters (steps seen, the leaf's steps, failed refreshes)."""
    return (4 * (2 * m * n + 2 * (m * m + n * n) + (m + n)) + 3 * 4) / (m * n)


@pytest.mark.parametrize("shape", [(96, 96), (128, 48)])
def test_fp32_soap_and_adamw_bytes_are_their_layouts(shape):
    q = load()
    assert q.bytes_per_param("soap", shape) == pytest.approx(soap_fp32_bytes(*shape), rel=1e-12)
    assert q.bytes_per_param("adamw", shape) == pytest.approx((8 * shape[0] * shape[1] + 8) / (shape[0] * shape[1]))  # + two counters


def test_low_bit_soap_takes_fewer_bytes_than_fp32():
    q = load()
    b = {v: q.bytes_per_param(v, (2048, 2048)) for v in ("soap", "soap8", "soap4")}
    assert b["soap4"] < 4.0 < b["soap8"] < b["soap"]


@pytest.mark.bench
@pytest.mark.parametrize("shape", [(96, 96), (128, 48)])
def test_heavyball_soap_bytes_are_its_layout(shape):
    """HeavyBall keeps float32 moments and per dimension the factor and its basis (d x d each):
    no eigenvalues, no coupling (its factor is the float32 statistic itself)."""
    q = load()
    m, n = shape
    assert q.bytes_per_param("heavyball", shape) == pytest.approx(4 * (2 + 2 * (m * m + n * n) / (m * n)), rel=1e-12)
