"""``state_format`` as a mapping from torch.optim state names to formats.

The reference for a mapping run is runs that keep every state in one format: in each of these
rules a state's own update reads only the gradient and that state (Adam's ``exp_avg`` never
reads ``exp_avg_sq``), so the state kept in format ``f`` by a mapping must equal, bit for bit,
the same state of a run with ``state_format=f``. The params, which read every state, are held
to a float64 textbook step from the stored states.
"""
from __future__ import annotations

import copy
import math
import warnings

import optree
import pytest
import torch

import bridge
import lowbit_tree as lt
from bridge.qstate import QState
from bridge.state_dict import read_state_dict
from lowbit_tree import records

SHAPES = [(48, 300), (7,), (33, 130)]  # quantized, never quantized (1-D), quantized with partial blocks


def make_params(seed: int, shapes=SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def grads_for(params, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(tuple(p.shape), generator=gen) * 10.0 ** (step % 3 - 1) for p in params]


def run(opt, params, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        for p, g in zip(params, grads_for(params, step)):
            p.grad = g.clone()
        opt.step()


def same_state(a, b) -> bool:
    """Bit for bit: the same record kind, metadata and parts, or the same plain tensor."""
    if isinstance(a, QState) or isinstance(b, QState):
        if not (isinstance(a, QState) and isinstance(b, QState)) or a.kind_name != b.kind_name or a.meta != b.meta:
            return False
        return all(torch.equal(_bits(a.parts[k]), _bits(b.parts[k])) for k in a.parts)
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def states_of(opt, params) -> list[dict]:
    return [dict(opt.state[p]) for p in params]


# ----------------------------------------------------------------------------------------------
# each state in its own format, against single-format runs
# ----------------------------------------------------------------------------------------------
MIXED = [
    # class, kwargs, the state_format mapping, the formats the group must resolve it to
    ("AdamW", {}, {"exp_avg": "8bit", "exp_avg_sq": "4bit"},
     {"exp_avg": "8bit", "exp_avg_sq": "4bit", "max_exp_avg_sq": "fp32"}),
    ("AdamW", {"rank1_normalization": False}, {"exp_avg": "fp8", "exp_avg_sq": "4bit"},
     {"exp_avg": "fp8", "exp_avg_sq": "4bit", "max_exp_avg_sq": "fp32"}),
    # a plain first state beside a record: the native kernel does not take these leaves, the torch
    # backend does, with the same bits as the single-format runs' native steps
    ("AdamW", {}, {"exp_avg_sq": "4bit"}, {"exp_avg": "fp32", "exp_avg_sq": "4bit", "max_exp_avg_sq": "fp32"}),
    ("Adam", {}, {"exp_avg": "bf16", "exp_avg_sq": "8bit"},
     {"exp_avg": "bf16", "exp_avg_sq": "8bit", "max_exp_avg_sq": "fp32"}),
    # amsgrad's running max reads exp_avg_sq, so the two share a format here (the reference is one run)
    ("AdamW", {"amsgrad": True}, {"exp_avg": "bf16", "exp_avg_sq": "8bit", "max_exp_avg_sq": "8bit"},
     {"exp_avg": "bf16", "exp_avg_sq": "8bit", "max_exp_avg_sq": "8bit"}),
    ("AdamW8bit", {}, {"exp_avg_sq": "4bit"}, {"exp_avg": "8bit", "exp_avg_sq": "4bit", "max_exp_avg_sq": "8bit"}),
    ("Adam4bit", {"weight_decay": 0.0}, {"exp_avg": "fp8"},
     {"exp_avg": "fp8", "exp_avg_sq": "4bit", "max_exp_avg_sq": "4bit"}),
    ("AdEMAMix", {}, {"exp_avg": "4bit", "exp_avg_sq": "8bit", "exp_avg_slow": "fp8"},
     {"exp_avg": "4bit", "exp_avg_sq": "8bit", "exp_avg_slow": "fp8"}),
    ("AdEMAMix4bit", {}, {"exp_avg": "8bit"}, {"exp_avg": "8bit", "exp_avg_sq": "4bit", "exp_avg_slow": "8bit"}),
    ("Lion", {}, {"exp_avg": "4bit"}, {"exp_avg": "4bit"}),
    ("SGD", {"momentum": 0.9}, {"momentum_buffer": "fp8"}, {"momentum_buffer": "fp8"}),
    ("Muon", {}, {"momentum_buffer": "nf4"}, {"momentum_buffer": "nf4"}),
]


def _base(cls_name: str) -> str:
    """The fp32 class of a named class (``AdamW8bit`` -> ``AdamW``)."""
    cls = getattr(bridge, cls_name)
    return next(c for c in cls.__mro__ if c._default_format == "fp32").__name__


@pytest.mark.parametrize("name,kw,mapping,resolved", MIXED, ids=[f"{c[0]}-{i}" for i, c in enumerate(MIXED)])
def test_each_state_equals_a_run_with_its_format(name, kw, mapping, resolved):
    shapes = [(48, 300), (33, 130)] if name == "Muon" else SHAPES
    params = make_params(0, shapes)
    opt = getattr(bridge, name)(params, state_format=mapping, min_quant_size=1024, **kw)
    assert opt.param_groups[0]["state_format"] == resolved
    run(opt, params, 4)
    for fmt in sorted(set(resolved.values())):
        ref_params = make_params(0, shapes)
        ref = getattr(bridge, _base(name))(ref_params, state_format=fmt, min_quant_size=1024, **kw)
        run(ref, ref_params, 4)
        for st, ref_st in zip(states_of(opt, params), states_of(ref, ref_params)):
            for state in (n for n, f in resolved.items() if f == fmt and n in st):
                assert same_state(st[state], ref_st[state]), (state, fmt)
    kept = {n for st in states_of(opt, params) for n in st} - {"step"}
    assert kept and kept <= set(resolved)


def test_params_follow_the_textbook_step_from_the_stored_states():
    """AdamW with an 8-bit first and a rank-1 4-bit second moment: each step's params equal, to
    float32 rounding, the float64 textbook step from the states stored before it (dequantized)."""
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    params = make_params(1)
    opt = bridge.AdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                       state_format={"exp_avg": "8bit", "exp_avg_sq": "4bit"}, min_quant_size=1024)
    run(opt, params, 1)  # the states exist from here on
    assert opt.state[params[0]]["exp_avg_sq"].kind_name == "rank1"
    for step in range(1, 5):
        grads = grads_for(params, step)
        expected = []
        for p, g in zip(params, grads):
            st = opt.state[p]
            m = _value(st["exp_avg"]) * b1 + (1 - b1) * g.double()
            v = _value(st["exp_avg_sq"]) * b2 + (1 - b2) * g.double() ** 2
            t = float(st["step"]) + 1
            u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
            expected.append(p.detach().double() - lr * (u + wd * p.detach().double()))
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.detach().double(), e, rtol=1e-6, atol=1e-7)


def _value(state) -> torch.Tensor:
    return (state.dequantize() if isinstance(state, QState) else state).double()


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "bf16", "nf4"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_mapping_of_one_format_is_that_format(fmt, amsgrad):
    """Functional: every state named with ``fmt`` gives the bits of ``state_format=fmt``."""
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    params = [p.detach() for p in make_params(2)]
    runs = []
    for state_format in (fmt, dict.fromkeys(names, fmt)):
        tx = lt.adamw(1e-2, amsgrad=amsgrad, state_format=state_format, min_quant_size=1024)
        ps, state = [p.clone() for p in params], tx.init(params)
        for step in range(3):
            updates, state = tx.update(grads_for(params, step), state, ps)
            ps = lt.apply_updates(ps, updates)
        runs.append((ps, state))
    (pa, sa), (pb, sb) = runs
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    leaves_a, leaves_b = (optree.tree_leaves(s, is_leaf=records.is_record) for s in (sa, sb))
    assert len(leaves_a) == len(leaves_b) > 0
    for a, b in zip(leaves_a, leaves_b):
        assert same_leaf(a, b)


def same_leaf(a, b) -> bool:
    """Two core state leaves (records or tensors), bit for bit."""
    kind = records.kind_of(a)
    if kind is None:
        return type(b) is type(a) and a.dtype == b.dtype and torch.equal(a, b)
    return (records.kind_of(b) is kind and kind.meta_of(a) == kind.meta_of(b)
            and all(torch.equal(_bits(x), _bits(kind.parts_of(b)[k])) for k, x in kind.parts_of(a).items()))


def test_the_functional_mapping_fills_in_8bit_and_the_bridge_in_the_class_format():
    p = [torch.zeros(64, 64)]
    core = lt.state_report(lt.adamw(1e-3, state_format={"exp_avg_sq": "fp8"}, min_quant_size=1).init(p))
    assert {r.path.split("/")[1]: r.format for r in core if r.path.endswith("/0")} == {
        "mu": "dynamic8", "nu": "e4m3_sqrt"}
    params = [torch.nn.Parameter(torch.zeros(64, 64))]
    params[0].grad = torch.ones(64, 64)
    for cls, first in ((bridge.AdamW, "fp32"), (bridge.AdamW4bit, "dynamic4")):
        opt = cls(params, state_format={"exp_avg_sq": "fp8"}, min_quant_size=1)
        opt.step()
        assert {r.name: r.format for r in opt.state_report()} == {"exp_avg": first, "exp_avg_sq": "e4m3_sqrt"}
        assert " exp_avg_sq       e4m3_sqrt " in opt.format_state_report()


def test_the_bridge_equals_the_functional_core_with_a_mapping():
    mapping = {"exp_avg": "4bit", "exp_avg_sq": "8bit", "exp_avg_slow": "fp8"}
    params = make_params(3)
    opt = bridge.AdEMAMix(params, lr=1e-2, state_format=mapping, min_quant_size=1024)
    tx = lt.ademamix(1e-2, state_format=mapping, min_quant_size=1024)
    fparams = [p.detach().clone() for p in params]
    state = tx.init(fparams)
    for step in range(3):
        grads = grads_for(params, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        updates, state = tx.update(grads, state, fparams)
        fparams = lt.apply_updates(fparams, updates)
    assert all(torch.equal(p.detach(), f) for p, f in zip(params, fparams))
    rule = next(s for s in optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, lt.ScaleByAdEMAMixState))
                if isinstance(s, lt.ScaleByAdEMAMixState))
    for field, name in lt.ScaleByAdEMAMixState.roles.items():
        if name == "step":
            continue
        for p, leaf in zip(params, getattr(rule, field)):
            live = opt.state[p][name]
            assert same_leaf(live.record if isinstance(live, QState) else live, leaf), (name, field)


# ----------------------------------------------------------------------------------------------
# per param group
# ----------------------------------------------------------------------------------------------
def test_a_group_mapping_takes_the_class_format_for_the_rest():
    params = make_params(4)
    user_mapping = {"exp_avg_sq": "4bit"}
    opt = bridge.AdamW([{"params": params[:2]}, {"params": params[2:], "state_format": user_mapping}],
                       state_format="8bit", min_quant_size=1024)
    user_mapping["exp_avg_sq"] = "fp8"  # the group keeps its own copy
    assert opt.param_groups[0]["state_format"] == "8bit"
    assert opt.param_groups[1]["state_format"] == {"exp_avg": "fp32", "exp_avg_sq": "4bit", "max_exp_avg_sq": "fp32"}
    run(opt, params, 2)
    rows = {(r.index, r.name): r.format for r in opt.state_report()}
    assert rows[(0, "exp_avg")] == "dynamic8" and rows[(2, "exp_avg")] == "fp32"
    assert rows[(2, "exp_avg_sq")] == "rank1_linear4_unsigned"
    named = bridge.AdamW8bit([{"params": params[2:], "state_format": {"exp_avg_sq": "4bit"}}], min_quant_size=1024)
    assert named.param_groups[0]["state_format"]["exp_avg"] == "8bit"
    with pytest.raises(ValueError, match=r"AdamW: state_format\['exp_avg'\] must be one of"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "state_format": {"exp_avg": "2bit"}})
    assert len(opt.param_groups) == 2


def test_slow_state_format_and_the_exp_avg_slow_entry_are_one_setting():
    params = make_params(5)[:1]
    # the constructor: the mapping's entry replaces AdEMAMix4bit's 8-bit slow EMA; both spellings agree
    opt = bridge.AdEMAMix4bit(params, state_format={"exp_avg_slow": "4bit"})
    assert opt.param_groups[0]["state_format"]["exp_avg_slow"] == "4bit"
    opt = bridge.AdEMAMix(params, state_format={"exp_avg": "8bit"}, slow_state_format="fp8")
    assert opt.param_groups[0]["state_format"] == {"exp_avg": "8bit", "exp_avg_sq": "fp32", "exp_avg_slow": "fp8"}
    assert opt.param_groups[0]["slow_state_format"] == "fp8"
    # a group's own setting, in either spelling, replaces the constructor's other one
    opt = bridge.AdEMAMix4bit([{"params": params, "state_format": {"exp_avg_slow": "fp8"}}])
    assert opt.param_groups[0]["state_format"]["exp_avg_slow"] == "fp8" == opt.param_groups[0]["slow_state_format"]
    opt = bridge.AdEMAMix([{"params": params, "slow_state_format": "fp8"}], state_format={"exp_avg_slow": "4bit"})
    assert opt.param_groups[0]["state_format"]["exp_avg_slow"] == "fp8"
    # one place, two different formats: refused, naming both
    with pytest.raises(ValueError, match=r"AdEMAMix: slow_state_format='8bit' and state_format\['exp_avg_slow'\]="
                                         r"'4bit' contradict"):
        bridge.AdEMAMix(params, state_format={"exp_avg_slow": "4bit"}, slow_state_format="8bit")
    with pytest.raises(ValueError, match="contradict"):
        bridge.AdEMAMix([{"params": params, "state_format": {"exp_avg_slow": "4bit"}, "slow_state_format": "8bit"}])
    with pytest.raises(ValueError, match="contradict"):
        lt.ademamix(1e-3, state_format={"exp_avg_slow": "4bit"}, slow_state_format="8bit")
    tx = lt.ademamix(1e-3, state_format={"exp_avg": "4bit"}, slow_state_format="fp8", min_quant_size=1)
    formats = {r.path.split("/")[1]: r.format for r in lt.state_report(tx.init([torch.zeros(8, 8)]))
               if r.path.endswith("/0") and "/" in r.path}
    assert formats == {"mu": "dynamic4", "nu": "dynamic8_sqrt", "mu_slow": "e4m3"}


def test_muon_mapping_names_both_kinds_of_group():
    w, b = torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(torch.zeros(64))
    opt = bridge.Muon4bit([{"params": [w]}, {"params": [b], "use_muon": False}], state_format={"exp_avg": "fp32"})
    assert opt.param_groups[0]["state_format"] == {"momentum_buffer": "nf4"}
    # the AdamW groups' left-out states take ADAMW_FORMATS's format, as with state_format="nf4"
    assert opt.param_groups[1]["state_format"] == {"exp_avg": "fp32", "exp_avg_sq": "8bit", "max_exp_avg_sq": "8bit"}
    with pytest.raises(ValueError, match="momentum_rank=4 splits a quantized momentum buffer; state_format='fp32'"):
        bridge.Muon([w], state_format={"momentum_buffer": "fp32"}, momentum_rank=4)


# ----------------------------------------------------------------------------------------------
# what is refused
# ----------------------------------------------------------------------------------------------
REFUSED = [
    (lambda p: bridge.AdamW(p, state_format={"momentum_buffer": "8bit"}),
     r"AdamW: state_format names 'momentum_buffer', which is not a state here; the states are 'exp_avg', "
     r"'exp_avg_sq', 'max_exp_avg_sq'"),
    (lambda p: bridge.SGD8bit(p, state_format={"exp_avg": "8bit"}, momentum=0.9),
     r"SGD8bit: state_format names 'exp_avg'.*the states are 'momentum_buffer'"),
    (lambda p: bridge.Lion(p, state_format={"exp_avg": "3bit"}), r"Lion: state_format\['exp_avg'\] must be one of"),
    (lambda p: bridge.AdamW(p, state_format=["8bit"]), r"AdamW: state_format must be one of .* or a mapping"),
    (lambda p: bridge.AdamW(p, state_format={"exp_avg_sq": "8bit"}, rank1_normalization=True),
     r"rank1_normalization=True .*'exp_avg_sq': '4bit'"),
    (lambda p: bridge.AdamW8bit(p, state_format="4bit"),
     r"AdamW8bit stores '8bit' states; .* or a mapping .* AdamW8bit\(params, state_format=\{'exp_avg': '4bit'\}\)"),
    (lambda p: lt.adamw(1e-3, state_format={"exp_avg_slow": "8bit"}),
     r"state_format names 'exp_avg_slow'.*'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'"),
    (lambda p: lt.adam(1e-3, state_format={"exp_avg_sq": "8bit"}, rank1_normalization=True),
     r"rank1_normalization=True needs a 4-bit second moment"),
    (lambda p: lt.lion(1e-3, state_format={"exp_avg": None}), r"state_format\['exp_avg'\] must be one of"),
    (lambda p: lt.sgd(1e-3, state_format={"exp_avg": "8bit"}), r"state_format names 'exp_avg'.*'momentum_buffer'"),
    (lambda p: lt.trace(0.9, state_format={"mu": "8bit"}), r"state_format names 'mu'"),
    (lambda p: lt.muon(1e-3, state_format={"exp_avg": "8bit"}), r"state_format names 'exp_avg'.*'momentum_buffer'"),
    (lambda p: lt.ademamix(1e-3, slow_state_format={"exp_avg_slow": "8bit"}), r"slow_state_format must be one of"),
]


@pytest.mark.parametrize("build,match", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refused_with_the_argument_and_the_valid_names(build, match):
    with pytest.raises(ValueError, match=match):
        build(make_params(6)[:1])


# ----------------------------------------------------------------------------------------------
# state dicts
# ----------------------------------------------------------------------------------------------
def _stepped(cls, steps=3, seed=7, **kw):
    params = make_params(seed)
    opt = cls(params, min_quant_size=1024, **kw)
    run(opt, params, steps)
    return opt, params


def test_state_dict_round_trip_is_exact(tmp_path):
    opt, params = _stepped(bridge.AdamW, state_format={"exp_avg": "fp8", "exp_avg_sq": "4bit"}, amsgrad=True)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    sd = read_state_dict(str(tmp_path / "opt.pt"))  # weights_only
    # another spelling of the same formats loads
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = bridge.AdamW(params2, min_quant_size=1024, amsgrad=True,
                        state_format={"exp_avg": "fp8", "exp_avg_sq": "4bit", "max_exp_avg_sq": "fp32"})
    opt2.load_state_dict(sd)
    for a, b in zip(states_of(opt, params), states_of(opt2, params2)):
        assert a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    run(opt, params, 2, first=3)
    run(opt2, params2, 2, first=3)
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, params2))
    for a, b in zip(states_of(opt, params), states_of(opt2, params2)):
        assert all(same_state(a[k], b[k]) for k in a)


def test_a_plain_format_checkpoint_in_a_mapping_optimizer():
    plain, params = _stepped(bridge.AdamW8bit)
    sd = plain.state_dict()
    # the same formats spelt as a mapping: loads, bit for bit, and the group keeps its spelling
    same = bridge.AdamW(make_params(7), min_quant_size=1024,
                        state_format={"exp_avg": "8bit", "exp_avg_sq": "8bit", "max_exp_avg_sq": "8bit"})
    same.load_state_dict(sd)
    assert isinstance(same.param_groups[0]["state_format"], dict)
    for a, b in zip(states_of(plain, params), [same.state[p] for p in same.param_groups[0]["params"]]):
        assert all(same_state(a[k], b[k]) for k in a)
    # another format for one state: refused, naming the state, and nothing changes
    other_params = make_params(8)
    other = bridge.AdamW(other_params, min_quant_size=1024, state_format={"exp_avg": "8bit", "exp_avg_sq": "4bit"})
    run(other, other_params, 1)
    before = [{k: copy.deepcopy(v) for k, v in st.items()} for st in states_of(other, other_params)]
    with pytest.raises(ValueError, match=r"param group 0: the state dict has state_format='8bit' but this optimizer has "
                                         r"state_format=\{.*\} \(the state dict keeps 'exp_avg_sq' in '8bit', this "
                                         r"optimizer in '4bit'\)"):
        other.load_state_dict(sd)
    for a, b in zip(before, states_of(other, other_params)):
        assert all(same_state(a[k], b[k]) for k in a)
    # the conversion: the fp32 export is quantized into each state's own format
    export = plain.torch_state_dict()
    other.load_state_dict(export)
    for p, sid in zip(other_params, export["param_groups"][0]["params"]):
        saved = export["state"][sid]
        st = other.state[p]
        if p.ndim < 2:
            assert torch.equal(st["exp_avg_sq"], saved["exp_avg_sq"])
            continue
        assert st["exp_avg"].label == "dynamic8" and torch.equal(
            st["exp_avg"].dequantize(), lt.dequantize(lt.quantize(saved["exp_avg"], "dynamic8")))
        assert st["exp_avg_sq"].kind_name == "rank1"
        v = saved["exp_avg_sq"].reshape(p.shape[0], -1)
        bound = torch.minimum(v.amax(1, keepdim=True), v.amax(0, keepdim=True)) / 16  # one code of linear4
        err = (st["exp_avg_sq"].dequantize().reshape(v.shape) - v).abs()
        assert bool((err <= bound * (1 + 1e-6)).all())


def test_ademamix_slow_format_mismatch_is_refused_naming_it():
    sd = _stepped(bridge.AdEMAMix4bit)[0].state_dict()  # slow EMA in 8 bits
    target = bridge.AdEMAMix(make_params(7), min_quant_size=1024, state_format="4bit")
    with pytest.raises(ValueError, match=r"the state dict has slow_state_format='8bit' but this optimizer has "
                                         r"slow_state_format=None \(the state dict keeps 'exp_avg_slow' in '8bit'"):
        target.load_state_dict(sd)
    mapped = bridge.AdEMAMix(make_params(7), min_quant_size=1024,
                             state_format={"exp_avg": "4bit", "exp_avg_sq": "4bit", "exp_avg_slow": "8bit"})
    mapped.load_state_dict(sd)  # the same three formats
    assert mapped.param_groups[0]["state_format"]["exp_avg_slow"] == "8bit"


def test_dcp_round_trip_and_inspect(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    from bridge.tools.inspect_state import inspect_path

    mapping = {"exp_avg": "8bit", "exp_avg_sq": "fp8"}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 5))
    opt = bridge.AdamW(model.parameters(), state_format=mapping, min_quant_size=1)
    run(opt, list(model.parameters()), 2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    for flat in (False, True):
        path = str(tmp_path / f"ckpt{flat}")
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"optim": get_optimizer_state_dict(model, opt, options=options)}, checkpoint_id=path)
            model2 = copy.deepcopy(model)
            opt2 = bridge.AdamW(model2.parameters(), state_format=mapping, min_quant_size=1)
            run(opt2, list(model2.parameters()), 1, first=5)
            osd = get_optimizer_state_dict(model2, opt2, options=options)
            dcp.load({"optim": osd}, checkpoint_id=path)
            set_optimizer_state_dict(model2, opt2, osd, options=options)
        for a, b in zip(states_of(opt, list(model.parameters())), states_of(opt2, list(model2.parameters()))):
            assert all(same_state(a[k], b[k]) for k in a)
        rows = {r.path.split("/", 1)[1]: r for r in inspect_path(path).rows}
        assert rows["0.weight/exp_avg"].format == "dynamic8"
        assert rows["0.weight/exp_avg_sq"].format == "e4m3_sqrt"
    report = inspect_path(str(tmp_path / "opt.pt"))
    rows = {r.path: r for r in report.rows}
    assert (rows["0/exp_avg"].format, rows["0/exp_avg"].block) == ("dynamic8", "256")
    assert (rows["0/exp_avg_sq"].format, rows["0/exp_avg_sq"].block) == ("e4m3_sqrt", "256")
    assert rows["1/exp_avg"].format == "fp32"
    assert math.isclose(sum(r.nbytes for r in report.rows), opt.state_bytes())
