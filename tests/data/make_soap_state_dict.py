"""Writes tests/data/soap_state_dict.pt: ``bridge.SOAP8bit`` and ``bridge.SOAP4bit`` state dicts as
the code of commit 4c0ebd4 wrote them (SOAP's own ``state_dict()``, before SOAP moved onto the common
optimizer base), and what two more steps give.

Run once with that commit's code:

    PYTHONPATH=. python tests/data/make_soap_state_dict.py

Per class: a (8, 12) matrix and a (12,) vector preconditioned too (``precondition_1d``), small
``min_quant_size`` so that the bases and couplings are quantized, a refresh every 2 steps; 4 steps
of random gradients, then the state dict (``saved``), the params then (``params``), the gradients of
2 more steps (``grads``) and the params after them (``params_after``; the second of
the two refreshes the bases). tests/test_soap_bridge.py loads ``saved`` with today's code, steps the same
gradients and compares the params, bit for bit.
"""
import copy
import os

import torch

import bridge

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {"w": (8, 12), "b": (12,)}
KW = dict(lr=1e-2, precondition_frequency=2, precondition_1d=True, min_quant_size=64)
CLASSES = ("SOAP8bit", "SOAP4bit")


def params(seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.nn.Parameter(torch.randn(s, generator=g)) for k, s in SHAPES.items()}


def grads(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=g) for k, s in SHAPES.items()} for _ in range(n)]


def run(opt, ps, gs):
    for step in gs:
        for k, p in ps.items():
            p.grad = step[k].clone()
        opt.step()


def main():
    torch.set_num_threads(1)
    out = {}
    for name in CLASSES:
        ps = params(0)
        opt = getattr(bridge, name)(list(ps.values()), **KW)
        run(opt, ps, grads(4, 1))
        saved = copy.deepcopy(opt.state_dict())  # a copy: its tensors are the live states
        entry = {"saved": saved, "params": {k: p.detach().clone() for k, p in ps.items()}, "grads": grads(2, 2)}
        run(opt, ps, entry["grads"])
        entry["params_after"] = {k: p.detach().clone() for k, p in ps.items()}
        entry["soap_step_after"] = int(opt.state[ps["w"]]["soap_step"])
        out[name] = entry
    torch.save(out, os.path.join(HERE, "soap_state_dict.pt"))


if __name__ == "__main__":
    main()
