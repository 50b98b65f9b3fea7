"""The rest of torch.optim's elementwise family (Adamax, Adadelta, RAdam, NAdam), each added as a
declaration (lowbit_tree/rules.py) plus its math per backend, against independent references:
torch.optim itself (float32 states within 1e-6 relative over 20 steps, with maximize, weight
decay and an LR scheduler), its state dicts loading into ours and ours into it, our state dicts
round trip bit for bit, the bridge equal to the functional alias, and every backend equal to a
numpy float32 reference bit for bit in every format (FSDP2 / TP: tests/fsdp_workers.py,
tests/tp_workers.py)."""
from __future__ import annotations

import copy
import inspect

import numpy as np
import pytest
import torch

import bridge
import lowbit_tree as lt
from lowbit_tree.kernels import native
from lowbit_tree.qtensor import QTensor

import test_kernels_step as K

SHAPES = [(37, 65), (7,), (3, 5, 11), (1, 4099)]
ZERO_STEPS = {3, 11}  # steps whose gradients are all zero
STEPS = 20

# name: (the core alias, the options torch.optim is compared over)
FAMILY = {
    "Adamax": (lt.adamax, [{}, {"betas": (0.8, 0.99), "eps": 1e-6}, {"weight_decay": 0.1}, {"maximize": True},
                           {"weight_decay": 0.05, "maximize": True, "scheduler": True}]),
    "Adadelta": (lt.adadelta, [{}, {"rho": 0.5, "eps": 1e-4}, {"weight_decay": 0.1}, {"maximize": True},
                               {"weight_decay": 0.05, "maximize": True, "scheduler": True}]),
    "RAdam": (lt.radam, [{}, {"betas": (0.8, 0.99), "eps": 1e-6}, {"weight_decay": 0.1},
                         {"weight_decay": 0.1, "decoupled_weight_decay": True}, {"maximize": True},
                         {"weight_decay": 0.05, "decoupled_weight_decay": True, "maximize": True, "scheduler": True}]),
    "NAdam": (lt.nadam, [{}, {"betas": (0.8, 0.99), "eps": 1e-6, "momentum_decay": 0.01}, {"weight_decay": 0.1},
                         {"weight_decay": 0.1, "decoupled_weight_decay": True}, {"maximize": True},
                         {"weight_decay": 0.05, "decoupled_weight_decay": True, "maximize": True, "scheduler": True}]),
}
CASES = [(name, o) for name, (_, options) in FAMILY.items() for o in options]
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'defaults'}" for name, o in CASES]


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int, params, seed: int = 100):
    g = torch.Generator().manual_seed(seed + step)
    return [torch.randn(p.shape, generator=g) * (0.0 if step in ZERO_STEPS else 1.0) for p in params]


def _close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-6) -> bool:
    """Within ``rtol`` of the reference relative to its largest value (an element near zero is
    compared at the tensor's scale: float32 rounding, not relative error of a crossing)."""
    scale = ref.abs().max().clamp_min(1e-30)
    return bool(((ours.float() - ref.float()).abs() <= rtol * scale).all())


def _step(pairs, s, seed=100):
    for o, params in pairs:
        for p, g in zip(params, _grads(s, params, seed)):
            p.grad = g.clone()
        o.step()


@pytest.mark.parametrize("name,options", CASES, ids=IDS)
def test_fp32_equals_torch_optim(name, options):
    options = dict(options)
    scheduled = options.pop("scheduler", False)
    ours, ref = _params(0), _params(0)
    opt = getattr(bridge, name)(ours, lr=1e-2, **options)
    topt = getattr(torch.optim, name)(ref, lr=1e-2, **options)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (opt, topt)] if scheduled else []
    for s in range(STEPS):
        _step([(opt, ours), (topt, ref)], s)
        for sch in scheds:
            sch.step()
    # decoupled decay: ours is p - lr * (u + wd * p) (AdamW's link), torch's p * (1 - lr * wd) - lr * u,
    # each rounded once per step, so the params drift apart by up to a rounding a step (measured
    # 2026-12-04 at 20 steps: 1.04e-6 relative on one param; AdamW against torch.optim.AdamW 5.7e-7)
    rtol = 2e-6 if options.get("decoupled_weight_decay") else 1e-6
    for p, q in zip(ours, ref):
        assert _close(p.detach(), q.detach(), rtol), (name, options, (p - q).abs().max().item())
        assert sorted(opt.state[p]) == sorted(topt.state[q])
        for k, v in topt.state[q].items():
            assert _close(opt.state[p][k], v), (name, options, k)


@pytest.mark.parametrize("count", [0, 4, 5, 6, 49])
def test_radam_terms_are_torchs_per_step_values(count):
    """The vector's ``cm`` and ``rect`` at step ``count + 1``, on the host and tensor paths, are
    torch.optim.RAdam's float64 terms rounded once (b2 = 0.99: rho_t > 5 from step 6 on)."""
    import unittest.mock

    from lowbit_tree.kernels import StepSpec, step_hyperparams
    from lowbit_tree.kernels.spec import Hyper

    b1, b2, step = 0.9, 0.99, count + 1
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * step * (b2**step) / (1 - b2**step)
    if rho_t > 5.0:
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        want = (rect * (1 - b2**step) ** 0.5 / (1 - b1**step), 1.0)
    else:
        want = (1 / (1 - b1**step), 0.0)
    host = Hyper(*step_hyperparams(StepSpec("radam"), count=count, b1=b1, b2=b2).tolist())
    with unittest.mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        args = {k: torch.tensor(v, dtype=torch.float64) for k, v in dict(count=count, b1=b1, b2=b2).items()}
        dev = Hyper(*step_hyperparams(StepSpec("radam"), **args).tolist())
    for h in (host, dev):
        assert (h.cm, h.rect) == (np.float32(want[0]), np.float32(want[1])), (count, h.cm, h.rect, want)
    assert (rho_t > 5.0) == (count >= 5)


@pytest.mark.parametrize("b1,momentum_decay", [(0.9, 4e-3), (0.8, 0.5)])
def test_nadam_terms_are_torchs_per_step_values(b1, momentum_decay):
    """``mu_product`` over 30 steps is torch.optim.NAdam's, bit for bit (a float32 product), and the
    vector's ``cg`` and ``cm`` are the factors torch's two ``addcdiv`` take (without ``-lr``),
    computed in float64 from it and rounded once."""
    from lowbit_tree.kernels import StepSpec, step_hyperparams
    from lowbit_tree.kernels.spec import Hyper, nadam_terms

    q = torch.nn.Parameter(torch.ones(3))
    topt = torch.optim.NAdam([q], lr=1.0, betas=(b1, 0.999), momentum_decay=momentum_decay)
    ours = torch.ones((), dtype=torch.float32)
    for t in range(1, 31):
        before = float(topt.state[q]["mu_product"]) if t > 1 else 1.0
        q.grad = torch.ones(3)
        topt.step()
        after = float(topt.state[q]["mu_product"])
        mu = b1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay)))
        mu_next = b1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * momentum_decay)))
        cg, cm, ours_next = nadam_terms(t, b1, momentum_decay, ours)
        assert ours_next.dtype == torch.float32 and float(ours) == before
        assert float(ours_next) == after, (t, float(ours_next), after)
        h = Hyper(*step_hyperparams(StepSpec("nadam"), count=t - 1, b1=b1, cg=cg, cm=cm).tolist())
        want_cg, want_cm = (1.0 - mu) / (1.0 - after), mu_next / (1.0 - after * mu_next)
        assert (h.cg, h.cm) == (np.float32(want_cg), np.float32(want_cm)), t
        ours = ours_next


@pytest.mark.parametrize("fmt", ["fp32", "8bit"])
def test_nadam_params_stepped_at_different_counts_keep_their_own_mu_product(fmt):
    """A param without a gradient on some steps keeps its own ``step`` and ``mu_product`` (as
    torch.optim.NAdam): the batch by step count and product, and in float32 states torch's params
    and products (bit for bit) after steps where only some params have gradients."""
    ours, ref = _params(5), _params(5)
    opt = bridge.NAdam(ours, lr=1e-2, weight_decay=0.01, state_format=fmt, min_quant_size=64)
    topt = torch.optim.NAdam(ref, lr=1e-2, weight_decay=0.01)
    for s in range(12):
        for o, params in ((opt, ours), (topt, ref)):
            for i, (p, g) in enumerate(zip(params, _grads(s, params, seed=9))):
                p.grad = None if (s + i) % 3 == 0 and i != 0 else g.clone()  # param 0 always steps
            o.step()
    steps = [float(opt.state[p]["step"]) for p in ours]
    assert len(set(steps)) > 1, steps
    # torch's state dict, its products apart, loaded into ours and stepped on beside torch
    loaded = [torch.nn.Parameter(q.detach().clone()) for q in ref]
    o2 = bridge.NAdam(loaded, lr=1e-2, weight_decay=0.01)
    o2.load_state_dict(copy.deepcopy(topt.state_dict()))
    for s in range(12, 15):
        for o, params in ((opt, ours), (topt, ref), (o2, loaded)):
            for i, (p, g) in enumerate(zip(params, _grads(s, params, seed=9))):
                p.grad = None if (s + i) % 3 == 0 and i != 0 else g.clone()
            o.step()
    for p, q, r in zip(ours, ref, loaded):
        assert float(opt.state[p]["step"]) == float(topt.state[q]["step"]) == float(o2.state[r]["step"])
        assert torch.equal(opt.state[p]["mu_product"], topt.state[q]["mu_product"])
        assert torch.equal(o2.state[r]["mu_product"], topt.state[q]["mu_product"])
        assert _close(r.detach(), q.detach())
        if fmt == "fp32":
            assert _close(p.detach(), q.detach())


def test_torch_signatures_are_kept():
    """torch.optim's arguments with its defaults, its positional ones in its order."""
    for name in FAMILY:
        ours = inspect.signature(getattr(bridge, name)).parameters
        theirs = inspect.signature(getattr(torch.optim, name)).parameters
        for n, p in theirs.items():
            assert n in ours and ours[n].default == p.default, (name, n)
        positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD][:len(positional)] == positional


@pytest.mark.parametrize("name", list(FAMILY))
def test_state_dicts_load_both_ways_with_torch_optim(name):
    """torch.optim -> ours (load_state_dict) and ours -> torch.optim (torch_state_dict), each
    stepped on beside an uninterrupted run: the same params within float32 rounding."""
    options = FAMILY[name][1][-1]
    options = {k: v for k, v in options.items() if k != "scheduler"}
    ours, ref = _params(2), _params(2)
    opt = getattr(bridge, name)(ours, lr=1e-2, **options)
    topt = getattr(torch.optim, name)(ref, lr=1e-2, **options)
    for s in range(8):
        _step([(opt, ours), (topt, ref)], s, seed=3)
    into_torch = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    t2 = getattr(torch.optim, name)(into_torch, lr=1e-2, **options)
    t2.load_state_dict(copy.deepcopy(opt.torch_state_dict()))
    into_ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    o2 = getattr(bridge, name)(into_ours, lr=1e-2, **options)
    o2.load_state_dict(copy.deepcopy(topt.state_dict()))
    for s in range(8, 16):
        _step([(opt, ours), (topt, ref), (t2, into_torch), (o2, into_ours)], s, seed=3)
    for a, b, c, d in zip(ours, ref, into_torch, into_ours):
        assert _close(c.detach(), a.detach()) and _close(d.detach(), b.detach()) and _close(a.detach(), b.detach())


def _bits(t):
    t = getattr(t, "record", t)
    if isinstance(t, QTensor):
        return (t.codes.view(torch.uint8), t.scale)
    return (torch.as_tensor(t),)


@pytest.mark.parametrize("cls", [f"{n}{f}" for n in FAMILY for f in ("8bit", "4bit", "Fp8")])
def test_low_bit_state_dicts_round_trip_bit_for_bit(cls):
    ps = _params(4)
    opt = getattr(bridge, cls)(ps, lr=1e-2, min_quant_size=64)
    for s in range(3):
        _step([(opt, ps)], s)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    o2 = getattr(bridge, cls)(qs, lr=1e-2, min_quant_size=64)
    o2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s in range(3, 6):
        _step([(opt, ps), (o2, qs)], s)
    for p, q in zip(ps, qs):
        assert torch.equal(p.detach(), q.detach())
        assert sorted(opt.state[p]) == sorted(o2.state[q])
        for k, v in opt.state[p].items():
            assert all(torch.equal(a, b) for a, b in zip(_bits(v), _bits(o2.state[q][k]))), (cls, k)


@pytest.mark.parametrize("fmt", ["fp32", "8bit", "4bit", "fp8"])
@pytest.mark.parametrize("name", list(FAMILY))
def test_bridge_equals_functional_alias(name, fmt):
    """The bridge class and the alias it runs, on the same params and gradients: the same bits."""
    options = {k: v for k, v in FAMILY[name][1][-1].items() if k != "scheduler"}
    core_options = dict(options)
    if "betas" in core_options:
        core_options["b1"], core_options["b2"] = core_options.pop("betas")
    ps = _params(1)
    opt = getattr(bridge, name)(ps, lr=1e-2, state_format=fmt, min_quant_size=64, **options)
    tx = FAMILY[name][0](1e-2, state_format=fmt, min_quant_size=64, **core_options)
    core = [p.detach().clone() for p in ps]
    state = tx.init(core)
    for s in range(4):
        grads = _grads(s, ps, seed=7)
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        updates, state = tx.update(grads, state, core)
        core = lt.apply_updates(core, updates)
    for p, c in zip(ps, core):
        assert torch.equal(p.detach(), c)


# ---------------------------------------------------------------------------- every backend vs numpy
def reference_rule_step(spec, hyper, p, g, states, *, write):
    """One step of the family's rules in numpy float32, written from kernels/spec.py's docstring
    (each operation correctly rounded, no contraction), in the reference frame of
    ``test_kernels_step.numpy_rule_step``. Returns ``(out, new states)``."""
    return K.numpy_rule_step(spec, hyper, p, g, states, write=write, rule_math=_family_math)


def _family_math(spec, h, gf, pf, olds):
    if spec.rule == "adamax":
        e = np.maximum(h["b2"] * olds[0], np.abs(gf) + h["eps"])
        m = h["b1"] * olds[1] + h["omb1"] * gf
        return (m * h["rbc1"]) / e, [e, m]
    if spec.rule == "adadelta":
        v = h["b2"] * olds[0] + h["omb2"] * (gf * gf)
        u = (np.sqrt(olds[1] + h["eps"]) / np.sqrt(v + h["eps"])) * gf
        return u, [v, h["b2"] * olds[1] + h["omb2"] * (u * u)]
    if spec.rule == "radam":
        v = h["b2"] * olds[0] + h["omb2"] * (gf * gf)
        m = h["b1"] * olds[1] + h["omb1"] * gf
        return ((m * h["cm"]) / (np.sqrt(v) + h["eps"]) if h["rect"] != 0 else m * h["cm"]), [v, m]
    if spec.rule == "nadam":
        v = h["b2"] * olds[0] + h["omb2"] * (gf * gf)
        m = h["b1"] * olds[1] + h["omb1"] * gf
        return (h["cg"] * gf + h["cm"] * m) / (np.sqrt(v) * h["rsbc2"] + h["eps"]), [v, m]
    raise AssertionError(spec.rule)


RULES = [("adamax", {}), ("adadelta", {}), ("radam", {}), ("nadam", {})]
RULE_IDS = ["adamax", "adadelta", "radam", "nadam"]
LINK_SETS = [{}, {"decay": True, "lr": True}, {"maximize": True, "l2": True, "lr": True}]
REF_SHAPES = [((37, 301), None), ((5, 16), 7), ((700,), None), ((3, 2, 129), 64)]


@pytest.mark.parametrize("backend", [pytest.param("native", marks=K.NATIVE), "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", K.STATE_FORMATS)
@pytest.mark.parametrize("rule,variant", RULES, ids=RULE_IDS)
def test_every_backend_equals_the_numpy_reference_bit_for_bit(rule, variant, fmt, dtype, backend):
    for li, links in enumerate(LINK_SETS):
        for si, (shape, bs) in enumerate(REF_SHAPES):
            spec, states, p, g, hyper = K.make_case(rule, variant, links, fmt, dtype, shape, bs, 10 * li + si)
            K.assert_rule_step_is_reference(spec, hyper, p, g, states, reference_rule_step, backend,
                                            (backend, rule, variant, fmt, dtype, links, shape))


def test_native_kernel_is_built():
    """The bit-for-bit test above runs the C kernel wherever a compiler is (a skip is visible)."""
    if not native.available():
        pytest.skip("no C compiler")
