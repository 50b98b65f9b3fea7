"""The optimizers inside the real training stacks, and torch.optim's constructor contract.

- torch.optim's constructor arguments (``foreach``, ``fused``, ``capturable``,
  ``differentiable``, ``maximize``, ``(name, param)`` pairs, extra group keys) and the
  clear errors for a torch.optim user's mistakes, checked against torch.optim itself;
- torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with
  ``flatten_optimizer_state_dict`` on and off x ``full_state_dict`` x ``cpu_offload``
  (one process, no process group) and x ``broadcast_from_rank0`` (2 gloo ranks: a
  replicated model and an FSDP2 one, ``@pytest.mark.slow``);
- Hugging Face ``Trainer(optimizer_cls_and_kwargs=(bridge.AdamW8bit, {...}))``: train,
  checkpoint, resume, against an uninterrupted run, bit for bit;
- torchtitan's ``OptimizersContainer`` (flat FQN state dict, DCP save/load): one process, FSDP2 on 2
  ranks, FSDP2 + TP on a 2x2 mesh;
- accelerate's FSDP2 plugin (2 CPU ranks, gloo).

A client test is skipped, with the reason, when its library is not importable
(``pip install -e ".[clients]"`` installs the tested versions: transformers 5.24.0,
accelerate 1.15.0, torchtitan 0.3.0, all with torch 2.13.0). The snippets of
docs/guide/integrations.md are the code of these tests (tests/test_readme.py runs them too).

What would need a GPU (not run here; no GPU was lent to this work): Trainer with
``bf16=True`` / ``fp16=True`` mixed precision and its GradScaler, torchtitan's trainer
(its job configs, ``torch.compile`` and NCCL), accelerate with NCCL and
``CPUOffloadPolicy(pin_memory=True)``, and ``fused=True`` resolving to our CUDA (compiled
torch) kernels.
"""
from __future__ import annotations

import copy
import io
import math
import os
import warnings

import pytest
import torch

import bridge
from bridge import QState

NAMED = [bridge.Adam8bit, bridge.AdamW8bit, bridge.Adam4bit, bridge.AdamW4bit, bridge.AdamFp8, bridge.AdamWFp8,
         bridge.Lion8bit, bridge.Lion4bit, bridge.SGD8bit]


def net(seed=0):
    """Odd shapes: rows that are not a whole number of blocks, a 1-D bias."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(19, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))


def run(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 19, generator=g), torch.randn(8, 5, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def states(opt) -> list[dict]:
    """Every state of every param (in order) as plain tensors (codes as uint8 bits)."""
    from bridge.distributed import is_dtensor

    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = {}
            for name, v in opt.state[p].items():
                v = v.full_tensor() if is_dtensor(v) else v
                if isinstance(v, QState):  # a record of any kind: its format and every part's bits
                    st[name] = (v.label,) + tuple(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.clone()
                                                  for t in v.parts.values())
                else:
                    st[name] = v.detach().clone()
            out.append(st)
    return out


def assert_same_states(a, b):
    assert len(a) == len(b)
    for sa, sb in zip(a, b):
        assert sorted(sa) == sorted(sb)
        for k in sa:
            x, y = sa[k], sb[k]
            if isinstance(x, tuple):
                assert len(x) == len(y) and all(
                    (u == w) if isinstance(u, str) else (u.dtype == w.dtype and torch.equal(u, w)) for u, w in zip(x, y)
                ), k
            else:
                assert x.dtype == y.dtype and torch.equal(x, y), k


def same_params(m1, m2) -> bool:
    return all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


def kwargs_for(cls):
    return dict(momentum=0.9) if issubclass(cls, bridge.SGD) else {}


# ----------------------------------------------------------------------------
# torch.optim's constructor arguments
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [bridge.AdamW8bit, bridge.AdamW, bridge.Adam4bit, bridge.Lion8bit, bridge.SGD8bit])
@pytest.mark.parametrize("impl", [dict(foreach=True), dict(fused=True), dict(foreach=False, fused=False),
                                  dict(capturable=True)], ids=["foreach", "fused", "neither", "capturable"])
def test_implementation_arguments_are_kept_in_the_groups_and_change_no_bit(cls, impl):
    if issubclass(cls, bridge.SGD):
        impl = {k: v for k, v in impl.items() if k != "capturable"} or dict(foreach=None)  # torch's SGD has none
    m0, m1 = net(), net()
    o0 = cls(m0.parameters(), lr=1e-2, min_quant_size=0, **kwargs_for(cls))
    o1 = cls(m1.parameters(), lr=1e-2, min_quant_size=0, **kwargs_for(cls), **impl)
    for k, v in impl.items():
        assert o1.param_groups[0][k] is v
    run(m0, o0, 3)
    run(m1, o1, 3)
    assert same_params(m0, m1)
    assert_same_states(states(o0), states(o1))


@pytest.mark.parametrize("ours, theirs", [(bridge.AdamW8bit, torch.optim.AdamW), (bridge.Adam4bit, torch.optim.Adam),
                                          (bridge.SGD8bit, torch.optim.SGD)])
def test_groups_carry_torch_optim_keys(ours, theirs):
    ref = theirs(net().parameters(), lr=1e-3)
    opt = ours(net().parameters(), lr=1e-3)
    missing = set(ref.param_groups[0]) - set(opt.param_groups[0]) - {"decoupled_weight_decay"}
    assert not missing, missing


def test_fused_true_like_torch():
    """torch 2.13: fused=True is fine for CPU (and CUDA) params, an error for other devices at
    the first step (meta params construct: they are materialized later) and, at construction,
    together with foreach=True."""
    for make in (lambda ps, **k: torch.optim.AdamW(ps, **k), lambda ps, **k: bridge.AdamW8bit(ps, **k)):
        m = net()
        run(m, make(m.parameters(), fused=True), 1)  # CPU: accepted
        with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
            make(net().parameters(), fused=True, foreach=True)
    meta = [torch.nn.Parameter(torch.empty(3, 3, device="meta"))]
    theirs = torch.optim.AdamW(meta, fused=True)
    meta[0].grad = torch.empty(3, 3, device="meta")
    torchs_words = "`fused=True` requires all the params to be floating point Tensors"  # what torch's tests match
    with pytest.raises(RuntimeError, match=torchs_words):
        theirs.step()
    ours = bridge.AdamW8bit(meta, fused=True)
    with pytest.raises(RuntimeError, match=torchs_words):
        ours.step()
    with pytest.raises(RuntimeError, match=r"AdamW8bit: `fused=True` requires all the params to be .* on meta"):
        ours.step()


@pytest.mark.parametrize("cls", NAMED + [bridge.AdamW, bridge.Lion, bridge.SGD])
def test_differentiable_is_refused_clearly(cls):
    m = net()
    with pytest.raises(ValueError, match=f"{cls.__name__}: differentiable=True is not supported"):
        cls(m.parameters(), differentiable=True, **kwargs_for(cls))
    assert cls(m.parameters(), maximize=False, **kwargs_for(cls)).param_groups[0]["maximize"] is False


@pytest.mark.parametrize("ours,theirs,kw", [
    (bridge.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (bridge.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (bridge.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
], ids=["AdamW", "Adam-amsgrad", "SGD-nesterov"])
def test_maximize_matches_torch_optim_for_fp32_states(ours, theirs, kw):
    """maximize=True (in the constructor, then switched off in a group) follows
    torch.optim's optimizer step for step: float tolerance (our float order is
    the kernel's, torch's its own), and it ascends: the params move the other way."""
    torch.manual_seed(0)
    a, b = net(), net()
    b.load_state_dict(a.state_dict())
    o1 = ours(a.parameters(), maximize=True, state_format="fp32", **kw)
    o2 = theirs(b.parameters(), maximize=True, **kw)
    x, y = torch.randn(16, 19), torch.randn(16, 5)
    loss0 = torch.nn.functional.mse_loss(a(x), y).item()
    for step in range(20):
        if step == 10:
            assert torch.nn.functional.mse_loss(a(x), y).item() > loss0  # ascended
            for o in (o1, o2):
                o.param_groups[0]["maximize"] = False
        for m, o in ((a, o1), (b, o2)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)


def test_named_params_keep_param_names_in_the_state_dict_as_torch_does():
    m = net()
    ref = torch.optim.AdamW(m.named_parameters(), lr=1e-3)
    opt = bridge.AdamW8bit(m.named_parameters(), lr=1e-3, min_quant_size=0)
    run(m, opt, 2)
    names = [n for n, _ in m.named_parameters()]
    assert ref.state_dict()["param_groups"][0]["param_names"] == names
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == names
    m2 = copy.deepcopy(m)
    opt2 = bridge.AdamW8bit(m2.named_parameters(), lr=1e-3, min_quant_size=0)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["param_names"] == names
    assert_same_states(states(opt), states(opt2))
    with pytest.raises(ValueError, match="all optimizer param groups should be with/without names"):  # torch's rule
        opt2.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def test_groups_with_torchtitan_style_extra_keys_train_like_plain_groups():
    m0, m1 = net(), net()
    o0 = bridge.AdamW8bit(m0.parameters(), lr=1e-2, min_quant_size=0)
    named = list(m1.named_parameters())
    group = {"params": [p for _, p in named], "param_names": [n for n, _ in named], "fused": True, "foreach": False,
             "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    o1 = bridge.AdamW8bit([group], min_quant_size=0)
    run(m0, o0, 3)
    run(m1, o1, 3)
    assert same_params(m0, m1)
    assert o1.state_dict()["param_groups"][0]["param_names"] == group["param_names"]


@pytest.mark.parametrize("cls", NAMED)
def test_a_named_class_refuses_another_state_format(cls):
    base = {"Adam": bridge.Adam, "AdamW": bridge.AdamW, "Lion": bridge.Lion, "SGD": bridge.SGD}[
        cls.__name__.replace("8bit", "").replace("4bit", "").replace("Fp8", "")]
    other = "4bit" if cls._default_format != "4bit" else "8bit"
    m = net()
    with pytest.raises(ValueError, match=rf"{cls.__name__} stores '{cls._default_format}' states; "
                                         rf"state_format='{other}' conflicts .* bridge.{base.__name__}\(params, "
                                         rf"state_format='{other}'\)"):
        cls(m.parameters(), state_format=other, **kwargs_for(cls))
    same = cls(m.parameters(), state_format=cls._default_format, min_quant_size=0, **kwargs_for(cls))
    run(m, same, 1)
    assert {r.format for r in same.state_report()} - {"fp32"}  # its own format: quantized states
    # a param group still overrides it for its own params
    mixed = cls([{"params": [m[0].weight]}, {"params": [m[2].weight], "state_format": "fp32"}], min_quant_size=0,
                **kwargs_for(cls))
    run(m, mixed, 1)
    assert {r.format for r in mixed.state_report() if r.index == 1} == {"fp32"}


BAD = [
    (bridge.AdamW8bit, dict(lr="1e-3"), TypeError, r"lr must be a number .* got str '1e-3'; pass a number"),
    (bridge.AdamW8bit, dict(lr=float("nan")), ValueError, "invalid lr value nan"),
    (bridge.AdamW8bit, dict(lr=math.inf), ValueError, "invalid lr value inf"),
    (bridge.AdamW8bit, dict(lr=-1e-3), ValueError, "invalid lr value -0.001"),
    (bridge.AdamW8bit, dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),
    (bridge.AdamW8bit, dict(betas=(0.9,)), ValueError, r"betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
    (bridge.AdamW8bit, dict(betas=(0.9, 0.99, 0.999)), ValueError, "betas must be a pair"),
    (bridge.AdamW8bit, dict(betas=0.9), ValueError, "betas must be a pair"),
    (bridge.AdamW8bit, dict(betas=(0.9, 1.0)), ValueError, r"invalid betas\[1\] value 1.0: must be in \[0.0, 1.0\)"),
    (bridge.AdamW8bit, dict(betas=("0.9", 0.999)), TypeError, r"betas\[0\] must be a number"),
    (bridge.AdamW8bit, dict(eps=-1e-8), ValueError, "invalid eps value -1e-08"),
    (bridge.AdamW8bit, dict(weight_decay=-0.1), ValueError, "invalid weight_decay value -0.1"),
    (bridge.AdamW8bit, dict(weight_decay="0.1"), TypeError, "weight_decay must be a number"),
    (bridge.AdamW8bit, dict(amsgrad="yes"), TypeError, "amsgrad must be True or False"),
    (bridge.AdamW8bit, dict(fused="yes"), TypeError, "fused must be True, False or None"),
    (bridge.AdamW8bit, dict(min_quant_size=-1), ValueError, "min_quant_size must be an int >= 0"),
    (bridge.AdamW8bit, dict(block_size=0), ValueError, "block_size must be a positive int"),
    (bridge.AdamW, dict(state_format="3bit"), ValueError, "state_format must be one of"),
    (bridge.AdamW8bit, dict(bf16_stochastic_round=1), TypeError, "bf16_stochastic_round must be True or False"),
    (bridge.Lion8bit, dict(betas=(0.9, -0.1)), ValueError, r"invalid betas\[1\] value -0.1"),
    (bridge.Lion8bit, dict(lr=None), TypeError, "lr must be a number"),
    (bridge.SGD8bit, dict(momentum=-0.1), ValueError, r"invalid momentum value -0.1: must be in \[0.0, 1.0\)"),
    (bridge.SGD8bit, dict(momentum=1.5), ValueError, "invalid momentum value 1.5"),
    (bridge.SGD8bit, dict(momentum="0.9"), TypeError, "momentum must be a number"),
    (bridge.SGD8bit, dict(momentum=0.9, dampening=0.1), ValueError, "dampening=0.1 is not supported"),
    (bridge.SGD8bit, dict(momentum=0.0, nesterov=True), ValueError, "nesterov=True requires a momentum > 0"),
    (bridge.SGD8bit, dict(momentum=0.9, nesterov=1), TypeError, "nesterov must be True or False"),
]


@pytest.mark.parametrize("cls, kw, exc, match", BAD, ids=[f"{c.__name__}-{sorted(k)[0]}-{i}" for i, (c, k, _, _) in enumerate(BAD)])
def test_a_torch_optim_users_mistakes_are_clear_errors_at_construction_and_in_groups(cls, kw, exc, match):
    m = net()
    with pytest.raises(exc, match=f"{cls.__name__}: {match}"):
        cls(m.parameters(), **kw)
    # the same mistake in a param group added later: refused before the optimizer changes
    base = dict(momentum=0.9) if cls is bridge.SGD8bit and "momentum" not in kw else {}
    opt = cls([m[0].weight], **base)
    before = copy.deepcopy(opt.param_groups[0])
    with pytest.raises(exc, match=match):
        opt.add_param_group({"params": [m[0].bias], **kw})
    assert len(opt.param_groups) == 1 and opt.param_groups[0].keys() == before.keys()


def test_torch_optim_accepts_what_we_accept_and_agrees_on_range_errors():
    """The ranges are torch's: its AdamW/SGD refuse the same negative values."""
    for kw in (dict(lr=-1e-3), dict(eps=-1e-8), dict(weight_decay=-0.1), dict(betas=(0.9, 1.0))):
        with pytest.raises(ValueError):
            torch.optim.AdamW(net().parameters(), **kw)
        with pytest.raises(ValueError):
            bridge.AdamW8bit(net().parameters(), **kw)
    with pytest.raises(ValueError):
        torch.optim.SGD(net().parameters(), momentum=-0.1)
    # accepted by both: tensor lr and betas, lr 0
    for make in (torch.optim.AdamW, bridge.AdamW8bit):
        make(net().parameters(), lr=torch.tensor(1e-3), betas=(torch.tensor(0.9), torch.tensor(0.999)))
        make(net().parameters(), lr=0.0)


def test_group_momentum_decides_its_own_buffer():
    m = net()
    opt = bridge.SGD8bit([{"params": [m[0].weight]}, {"params": [m[2].weight], "momentum": 0.9}], lr=1e-2,
                         min_quant_size=0)
    run(m, opt, 1)
    assert "momentum_buffer" not in opt.state[m[0].weight] and "momentum_buffer" in opt.state[m[2].weight]


# ----------------------------------------------------------------------------
# torch's state-dict helpers (torch.distributed.checkpoint.state_dict)
# ----------------------------------------------------------------------------
def _opt_for(fmt, params):
    if fmt == "muon4bit":  # the low-rank momentum record (four tensors) on the matrices, AdamW8bit's on the bias
        ps = list(params)
        return bridge.Muon4bit([{"params": [p for p in ps if p.ndim == 2]},
                                {"params": [p for p in ps if p.ndim != 2], "use_muon": False}], lr=1e-2, min_quant_size=0)
    if fmt == "rank1":
        from lowbit_tree.alias import adamw

        return bridge.LowBitOptimizer(params, adamw, dict(learning_rate=1e-2, state_format="4bit",
                                                          rank1_normalization=True, min_quant_size=0))
    return bridge.AdamW(params, lr=1e-2, weight_decay=0.1, state_format=fmt, block_size=16, min_quant_size=0)


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "rank1", "muon4bit"])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flatten"])
@pytest.mark.parametrize("full, offload", [(False, False), (True, False), (True, True)],
                         ids=["local", "full", "full-cpu_offload"])
def test_get_and_set_optimizer_state_dict_round_trip(fmt, flatten, full, offload):
    """One process, no process group: get_optimizer_state_dict -> torch.save/load
    (weights_only) -> set_optimizer_state_dict into a fresh model and optimizer: every
    state bit for bit, and training continues identically."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=flatten, full_state_dict=full, cpu_offload=offload)
    if flatten and full:
        # torch 2.13's set_optimizer_state_dict cannot load a flattened full state dict in one
        # process (KeyError 'param_groups.0.params.0' in _unflatten_state_dict): its own
        # AdamW fails the same way. We must fail exactly like it, and work once it does.
        ref = net()
        ref_opt = torch.optim.AdamW(ref.parameters())
        run(ref, ref_opt, 1)
        ref_sd = get_optimizer_state_dict(ref, ref_opt, options=options)
        ref2 = net(seed=5)
        try:
            set_optimizer_state_dict(ref2, torch.optim.AdamW(ref2.parameters()), ref_sd, options=options)
            torch_fails = None
        except KeyError as e:
            torch_fails = e
    m = net()
    opt = _opt_for(fmt, m.parameters())
    run(m, opt, 3)
    osd = get_optimizer_state_dict(m, opt, options=options)
    if flatten and fmt == "muon4bit":  # torch's own flat keys, the record's four tensors under momentum_buffer
        live = opt.state[m[0].weight]["momentum_buffer"].parts
        assert all(torch.equal(osd[f"state.0.weight.momentum_buffer.{k}"], t) for k, t in live.items())
        assert "param_groups.0.weight.lowbit_tree_version" in osd
    elif flatten:  # torch's own flat keys, under torch's state names
        assert torch.equal(osd["state.0.weight.exp_avg.codes"], opt.state[m[0].weight]["exp_avg"].codes.view(torch.uint8))
        assert "param_groups.0.weight.lowbit_tree_version" in osd
    buf = io.BytesIO()
    torch.save(osd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    m2 = net(seed=5)
    opt2 = _opt_for(fmt, m2.parameters())
    if flatten and full and torch_fails is not None:
        with pytest.raises(KeyError, match=str(torch_fails).strip("'")):
            set_optimizer_state_dict(m2, opt2, loaded, options=options)
        return
    set_optimizer_state_dict(m2, opt2, loaded, options=options)
    # after: the helper's state-creating step runs with lr=0 only for groups that have an "lr"
    # (the raw core alias behind "rank1" calls it learning_rate)
    m2.load_state_dict(m.state_dict())
    assert_same_states(states(opt), states(opt2))
    run(m, opt, 2, seed=7)
    run(m2, opt2, 2, seed=7)
    assert same_params(m, m2)
    assert_same_states(states(opt), states(opt2))


def test_flattened_version_1_names_fail_with_a_clear_error():
    """What the bug report saw with version 1: flatten's unflatten looks states up by the
    live names, finds nothing under 'exp_avg' and hands over an empty dict. The error now
    says so (version 2 dicts never get there; see the round-trip test)."""
    m = net()
    opt = bridge.AdamW8bit(m.parameters(), lr=1e-2, min_quant_size=0)
    run(m, opt, 1)
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = {}
    with pytest.raises(ValueError, match=r"param 0 .*'exp_avg' has entries \[\], expected \['codes', 'scale'\] "
                                         r"\(an empty dict: nothing was saved under this name\)"):
        bridge.AdamW8bit(net().parameters(), lr=1e-2, min_quant_size=0).load_state_dict(sd)


# ----------------------------------------------------------------------------
# Hugging Face Trainer
# ----------------------------------------------------------------------------
class TokenDataset(torch.utils.data.Dataset):
    """A tiny in-memory causal-LM dataset (no tokenizer, no download)."""

    def __init__(self, n=24, seq=12, vocab=61, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)  # odd shapes: (61, 24) embeddings, (24, 72) attention


def hf_trainer(out_dir, model, max_steps, optimizer=None):
    """A Trainer with AdamW8bit through ``optimizer_cls_and_kwargs``, or with ``optimizer(model)``
    through ``optimizers=`` (how a Muon optimizer, which needs its own param groups, goes in)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out_dir), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=3e-3,
        weight_decay=0.01, save_strategy="steps", save_steps=3, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    if optimizer is not None:
        return Trainer(model=model, args=args, train_dataset=TokenDataset(), optimizers=(optimizer(model), None))
    return Trainer(model=model, args=args, train_dataset=TokenDataset(),
                   optimizer_cls_and_kwargs=(bridge.AdamW8bit, {"lr": 3e-3, "min_quant_size": 256}))


@pytest.mark.clients
def test_hf_trainer_checkpoint_and_resume_bit_for_bit(tmp_path):
    """Trainer(optimizer_cls_and_kwargs=(bridge.AdamW8bit, ...)) on a tiny GPT-2 built from a
    config: 6 steps straight, against 3 steps, a checkpoint (optimizer.pt: torch.save of
    our state dict, loaded back with weights_only=True by the Trainer) and a resumed run
    to 6: same params, same codes and scales, bit for bit."""
    straight = hf_trainer(tmp_path / "a", tiny_gpt2(), 6)
    straight.train()
    opt = straight.optimizer.optimizer if hasattr(straight.optimizer, "optimizer") else straight.optimizer
    assert isinstance(opt, bridge.AdamW8bit)
    assert any(r.format == "dynamic8" for r in opt.state_report())
    saved = torch.load(tmp_path / "a" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert {g["lowbit_tree_version"] for g in saved["param_groups"]} == {bridge.STATE_DICT_VERSION}

    resumed = hf_trainer(tmp_path / "b", tiny_gpt2(), 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    ropt = resumed.optimizer.optimizer if hasattr(resumed.optimizer, "optimizer") else resumed.optimizer
    assert same_params(straight.model, resumed.model)
    assert_same_states(states(opt), states(ropt))
    assert ropt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]  # the scheduler resumed too


@pytest.mark.clients
def test_hf_trainer_resumes_muon4bit_bit_for_bit(tmp_path):
    """Muon4bit (low-rank momentum on GPT-2's hidden matrices, AdamW8bit on the rest) handed to the
    Trainer as ``optimizers=(opt, None)``: 6 steps straight against 3, the Trainer's checkpoint
    and a resumed run to 6: same params and records (codes, scales, factors), bit for bit."""
    def muon4bit(model):
        return bridge.Muon4bit(bridge.muon_param_groups(model, exclude=("wte", "wpe", "lm_head")), lr=3e-3,
                               adjust_lr_fn="match_rms_adamw", min_quant_size=256)

    straight = hf_trainer(tmp_path / "a", tiny_gpt2(), 6, muon4bit)
    straight.train()
    opt = straight.optimizer.optimizer if hasattr(straight.optimizer, "optimizer") else straight.optimizer
    assert any(r.format == "normal4+rank16" for r in opt.state_report())
    resumed = hf_trainer(tmp_path / "b", tiny_gpt2(), 6, muon4bit)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    ropt = resumed.optimizer.optimizer if hasattr(resumed.optimizer, "optimizer") else resumed.optimizer
    assert same_params(straight.model, resumed.model)
    assert_same_states(states(opt), states(ropt))


# ----------------------------------------------------------------------------
# torchtitan
# ----------------------------------------------------------------------------
def titan_container(model):
    """torchtitan's OptimizersContainer resolves optimizer names from a fixed table
    (Adam, AdamW, DistMuon); a subclass adds ours. Two param groups, two optimizers:
    norms and biases in fp32 ``bridge.AdamW``, the rest ``bridge.AdamW8bit``."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    class LowBitOptimizersContainer(OptimizersContainer):
        @staticmethod
        def _resolve_optimizer_factory(name):
            return getattr(bridge, name)

    config = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"(\.bias$|ln)", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW8bit",
                         optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1, "min_quant_size": 1, "block_size": 8}),
    ])  # implementation="fused" (the default): fused=True, foreach=False in every group
    return LowBitOptimizersContainer(config, model_parts=[model])


def _titan_steps(model, container, steps, start):
    import fsdp_workers as W

    for step in range(start, start + steps):
        container.zero_grad()
        model(W.batch(step)).backward()
        container.step()


@pytest.mark.clients
def test_torchtitan_optimizers_container_dcp_save_and_resume_bit_for_bit(tmp_path):
    """torchtitan 0.3.0's OptimizersContainer: its flat FQN state dict ('state.<fqn>.exp_avg.codes',
    'param_groups.<fqn>.<key>', looked up by the live state names on load) through dcp.save /
    dcp.load (the container as a Stateful), one process: states and params bit for bit
    against an uninterrupted run."""
    import torch.distributed.checkpoint as dcp

    import fsdp_workers as W

    model = W.make_model()
    container = titan_container(model)
    assert [type(o).__name__ for o in container.optimizers] == ["AdamW", "AdamW8bit"]
    assert container.optimizers[1].param_groups[0]["fused"] is True
    _titan_steps(model, container, 3, 0)
    flat = container.state_dict()
    assert flat["state.emb.weight.exp_avg.codes"].dtype == torch.uint8
    assert flat["param_groups.emb.weight.state_format"] == "8bit"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process"
        dcp.save({"model": model.state_dict(), "optimizer": container}, checkpoint_id=str(tmp_path / "ckpt"))
    _titan_steps(model, container, 3, 3)

    resumed = W.make_model(seed=1)  # other weights: loading must overwrite them
    rcontainer = titan_container(resumed)
    target = {"model": resumed.state_dict(), "optimizer": rcontainer}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    resumed.load_state_dict(target["model"])
    _titan_steps(resumed, rcontainer, 3, 3)
    assert same_params(model, resumed)
    for a, b in zip(container.optimizers, rcontainer.optimizers):
        assert_same_states(states(a), states(b))


# ----------------------------------------------------------------------------
# 2 gloo ranks: a replicated model and an FSDP2 one
# ----------------------------------------------------------------------------
# (get options, set options): flatten is crossed with each. cpu_offload=True with
# full_state_dict=True leaves the dict on rank 0 only, so it is loaded with broadcast_from_rank0.
HELPER_CASES = [
    (dict(), dict()),
    (dict(cpu_offload=True), dict()),
    (dict(full_state_dict=True), dict(full_state_dict=True)),
    (dict(full_state_dict=True), dict(full_state_dict=True, broadcast_from_rank0=True)),
    (dict(full_state_dict=True, cpu_offload=True), dict(full_state_dict=True, broadcast_from_rank0=True)),
]


def _entry(rank, fn, world, store_file, args):
    """A rank: gloo process group, ``fn``, then destroy the group, flush and ``os._exit(0)``
    (pytorch issue 190489: a rank can crash in interpreter shutdown after a clean run).
    A failure raises normally, so torch.multiprocessing reports it."""
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    fn(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn, world, *args):
    """Like fsdp_workers.launch, ending ranks by _entry. A rank that dies, by a signal or an
    exception, fails the test: no retry (ranks leave through os._exit, so the shutdown crash of
    pytorch issue 190489 cannot kill them)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lowbit_clients_") as tmp:
        mp.start_processes(_entry, args=(fn, world, os.path.join(tmp, "store"), args), nprocs=world,
                           join=True, start_method="spawn")


def _set_fails_like_torch(model_fn, get_opts, set_opts, rank):
    """None if torch.optim.AdamW loads this case, else the exception type it raises."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    import fsdp_workers as W

    m = model_fn(W.make_model())
    o = torch.optim.AdamW(m.parameters())
    W.set_global_grads(m, 0)
    o.step()
    sd = get_optimizer_state_dict(m, o, options=get_opts)
    m2 = model_fn(W.make_model(seed=1))
    try:
        set_optimizer_state_dict(m2, torch.optim.AdamW(m2.parameters()), sd if rank == 0 or not set_opts.broadcast_from_rank0
                                 else {}, options=set_opts)
        return None
    except Exception as e:  # noqa: BLE001 -- compared with what ours raises
        return type(e)


def state_dict_helpers_worker(rank, world):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict,
    )

    import fsdp_workers as W

    i, failed = 0, []
    for sharded in (False, True):
        model_fn = (lambda m: W.shard(m, world)) if sharded else (lambda m: m)
        for flatten in (False, True):
            for get_kw, set_kw in HELPER_CASES:
                fmt = W.FORMATS[i % 3]
                i += 1
                what = f"rank {rank} fsdp={sharded} flatten={flatten} get={get_kw} set={set_kw} {fmt}"
                get_opts = StateDictOptions(flatten_optimizer_state_dict=flatten, **get_kw)
                set_opts = StateDictOptions(flatten_optimizer_state_dict=flatten, **set_kw)
                torch_fails = _set_fails_like_torch(model_fn, get_opts, set_opts, rank)
                model = model_fn(W.make_model())
                opt = W.make_opt(model.parameters(), fmt)
                for step in range(3):
                    W.set_global_grads(model, step)
                    opt.step()
                osd = copy.deepcopy(get_optimizer_state_dict(model, opt, options=get_opts))  # 'step' is live
                if get_kw.get("full_state_dict"):
                    from bridge.distributed import is_dtensor
                    leaves = [v for st in (osd.get("state", {}) or {}).values() for v in st.values()] if not flatten \
                        else list(osd.values())
                    assert not any(is_dtensor(v) for v in leaves), what
                    if get_kw.get("cpu_offload"):
                        assert (len(osd) > 0) == (rank == 0), what
                model2 = model_fn(W.make_model(seed=1))
                opt2 = W.make_opt(model2.parameters(), fmt)
                given = osd if rank == 0 or not set_kw.get("broadcast_from_rank0") else {}
                if torch_fails is not None:  # torch 2.13 cannot load this case for its own AdamW either
                    try:
                        set_optimizer_state_dict(model2, opt2, given, options=set_opts)
                    except Exception:  # noqa: BLE001 -- where torch raises KeyError('state'), we say what is missing
                        failed.append(what)
                        continue
                    raise AssertionError(f"{what}: torch.optim.AdamW raised {torch_fails.__name__}, ours loaded")
                set_optimizer_state_dict(model2, opt2, given, options=set_opts)
                W.assert_states_equal(W.full_states(opt2), W.full_states(opt), what=what)
                for p, q in zip(model.parameters(), model2.parameters()):
                    with torch.no_grad():
                        q.copy_(p)
                for step in range(3, 5):
                    for m, o in ((model, opt), (model2, opt2)):
                        W.set_global_grads(m, step)
                        o.step()
                W.assert_states_equal(W.full_states(opt2), W.full_states(opt), what=what + " continued")
                assert all(torch.equal(a, b) for a, b in zip(W.full_params(model), W.full_params(model2))), what
    # the flattened full cases, on both models: torch 2.13's own limit (see the single-process test)
    assert len(failed) == 6 and all("flatten=True" in w and "full_state_dict" in w for w in failed), failed
    print(f"rank {rank}: {i} cases, {len(failed)} unloadable for torch.optim.AdamW too", flush=True)


@pytest.mark.slow
def test_state_dict_helpers_two_ranks_replicated_and_fsdp2():
    """get/set_optimizer_state_dict on 2 gloo ranks, a replicated model and an FSDP2 one
    (uneven shards), flatten on and off x {local, local cpu_offload, full, full +
    broadcast_from_rank0, full cpu_offload + broadcast_from_rank0}, formats 8/4-bit/FP8
    in turn: loaded states bit for bit, two more steps identical. Cases torch 2.13 cannot
    load for its own AdamW must fail the same way for ours (asserted in the worker)."""
    launch(state_dict_helpers_worker, 2)


# ----------------------------------------------------------------------------
# accelerate
# ----------------------------------------------------------------------------
@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _accelerate_steps(acc, model, opt, steps, start):
    import fsdp_workers as W

    for step in range(start, start + steps):
        loss = model(W.batch(step))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()


@pytest.mark.clients
def test_accelerate_prepare_save_state_and_load_state_bit_for_bit(tmp_path, fresh_accelerate_state):
    """accelerate 1.15.0, one CPU process: Accelerator.prepare wraps our optimizer
    (AcceleratedOptimizer), save_state writes its state dict, load_state into a fresh
    model and optimizer resumes bit for bit. (Its FSDP2 path needs an accelerator device:
    accelerate selects DistributedType.FSDP only for GPU-like device types, never MULTI_CPU.)"""
    from accelerate import Accelerator

    import fsdp_workers as W

    acc = Accelerator(cpu=True)
    model = W.make_model()
    opt = bridge.AdamW8bit(model.parameters(), lr=1e-2, min_quant_size=1, block_size=8)
    model, opt = acc.prepare(model, opt)
    _accelerate_steps(acc, model, opt, 3, 0)
    acc.save_state(str(tmp_path / "state"))
    _accelerate_steps(acc, model, opt, 2, 3)

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a new run: a new Accelerator
    acc2 = Accelerator(cpu=True)
    model2 = W.make_model(seed=1)  # other weights: loading must overwrite them
    opt2 = bridge.AdamW8bit(model2.parameters(), lr=1e-2, min_quant_size=1, block_size=8)
    model2, opt2 = acc2.prepare(model2, opt2)
    acc2.load_state(str(tmp_path / "state"))
    _accelerate_steps(acc2, model2, opt2, 2, 3)
    assert same_params(model, model2)
    assert_same_states(states(opt.optimizer), states(opt2.optimizer))


def torchtitan_fsdp_worker(rank, world, workdir):
    import torch.distributed.checkpoint as dcp

    import fsdp_workers as W

    model = W.shard(W.make_model(), world)
    container = titan_container(model)
    for step in range(3):
        container.zero_grad()
        W.set_global_grads(model, step)
        container.step()
    flat = container.state_dict()
    codes = flat["state.emb.weight.exp_avg.codes"]
    assert codes.to_local().dtype == torch.uint8 and tuple(codes.shape) == (13, 12), codes  # row-sharded DTensor
    dcp.save({"model": model.state_dict(), "optimizer": container}, checkpoint_id=workdir)
    for step in range(3, 5):
        container.zero_grad()
        W.set_global_grads(model, step)
        container.step()

    resumed = W.shard(W.make_model(seed=1), world)
    rcontainer = titan_container(resumed)
    target = {"model": resumed.state_dict(), "optimizer": rcontainer}
    dcp.load(target, checkpoint_id=workdir)
    resumed.load_state_dict(target["model"])
    for step in range(3, 5):
        rcontainer.zero_grad()
        W.set_global_grads(resumed, step)
        rcontainer.step()
    for a, b in zip(container.optimizers, rcontainer.optimizers):
        W.assert_states_equal(W.full_states(b), W.full_states(a), what=f"rank {rank} {type(a).__name__}")
    assert all(torch.equal(x, y) for x, y in zip(W.full_params(model), W.full_params(resumed)))


@pytest.mark.slow
@pytest.mark.clients
def test_torchtitan_optimizers_container_fsdp2_two_ranks(tmp_path):
    """torchtitan's OptimizersContainer over an FSDP2 model (uneven shards) on 2 gloo ranks:
    its flat dict holds our row-sharded codes/scale DTensors; dcp.save, dcp.load into a fresh
    sharded model and container, two more steps: bit for bit against the uninterrupted run."""
    launch(torchtitan_fsdp_worker, 2, str(tmp_path / "ckpt"))


def torchtitan_tp_worker(rank, world, workdir):
    import torch.distributed.checkpoint as dcp

    import tp_workers as T

    def run(seed):
        torch.manual_seed(seed)
        model = T.parallelize(T.Net(), (2, 2), ("dp", "tp"))
        return model, titan_container(model)

    def steps(model, container, start, n):
        for step in range(start, start + n):
            container.zero_grad()
            T.set_grads(model, step)
            container.step()

    model, container = run(0)
    steps(model, container, 0, 3)
    codes = container.state_dict()["state.fc2.weight.exp_avg.codes"]  # rows over dp, columns over tp
    assert codes.to_local().dtype == torch.uint8 and tuple(codes.shape) == (24, 40), codes
    assert tuple(codes.placements) == tuple(model.fc2.weight.placements), codes.placements
    dcp.save({"model": model.state_dict(), "optimizer": container}, checkpoint_id=workdir)
    steps(model, container, 3, 2)

    resumed, rcontainer = run(1)  # other weights: loading must overwrite them
    target = {"model": resumed.state_dict(), "optimizer": rcontainer}
    dcp.load(target, checkpoint_id=workdir)
    resumed.load_state_dict(target["model"])
    steps(resumed, rcontainer, 3, 2)
    for a, b in zip(container.optimizers, rcontainer.optimizers):
        T.assert_same(T.full_states(b, resumed), T.full_states(a, model), f"rank {rank} {type(a).__name__}")
    T.assert_same(T.full_params(resumed), T.full_params(model), f"rank {rank} params")


@pytest.mark.slow
@pytest.mark.clients
def test_torchtitan_optimizers_container_fsdp2_tp_2x2(tmp_path):
    """torchtitan's OptimizersContainer over FSDP2 + TP on a 2x2 gloo mesh (its default
    parallelism): the flat dict holds codes DTensors placed like their weights (Shard(0),
    Shard(1)); dcp.save, dcp.load into a fresh model and container, two more steps: bit for
    bit against the uninterrupted run."""
    launch(torchtitan_tp_worker, 4, str(tmp_path / "ckpt"))


# ----------------------------------------------------------------------------
# the integration guide's snippets (docs/guide/integrations.md: ```py blocks; tests/test_readme.py
# runs its ```python ones after the README's)
# ----------------------------------------------------------------------------
GUIDE = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "guide", "integrations.md")


def readme_snippet(title: str) -> tuple[str, str]:
    """The ```py block under the integration guide's "## {title}", split before its last line (the resume)."""
    import re

    text = open(GUIDE, encoding="utf-8").read()
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```py\n(.*?)```", section, flags=re.S)[0].rstrip("\n")
    head, _, last = code.rpartition("\n")
    return head, last


def _exec(code, namespace, title):
    exec(compile(code, f"README {title}", "exec"), namespace)


@pytest.mark.clients
def test_readme_trainer_snippet(tmp_path):
    head, resume = readme_snippet("Hugging Face Trainer")
    ns = {"model": tiny_gpt2(), "train_dataset": TokenDataset(), "ckpt_dir": str(tmp_path)}
    _exec(head, ns, "Trainer")
    opt = ns["trainer"].optimizer.optimizer if hasattr(ns["trainer"].optimizer, "optimizer") else ns["trainer"].optimizer
    assert isinstance(opt, bridge.AdamW8bit)
    straight = [p.detach().clone() for p in ns["model"].parameters()]
    straight_states = states(opt)
    _exec(resume, ns, "Trainer")  # steps 4-6 again, from checkpoint-3
    opt = ns["trainer"].optimizer.optimizer if hasattr(ns["trainer"].optimizer, "optimizer") else ns["trainer"].optimizer
    assert all(torch.equal(a, b) for a, b in zip(straight, ns["model"].parameters()))
    assert_same_states(straight_states, states(opt))


def _resume_snippet_check(title, ns, step_fn, get_opts):
    """Run the snippet up to its save, train on (states change), then its load: the states
    and params are the saved ones again, bit for bit."""
    head, load = readme_snippet(title)
    _exec(head, ns, title)
    saved_params = [p.detach().clone() for p in ns["model"].parameters()]
    saved = [states(o) for o in get_opts(ns)]
    step_fn(ns)
    assert not all(torch.equal(a, b) for a, b in zip(saved_params, ns["model"].parameters()))
    _exec(load, ns, title)
    for o, st in zip(get_opts(ns), saved):
        assert_same_states(states(o), st)
    assert all(torch.equal(a, b) for a, b in zip(saved_params, ns["model"].parameters()))


@pytest.mark.clients
def test_readme_torchtitan_snippet(tmp_path):
    import fsdp_workers as W

    model = W.make_model()

    def train(ns):
        _titan_steps(ns["model"], ns["optimizers"], 2, 0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group
        _resume_snippet_check("torchtitan", {"model": model, "ckpt_dir": str(tmp_path / "ckpt")}, train,
                              lambda ns: ns["optimizers"].optimizers)


@pytest.mark.clients
def test_readme_accelerate_snippet(tmp_path, fresh_accelerate_state):
    import fsdp_workers as W

    head, load = readme_snippet("accelerate")
    prepare, save = head.rsplit("\n", 1)
    ns = {"model": W.make_model(), "ckpt_dir": str(tmp_path / "state")}
    _exec(prepare, ns, "accelerate")
    _accelerate_steps(ns["accelerator"], ns["model"], ns["opt"], 1, 0)  # states exist
    _exec(save, ns, "accelerate")
    saved_params = [p.detach().clone() for p in ns["model"].parameters()]
    saved = states(ns["opt"].optimizer)
    _accelerate_steps(ns["accelerator"], ns["model"], ns["opt"], 2, 1)
    assert not all(torch.equal(a, b) for a, b in zip(saved_params, ns["model"].parameters()))
    _exec(load, ns, "accelerate")
    assert_same_states(states(ns["opt"].optimizer), saved)
    assert all(torch.equal(a, b) for a, b in zip(saved_params, ns["model"].parameters()))
