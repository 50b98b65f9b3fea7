"""Buffer reuse is the caller's explicit choice: a donated step (UpdateStep(tx)(..., donate=True))
writes into the state and params it is given up, a pure step never touches memory that anything
passed in holds, and a pure loop keeping every step's results sees none of them change."""
from __future__ import annotations

import threading

import optree
import pytest
import torch

import lowbit_tree as lt

BIG = (512, 1024)  # 2 MiB of float32


def _tensors(tree):
    """Every tensor in a state / params / updates tree, records opened up (uint8 views of floats)."""
    out = []
    for x in optree.tree_leaves(tree):
        out.append(x.view(torch.uint8) if x.dtype.is_floating_point and x.ndim else x)
    return out


def _ptrs(tree) -> set:
    return {x.untyped_storage().data_ptr() for x in optree.tree_leaves(tree) if x.numel()}


@pytest.mark.parametrize("state_format", ["fp32", "8bit", "4bit"])
def test_a_donated_step_keeps_every_buffer_and_a_pure_one_reuses_none(state_format):
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(BIG, generator=gen), torch.randn(300, 70, generator=gen), torch.randn(64, generator=gen)]
    grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in params]
    tx = lt.adamw(1e-2, weight_decay=0.1, state_format=state_format)
    step = lt.UpdateStep(tx)
    state = tx.init(params)
    held = _ptrs(state) | _ptrs(params)
    new_params, new_state = step(grads, state, params)  # pure: all new memory
    assert not (_ptrs(new_params) | _ptrs(new_state)) & (held | _ptrs(grads))
    snapshot = [x.clone() for x in _tensors((params, state))]
    for _ in range(3):
        params, state = step(grads, state, params, donate=True)  # donated: the same memory, new values
        assert _ptrs(params) | _ptrs(state) == held
    assert not all(torch.equal(a, b) for a, b in zip(_tensors((params, state)), snapshot))


@pytest.mark.parametrize("state_format", ["fp32", "8bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pure_loop_keeping_every_state_sees_none_of_them_change(state_format, dtype):
    """A caller that keeps every step's state, update and params (pure semantics): none of
    them is overwritten by later steps, and the run equals the donated run bit for bit."""
    gen = torch.Generator().manual_seed(11)
    params = [torch.randn(600, 700, generator=gen).to(dtype), torch.randn(1000, 520, generator=gen).to(dtype)]
    grads = [[torch.randn(p.shape, generator=gen).to(dtype) * 1e-2 for p in params] for _ in range(4)]
    tx = lt.adamw(1e-2, weight_decay=0.1, state_format=state_format)

    p, st = params, tx.init(params)
    kept = []
    for g in grads:
        u, st = tx.update(g, st, p)
        p = lt.apply_updates(p, u)
        kept.append((p, u, st))
    snapshot = [[x.clone() for x in _tensors(k)] for k in kept]
    step = lt.UpdateStep(tx)
    dp, dst = [x.clone() for x in params], tx.init(params)
    for g in grads:  # more steps while `kept` is alive
        dp, dst = step(g, dst, dp, donate=True)
    for k, snap in zip(kept, snapshot):
        assert all(torch.equal(a, b) for a, b in zip(_tensors(k), snap))
    assert all(torch.equal(a, b) for a, b in zip(_tensors((dp, dst)), _tensors((kept[-1][0], kept[-1][2]))))


def test_threads_with_their_own_steps_give_a_sequential_runs_bits():
    """Four threads, each with its own UpdateStep, state and params, step at once: each ends with
    the bits of the same run made alone (nothing is shared between calls but the arguments)."""
    gen = torch.Generator().manual_seed(5)
    inputs = [([torch.randn(BIG, generator=gen), torch.randn(33, 65, generator=gen)],
               [torch.randn(BIG, generator=gen) * 1e-2, torch.randn(33, 65, generator=gen) * 1e-2]) for _ in range(4)]
    tx = lt.adamw(1e-2, weight_decay=0.1, state_format="8bit")

    def run(params, grads, donate):
        step, p, s = lt.UpdateStep(tx), [x.clone() for x in params], tx.init(params)
        for _ in range(5):
            p, s = step(grads, s, p, donate=donate)
        return _tensors((p, s))

    alone = [run(p, g, donate=False) for p, g in inputs]
    results, errors = [None] * 4, []

    def worker(k):
        try:
            results[k] = run(*inputs[k], donate=k % 2 == 0)
        except Exception as e:  # noqa: BLE001 - a thread's exception would not fail the test itself
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for got, want in zip(results, alone):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
