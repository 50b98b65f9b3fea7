"""Muon: Newton-Schulz and the fp32 optimizer against torch.optim.Muon; the low-bit momentum's
definition (the Newton-Schulz input in storage form) against the reference quantizer; bridge ==
functional for every format; purity; Muon + AdamW groups; state dicts; argument errors.
(FSDP2: tests/test_fsdp.py, ``test_muon_fsdp_exact_at_1_2_3_ranks``.)"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.optim._muon import _zeropower_via_newtonschulz

import bridge
import lowbit_tree as lt
from lowbit_tree.kernels import StepLeaf, StepSpec, native, run_step, step_hyperparams
from lowbit_tree.kernels.torch_backend import _fma
from lowbit_tree.muon_transform import DEFAULT_NS_COEFFICIENTS, newton_schulz
from test_kernels_step import np_fma, np_lerp, same

FORMATS = ["fp32", "bf16", "8bit", "4bit", "nf4", "fp8"]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (33, 33), (1, 7), (300, 17)])
def test_newton_schulz_is_torchs_bit_for_bit(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    for inp in (x, x.bfloat16(), torch.zeros(shape)):
        before = inp.clone()
        want = _zeropower_via_newtonschulz(inp.clone(), DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
        got = newton_schulz(inp, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), shape
        assert torch.equal(inp, before)  # torch's divides a bfloat16 input in place; ours does not


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(20, 48, bias=False)
        self.b = nn.Linear(48, 48, bias=False)
        self.c = nn.Linear(48, 5, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _train(model, opt, steps=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 20, generator=gen)
        y = torch.randint(0, 5, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("nesterov,adjust", [(True, None), (False, None), (True, "match_rms_adamw")])
def test_fp32_matches_torch_muon_over_50_steps(nesterov, adjust):
    """The same 50 gradients (wide, tall, square, odd): params and momentum buffers within
    1e-6 relative of torch.optim.Muon's (measured: ~1e-10; the buffers are bit-identical).
    Fixed gradients, not a training loop: in one, any 1-ulp difference flips a bfloat16
    rounding inside Newton-Schulz and grows (torch.optim.Muon against itself with one weight
    1 ulp apart: 7e-3..7e-2 after 50 steps; design.md, "Muon")."""
    params, grads = _problem([(48, 20), (48, 48), (5, 48), (37, 301)], 50, seed=0)
    ref = [p.clone().requires_grad_() for p in params]
    ours = [p.clone().requires_grad_() for p in params]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust)
    t_opt, o_opt = torch.optim.Muon(ref, **kw), bridge.Muon(ours, **kw)
    for gs in grads:
        for r, o, g in zip(ref, ours, gs):
            r.grad, o.grad = g.clone(), g.clone()
        t_opt.step()
        o_opt.step()
    for p, r, p0 in zip(ours, ref, params):
        assert _rel(p.detach(), r.detach()) <= 1e-6
        assert torch.equal(o_opt.state[p]["momentum_buffer"], t_opt.state[r]["momentum_buffer"])
        assert _rel(p.detach(), p0) > 1e-2  # it moved


def _problem(shapes, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * (1 + t % 3) for s in shapes] for t in range(steps)]
    return params, grads


def _bridge_and_functional(fmt, nesterov, dtype, steps, seed, **kw):
    """``bridge.Muon`` and ``lt.muon`` with the same options stepped on the same gradients of
    three shapes (wide, tall, 3 x 300): ``(bridge params, functional params, optimizer, state)``."""
    params, grads = _problem([(40, 70), (130, 24), (3, 300)], steps, seed=seed)
    params = [p.to(dtype) for p in params]
    tx = lt.muon(0.02, 0.9, 0.05, nesterov, state_format=fmt, min_quant_size=1, block_size=32, **kw)
    ps, state = [p.clone() for p in params], tx.init(params)
    ours = [p.clone() for p in params]
    opt = bridge.Muon(ours, lr=0.02, momentum=0.9, weight_decay=0.05, nesterov=nesterov, state_format=fmt,
                      min_quant_size=1, block_size=32, **kw)
    for gs in grads:
        gs = [g.to(dtype) for g in gs]
        updates, state = tx.update(gs, state, ps)
        ps = lt.apply_updates(ps, updates)
        for p, g in zip(ours, gs):
            p.grad = g.clone()
        opt.step()
    return ours, ps, opt, state


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_bridge_equals_functional_bit_for_bit(fmt, nesterov, dtype):
    ours, ps, opt, state = _bridge_and_functional(fmt, nesterov, dtype, steps=6, seed=1)
    muon_state = state[0]
    for i, (p, q) in enumerate(zip(ours, ps)):
        assert same(p, q), (fmt, i)
        live = opt.state[p]["momentum_buffer"]
        live = live.record if isinstance(live, bridge.QState) else live
        assert same(live, muon_state.trace[i]), (fmt, i)


def test_update_is_pure():
    params, grads = _problem([(40, 70), (70, 40)], 2, seed=2)
    for fmt in ("8bit", "fp32"):
        tx = lt.muon(0.02, state_format=fmt, min_quant_size=1)
        state = tx.init(params)
        state, _ = tx.update(grads[0], state, params)[1], None
        snap = copy.deepcopy((params, grads[1], state))
        tx.update(grads[1], state, params)
        for a, b in zip(*(lt.tree_utils.flatten(t)[0] for t in (snap, (params, grads[1], state)))):
            if isinstance(a, lt.QTensor):
                assert same(a, b)
            elif isinstance(a, torch.Tensor):
                assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "nf4", "fp8"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_low_bit_update_is_newton_schulz_of_the_stored_form(fmt, nesterov):
    """The definition, from independent pieces: the momentum by numpy's lerp (float32, one
    rounding), the stored form by the reference quantizer, Newton-Schulz by torch's own; the
    update ``o * ratio``."""
    shape, bs, mu = (24, 80), 32, 0.9
    gen = torch.Generator().manual_seed(3)
    buf = lt.quantize(torch.randn(shape, generator=gen) * 0.1, fmt, bs, signed=True)
    g = torch.randn(shape, generator=gen)
    tx = lt.scale_by_muon(mu, nesterov, state_format=fmt, block_size=bs, min_quant_size=1)
    (u,), new = tx.update([g], lt.ScaleByMuonState(torch.zeros((), dtype=torch.int32), [buf]))
    b_old = lt.dequantize(buf).numpy()
    b = np_lerp(b_old, g.numpy(), np.float32(1 - mu))
    want_buf = lt.quantize(torch.from_numpy(b), buf.format, bs)
    assert same(new.trace[0], want_buf)
    x = torch.from_numpy(np_lerp(g.numpy(), b, np.float32(mu))) if nesterov else torch.from_numpy(b)
    stored = lt.dequantize(lt.quantize(x, buf.format, bs))
    want = _zeropower_via_newtonschulz(stored, DEFAULT_NS_COEFFICIENTS, 5, 1e-7).float() * 1.0  # 24 < 80: ratio 1
    assert torch.equal(u, want)


def test_fp32_update_and_tall_ratio():
    shape, mu = (90, 30), 0.95
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(shape, generator=gen)
    tx = lt.scale_by_muon(mu, state_format="fp32")
    (u,), new = tx.update([g], tx.init([g]))
    b = np_lerp(np.zeros(shape, np.float32), g.numpy(), np.float32(1 - mu))
    x = torch.from_numpy(np_lerp(g.numpy(), b, np.float32(mu)))
    want = _zeropower_via_newtonschulz(x, DEFAULT_NS_COEFFICIENTS, 5, 1e-7).float() * np.float32(3 ** 0.5)
    assert torch.equal(new.trace[0], torch.from_numpy(b)) and torch.equal(u, want)


@pytest.mark.parametrize("backend", ["native", "eager"])
def test_small_momentum_takes_lerps_other_branch(backend):
    """momentum < 0.5: the buffer's lerp weight 1 - mu >= 0.5 (fma(w - 1, ...)), nesterov's < 0.5."""
    if backend == "native" and not native.available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(5)
    g, b0 = torch.randn(7, 301, generator=gen), torch.randn(7, 301, generator=gen)
    for mu in (0.3, 0.0):
        spec = StepSpec("muon", nesterov=True)
        hyper = step_hyperparams(spec, b1=mu)
        (u,), ((b,),) = run_step(spec, hyper, [StepLeaf(None, g, (b0,))], backend=backend)
        want_b = np_lerp(b0.numpy(), g.numpy(), np.float32(1 - mu))
        want_u = np_lerp(g.numpy(), want_b, np.float32(mu))
        assert np.array_equal(b.numpy(), want_b) and np.array_equal(u.numpy(), want_u), mu


def test_torch_backend_fma_is_correctly_rounded():
    """The compiled backend's fma from float64 operations, on random values and on products
    that put the float64 sum exactly on a float32 midpoint (where plain float64 double-rounds)."""
    gen = torch.Generator().manual_seed(6)
    x, y, z = (torch.randn(100_000, generator=gen) * torch.exp(torch.randn(100_000, generator=gen) * 4)
               for _ in range(3))
    one = torch.ones(4)
    tiny = torch.tensor([2.0 ** -30, -(2.0 ** -30), 2.0 ** -60, -(2.0 ** -60)])
    mid = torch.full((4,), 1.0 + 2.0 ** -23) + 2.0 ** -24 * 0  # z = 1 + ulp, product = half an ulp +- tiny
    xs = torch.cat([x, one * (2.0 ** -24), one])
    ys = torch.cat([y, one + 2.0 ** -23, tiny])
    zs = torch.cat([z, mid, one + 2.0 ** -23])
    got = torch.compile(_fma, fullgraph=True)(xs, ys, zs)
    want = np_fma(xs.numpy(), ys.numpy(), zs.numpy())
    assert np.array_equal(got.numpy(), want)
    assert np.array_equal(_fma(xs, ys, zs).numpy(), want)


def test_muon_and_adamw_groups_train_a_whole_model():
    """muon_param_groups: hidden matrices to Muon, embedding, head, norms and biases to AdamW;
    the AdamW group's params follow bridge.AdamW's exactly; the loss falls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 32), nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64),
                          nn.Linear(64, 30))
    named = dict(model.named_parameters())
    groups = bridge.muon_param_groups(model, exclude=("0", "5"), lr=3e-3, weight_decay=0.01)
    assert [id(p) for p in groups[0]["params"]] == [id(named["1.weight"]), id(named["4.weight"])]
    assert groups[1]["use_muon"] is False and len(groups[1]["params"]) == len(named) - 2
    twin = copy.deepcopy(model)
    opt = bridge.Muon8bit(groups, lr=0.02, min_quant_size=1)
    tw = dict(twin.named_parameters())
    adamw = bridge.AdamW8bit([tw[n] for n, p in named.items() if not any(p is q for q in groups[0]["params"])],
                             lr=3e-3, weight_decay=0.01, min_quant_size=1)
    tokens = torch.randint(0, 30, (8, 9), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, 30), tokens[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
        for n, p in named.items():  # the twin sees the same gradients
            tw[n].grad = p.grad.clone()
        opt.step()
        adamw.step()
    assert losses[-1] < 0.5 * losses[0]
    for n, p in named.items():
        if not any(p is q for q in groups[0]["params"]):
            assert torch.equal(p, tw[n]), n
    assert set(opt.state[named["1.weight"]]) == {"step", "momentum_buffer"}
    assert set(opt.state[named["0.weight"]]) == {"step", "exp_avg", "exp_avg_sq"}


def _round_trip(cls):
    """3 steps, ``state_dict()`` into a twin, 3 more steps of both: the params stay equal bit for
    bit. Returns the first model, its optimizer and the (copied) state dict."""
    torch.manual_seed(0)
    model = MLP()
    opt = cls(model.parameters(), lr=0.02, min_quant_size=1)
    _train(model, opt, steps=3)
    sd = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    opt2 = cls(twin.parameters(), lr=0.02, min_quant_size=1)
    opt2.load_state_dict(sd)
    _train(model, opt, steps=3, seed=9)
    _train(twin, opt2, steps=3, seed=9)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    return model, opt, sd


def _from_torch_muon(cls):
    """torch.optim.Muon's state dict after 3 steps loaded into ``cls``: ``[(our momentum_buffer,
    torch's)]`` per param."""
    ref = MLP()
    t_opt = torch.optim.Muon(ref.parameters(), lr=0.02)
    _train(ref, t_opt, steps=3)
    ours = copy.deepcopy(ref)
    o = cls(ours.parameters(), lr=0.02, min_quant_size=1)
    o.load_state_dict(t_opt.state_dict())
    return [(o.state[p]["momentum_buffer"], t_opt.state[r]["momentum_buffer"])
            for p, r in zip(ours.parameters(), ref.parameters())]


def test_state_dict_round_trip_and_torch_muon_state():
    model, opt, sd = _round_trip(bridge.Muon8bit)
    # a torch.optim.Muon state dict: its float32 buffers quantized into this optimizer's format
    for ours, theirs in _from_torch_muon(bridge.Muon8bit):
        assert _rel(ours.dequantize(), theirs) < 0.02
    with pytest.raises(ValueError, match="state_format|format"):
        bridge.Muon4bit(copy.deepcopy(model).parameters(), lr=0.02, min_quant_size=1).load_state_dict(sd)


def test_muon4bit_is_nf4_and_loads_checkpoints_of_the_dynamic_4bit_format():
    """Muon4bit keeps its momentum as rank-16 factors and a residual on the normal-float map,
    blocks of 32 (a 5 x 48 matrix: rank 5); a Muon4bit state dict written when Muon4bit used
    ``state_format="4bit"`` (the dynamic map, blocks of 128) is refused with the format named,
    and loads bit for bit into ``bridge.Muon(state_format="4bit")``."""
    model = MLP()
    opt = bridge.Muon4bit(model.parameters(), lr=0.02, min_quant_size=1)
    assert opt.defaults["state_format"] == "nf4" and opt.defaults["momentum_rank"] == 16
    _train(model, opt, steps=2)
    rows = opt.state_report()
    assert [r[2] for r in rows if r[1] == "momentum_buffer"] == ["normal4+rank16", "normal4+rank16", "normal4+rank5"]
    buf = opt.state[next(model.parameters())]["momentum_buffer"].record
    assert buf.block_size == 32 and lt.get_format(buf.format).values.equal(lt.formats.normal_map())
    old_model = MLP()
    old = bridge.Muon(old_model.parameters(), lr=0.02, min_quant_size=1, state_format="4bit")
    _train(old_model, old, steps=2)
    sd = old.state_dict()
    with pytest.raises(ValueError, match="state_format='4bit' but this optimizer has state_format='nf4'"):
        bridge.Muon4bit(copy.deepcopy(old_model).parameters(), lr=0.02, min_quant_size=1).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"bridge.Muon\(params, state_format='4bit'\)"):
        bridge.Muon4bit(old_model.parameters(), state_format="4bit")
    twin = copy.deepcopy(old_model)
    again = bridge.Muon(twin.parameters(), lr=0.02, min_quant_size=1, state_format="4bit")
    again.load_state_dict(sd)
    for p, q in zip(old_model.parameters(), twin.parameters()):
        a, b = old.state[p]["momentum_buffer"], again.state[q]["momentum_buffer"]
        assert a.format == b.format == "dynamic4" and torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    _train(old_model, old, steps=2, seed=5)
    _train(twin, again, steps=2, seed=5)
    for p, q in zip(old_model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("block_size", [None, 128])
def test_dcp_refuses_an_old_muon4bit_checkpoint_by_format(tmp_path, block_size):
    """Through DCP too (one process): an old Muon4bit checkpoint is refused by its state_format,
    also where an explicit block size makes the saved and live shapes agree (its dynamic-map codes
    would otherwise be read on the normal-float map), and before ``dcp.load`` writes into the
    optimizer's own state tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from bridge.dcp import load_optimizer

    model = MLP()
    old = bridge.Muon(model.parameters(), lr=0.02, min_quant_size=1, state_format="4bit", block_size=block_size)
    _train(model, old, steps=2)
    dcp.save({"optim": get_optimizer_state_dict(model, old)}, checkpoint_id=str(tmp_path))
    new = bridge.Muon4bit(model.parameters(), lr=0.02, min_quant_size=1, block_size=block_size)
    _train(model, new, steps=1, seed=3)
    before = {id(p): {k: t.clone() for k, t in new.state[p]["momentum_buffer"].parts.items()}
              for p in model.parameters()}
    with pytest.raises(ValueError, match="state_format='4bit' but this optimizer has state_format='nf4'"):
        load_optimizer(model, new, str(tmp_path))
    for p in model.parameters():  # refused before any state was read: the live states are untouched
        live = new.state[p]["momentum_buffer"].parts
        assert set(live) == {"codes", "scale", "row_factor", "col_factor"}
        assert all(torch.equal(t, before[id(p)][k]) for k, t in live.items())


def test_adamw_groups_of_nf4_muon_take_8bit_unless_they_say():
    """``"nf4"`` is the momentum's map; an AdamW group without its own format gets ``"8bit"``
    (written into the group), one with its own keeps it, and the step is lt.adamw's in that format."""
    torch.manual_seed(0)
    emb = torch.randn(40, 24, requires_grad=True)
    mat = torch.randn(24, 24, requires_grad=True)
    opt = bridge.Muon4bit([{"params": [mat]}, {"params": [emb], "use_muon": False}], lr=0.01, min_quant_size=1)
    assert [g["state_format"] for g in opt.param_groups] == ["nf4", "8bit"]
    mine = bridge.Muon(
        [{"params": [mat]}, {"params": [emb], "use_muon": False, "state_format": "4bit"}], state_format="nf4")
    assert [g["state_format"] for g in mine.param_groups] == ["nf4", "4bit"]
    assert [g["state_format"] for g in bridge.Muon([mat], state_format="4bit").param_groups] == ["4bit"]
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(40, 24, generator=gen)
    emb.grad, mat.grad = g.clone(), torch.randn(24, 24, generator=gen)
    e0 = emb.detach().clone()
    opt.step()
    kinds = {r[1]: r[2] for r in opt.state_report() if r[0] == 1}
    assert kinds == {"exp_avg": "dynamic8", "exp_avg_sq": "dynamic8_sqrt"}
    tx = lt.adamw(0.01, 0.9, 0.999, 1e-8, 0.1, state_format="8bit", min_quant_size=1)
    u, _ = tx.update([g], tx.init([e0]), [e0])
    assert torch.equal(emb.detach(), lt.apply_updates([e0], u)[0])


def test_argument_errors():
    lin, vec = torch.zeros(4, 5, requires_grad=True), torch.zeros(5, requires_grad=True)
    with pytest.raises(ValueError, match="use_muon=False"):
        bridge.Muon([lin, vec])
    bridge.Muon([{"params": [lin]}, {"params": [vec], "use_muon": False}])  # fine
    for kw, what in [(dict(ns_steps=100), "ns_steps"), (dict(ns_steps=2.0), "ns_steps"),
                     (dict(ns_coefficients=(1, 2)), "ns_coefficients"), (dict(adjust_lr_fn="x"), "adjust_lr_fn"),
                     (dict(momentum=-0.1), "momentum"), (dict(lr=-1.0), "lr"), (dict(eps=float("nan")), "eps")]:
        with pytest.raises(ValueError, match=what):
            bridge.Muon([lin], **kw)
    with pytest.raises(ValueError, match="2-D"):
        lt.muon(0.1).init([torch.zeros(3, 4, 5)])
    with pytest.raises(ValueError, match="2-D"):
        tx = lt.scale_by_muon(state_format="fp32")
        tx.update([torch.zeros(7)], lt.ScaleByMuonState(torch.zeros((), dtype=torch.int32), [torch.zeros(7)]))
    with pytest.raises(ValueError, match="needs params"):
        tx = lt.muon(0.1, state_format="fp32")
        tx.update([torch.ones(3, 4)], tx.init([torch.zeros(3, 4)]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fmt", ["fp32", "8bit", "4bit", "nf4"])
def test_cuda_bridge_equals_functional_and_torch_momentum(fmt):
    """On CUDA (compiled backend): bridge == functional bit for bit; fp32 momentum buffers equal
    torch.optim.Muon's on the same device, params within 1e-6."""
    params, grads = _problem([(40, 70), (130, 24)], 8, seed=7)
    params = [p.cuda() for p in params]
    tx = lt.muon(0.02, state_format=fmt, min_quant_size=1)
    ps, state = [p.clone() for p in params], tx.init(params)
    ours = [p.clone() for p in params]
    ref = [p.clone() for p in params]
    opt = bridge.Muon(ours, lr=0.02, state_format=fmt, min_quant_size=1)
    t_opt = torch.optim.Muon(ref, lr=0.02)
    for gs in grads:
        gs = [g.cuda() for g in gs]
        updates, state = tx.update(gs, state, ps)
        ps = lt.apply_updates(ps, updates)
        for p, r, g in zip(ours, ref, gs):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        t_opt.step()
    for p, q, r in zip(ours, ps, ref):
        assert same(p.cpu(), q.cpu())
        if fmt == "fp32":
            assert torch.equal(opt.state[p]["momentum_buffer"], t_opt.state[r]["momentum_buffer"])
            assert _rel(p, r) <= 1e-6


def _live_record(opt, p):
    v = opt.state[p]["momentum_buffer"]
    return v.record if hasattr(v, "record") else v


@pytest.mark.parametrize("fmt,rank", [("nf4", 8), ("8bit", 3), ("fp8", 4)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_momentum_rank_bridge_equals_functional_bit_for_bit(fmt, rank, nesterov, dtype):
    """``momentum_rank``: the bridge's in-place step and the functional update give the same
    params and the same records (residual codes and scales, both factors), for every shape
    kind (wide, tall, narrower than the rank)."""
    from test_lowrank import same_record

    ours, ps, opt, state = _bridge_and_functional(fmt, nesterov, dtype, steps=5, seed=4, momentum_rank=rank)
    for i, (p, q) in enumerate(zip(ours, ps)):
        assert same(p, q), (fmt, i)
        rec = _live_record(opt, p)
        assert rec.rank == min(rank, *p.shape) and same_record(rec, state[0].trace[i]), (fmt, i)
        assert rec.row_factor.abs().max() > 0  # the factors were refreshed


def test_muon4bit_state_dicts_old_and_new():
    """A Muon4bit state dict round-trips bit for bit; an nf4 one without factors (Muon4bit before
    momentum_rank) loads into today's Muon4bit as the same buffer value (zero factors); torch.optim.Muon's
    buffers load as residuals; a rank mismatch is refused naming momentum_rank, before anything
    changes; the fp32 export is the whole buffer, factors included."""
    model, opt, sd = _round_trip(bridge.Muon4bit)
    assert set(sd["state"][0]["momentum_buffer"]) == {"codes", "scale", "row_factor", "col_factor"}
    assert sd["param_groups"][0]["momentum_rank"] == 16
    exported = opt.torch_state_dict()["state"]
    for i, p in enumerate(model.parameters()):
        rec = _live_record(opt, p)
        assert torch.equal(exported[i]["momentum_buffer"], lt.moments.load(rec))
        assert exported[i]["momentum_buffer"].shape == p.shape

    old_model = MLP()
    old = bridge.Muon(old_model.parameters(), lr=0.02, min_quant_size=1, state_format="nf4")
    _train(old_model, old, steps=2)
    old_sd = copy.deepcopy(old.state_dict())
    for g in old_sd["param_groups"]:
        del g["momentum_rank"]  # written before the key existed
    new = bridge.Muon4bit(copy.deepcopy(old_model).parameters(), lr=0.02, min_quant_size=1)
    new.load_state_dict(old_sd)
    for p, q in zip(old_model.parameters(), new.param_groups[0]["params"]):
        rec = _live_record(new, q)
        assert not rec.row_factor.any() and not rec.col_factor.any()
        assert torch.equal(lt.moments.load(rec), old.state[p]["momentum_buffer"].dequantize())
    assert new.param_groups[0]["momentum_rank"] == 16

    with_key = old.state_dict()  # momentum_rank=0 said explicitly: refused, not guessed
    target_model = copy.deepcopy(old_model)
    target = bridge.Muon4bit(target_model.parameters(), lr=0.02, min_quant_size=1)
    _train(target_model, target, steps=1)
    before = [{k: t.clone() for k, t in target.state[p]["momentum_buffer"].parts.items()}
              for p in target.param_groups[0]["params"]]
    with pytest.raises(ValueError, match="momentum_rank=0 but this optimizer has momentum_rank=16"):
        target.load_state_dict(with_key)
    with pytest.raises(ValueError, match="momentum_rank=16 but this optimizer has momentum_rank=0"):
        bridge.Muon(copy.deepcopy(model).parameters(), lr=0.02, min_quant_size=1, state_format="nf4").load_state_dict(sd)
    fewer = bridge.Muon4bit(copy.deepcopy(model).parameters(), lr=0.02, min_quant_size=1, momentum_rank=2)
    relabelled = copy.deepcopy(sd)  # the groups say 2, the records hold rank-16 factors
    for g in relabelled["param_groups"]:
        g["momentum_rank"] = 2
    with pytest.raises(ValueError, match="another momentum_rank"):
        fewer.load_state_dict(relabelled)
    for p, b in zip(target.param_groups[0]["params"], before):
        assert all(torch.equal(t, b[k]) for k, t in target.state[p]["momentum_buffer"].parts.items())

    for ours, theirs in _from_torch_muon(bridge.Muon4bit):
        rec = ours.record
        assert not rec.row_factor.any()
        assert _rel(lt.moments.load(rec), theirs) < 0.15  # one nf4 rounding


def test_muon4bit_dcp_round_trip(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from bridge.dcp import load_optimizer

    model = MLP()
    opt = bridge.Muon4bit(model.parameters(), lr=0.02, min_quant_size=1)
    _train(model, opt, steps=3)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path))
    twin = copy.deepcopy(model)
    fresh = bridge.Muon4bit(twin.parameters(), lr=0.02, min_quant_size=1)
    _train(twin, fresh, steps=1, seed=4)  # live states to be overwritten
    twin.load_state_dict(model.state_dict())
    load_optimizer(twin, fresh, str(tmp_path))
    _train(model, opt, steps=2, seed=6)
    _train(twin, fresh, steps=2, seed=6)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_momentum_rank_argument_errors():
    mat = torch.zeros(8, 8, requires_grad=True)
    with pytest.raises(ValueError, match="momentum_rank must be an int >= 0"):
        bridge.Muon([mat], state_format="nf4", momentum_rank=-2)
    with pytest.raises(ValueError, match="state_format='fp32' keeps it unquantized"):
        bridge.Muon([mat], momentum_rank=4)
    with pytest.raises(ValueError, match="or momentum_rank=0"):
        bridge.Muon4bit([{"params": [mat], "state_format": "bf16"}])
    bridge.Muon4bit([{"params": [mat], "state_format": "bf16", "momentum_rank": 0}])


def test_an_nf4_dcp_checkpoint_without_factors_loads_into_muon4bit(tmp_path):
    """A DCP checkpoint of ``Muon(state_format="nf4")`` (what Muon4bit was before momentum_rank)
    through ``bridge.dcp.load_optimizer`` into today's Muon4bit: each buffer becomes the same
    value, its codes as the residual and zero factors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from bridge.dcp import load_optimizer

    model = MLP()
    old = bridge.Muon(model.parameters(), lr=0.02, min_quant_size=1, state_format="nf4")
    _train(model, old, steps=2)
    osd = get_optimizer_state_dict(model, old)
    for g in osd["param_groups"]:
        del g["momentum_rank"]  # not written before it existed
    dcp.save({"optim": osd}, checkpoint_id=str(tmp_path))
    twin = copy.deepcopy(model)
    new = bridge.Muon4bit(twin.parameters(), lr=0.02, min_quant_size=1)
    _train(twin, new, steps=1, seed=3)  # live records with factors, to be replaced
    load_optimizer(twin, new, str(tmp_path))
    for p, q in zip(model.parameters(), twin.parameters()):
        rec = new.state[q]["momentum_buffer"].record
        assert not rec.row_factor.any() and not rec.col_factor.any()
        assert torch.equal(lt.moments.load(rec), old.state[p]["momentum_buffer"].dequantize())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_muon4bit_bridge_equals_functional():
    """Muon4bit's low-rank momentum on CUDA (compiled backend, cuSOLVER's QR): bridge ==
    functional bit for bit, and within 2% (relative) of the CPU run's params after 8 steps."""
    from lowbit_tree.lowrank import LowRankQTensor
    from test_lowrank import same_record

    def on_cpu(r):
        return LowRankQTensor(r.codes.cpu(), r.scale.cpu(), r.row_factor.cpu(), r.col_factor.cpu(), r.shape,
                              r.block_size, r.format)

    params, grads = _problem([(40, 70), (130, 24)], 8, seed=7)
    tx = lt.muon(0.02, weight_decay=0.1, state_format="nf4", min_quant_size=1, momentum_rank=8)
    gpu, cpu = [p.cuda() for p in params], [p.clone() for p in params]
    state, cstate = tx.init(gpu), tx.init(cpu)
    ours = [p.cuda() for p in params]
    opt = bridge.Muon4bit(ours, lr=0.02, weight_decay=0.1, min_quant_size=1)
    for gs in grads:
        u, state = tx.update([g.cuda() for g in gs], state, gpu)
        gpu = lt.apply_updates(gpu, u)
        cu, cstate = tx.update(gs, cstate, cpu)
        cpu = lt.apply_updates(cpu, cu)
        for p, g in zip(ours, gs):
            p.grad = g.cuda()
        opt.step()
    for i, (p, q, c) in enumerate(zip(ours, gpu, cpu)):
        assert same(p.cpu(), q.cpu())
        assert same_record(on_cpu(_live_record(opt, p)), on_cpu(state[0].trace[i]))
        assert _rel(q.cpu(), c) < 0.02


@pytest.mark.parametrize("cls", [bridge.Muon, bridge.Muon8bit, bridge.Muon4bit])
def test_muon_refuses_param_correction_in_a_group(cls):
    """The Muon classes keep no int8 correction: a group asking for one is refused, naming the
    option, instead of being stepped without it (as an ignored group key would be)."""
    w = nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).bfloat16())
    with pytest.raises(ValueError, match="param_correction"):
        cls([{"params": [w], "param_correction": True}])
    opt = cls([w])
    with pytest.raises(ValueError, match="param_correction"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(8, 8))], "param_correction": True})
    assert len(opt.param_groups) == 1
