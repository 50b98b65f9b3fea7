"""State pytrees through torch.save / weights_only load and the flat dict."""
import io

import optree
import pytest
import torch

from lowbit_tree.alias import adam, adamw, lion, sgd
from lowbit_tree.checkpoint import VERSION_KEY, state_from_dict, state_to_dict
from lowbit_tree.combine import partition
from lowbit_tree.update import apply_updates
from lowbit_tree.wrappers import inject_hyperparams


def _params(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(32, 64, generator=g).to(device), "b": torch.randn(64, generator=g).to(device), "none": None}


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {"w": torch.randn(32, 64, generator=g), "b": torch.randn(64, generator=g), "none": None}


TXS = {
    "adamw_8bit": lambda: adamw(1e-2, state_format="8bit", min_quant_size=0),
    "adam_4bit_rank1_amsgrad": lambda: adam(1e-2, amsgrad=True, state_format="4bit", rank1_normalization=True, min_quant_size=0),
    "adam_fp8": lambda: adam(1e-2, state_format="fp8", min_quant_size=0),
    "lion_bf16": lambda: lion(1e-3, state_format="bf16"),
    "sgd_8bit_bnb": lambda: sgd(1e-2, momentum=0.9, state_format="8bit_bnb", min_quant_size=0),
    "inject_partition": lambda: partition(
        {"q": inject_hyperparams(adamw)(learning_rate=1e-2, weight_decay=0.1, state_format="4bit", min_quant_size=0),
         "f": adam(1e-2, state_format="fp32")},
        {"w": "q", "b": "f", "none": "f"}),
}


def _run(tx, params, state, steps, start=0):
    for i in range(start, start + steps):
        u, state = tx.update(_grads(i), state, params)
        params = apply_updates(params, u)
    return params, state


def _bits(x):
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x  # torch.equal lacks float8 on CPU


def _equal_trees(a, b):
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(la, lb))


@pytest.mark.parametrize("name", sorted(TXS))
def test_torch_save_roundtrip_and_resume_bit_for_bit(name):
    tx = TXS[name]()
    params, state = _run(tx, _params(), tx.init(_params()), 3)
    buf = io.BytesIO()
    torch.save({"params": params, "state": state}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert _equal_trees(loaded["state"], state) and type(loaded["state"]) is type(state)
    p1, s1 = _run(tx, params, state, 3, start=3)
    p2, s2 = _run(tx, loaded["params"], loaded["state"], 3, start=3)
    assert _equal_trees(p1, p2) and _equal_trees(s1, s2)


@pytest.mark.parametrize("name", sorted(TXS))
def test_state_dict_roundtrip_with_meta_template(name):
    tx = TXS[name]()
    _, state = _run(tx, _params(), tx.init(_params()), 2)
    d = state_to_dict(state)
    assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items())
    assert d[VERSION_KEY].item() == 1
    template = tx.init(_params("meta"))
    back = state_from_dict(template, d)
    assert _equal_trees(back, state)
    assert _equal_trees(state_from_dict(tx.init(_params()), d), state)  # a real template: tensors go to its devices
    # torch.save of the flat dict works with weights_only too
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    assert _equal_trees(state_from_dict(template, torch.load(buf, weights_only=True)), state)


def test_state_dict_keys_are_paths():
    from lowbit_tree.transform import scale_by_adam

    tx = scale_by_adam(state_format="8bit", min_quant_size=0)
    d = state_to_dict(tx.init({"w": torch.zeros(4, 4)}))
    assert {"count", "mu/w/codes", "mu/w/scale", "mu/w/__format__", "mu/w/__shape__", "mu/w/__block_size__", "nu/w/codes"} <= set(d)
    assert bytes(d["mu/w/__format__"].tolist()) == b"dynamic8"


def test_mismatches_name_the_first_differing_path():
    tx = adamw(1e-2, state_format="8bit", min_quant_size=0)
    d = state_to_dict(tx.init(_params()))
    with pytest.raises(ValueError, match="'0/mu/w/__format__'.*dynamic8.*dynamic4"):
        state_from_dict(adamw(1e-2, state_format="4bit", min_quant_size=0).init(_params()), d)
    with pytest.raises(ValueError, match="'0/mu/w/__block_size__'"):
        state_from_dict(adamw(1e-2, state_format="8bit", block_size=64, min_quant_size=0).init(_params()), d)
    with pytest.raises(ValueError, match="'0/mu/w/__shape__'"):
        state_from_dict(tx.init({"w": torch.zeros(64, 32), "b": torch.zeros(64), "none": None}), d)
    with pytest.raises(ValueError, match="'0/mu/b'.*float32\\[64\\].*bfloat16\\[64\\]"):
        state_from_dict(adamw(1e-2, state_format="bf16").init(_params()), {**d})
    with pytest.raises(ValueError, match="'0/mu/w': missing.*float32\\[32, 64\\]"):  # fp32 template: a plain tensor expected
        state_from_dict(adamw(1e-2, state_format="fp32").init(_params()), d)
    with pytest.raises(ValueError, match="'0/count'.*missing"):
        state_from_dict(tx.init(_params()), {k: v for k, v in d.items() if k != "0/count"})
    with pytest.raises(ValueError, match="'extra/x'.*not in the template"):
        state_from_dict(tx.init(_params()), {**d, "extra/x": torch.zeros(1)})
    with pytest.raises(ValueError, match=VERSION_KEY):
        state_from_dict(tx.init(_params()), {**d, VERSION_KEY: torch.tensor(2)})
    with pytest.raises(ValueError, match=VERSION_KEY):
        state_from_dict(tx.init(_params()), {k: v for k, v in d.items() if k != VERSION_KEY})
