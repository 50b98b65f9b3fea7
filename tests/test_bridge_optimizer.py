"""bridge optimizers against torch.optim and textbook references."""
import io

import pytest
import torch

import bridge
from lowbit_tree.kernels import native as kernels_native
from bridge import QState


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(24, 96), torch.nn.Tanh(), torch.nn.Linear(96, 80), torch.nn.Tanh(), torch.nn.Linear(80, 3)
    ).to(dtype)


def data(seed=1, n=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 24, generator=g)
    w = torch.randn(24, 3, generator=g)
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(n, 3, generator=g)


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def train(model, opt, steps, sched=None, x=None, y=None):
    if x is None:
        x, y = data()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def groups(model, **second):
    """Two param groups: weights and biases, the second with overrides."""
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    b = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": w}, {"params": b, **second}]


def max_rel_diff(m1, m2):
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(m1.parameters(), m2.parameters()))


@pytest.mark.parametrize(
    "ours, theirs, kw",
    [
        (bridge.Adam, torch.optim.Adam, dict(lr=3e-3, weight_decay=1e-2)),
        (bridge.AdamW, torch.optim.AdamW, dict(lr=3e-3, weight_decay=5e-2)),
        (bridge.Adam, torch.optim.Adam, dict(lr=3e-3, amsgrad=True)),
        (bridge.SGD, torch.optim.SGD, dict(lr=3e-2, momentum=0.9, weight_decay=1e-3)),
        (bridge.SGD, torch.optim.SGD, dict(lr=3e-2, momentum=0.9, nesterov=True)),
        (bridge.SGD, torch.optim.SGD, dict(lr=3e-2)),
    ],
)
@pytest.mark.parametrize("backend", ["native", "eager"])
def test_fp32_matches_torch_optim_step_for_step(ours, theirs, kw, backend, monkeypatch):
    # both backends of the one transition (the C kernel, the eager torch code) against torch.optim
    if backend == "native" and not kernels_native.available():
        pytest.skip("no C compiler")
    monkeypatch.setenv("LOWBIT_TREE_BACKEND", backend)
    m1, m2 = mlp(), mlp()
    o1 = ours(groups(m1, lr=kw["lr"] / 3), **kw)
    o2 = theirs(groups(m2, lr=kw["lr"] / 3), **kw)
    s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=10, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=10, gamma=0.5)
    x, y = data()
    for _ in range(50):
        for m, o, s in ((m1, o1, s1), (m2, o2, s2)):
            o.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()
            s.step()
    assert max_rel_diff(m1, m2) < 2e-6
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for name, v in o2.state[p2].items():
            if name == "step":
                assert o1.state[p1]["step"].item() == v.item()
            else:
                torch.testing.assert_close(o1.state[p1][name], v, rtol=1e-5, atol=1e-7)


def lion_reference(params, grads_per_step, lr, b1, b2, wd):
    """Textbook Lion (arXiv 2302.06675, Algorithm 2) in float64."""
    ps = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    for grads in grads_per_step:
        for p, m, g in zip(ps, ms, grads):
            g = g.double()
            update = torch.sign(b1 * m + (1 - b1) * g)
            p.mul_(1 - lr * wd).sub_(lr * update)
            m.mul_(b2).add_((1 - b2) * g)
    return ps


def test_lion_fp32_matches_textbook_reference():
    torch.manual_seed(0)
    params = [torch.randn(30, 20, requires_grad=True), torch.randn(20, requires_grad=True)]
    init = [p.detach().clone() for p in params]
    grads = [[torch.randn_like(p) for p in params] for _ in range(40)]
    opt = bridge.Lion(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    ref = lion_reference(init, grads, 1e-2, 0.9, 0.99, 0.1)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.double(), r, rtol=1e-6, atol=1e-6)


# Final loss minus fp32 AdamW's, as a fraction of the initial loss, after 100 steps
# on the synthetic task; measured: 8bit -0.0013, fp8 -0.0026, 4bit +0.016.
@pytest.mark.parametrize("cls, tol", [(bridge.AdamW8bit, 0.005), (bridge.AdamWFp8, 0.005), (bridge.AdamW4bit, 0.03)])
def test_quantized_classes_train_like_fp32(cls, tol):
    x, y = data(n=128)
    m_ref = mlp()
    ref = train(m_ref, torch.optim.AdamW(m_ref.parameters(), lr=3e-3), 100, x=x, y=y)
    m = mlp()
    opt = cls(m.parameters(), lr=3e-3, min_quant_size=0)
    losses = train(m, opt, 100, x=x, y=y)
    formats = {r.format for r in opt.state_report() if len(r.shape) == 2}
    assert "fp32" not in formats, "all matrices must really be quantized"
    assert losses[-1] < 0.05 * losses[0]
    assert (losses[-1] - ref[-1]) / ref[0] <= tol, (losses[-1], ref[-1], ref[0])


def test_param_group_state_format_override_takes_effect():
    m = mlp()
    opt = bridge.AdamW8bit(
        [{"params": [m[0].weight], "state_format": "fp32"}, {"params": [m[2].weight, m[4].weight]},
         {"params": [m[0].bias, m[2].bias, m[4].bias], "state_format": "bf16"}],
        lr=1e-3, min_quant_size=0,
    )
    train(m, opt, 2)
    fmt = {(r.index, r.name): r.format for r in opt.state_report()}
    assert fmt[(0, "exp_avg")] == "fp32" and fmt[(0, "exp_avg_sq")] == "fp32"
    assert fmt[(1, "exp_avg")] == "dynamic8" and fmt[(1, "exp_avg_sq")] == "dynamic8_sqrt"
    assert fmt[(3, "exp_avg")] == "bf16"
    assert isinstance(opt.state[m[2].weight]["exp_avg"], QState)
    assert opt.state[m[0].weight]["exp_avg"].dtype == torch.float32
    assert opt.state[m[0].bias]["exp_avg"].dtype == torch.bfloat16


def test_small_tensors_keep_fp32_state_visibly():
    m = mlp()
    opt = bridge.AdamW8bit(m.parameters())  # min_quant_size 4096: only the 96x80 weight... is 7680
    train(m, opt, 1)
    report = {r.index: r.format for r in opt.state_report() if r.name == "exp_avg"}
    assert report == {0: "fp32", 1: "fp32", 2: "dynamic8", 3: "fp32", 4: "fp32", 5: "fp32"}
    text = opt.format_state_report()
    assert "dynamic8" in text and "fp32" in text and "bytes/param" in text


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 5, 0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=30, cycle_momentum=True),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 5), torch.optim.lr_scheduler.CosineAnnealingLR(o, 25)], [5]
    ),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 7),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_schedulers_drive_lr_like_torch(name):
    m1, m2 = mlp(), mlp()
    o1, o2 = bridge.AdamW(m1.parameters(), lr=1e-3), torch.optim.AdamW(m2.parameters(), lr=1e-3)
    s1, s2 = SCHEDULERS[name](o1), SCHEDULERS[name](o2)
    x, y = data()
    for _ in range(30):
        for m, o, s in ((m1, o1, s1), (m2, o2, s2)):
            o.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()
            s.step()
        assert o1.param_groups[0]["lr"] == pytest.approx(o2.param_groups[0]["lr"])
        assert o1.param_groups[0]["betas"][0] == pytest.approx(o2.param_groups[0]["betas"][0])
    assert max_rel_diff(m1, m2) < 1e-5


def test_reduce_lr_on_plateau_writes_float_lr_into_quantized_optimizer():
    m = mlp()
    opt = bridge.AdamW8bit(m.parameters(), lr=1e-2, min_quant_size=0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.1)
    x, y = data()
    for _ in range(3):
        opt.zero_grad()
        loss_fn(m, x, y).backward()
        opt.step()
        sched.step(1.0)  # never improves: lr drops every step
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.1**2)
    before = [p.detach().clone() for p in m.parameters()]
    opt.zero_grad()
    loss_fn(m, x, y).backward()
    opt.step()
    step = max((p - b).abs().max().item() for p, b in zip(m.parameters(), before))
    assert 0 < step < 1e-4 * 5  # lr 1e-4: the step is bounded by ~lr


def test_tensor_lr_and_betas_work_and_change_the_step():
    m1, m2 = mlp(), mlp()
    o1 = bridge.AdamW(m1.parameters(), lr=torch.tensor(1e-3), betas=(torch.tensor(0.9), torch.tensor(0.999)))
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    x, y = data()
    for i in range(10):
        if i == 5:
            o1.param_groups[0]["lr"] = torch.tensor(5e-3)
            o2.param_groups[0]["lr"] = 5e-3
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()
    assert max_rel_diff(m1, m2) < 1e-5


def test_closure_zero_grad_and_params_without_grad():
    torch.manual_seed(0)
    m = mlp()
    frozen = torch.nn.Parameter(torch.randn(5, 5))
    opt = bridge.AdamW8bit([*m.parameters(), frozen], lr=1e-3)
    x, y = data()
    returned = []

    def closure():
        opt.zero_grad()
        loss = loss_fn(m, x, y)
        loss.backward()
        returned.append(loss)
        return loss

    before = frozen.detach().clone()
    loss = opt.step(closure)
    # step() returns the closure's own loss, computed with grad enabled (step runs under no_grad)
    assert len(returned) == 1 and loss is returned[0] and loss.grad_fn is not None
    assert torch.equal(frozen, before) and len(opt.state[frozen]) == 0
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in m.parameters())
    loss_fn(m, x, y).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and (p.grad == 0).all() for p in m.parameters())


def test_add_param_group_and_shared_params_rejected():
    m = mlp()
    opt = bridge.AdamW8bit([m[0].weight], lr=1e-3)
    opt.add_param_group({"params": [m[2].weight], "state_format": "4bit", "lr": 1e-4})
    assert opt.param_groups[1]["state_format"] == "4bit" and opt.param_groups[1]["lr"] == 1e-4
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [m[0].weight]})
    with pytest.raises(ValueError, match="state_format"):
        opt.add_param_group({"params": [m[4].weight], "state_format": "3bit"})
    with pytest.raises(ValueError, match="block_size"):
        bridge.AdamW8bit(m.parameters(), block_size=0)


def test_sparse_and_complex_params_are_clear_errors():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = bridge.AdamW8bit(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    with pytest.raises(ValueError, match="complex parameter.*view_as_real"):
        bridge.AdamW8bit([torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="not a floating-point"):
        bridge.AdamW8bit([torch.zeros(3, dtype=torch.int64)])


def state_snapshot(opt):
    out = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[(id(p), k)] = v.clone()  # a record's clone copies its parts; torch.equal compares their bits
    return out


def snapshots_equal(a, b):
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if not torch.equal(x, y):
            return False
    return True


def test_grad_scaler_skips_inf_steps_without_touching_params_or_state():
    m = mlp()
    opt = bridge.AdamW8bit(m.parameters(), lr=1e-3, min_quant_size=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = data()
    for i in range(6):
        opt.zero_grad()
        scaler.scale(loss_fn(m, x, y)).backward()
        if i == 3:
            m[2].weight.grad[0, 0] = float("inf")
            params_before = [p.detach().clone() for p in m.parameters()]
            state_before = state_snapshot(opt)
            scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if i == 3:
            assert all(torch.equal(p, b) for p, b in zip(m.parameters(), params_before))
            assert snapshots_equal(state_snapshot(opt), state_before)
            assert scaler.get_scale() == scale_before / 2
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_nonfinite_grad_without_scaler_damages_only_its_own_param():
    m = mlp()
    opt = bridge.AdamW8bit(m.parameters(), lr=1e-3, min_quant_size=0)
    train(m, opt, 2)
    x, y = data()
    opt.zero_grad()
    loss_fn(m, x, y).backward()
    m[2].weight.grad[0, 0] = float("nan")
    opt.step()
    for i, p in enumerate(m.parameters()):
        st = opt.state[p]
        finite = all(torch.isfinite(v.dequantize() if isinstance(v, QState) else v).all() for v in st.values())
        assert finite == (p is not m[2].weight)
        assert torch.isfinite(p).all() == (p is not m[2].weight)


def test_skip_nonfinite_option_skips_the_whole_step_on_device():
    m = mlp()
    opt = bridge.AdamW8bit(m.parameters(), lr=1e-3, min_quant_size=0, skip_nonfinite=True)
    train(m, opt, 2)
    x, y = data()
    opt.zero_grad()
    loss_fn(m, x, y).backward()
    m[2].weight.grad[0, 0] = float("inf")
    params_before = [p.detach().clone() for p in m.parameters()]
    state_before = state_snapshot(opt)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), params_before))
    assert snapshots_equal(state_snapshot(opt), state_before)
    train(m, opt, 2)  # finite steps go on
    assert opt.state[m[0].weight]["step"].item() == 4


def test_bf16_params_and_bf16_default_dtype():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        m = mlp(dtype=torch.bfloat16)
        opt = bridge.AdamW8bit(m.parameters(), lr=1e-3, min_quant_size=0)
        x, y = data()
        losses = train(m, opt, 20, x=x.bfloat16(), y=y.bfloat16())
    finally:
        torch.set_default_dtype(old)
    assert losses[-1] < losses[0]
    st = opt.state[m[0].weight]
    assert st["step"].dtype == torch.float32
    assert st["exp_avg"].codes.dtype == torch.uint8 and st["exp_avg"].scale.dtype == torch.float32
    assert opt.state[m[0].bias]["exp_avg"].dtype == torch.float32  # fp32 math and state, not bf16
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())


@pytest.mark.parametrize("change, says", [
    ("cast", r"\(torch.bfloat16\) holds \['exp_avg', 'exp_avg_sq'\] where the group now keeps \['exp_avg', "
             r"'exp_avg_sq', 'param_correction'\]"),
    ("state_format", r"stores 'exp_avg' as block .*dynamic8.* where the group now keeps block .*dynamic4"),
    ("block_size", r"stores 'exp_avg' as block \{'block_size': 256.* where the group now keeps block \{'block_size': 64"),
    ("amsgrad", r"where the group now keeps \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'\]"),
    ("mapping", r"stores 'exp_avg_sq' as block .*dynamic8_sqrt.* where the group now keeps rank1"),
])
def test_a_state_layout_changed_after_creation_is_refused_before_anything_moves(change, says):
    """States keep the layout they were made with: a param cast to bfloat16 under
    param_correction=True (it would step on without a correction) or a group's storage option
    changed after the states exist is refused at the next step, naming both layouts and the
    fix, with params and states untouched."""
    m = mlp()
    fmt = {"exp_avg": "8bit", "exp_avg_sq": "8bit"}
    opt = bridge.AdamW(m.parameters(), lr=1e-3, min_quant_size=0, state_format=fmt,
                       param_correction=(change == "cast"))
    train(m, opt, 2)
    if change == "cast":
        m.bfloat16()
    elif change == "state_format":
        opt.param_groups[0]["state_format"] = "4bit"
    elif change == "block_size":
        opt.param_groups[0]["block_size"] = 64
    elif change == "amsgrad":
        opt.param_groups[0]["amsgrad"] = True
    else:
        opt.param_groups[0]["state_format"]["exp_avg_sq"] = "4bit"  # the group's own mapping, changed in place
    before = [p.detach().clone() for p in m.parameters()]
    states = {k: v.clone() for k, v in opt.state_dict()["state"][0].items() if torch.is_tensor(v)}
    x, y = data()
    loss_fn(m, x.to(before[0].dtype), y.to(before[0].dtype)).float().backward()
    with pytest.raises(ValueError, match=says) as err:
        opt.step()
    assert "set these options at construction" in str(err.value) and "cast the model before" in str(err.value)
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert all(torch.equal(opt.state_dict()["state"][0][k], v) for k, v in states.items())


def test_a_cast_that_keeps_the_layout_steps_on_as_a_fresh_optimizer_would():
    """Without param_correction a param's states do not depend on its dtype: a model cast to
    bfloat16 after its states exist steps on exactly as an optimizer built on the cast model
    and loaded with the same states."""
    m = mlp()
    opt = bridge.AdamW8bit(m.parameters(), lr=1e-3, min_quant_size=0)
    train(m, opt, 2)
    twin = mlp().bfloat16()
    with torch.no_grad():
        for a, b in zip(twin.parameters(), m.parameters()):
            a.copy_(b)
    twin_opt = bridge.AdamW8bit(twin.parameters(), lr=1e-3, min_quant_size=0)
    twin_opt.load_state_dict(opt.state_dict())
    m.bfloat16()
    x, y = data()
    for model, o in ((m, opt), (twin, twin_opt)):
        train(model, o, 3, x=x.bfloat16(), y=y.bfloat16())
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), twin.parameters()))
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())


def test_bf16_stochastic_rounding_resumes_bit_for_bit_and_moves_tiny_updates():
    def run(steps, resume_at=None):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
        opt = bridge.AdamW8bit([p], lr=1e-4, min_quant_size=0, bf16_stochastic_round=True)
        g = torch.Generator().manual_seed(1)
        for i in range(steps):
            if i == resume_at:
                buf = io.BytesIO()
                torch.save({"p": p.detach(), "opt": opt.state_dict()}, buf)
                buf.seek(0)
                ck = torch.load(buf, weights_only=True)
                p = torch.nn.Parameter(ck["p"].clone())
                opt = bridge.AdamW8bit([p], lr=1e-4, min_quant_size=0, bf16_stochastic_round=True)
                opt.load_state_dict(ck["opt"])
            p.grad = torch.randn(64, 64, generator=g).bfloat16()
            opt.step()
        return p.detach()

    full, resumed = run(8), run(8, resume_at=4)
    assert torch.equal(full.view(torch.int16), resumed.view(torch.int16))
    # lr 1e-4 is far below bf16 resolution for |p|~1 (2^-8): round-to-nearest would never move
    torch.manual_seed(0)
    start = torch.randn(64, 64).bfloat16()
    assert (full != start).float().mean().item() > 0.05


@pytest.mark.parametrize("cls,kw", [(bridge.AdamW8bit, {}), (bridge.AdamW4bit, {}),
                                    (bridge.AdamW4bit, {"rank1_normalization": False}), (bridge.AdamWFp8, {}),
                                    (bridge.Adam8bit, {}), (bridge.Lion8bit, {})],
                         ids=["AdamW8bit", "AdamW4bit", "AdamW4bit-block", "AdamWFp8", "Adam8bit", "Lion8bit"])
def test_backends_train_bit_for_bit_the_same(cls, kw, monkeypatch):
    """The native kernel and the eager torch backend are two implementations of one
    transition: 30 training steps give the same params and states, bit for bit."""
    if not kernels_native.available():
        pytest.skip("no C compiler")
    x, y = data(n=128)
    runs = {}
    for backend in ("native", "eager"):
        monkeypatch.setenv("LOWBIT_TREE_BACKEND", backend)
        m = mlp()
        opt = cls(m.parameters(), lr=3e-3, min_quant_size=0, **kw)
        runs[backend] = (m, train(m, opt, 30, x=x, y=y), opt)
    (m1, l1, o1), (m0, l0, o0) = runs["native"], runs["eager"]
    assert l1 == l0
    for p1, p0 in zip(m1.parameters(), m0.parameters()):
        assert torch.equal(p1, p0)
        s1, s0 = o1.state[p1], o0.state[p0]
        assert s1["step"].item() == s0["step"].item() == 30
        for name, v1 in s1.items():
            v0 = s0[name]
            assert torch.equal(v1, v0)  # a record: every part, bit for bit
