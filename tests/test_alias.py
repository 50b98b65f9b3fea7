"""Aliases (adam, adamw, lion, sgd) against independent references.

References: a float64 numpy textbook implementation written from the papers /
torch docs (not from lowbit_tree), and torch.optim itself.
"""
import math

import numpy as np
import pytest
import torch

from lowbit_tree.alias import adagrad, adam, adamw, lion, rmsprop, sgd
from lowbit_tree.update import apply_updates



@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add barrier waits (60x slower bucketize
    on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


QUANTIZED = ["8bit", "4bit", "fp8", "8bit_bnb"]
ALL_FORMATS = ["fp32", "bf16"] + QUANTIZED


# ---------------------------------------------------------------------------
# float64 textbook references (one step on numpy arrays, state dict per param)
# ---------------------------------------------------------------------------
def ref_adam(p, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, decoupled=False, amsgrad=False):
    if wd and not decoupled:
        g = g + wd * p
    m = st.get("m", np.zeros_like(p)) * b1 + (1 - b1) * g
    v = st.get("v", np.zeros_like(p)) * b2 + (1 - b2) * g * g
    st["m"], st["v"] = m, v
    if amsgrad:
        st["vmax"] = np.maximum(st.get("vmax", np.zeros_like(p)), v)
        v = st["vmax"]
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    if decoupled:
        p = p * (1 - lr * wd)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps)


def ref_lion(p, g, st, t, lr, b1=0.9, b2=0.99, wd=0.0):
    m = st.get("m", np.zeros_like(p))
    c = b1 * m + (1 - b1) * g
    st["m"] = b2 * m + (1 - b2) * g
    return p * (1 - lr * wd) - lr * np.sign(c)


def ref_sgd(p, g, st, t, lr, momentum=0.0, nesterov=False, wd=0.0):
    g = g + wd * p
    if momentum:
        buf = g if "buf" not in st else momentum * st["buf"] + g
        st["buf"] = buf
        g = g + momentum * buf if nesterov else buf
    return p - lr * g


# ---------------------------------------------------------------------------
# a least-squares problem: params {"w": (16, 8), "b": (8,)}
# ---------------------------------------------------------------------------
def make_problem(seed=0, n=64, din=16, dout=8):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, din))
    y = rng.standard_normal((n, dout))
    p0 = {"w": rng.standard_normal((din, dout)) * 0.5, "b": rng.standard_normal(dout) * 0.5}
    return x, y, p0


def grads_np(p, x, y):
    r = (x @ p["w"] + p["b"] - y) * (2 / len(x))
    return {"w": x.T @ r, "b": r.sum(0)}


def grad_sequence(steps, seed=1):
    """Parameter-independent gradients: Lion's sign() is discontinuous, so on a
    feedback problem one float32-vs-float64 tie flips a step; a fixed sequence
    compares the arithmetic itself."""
    rng = np.random.default_rng(seed)
    return [{"w": rng.standard_normal((16, 8)), "b": rng.standard_normal(8)} for _ in range(steps)]


def run_reference(step_fn, steps=100, fixed_grads=False, **hp):
    x, y, p = make_problem()
    st = {k: {} for k in p}
    seq = grad_sequence(steps) if fixed_grads else None
    for t in range(1, steps + 1):
        g = seq[t - 1] if fixed_grads else grads_np(p, x, y)
        p = {k: step_fn(p[k], g[k], st[k], t, **hp) for k in p}
    return p


def run_ours(tx, steps=100, dtype=torch.float32, fixed_grads=False):
    x, y, p0 = make_problem()
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    params = {k: torch.tensor(v, dtype=dtype) for k, v in p0.items()}
    state = tx.init(params)
    seq = grad_sequence(steps) if fixed_grads else None
    for i in range(steps):
        if fixed_grads:
            g = {k: torch.tensor(v, dtype=dtype) for k, v in seq[i].items()}
        else:
            pw, pb = params["w"].float(), params["b"].float()
            r = (xt @ pw + pb - yt) * (2 / len(xt))
            g = {"w": (xt.T @ r).to(dtype), "b": r.sum(0).to(dtype)}
        updates, state = tx.update(g, state, params)
        params = apply_updates(params, updates)
    return {k: v.double().numpy() for k, v in params.items()}


def run_torch_optim(make_opt, steps=100):
    x, y, p0 = make_problem()
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    w = torch.tensor(p0["w"], dtype=torch.float32, requires_grad=True)
    b = torch.tensor(p0["b"], dtype=torch.float32, requires_grad=True)
    opt = make_opt([w, b])
    for _ in range(steps):
        opt.zero_grad()
        r = (xt @ w + b - yt) * (2 / len(xt))
        w.grad, b.grad = (xt.T @ r).detach(), r.sum(0).detach()
        opt.step()
    return {"w": w.detach().double().numpy(), "b": b.detach().double().numpy()}


def rel_err(a, b):
    return max(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max() for k in b)


LR = 1e-2
CASES = {
    "adam": (lambda f: adam(LR, state_format=f), ref_adam, dict(lr=LR)),
    "adam_amsgrad": (lambda f: adam(LR, amsgrad=True, state_format=f), ref_adam, dict(lr=LR, amsgrad=True)),
    "adamw": (lambda f: adamw(LR, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, state_format=f), ref_adam,
              dict(lr=LR, b1=0.8, b2=0.99, eps=1e-6, wd=0.1, decoupled=True)),
    "lion": (lambda f: lion(LR / 10, weight_decay=0.5, state_format=f), ref_lion, dict(lr=LR / 10, wd=0.5, fixed_grads=True)),
    "sgd": (lambda f: sgd(LR, state_format=f), ref_sgd, dict(lr=LR)),
    "sgd_momentum": (lambda f: sgd(LR, momentum=0.9, weight_decay=0.01, state_format=f), ref_sgd,
                     dict(lr=LR, momentum=0.9, wd=0.01)),
    "sgd_nesterov": (lambda f: sgd(LR, momentum=0.9, nesterov=True, state_format=f), ref_sgd,
                     dict(lr=LR, momentum=0.9, nesterov=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp32_matches_float64_textbook(name):
    make_tx, ref, hp = CASES[name]
    ours = run_ours(make_tx("fp32"), fixed_grads=hp.get("fixed_grads", False))
    expected = run_reference(ref, **hp)
    err = rel_err(ours, expected)
    # float32 arithmetic over 100 steps: measured <= 2e-6 (lion's sign makes it exact up to decay rounding)
    assert err < 5e-6, err


TORCH_CASES = {
    "adam": (lambda: adam(LR, state_format="fp32"), lambda ps: torch.optim.Adam(ps, lr=LR)),
    "adam_amsgrad": (lambda: adam(LR, amsgrad=True, state_format="fp32"), lambda ps: torch.optim.Adam(ps, lr=LR, amsgrad=True)),
    "adamw": (lambda: adamw(LR, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, state_format="fp32"),
              lambda ps: torch.optim.AdamW(ps, lr=LR, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "sgd": (lambda: sgd(LR, state_format="fp32"), lambda ps: torch.optim.SGD(ps, lr=LR)),
    "sgd_momentum": (lambda: sgd(LR, momentum=0.9, weight_decay=0.01, state_format="fp32"),
                     lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov": (lambda: sgd(LR, momentum=0.9, nesterov=True, state_format="fp32"),
                     lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, nesterov=True)),
    "rmsprop": (lambda: rmsprop(LR, state_format="fp32"), lambda ps: torch.optim.RMSprop(ps, lr=LR)),
    "rmsprop_centered": (lambda: rmsprop(LR, weight_decay=0.01, centered=True, state_format="fp32"),
                         lambda ps: torch.optim.RMSprop(ps, lr=LR, weight_decay=0.01, centered=True)),
    "rmsprop_momentum": (lambda: rmsprop(LR, momentum=0.9, state_format="fp32"),
                         lambda ps: torch.optim.RMSprop(ps, lr=LR, momentum=0.9)),
    "adagrad": (lambda: adagrad(LR, state_format="fp32"), lambda ps: torch.optim.Adagrad(ps, lr=LR)),
    "adagrad_decay_init": (
        lambda: adagrad(LR, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1, state_format="fp32"),
        lambda ps: torch.optim.Adagrad(ps, lr=LR, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
}


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
def test_fp32_matches_torch_optim(name):
    make_tx, make_opt = TORCH_CASES[name]
    # RMSprop near this problem's optimum steps by g / sqrt(v) of vanishing gradients, which turns
    # float32 rounding differences into chaos (measured at 50 steps: 2.3e-7, centered 1.2e-7,
    # momentum 6.8e-7; at 100: 7e-4; alpha=0.9 at 50: 9e-4). Every option against torch.optim
    # on gradients that do not vanish: tests/test_rmsprop_adagrad.py.
    steps = 50 if name.startswith("rmsprop") else 100
    err = rel_err(run_ours(make_tx(), steps=steps), run_torch_optim(make_opt, steps=steps))
    assert err < 5e-6, err


# ---------------------------------------------------------------------------
# quantized states against the fp32 run
# ---------------------------------------------------------------------------
def _ls_problem(seed=0, n=256, din=64, dout=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, din, generator=g)
    y = x @ torch.randn(din, dout, generator=g) + 0.1 * torch.randn(n, dout, generator=g)
    return x, y


def _ls_run(tx, steps=100):
    x, y = _ls_problem()
    p = {"w": torch.zeros(x.shape[1], y.shape[1]), "b": torch.zeros(y.shape[1])}
    s = tx.init(p)
    for _ in range(steps):
        r = (x @ p["w"] + p["b"] - y) * (2 / len(x))
        u, s = tx.update({"w": x.T @ r, "b": r.sum(0)}, s, p)
        p = apply_updates(p, u)
    return p, ((x @ p["w"] + p["b"] - y) ** 2).mean().item()


LS_ALGOS = {
    "adam": lambda f: adam(1e-2, state_format=f, min_quant_size=0),
    "adamw": lambda f: adamw(1e-2, weight_decay=0.1, state_format=f, min_quant_size=0),
    "lion": lambda f: lion(1e-3, state_format=f, min_quant_size=0),
    "sgd": lambda f: sgd(1e-2, momentum=0.9, state_format=f, min_quant_size=0),
    "rmsprop": lambda f: rmsprop(1e-3, momentum=0.5, state_format=f, min_quant_size=0),
    "adagrad": lambda f: adagrad(1e-1, state_format=f, min_quant_size=0),
}
# Relative l2 distance to the fp32 params after 100 steps. Measured (max over
# adam/adamw/sgd, seed 0): bf16 3.9e-3, 8bit 3.8e-2, 8bit_bnb 3.6e-2,
# fp8 5.8e-2, 4bit 0.35; tolerance ~1.6-2.6x that. The order follows the maps'
# resolution near a block's maximum: bf16 2^-9; dynamic8 ~1-4%; e4m3 (3
# mantissa bits) ~6%; dynamic4 (15 levels, 0.21/0.44/0.66/0.89) 25-40%, and
# a deterministic full-batch problem accumulates these errors coherently.
LS_TOL = {"bf16": 1e-2, "8bit": 8e-2, "8bit_bnb": 8e-2, "fp8": 0.12, "4bit": 0.6}
# Loss after 100 steps relative to fp32's (measured: <= 1.02 except 4bit: 1.42
# for adam/adamw, 1.50 for sgd).
LS_LOSS_RATIO = {"bf16": 1.03, "8bit": 1.05, "8bit_bnb": 1.05, "fp8": 1.05, "4bit": 1.7}
_LS_FP32 = {}


@pytest.mark.parametrize("fmt", QUANTIZED + ["bf16"])
@pytest.mark.parametrize("algo", sorted(LS_ALGOS))
def test_low_precision_state_stays_close_to_fp32(algo, fmt):
    if algo not in _LS_FP32:
        _LS_FP32[algo] = _ls_run(LS_ALGOS[algo]("fp32"))
    ref, ref_loss = _LS_FP32[algo]
    p, loss = _ls_run(LS_ALGOS[algo](fmt))
    assert loss <= LS_LOSS_RATIO[fmt] * ref_loss, (loss, ref_loss)
    if algo == "lion":
        return  # sign(): near-zero momenta flip, so params differ by +-lr; the loss is the measure
    dist = torch.cat([(p[k] - ref[k]).flatten() for k in p]).norm() / torch.cat([ref[k].flatten() for k in p]).norm()
    assert dist <= LS_TOL[fmt], dist


# ---------------------------------------------------------------------------
# parabola and Rosenbrock (as optax's alias tests), every format
# ---------------------------------------------------------------------------
from lowbit_tree.schedule import cosine_decay_schedule  # noqa: E402

PARABOLA = {
    "adam": lambda f: adam(cosine_decay_schedule(0.1, 300, alpha=1e-3), state_format=f, min_quant_size=0),
    "adamw": lambda f: adamw(cosine_decay_schedule(0.1, 300, alpha=1e-3), weight_decay=0.0, state_format=f, min_quant_size=0),
    "lion": lambda f: lion(cosine_decay_schedule(0.05, 300, alpha=1e-3), b2=0.9, state_format=f, min_quant_size=0),
    "sgd": lambda f: sgd(0.05, momentum=0.9, state_format=f, min_quant_size=0),
}


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("algo", sorted(PARABOLA))
def test_parabola_reaches_optimum(algo, fmt):
    g = torch.Generator().manual_seed(1)
    target = torch.randn(8, 32, generator=g)
    p = torch.zeros(8, 32)
    tx = PARABOLA[algo](fmt)
    s = tx.init(p)
    for _ in range(300):
        u, s = tx.update(2 * (p - target), s, p)
        p = apply_updates(p, u)
    assert (p - target).abs().max() < 1e-2


def _rosenbrock_grad(p):
    x, y = p[0], p[1]
    return torch.stack([-2 * (1 - x) - 400 * x * (y - x * x), 200 * (y - x * x)])


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rosenbrock_reaches_optimum(fmt):
    """32 Rosenbrock problems in a (2, 32) param: row 0 holds the x's, row 1 the y's
    (one quantization block per row). Optimum (1, 1). Measured max error after
    1500 steps: <= 3e-6 except 4bit 1.8e-4."""
    g = torch.Generator().manual_seed(0)
    p = 0.2 * torch.rand(2, 32, generator=g)
    tx = adam(cosine_decay_schedule(0.05, 1500, alpha=0.01), b2=0.99, state_format=fmt, min_quant_size=0)
    s = tx.init(p)
    for _ in range(1500):
        u, s = tx.update(_rosenbrock_grad(p), s, p)
        p = apply_updates(p, u)
    assert (p - 1).abs().max() < 1e-3


# ---------------------------------------------------------------------------
# robustness: heavy-tailed and intermittent gradients
# ---------------------------------------------------------------------------
def _heavy_tailed_sequence(steps=100, rows=32, cols=256, seed=0, bursty=False):
    """Values spanning 1e-8..1 within every row; whole rows exactly zero at
    random steps (embedding rows absent from a batch). ``bursty``: most entries
    1e-12..1e-4, rare (0.2%) entries +-1 -- a big gradient once, then tiny ones."""
    g = torch.Generator().manual_seed(seed)
    seq = []
    for _ in range(steps):
        x = 10 ** (-8 * torch.rand(rows, cols, generator=g))
        x = x * torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
        if bursty:
            x = torch.where(torch.rand(rows, cols, generator=g) < 0.002, x.sign(), x * 1e-4)
        present = torch.rand(rows, 1, generator=g) >= (0.7 if bursty else 0.5)
        seq.append(x * present)
    return seq


def _largest_step(tx, seq):
    p = torch.zeros(seq[0].shape)  # 32 x 256 = 8192 >= min_quant_size: quantized
    s = tx.init(p)
    worst = torch.zeros(())
    for g in seq:
        u, s = tx.update(g, s, p)  # gradients do not depend on p: compare the steps themselves
        worst = torch.maximum(worst, u.abs().max())
    assert torch.isfinite(worst)
    return worst.item()


_ROBUST_REF = {}


@pytest.mark.parametrize("bursty", [False, True], ids=["iid", "bursty"])
@pytest.mark.parametrize(
    "fmt",
    ["bf16", "8bit", "4bit", "fp8", "4bit_rank1",
     pytest.param("8bit_bnb", marks=pytest.mark.xfail(strict=True, reason=(
         "bitsandbytes' unsigned map stores v (not sqrt v) and rounds small v to 0: "
         "measured 1.5e4x (iid) and 3.2e3x (bursty) the largest fp32 step")))],
)
def test_no_step_exceeds_3x_largest_fp32_adam_step(fmt, bursty):
    """Measured ratios (largest quantized step / largest fp32 step, 100 steps, 32x256):
    iid: bf16 1.00, 8bit 1.82, 4bit 0.95, fp8 1.02, 4bit+rank1 1.03;
    bursty: bf16 1.00, 8bit 1.78, 4bit 0.76, fp8 1.15, 4bit+rank1 0.97."""
    seq = _heavy_tailed_sequence(bursty=bursty)
    if bursty not in _ROBUST_REF:
        _ROBUST_REF[bursty] = _largest_step(adam(1.0, state_format="fp32"), seq)
    state_format, rank1 = ("4bit", True) if fmt == "4bit_rank1" else (fmt, False)
    worst = _largest_step(adam(1.0, state_format=state_format, rank1_normalization=rank1), seq)
    assert worst <= 3 * _ROBUST_REF[bursty], worst / _ROBUST_REF[bursty]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("algo", ["adam", "adamw", "lion", "sgd"])
def test_always_zero_gradient_leaves_param_unchanged(algo, fmt):
    torch.manual_seed(0)
    make = {
        "adam": lambda: adam(0.1, state_format=fmt, min_quant_size=0),
        "adamw": lambda: adamw(0.1, weight_decay=0.5, state_format=fmt, min_quant_size=0),
        "lion": lambda: lion(0.1, state_format=fmt, min_quant_size=0),
        "sgd": lambda: sgd(0.1, momentum=0.9, nesterov=True, state_format=fmt, min_quant_size=0),
    }[algo]
    tx = make()
    params = {"frozen": torch.randn(8, 32), "live": torch.randn(8, 32)}
    frozen0 = params["frozen"].clone()
    s = tx.init(params)
    for i in range(20):
        g = {"frozen": torch.zeros(8, 32), "live": torch.randn(8, 32)}
        u, s = tx.update(g, s, params)
        params = apply_updates(params, u)
    assert torch.isfinite(params["frozen"]).all() and torch.isfinite(params["live"]).all()
    if algo == "adamw":  # decay only: p * (1 - lr*wd)^20, computed as p - lr*wd*p each step
        expected = frozen0.double() * (1 - 0.05) ** 20
        torch.testing.assert_close(params["frozen"].double(), expected, rtol=1e-5, atol=0)
    else:
        assert torch.equal(params["frozen"], frozen0)


@pytest.mark.parametrize("fmt", ["fp32", "8bit", "4bit"])
def test_bf16_params_and_grads(fmt):
    """bf16 params: updates come back float32 (rounded once, by apply_updates),
    params stay bf16, states keep their format, and the run tracks the fp32-param run."""
    x, y = _ls_problem()

    def run(dtype):
        tx = adamw(1e-2, state_format=fmt, min_quant_size=0)
        p = {"w": torch.zeros(x.shape[1], y.shape[1], dtype=dtype), "b": torch.zeros(y.shape[1], dtype=dtype)}
        s = tx.init(p)
        kinds0 = [type(l) for l in __import__("optree").tree_leaves(s)]
        for _ in range(30):
            r = (x @ p["w"].float() + p["b"].float() - y) * (2 / len(x))
            g = {"w": (x.T @ r).to(dtype), "b": r.sum(0).to(dtype)}
            u, s = tx.update(g, s, p)
            assert all(u[k].dtype == torch.float32 for k in u)
            p = apply_updates(p, u)
            assert all(p[k].dtype == dtype for k in p)
        assert [type(l) for l in __import__("optree").tree_leaves(s)] == kinds0
        return p

    p16, p32 = run(torch.bfloat16), run(torch.float32)
    for k in p32:
        dist = (p16[k].float() - p32[k]).norm() / p32[k].norm()
        assert dist < 0.05, (k, dist)  # bf16 param rounding (2^-9) over 30 steps of ~1e-2
