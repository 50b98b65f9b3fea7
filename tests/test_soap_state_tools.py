"""SOAP's state dicts through the tools a user checkpoints with: torch's
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (one process) and ``lowbit-tree
inspect`` (every state's format, block size, logical shape and bytes)."""
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import bridge
from bridge.tools.inspect_state import inspect_optimizer_state_dict


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 80), torch.nn.ReLU(), torch.nn.Linear(80, 8))


def trained(cls, seed: int = 0, steps: int = 3):
    m = model(seed)
    opt = cls(m.parameters(), lr=1e-3, precondition_frequency=2, min_quant_size=1)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        m(torch.randn(4, 96, generator=gen)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


@pytest.mark.parametrize("cls", [bridge.SOAP, bridge.SOAP8bit, bridge.SOAP4bit], ids=lambda c: c.__name__)
def test_torch_state_dict_helpers_round_trip_soap(cls):
    m, opt = trained(cls)
    sd = get_optimizer_state_dict(m, opt)
    assert set(sd["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # keyed by name, as torch's helpers key
    m2 = model(1)
    m2.load_state_dict(m.state_dict())
    opt2 = cls(m2.parameters(), lr=1e-3, precondition_frequency=2, min_quant_size=1)
    set_optimizer_state_dict(m2, opt2, sd)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(7))
    for o, mm in ((opt, m), (opt2, m2)):  # the next step, a refresh among them, is the same bits
        for _ in range(2):
            mm(x).square().sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls,fmt,bits", [(bridge.SOAP8bit, "dynamic8", 8), (bridge.SOAP4bit, "normal4", 4)],
                         ids=["8bit", "4bit"])
def test_inspect_names_every_soap_state_and_its_bytes(cls, fmt, bits):
    _, opt = trained(cls)
    sd = opt.state_dict()
    rows = {r.path: r for r in inspect_optimizer_state_dict(sd).rows}
    assert not [p for p, r in rows.items() if r.format.startswith("?") or r.block.endswith("?")]
    for d, n in ((0, 80), (1, 96)):  # the first weight is (80, 96): bases and couplings 80 x 80 and 96 x 96
        for name in ("eigenbasis", "coupling"):
            r = rows[f"0/{name}_{d}"]
            assert (r.format, r.block, r.shape) == (fmt, "64", (n, n))
            parts = sd["state"][0][f"{name}_{d}"]
            assert r.nbytes == sum(t.numel() * t.element_size() for t in parts.values())
            assert parts["codes"].numel() * 8 // bits == n * n
        assert rows[f"0/eigenvalues_{d}"].format == "fp32"
    total = sum(t.numel() * t.element_size() for st in sd["state"].values() for k, v in st.items() if k != "step"
                for t in (v.values() if isinstance(v, dict) else [v]))
    assert sum(r.nbytes for r in rows.values()) == total


def test_a_dcp_checkpoint_in_the_earlier_layout_loads_through_load_optimizer(tmp_path):
    """A DCP checkpoint as the SOAP classes wrote it before they were LowBitOptimizers: the same
    keys and shapes but no ``lowbit_tree_version`` in the param groups (checked against
    tests/data/soap_state_dict.pt, written by that code). ``bridge.dcp.load_optimizer`` loads it
    (it keeps the group keys a checkpoint lacks) and two more steps land on the uninterrupted run's
    params, bit for bit; plain ``dcp.load`` into ``opt.state_dict()`` names the missing key."""
    import traceback
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from bridge.dcp import load_optimizer
    from bridge.state_dict import VERSION_KEY

    old = torch.load(__file__.replace("test_soap_state_tools.py", "data/soap_state_dict.pt"), weights_only=True)
    assert all(VERSION_KEY not in g for g in old["SOAP8bit"]["saved"]["param_groups"])
    m, opt = trained(bridge.SOAP8bit)
    osd = get_optimizer_state_dict(m, opt)
    for g in osd["param_groups"]:
        del g[VERSION_KEY]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP in one process, no process group: said once
        dcp.save({"optim": osd}, checkpoint_id=str(tmp_path))
        m2 = model(7)
        m2.load_state_dict(m.state_dict())
        opt2 = bridge.SOAP8bit(m2.parameters(), lr=1e-3, precondition_frequency=2, min_quant_size=1)
        load_optimizer(m2, opt2, str(tmp_path))
        with pytest.raises(CheckpointException) as refused:
            dcp.load({"optim": bridge.SOAP8bit(model(7).parameters(), min_quant_size=1).state_dict()},
                     checkpoint_id=str(tmp_path))
    assert "Missing key in checkpoint state_dict: optim.param_groups.0.lowbit_tree_version" in "".join(
        traceback.format_exception(refused.value))  # (DCP wraps each rank's error)
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        x = torch.randn(4, 96, generator=gen)
        for mm, oo in ((m, opt), (m2, opt2)):
            mm(x).square().sum().backward()
            oo.step()
            oo.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
