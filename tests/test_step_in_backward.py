"""bridge.step_in_backward: each param steps in its post-accumulate-grad hook and its gradient is
freed there. Checked against ``opt.step()`` on a deep copy of the model fed the same batches:
params and every state (codes and scales, step counts) bit for bit, for every optimizer family;
the gradients never coexist; what it refuses; the handle's removal. FSDP2 at 2 ranks: a worker
in ``fsdp_workers.py`` (slow)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import bridge
import lowbit_tree as lt
from bridge import QState


class Net(nn.Module):
    """Two param groups' worth of layers, one used twice (its hook must fire once per backward,
    after both uses) and one used only on even steps (its step count falls behind the others,
    so ``opt.step()`` batches the group by two step counts)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.inp = nn.Linear(24, 160)
        self.shared = nn.Linear(160, 160)
        self.sometimes = nn.Linear(160, 160)
        self.out = nn.Linear(160, 3)
        self.to(dtype)

    def forward(self, x, step):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        if step % 2 == 0:
            h = h + torch.tanh(self.sometimes(h))
        return self.out(h).float().square().mean()


def groups(model):
    """Two groups: the stochastic-rounding key of a param of the second counts the first's params."""
    first = [model.inp.weight, model.inp.bias, model.shared.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first}, {"params": rest, "lr": 3e-3}]


CASES = {
    "AdamW8bit": (bridge.AdamW8bit, {}),
    "AdamW4bit": (bridge.AdamW4bit, {}),  # rank-1 second moments
    "AdamW4bit-block": (bridge.AdamW4bit, {"rank1_normalization": False}),
    "AdamW-fp32": (bridge.AdamW, {"amsgrad": True}),
    "Lion8bit": (bridge.Lion8bit, {}),
    "SGD8bit-momentum": (bridge.SGD8bit, {"momentum": 0.9, "nesterov": True}),
    "AdEMAMix8bit": (bridge.AdEMAMix8bit, {"t_alpha": 4, "t_beta3": 4}),
    "AdEMAMix4bit": (bridge.AdEMAMix4bit, {}),
    "AdamW8bit-bf16-sr": (bridge.AdamW8bit, {"bf16_stochastic_round": True}),
    "Lion4bit-bf16-sr": (bridge.Lion4bit, {"bf16_stochastic_round": True}),
}


def make(case):
    cls, kw = CASES[case]
    dtype = torch.bfloat16 if kw.get("bf16_stochastic_round") else torch.float32
    torch.manual_seed(0)
    model = Net(dtype)
    ref = copy.deepcopy(model)
    kw = dict(lr=1e-2, min_quant_size=1, block_size=64, **kw)
    return model, ref, cls(groups(model), **kw), cls(groups(ref), **kw)


def batch(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 24, generator=g).to(dtype)


def bits(t):
    t = t.detach()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


def assert_same(model, ref, opt, ref_opt):
    """Params, and every state of every param (a quantized state's parts, each step count), bit for bit."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
        st, rst = opt.state[p], ref_opt.state[q]
        assert sorted(st) == sorted(rst), name
        for k in st:
            a, b = st[k], rst[k]
            if isinstance(a, QState):
                assert isinstance(b, QState) and sorted(a.parts) == sorted(b.parts), (name, k)
                for part in a.parts:
                    assert torch.equal(bits(a.parts[part]), bits(b.parts[part])), (name, k, part)
            else:
                assert a.dtype == b.dtype and torch.equal(a, b), (name, k)


def iterate(model, ref, opt, ref_opt, step):
    """One float32 iteration of both: ``model``'s steps in backward (``opt.step()`` ends it), and
    backward then ``ref_opt.step()`` on the reference."""
    x = batch(step, torch.float32)
    model(x, step).backward()
    opt.step()
    ref(x, step).backward()
    ref_opt.step()
    ref_opt.zero_grad()


def live_gradient_probe(model):
    """A post-accumulate-grad hook on every param, registered before step_in_backward's so it
    runs first: it records how many params hold a gradient at that moment."""
    seen = []
    params = list(model.parameters())

    def probe(p):
        seen.append(sum(q.grad is not None for q in params))

    handles = [p.register_post_accumulate_grad_hook(probe) for p in params]
    return seen, handles


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_bits_as_opt_step(case):
    """5 iterations with an LR schedule: the params and states of step_in_backward equal those of
    opt.step() on a deep copy, bit for bit (so opt.step() while the hooks are on stepped nothing:
    a second step would differ). Every gradient is freed by the end of backward, and when a
    param's hook runs it is the only param holding a gradient."""
    model, ref, opt, ref_opt = make(case)
    dtype = next(model.parameters()).dtype
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    seen, probes = live_gradient_probe(model)
    handle = bridge.step_in_backward(model, opt)
    for step in range(5):
        x = batch(step, dtype)
        model(x, step).backward()
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        sched.step()
        ref(x, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        assert_same(model, ref, opt, ref_opt)
    assert float(opt.state[model.sometimes.weight]["step"]) == 3 and float(opt.state[model.out.weight]["step"]) == 5
    assert seen and set(seen) == {1}, seen
    # 6 params every step, 2 more on even steps: each hook once per backward (the shared layer too)
    assert len(seen) == 5 * 6 + 3 * 2
    handle.remove()
    for h in probes:
        h.remove()


def test_group_values_changed_between_steps_reach_the_steps_in_backward():
    """The steps in backward remember each group's split of its values (one per param would
    cost host time per param) only while the values are the same: betas and weight decay
    replaced, a group's epsilon written as a tensor and changed in place, all between
    iterations, give the bits of opt.step() given the same changes."""
    model, ref, opt, ref_opt = make("AdamW8bit")
    ref_opt._pure_kwargs = False  # the reference splits its groups afresh at every step
    for o in (opt, ref_opt):
        o.param_groups[1]["eps"] = torch.tensor(1e-8, dtype=torch.float64)
    handle = bridge.step_in_backward(model, opt)
    for step in range(4):
        if step == 2:
            for o in (opt, ref_opt):
                o.param_groups[0]["betas"] = (0.5, 0.9)
                o.param_groups[1]["weight_decay"] = 0.5
                o.param_groups[1]["eps"].fill_(1e-2)
        iterate(model, ref, opt, ref_opt, step)
        assert_same(model, ref, opt, ref_opt)
    handle.remove()


def test_muon_same_bits_as_opt_step():
    """Muon (Newton-Schulz per matrix; AdamW groups for the rest): the same bits too."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)

    def muon(m):
        return bridge.Muon8bit(bridge.muon_param_groups(m, exclude=("out",)), lr=1e-2, min_quant_size=1, block_size=64)

    opt, ref_opt = muon(model), muon(ref)
    with bridge.step_in_backward(model, opt):
        for step in range(3):
            iterate(model, ref, opt, ref_opt, step)
    assert_same(model, ref, opt, ref_opt)


def test_remove_restores_opt_step_and_plans_coexist():
    """After remove(): backward leaves gradients, opt.step() steps (from the per-param plans'
    step counts to the whole group's plan) and still equals the reference; registering again
    switches back. A state dict loaded while the hooks are on (new param-group dicts) is
    followed."""
    model, ref, opt, ref_opt = make("AdamW8bit")
    handle = bridge.step_in_backward(model, opt)

    def both(step, hooked):
        x = batch(step, torch.float32)
        model(x, 0).backward()
        assert all((p.grad is None) == hooked for p in model.parameters())
        opt.step()
        opt.zero_grad()
        ref(x, 0).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_same(model, ref, opt, ref_opt)

    both(0, True)
    opt.load_state_dict(opt.state_dict())
    both(1, True)
    handle.remove()
    handle.remove()  # idempotent
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    both(2, False)
    both(3, False)
    with bridge.step_in_backward(model.parameters(), opt):
        both(4, True)
    both(5, False)


def test_custom_transform_needs_the_promise():
    """A plain LowBitOptimizer runs a transformation the helper cannot see into: one with global
    norm clipping stepped per param would clip each param by its own norm. It is refused unless
    per_param_transform=True; with the promise, a per-param transformation gives opt.step()'s bits."""
    def clipped(lr):
        return lt.chain(lt.clip_by_global_norm(1e-3), lt.adamw(lr, 0.9, 0.999, 1e-8, 0.0, state_format="8bit",
                                                               min_quant_size=1))

    model = Net()
    opt = bridge.LowBitOptimizer(model.parameters(), clipped, {"lr": 1e-2})
    with pytest.raises(ValueError, match="per_param_transform=True"):
        bridge.step_in_backward(model, opt)

    def plain(lr):
        return lt.adamw(lr, 0.9, 0.999, 1e-8, 0.0, state_format="8bit", min_quant_size=1)

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = bridge.LowBitOptimizer(model.parameters(), plain, {"lr": 1e-2})
    ref_opt = bridge.LowBitOptimizer(ref.parameters(), plain, {"lr": 1e-2})
    with bridge.step_in_backward(model, opt, per_param_transform=True):
        for step in range(2):
            model(batch(step, torch.float32), 0).backward()
            opt.step()
            ref(batch(step, torch.float32), 0).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert_same(model, ref, opt, ref_opt)


def no_hooks(model):
    return all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_refused_at_registration():
    """Each refusal raises before any hook is registered, naming what is wrong."""
    model = Net()
    params = list(model.parameters())
    with pytest.raises(TypeError, match="LowBitOptimizer"):
        bridge.step_in_backward(model, torch.optim.AdamW(params))
    with pytest.raises(ValueError, match="skip_nonfinite"):
        bridge.step_in_backward(model, bridge.AdamW8bit([{"params": params[:2], "skip_nonfinite": True},
                                                        {"params": params[2:]}]))
    with pytest.raises(ValueError, match=r"not in AdamW8bit; give the optimizer's params only"):
        bridge.step_in_backward(model, bridge.AdamW8bit(params[1:]))
    with pytest.raises(ValueError, match="not among the params given"):
        bridge.step_in_backward(params[1:], bridge.AdamW8bit(params))
    with pytest.raises(ValueError, match="no params"):
        bridge.step_in_backward([], bridge.AdamW8bit(params))
    model.inp.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="does not require grad"):
        bridge.step_in_backward(model, bridge.AdamW8bit(params))
    assert no_hooks(model)
    # frozen params left out of both: accepted
    trainable = [p for p in params if p.requires_grad]
    opt = bridge.AdamW8bit(trainable)
    handle = bridge.step_in_backward(trainable, opt)
    with pytest.raises(RuntimeError, match="already steps in backward"):
        bridge.step_in_backward(trainable, opt)
    handle.remove()
    assert no_hooks(model)


def test_distributed_data_parallel_is_refused(tmp_path):
    """DDP averages gradients after the post-accumulate-grad hooks: each replica would step on
    its own gradient. A DDP module is refused before any hook is registered."""
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = Net()
        ddp = DistributedDataParallel(model)
        with pytest.raises(ValueError, match="DistributedDataParallel averages gradients after.*FSDP2"):
            bridge.step_in_backward(ddp, bridge.AdamW8bit(ddp.parameters()))
        assert no_hooks(model)
    finally:
        dist.destroy_process_group()


def test_refused_while_on():
    """While the hooks are on: a second backward before opt.step() (accumulation) raises at the
    first param it reaches; opt.step(closure) raises; a gradient set by hand makes opt.step()
    raise instead of being skipped; skip_nonfinite turned on afterwards raises in the hook.
    None of them steps anything twice."""
    model, ref, opt, ref_opt = make("AdamW8bit")
    x = batch(0, torch.float32)
    with bridge.step_in_backward(model, opt):
        model(x, 1).backward()
        with pytest.raises(RuntimeError, match="second backward.*left in .grad: opt.zero_grad.. drops them"):
            model(x, 1).backward()
        with pytest.raises(RuntimeError, match="hold a gradient.*opt.zero_grad.. drops them"):
            opt.step()  # the gradient the refused backward left behind
        opt.zero_grad()
        opt.step()
        with pytest.raises(RuntimeError, match="add_param_group.*would never step.*handle.remove"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        assert len(opt.param_groups) == 2
        with pytest.raises(RuntimeError, match="closure"):
            opt.step(lambda: model(x, 1))
        model.out.weight.grad = torch.ones_like(model.out.weight)
        with pytest.raises(RuntimeError, match="hold a gradient"):
            opt.step()
        model.out.weight.grad = None
        opt.param_groups[1]["skip_nonfinite"] = True
        with pytest.raises(RuntimeError, match="skip_nonfinite"):
            model(x, 1).backward()
        opt.param_groups[1]["skip_nonfinite"] = False
    # the first backward stepped every param it reached; nothing after it stepped anything
    ref(x, 1).backward()
    ref_opt.step()
    assert_same(model, ref, opt, ref_opt)


# ----------------------------------------------------------------------------
# FSDP2
# ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_fsdp2_same_bits_as_opt_step_at_2_ranks():
    """FSDP2 at 2 ranks (gloo; uneven shards): step_in_backward against opt.step() on a sharded
    deep copy fed the same batches, for AdamW 8-bit / 4-bit rank-1 (an all-reduce of maxima
    inside the hooks) / fp32, Lion, SGD with momentum, AdEMAMix, Muon and bf16 params with
    stochastic rounding: losses, params and every gathered state bit for bit; each sharded
    param's hook runs once per backward, as the only param holding a gradient; FSDP2's
    accumulation (set_requires_gradient_sync(False) on the first micro-batch) steps once."""
    import fsdp_workers as W

    W.launch(W.step_in_backward_worker, 2)
