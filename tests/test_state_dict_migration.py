"""Loading state dicts written by another setup: a float32 run continued on bfloat16 params with
corrections, formats of states a group does not keep, and torch.optim dicts whose settings decide
other states than this optimizer's."""
import copy

import pytest
import torch

import bridge
from bridge import QState


TOL = 5e-4
"""Masters against a float32 run: a correction keeps 16 significant bits (about 6e-5 at these
values, 2e-4 after three more steps); a lost one leaves bfloat16's 8 (about 8e-3)."""


def make_params(dtype=torch.float32, seed=0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 32, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(16, generator=g).to(dtype))]


def float32_of(params: list) -> list:
    return [torch.nn.Parameter(p.detach().float().clone()) for p in params]


def run(opt, params: list, steps: int, first: int = 0) -> None:
    """``steps`` steps with gradients seeded by step number, exact in bfloat16 (so every run,
    float32 or not, sees the same values)."""
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16).to(p.dtype)
        opt.step()


def max_diff(a: list, b: list) -> float:
    return max((x.detach().float() - y.detach().float()).abs().max().item() for x, y in zip(a, b))


def same_state(a, b) -> bool:
    if isinstance(a, QState):
        return isinstance(b, QState) and a.kind_name == b.kind_name and torch.equal(a, b)
    return torch.equal(a, b)


def states_of(opt) -> list:
    return [{k: v for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


# ----------------------------------------------------------------------------------------------
# a state dict without corrections into an optimizer with param_correction=True
# ----------------------------------------------------------------------------------------------
def _float32_run(cls=bridge.AdamW8bit, steps=3, **kw):
    params = make_params()
    opt = cls(params, lr=1e-2, min_quant_size=0, **kw)
    run(opt, params, steps)
    return opt, params


@pytest.mark.parametrize("source", ["state_dict", "torch_state_dict"])
@pytest.mark.parametrize("masters_first", [True, False])
def test_a_float32_run_continues_on_bfloat16_params_with_corrections(source, masters_first):
    """The documented migration, in either order: the moments load as into the float32
    optimizer, the corrections are the ones load_master_params sets, and the run continues as the
    float32 run continued from the same dict (to the 16 significant bits a correction keeps)."""
    run32, params32 = _float32_run()
    sd = getattr(run32, source)()
    masters = [p.detach().clone() for p in params32]
    ref_params = float32_of(masters)
    ref = bridge.AdamW8bit(ref_params, lr=1e-2, min_quant_size=0)
    ref.load_state_dict(copy.deepcopy(sd))
    params = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in masters]
    opt = bridge.AdamW8bit(params, lr=1e-2, min_quant_size=0, param_correction=True)
    if masters_first:
        bridge.load_master_params(opt, masters)
        set_by_masters = [opt.state[p]["param_correction"].clone() for p in params]
        opt.load_state_dict(copy.deepcopy(sd))
        assert all(torch.equal(opt.state[p]["param_correction"], c) for p, c in zip(params, set_by_masters))
    else:
        opt.load_state_dict(copy.deepcopy(sd))
        assert all(torch.count_nonzero(opt.state[p]["param_correction"]) == 0 for p in params)  # fresh: zero
        bridge.load_master_params(opt, masters)
    assert max_diff(bridge.master_params(opt), masters) < TOL
    for p, q in zip(ref_params, params):
        assert all(same_state(ref.state[p][k], opt.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    run(ref, ref_params, 3, first=3)
    run(opt, params, 3, first=3)
    assert max_diff(bridge.master_params(opt), ref_params) < TOL


@pytest.mark.parametrize("make", [
    lambda ps: (torch.optim.AdamW(ps, lr=1e-2), bridge.AdamW),
    lambda ps: (torch.optim.SGD(ps, lr=1e-2, momentum=0.9), bridge.SGD),
    lambda ps: (torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True), bridge.SGD),
], ids=["AdamW", "SGD-momentum", "SGD-nesterov"])
def test_a_torch_optim_float32_run_continues_on_bfloat16_params_with_corrections(make):
    """A torch.optim dict (float32 params) into the same rule on bfloat16 params with
    corrections (float32 states): the run continues as torch.optim's float32 run does."""
    ref_params = make_params()
    ref, cls = make(ref_params)
    run(ref, ref_params, 3)
    masters = [p.detach().clone() for p in ref_params]
    params = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in masters]
    group = {k: v for k, v in ref.param_groups[0].items() if k in ("momentum", "nesterov")}
    opt = cls(params, lr=1e-2, param_correction=True, **group)
    bridge.load_master_params(opt, masters)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert max_diff(bridge.master_params(opt), masters) < TOL
    run(ref, ref_params, 3, first=3)
    run(opt, params, 3, first=3)
    assert max_diff(bridge.master_params(opt), ref_params) < TOL


@pytest.mark.parametrize("source", ["torch SGD without momentum", "ours before any step"])
def test_a_state_dict_without_states_keeps_the_corrections(source):
    """A dict that holds no state for a param (torch.optim.SGD without momentum keeps none; a run
    saved before its first step) still leaves the corrections load_master_params set."""
    ref_params = make_params()
    ref = (torch.optim.SGD(ref_params, lr=1e-2) if source.startswith("torch")
           else bridge.SGD8bit(ref_params, lr=1e-2, min_quant_size=0))
    if source.startswith("torch"):
        run(ref, ref_params, 2)
    sd = copy.deepcopy(ref.state_dict())
    assert not sd["state"]
    masters = [p.detach().clone() for p in ref_params]
    params = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in masters]
    opt = bridge.SGD8bit(params, lr=1e-2, min_quant_size=0, param_correction=True)
    bridge.load_master_params(opt, masters)
    opt.load_state_dict(sd)
    assert max_diff(bridge.master_params(opt), masters) < TOL
    assert all(opt.state[p]["step"].item() == 0 for p in params)
    run(ref, ref_params, 2, first=2)
    run(opt, params, 2, first=2)
    assert max_diff(bridge.master_params(opt), ref_params) < TOL


def test_a_state_dict_with_corrections_sets_them():
    """A dict that holds corrections sets them, whatever load_master_params set before."""
    src_params = make_params(torch.bfloat16)
    src = bridge.AdamW8bit(src_params, lr=1e-2, min_quant_size=0, param_correction=True)
    run(src, src_params, 3)
    params = [torch.nn.Parameter(p.detach().clone()) for p in src_params]
    opt = bridge.AdamW8bit(params, lr=1e-2, min_quant_size=0, param_correction=True)
    bridge.load_master_params(opt, [p.detach().float() + 1e-3 for p in src_params])
    with torch.no_grad():
        for p, q in zip(params, src_params):
            p.copy_(q)
    opt.load_state_dict(copy.deepcopy(src.state_dict()))
    for p, q in zip(params, src_params):
        assert torch.equal(opt.state[p]["param_correction"], src.state[q]["param_correction"])
    run(src, src_params, 2, first=3)
    run(opt, params, 2, first=3)
    assert max_diff(params, src_params) == 0


@pytest.mark.parametrize("source", ["state_dict", "torch_state_dict"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_dict_with_corrections_into_an_optimizer_without_is_refused(source, dtype):
    """Loading corrections where none are kept would drop the masters' low bits: refused naming
    the group, the param and both fixes, and nothing changes."""
    src_params = make_params(torch.bfloat16)
    src = bridge.AdamW8bit(src_params, lr=1e-2, min_quant_size=0, param_correction=True)
    run(src, src_params, 2)
    sd = getattr(src, source)()
    params = make_params(dtype)
    opt = bridge.AdamW8bit(params, lr=1e-2, min_quant_size=0)
    run(opt, params, 1)
    before = [{k: v.clone() for k, v in st.items()} for st in states_of(opt)]
    with pytest.raises(ValueError, match=r"param group 0, param 0 \(shape \(16, 32\), torch\.(float32|bfloat16)\): "
                                         r"the state dict holds its 'param_correction'.*param_correction=False.*"
                                         r"build the optimizer with param_correction=True.*bridge\.master_params"):
        opt.load_state_dict(sd)
    assert all(all(same_state(b[k], st[k]) for k in b) for b, st in zip(before, states_of(opt)))
    assert "param_correction" not in opt.param_groups[0]


def test_a_group_keeps_its_own_param_correction():
    """A dict with no states to say otherwise does not switch this optimizer's corrections on."""
    empty = bridge.AdamW8bit(make_params(torch.bfloat16), param_correction=True).state_dict()
    opt = bridge.AdamW8bit(make_params(torch.bfloat16))
    opt.load_state_dict(empty)
    assert "param_correction" not in opt.param_groups[0]


# ----------------------------------------------------------------------------------------------
# formats of states the group does not keep
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("saved_kw,target_kw", [
    (dict(cls=bridge.AdamW8bit, state_format={"exp_avg_sq": "4bit"}),
     dict(cls=bridge.AdamW, state_format={"exp_avg": "8bit", "exp_avg_sq": "4bit"})),
    (dict(cls=bridge.AdamW8bit), dict(cls=bridge.AdamW, state_format={"exp_avg": "8bit", "exp_avg_sq": "8bit"})),
    (dict(cls=bridge.AdamW, state_format={"exp_avg": "8bit", "exp_avg_sq": "4bit"}),
     dict(cls=bridge.AdamW8bit, state_format={"exp_avg_sq": "4bit"})),
], ids=["8bit-mapping-into-AdamW", "8bit-into-AdamW", "AdamW-into-8bit-mapping"])
def test_formats_of_states_not_kept_do_not_refuse_a_load(saved_kw, target_kw):
    """Without amsgrad no 'max_exp_avg_sq' exists: the two optimizers keep the same states in the
    same formats, so each loads the other's dict and continues bit for bit."""
    src_params = make_params()
    src = saved_kw.pop("cls")(src_params, lr=1e-2, min_quant_size=0, **saved_kw)
    run(src, src_params, 3)
    params = [torch.nn.Parameter(p.detach().clone()) for p in src_params]
    opt = target_kw.pop("cls")(params, lr=1e-2, min_quant_size=0, **target_kw)
    opt.load_state_dict(copy.deepcopy(src.state_dict()))
    for a, b in zip(states_of(src), states_of(opt)):
        assert a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    run(src, src_params, 2, first=3)
    run(opt, params, 2, first=3)
    assert max_diff(params, src_params) == 0


def test_a_kept_state_in_another_format_is_still_refused():
    """With amsgrad the running max exists: its format must agree, and the error names it."""
    src = bridge.AdamW8bit(make_params(), min_quant_size=0, amsgrad=True)
    run(src, src.param_groups[0]["params"], 1)
    opt = bridge.AdamW(make_params(), min_quant_size=0, amsgrad=True,
                       state_format={"exp_avg": "8bit", "exp_avg_sq": "8bit"})
    with pytest.raises(ValueError, match=r"param group 0: .*keeps 'max_exp_avg_sq' in '8bit', this optimizer in "
                                         r"'fp32'.*build the optimizer with"):
        opt.load_state_dict(src.state_dict())
    assert len(opt.state) == 0


# ----------------------------------------------------------------------------------------------
# torch.optim dicts whose settings decide other states
# ----------------------------------------------------------------------------------------------
def _torch_run(make, steps=2):
    params = make_params()
    opt = make(params)
    run(opt, params, steps)
    return opt, params


MISMATCHES = [
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), lambda ps: bridge.AdamW8bit(ps),
     "amsgrad=True", "amsgrad=False"),
    (lambda ps: torch.optim.AdamW(ps), lambda ps: bridge.AdamW8bit(ps, amsgrad=True),
     "amsgrad=False", "amsgrad=True"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: bridge.SGD8bit(ps, lr=0.1),
     "momentum=0.9", "momentum=0.0"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: bridge.SGD8bit(ps, lr=0.1, momentum=0.9),
     "momentum=0", "momentum=0.9"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
     lambda ps: bridge.SGD8bit(ps, lr=0.1, momentum=0.9), "nesterov=True", "nesterov=False"),
]


@pytest.mark.parametrize("make_torch,make_ours,theirs,mine", MISMATCHES,
                         ids=["amsgrad-dropped", "amsgrad-missing", "momentum-dropped", "momentum-missing", "nesterov"])
def test_a_torch_dict_with_other_state_settings_is_refused(make_torch, make_ours, theirs, mine):
    """A torch.optim dict whose amsgrad / momentum / nesterov differs from this optimizer's would
    drop a state it holds, lack one the rule reads, or switch the rule: refused naming the group,
    the setting on both sides and the fix; nothing changes."""
    ref, _ = _torch_run(make_torch)
    opt = make_ours(make_params())
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    key = theirs.split("=")[0]
    with pytest.raises(ValueError, match=rf"param group 0: the state dict has {theirs} but this optimizer has {mine} "
                                         rf"\(.*\).*build the optimizer with {theirs}"):
        opt.load_state_dict(ref.state_dict())
    assert len(opt.state) == 0
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups, key


def test_a_torch_dict_state_this_optimizer_does_not_keep_is_refused():
    """A state the dict holds and no setting here keeps (NAdam's 'mu_product') is refused, not
    dropped."""
    ref, _ = _torch_run(lambda ps: torch.optim.NAdam(ps))
    opt = bridge.AdamW(make_params())
    with pytest.raises(ValueError, match=r"param 0 .*unexpected state entries \['mu_product'\].*would drop them"):
        opt.load_state_dict(ref.state_dict())
    assert len(opt.state) == 0


def test_a_torch_dict_with_values_this_optimizer_refuses_is_refused():
    """A group value the class refuses at construction (SGD's dampening) is refused in a loaded
    dict too, before anything changes: loaded, it would be kept in the group and ignored by
    the rule."""
    ref, _ = _torch_run(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5))
    opt = bridge.SGD8bit(make_params(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"SGD8bit.load_state_dict, param group 0: dampening=0.5 is not supported"):
        opt.load_state_dict(ref.state_dict())
    assert len(opt.state) == 0 and opt.param_groups[0]["dampening"] == 0


@pytest.mark.parametrize("make_torch,make_ours", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True), lambda ps: bridge.AdamW(ps, lr=1e-2, amsgrad=True)),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
     lambda ps: bridge.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True)),
], ids=["AdamW-amsgrad", "SGD-nesterov"])
def test_agreeing_settings_load_and_continue_as_torch(make_torch, make_ours):
    """Where the settings agree the dict loads (every state it holds) and the float32 rule
    continues as torch.optim's does."""
    ref, ref_params = _torch_run(make_torch, steps=3)
    params = float32_of(ref_params)
    opt = make_ours(params)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for p, q in zip(ref_params, params):
        assert set(ref.state[p]) <= set(opt.state[q])
        for name, v in ref.state[p].items():
            assert torch.equal(opt.state[q][name], v.float()), name
    run(ref, ref_params, 3, first=3)
    run(opt, params, 3, first=3)
    assert max_diff(params, ref_params) < 1e-5  # float32 both: the order of operations only


@pytest.mark.parametrize("make", [lambda ps: bridge.AdamW8bit(ps, lr=1e-2, amsgrad=True, min_quant_size=0),
                                  lambda ps: bridge.SGD8bit(ps, lr=1e-2, momentum=0.9, nesterov=True, min_quant_size=0)],
                         ids=["amsgrad", "nesterov"])
def test_torch_state_dict_keeps_the_settings_torch_reads(make):
    """The float32 export keeps amsgrad / nesterov (torch.optim's keys): torch.optim would
    otherwise take them as False and run another rule on the exported states."""
    ours, params = _torch_run(make)
    export = ours.torch_state_dict()
    key = "amsgrad" if "amsgrad" in ours.param_groups[0] and ours.param_groups[0]["amsgrad"] else "nesterov"
    assert export["param_groups"][0][key] is True
    plain = (torch.optim.AdamW(float32_of(params), amsgrad=True) if key == "amsgrad"
             else torch.optim.SGD(float32_of(params), momentum=0.9, nesterov=True))
    plain.load_state_dict(export)
    assert plain.param_groups[0][key] is True
    back = make(make_params())
    back.load_state_dict(export)  # and back into the same setup
    assert back.param_groups[0][key] is True
