"""Writes tests/data/v1_state_dict.pt: real version-1 ``LowBitOptimizer.state_dict()`` output.

Run once with the code of commit d51b273 (the last one writing version 1, where each quantized
state ``name`` is saved as ``name::codes`` / ``name::scale``, rank-1 records as
``name::codes`` / ``name::row_max`` / ``name::col_max``):

    PYTHONPATH=. python tests/data/make_v1_state_dict.py

The file holds the params and two state dicts: ``bridge.AdamW`` with three param groups
(8-bit, 4-bit with block 16, FP8; 1-D biases keep fp32 states) and a ``LowBitOptimizer`` over
``lowbit_tree.adamw`` with rank-1 normalized 4-bit second moments. Odd shapes, 3 steps of
random gradients. tests/test_bridge_state_dict.py loads it with today's code, bit for bit.
"""
import os

import torch

import bridge
from lowbit_tree.alias import adamw

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {"w0": (7, 13), "b0": (7,), "w1": (33, 7), "w2": (5, 33), "b2": (5,)}


def params(seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.nn.Parameter(torch.randn(s, generator=g)) for k, s in SHAPES.items()}


def groups(ps):
    return [
        {"params": [ps["w0"], ps["b0"]], "state_format": "8bit"},
        {"params": [ps["w1"]], "state_format": "4bit", "block_size": 16},
        {"params": [ps["w2"], ps["b2"]], "state_format": "fp8"},
    ]


def steps(ps, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in ps.values():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def main():
    ps = params(0)
    opt = bridge.AdamW(groups(ps), lr=1e-2, weight_decay=0.1, min_quant_size=0)
    steps(ps, opt, 3, 1)
    rs = params(2)
    rank1 = bridge.LowBitOptimizer(list(rs.values()), adamw, dict(learning_rate=1e-2, state_format="4bit",
                                                                 rank1_normalization=True, min_quant_size=0))
    steps(rs, rank1, 3, 3)
    out = {
        "params": {k: p.detach().clone() for k, p in ps.items()},
        "optim": opt.state_dict(),
        "rank1_params": {k: p.detach().clone() for k, p in rs.items()},
        "rank1_optim": rank1.state_dict(),
    }
    torch.save(out, os.path.join(HERE, "v1_state_dict.pt"))


if __name__ == "__main__":
    main()
