"""lowbit_tree.kernels.buffers: recycled outputs of the pure steps never reuse memory that
anything still refers to, and a pure training loop reuses its dropped outputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import lowbit_tree as lt
from lowbit_tree.kernels import buffers

BIG = (512, 1024)  # 2 MiB of float32: above buffers.MIN_BYTES


@pytest.fixture(autouse=True)
def _fresh_pool(monkeypatch):
    monkeypatch.delenv("LOWBIT_TREE_RECYCLE", raising=False)
    monkeypatch.setattr(buffers, "_pools", {})
    yield


def _take(holder_kind):
    """A pooled buffer filled with a pattern, and whatever the holder keeps of it."""
    t = buffers.empty(BIG, torch.float32, torch.device("cpu"))
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(BIG))
    ptr = t.data_ptr()
    if holder_kind == "tensor":
        kept = t
    elif holder_kind == "view":
        kept = t.view(torch.int32)[3:]
    elif holder_kind == "numpy":
        kept = t.numpy()
    elif holder_kind == "dlpack":
        kept = torch.utils.dlpack.to_dlpack(t)
    elif holder_kind == "storage":
        kept = t.untyped_storage()
    else:
        raise AssertionError(holder_kind)
    del t
    return ptr, kept


def _pattern_intact(holder_kind, kept) -> bool:
    expect = torch.arange(BIG[0] * BIG[1], dtype=torch.float32)
    if holder_kind == "tensor":
        return torch.equal(kept.flatten(), expect)
    if holder_kind == "view":
        return torch.equal(kept, expect.view(BIG).view(torch.int32)[3:])
    if holder_kind == "numpy":
        return np.array_equal(kept.ravel(), expect.numpy())
    if holder_kind == "dlpack":
        return torch.equal(torch.utils.dlpack.from_dlpack(kept).flatten(), expect)
    return torch.equal(torch.tensor([], dtype=torch.float32).set_(kept).flatten(), expect)  # the storage itself


@pytest.mark.parametrize("holder_kind", ["tensor", "view", "numpy", "dlpack", "storage"])
def test_memory_still_referenced_is_never_handed_out(holder_kind):
    ptr, kept = _take(holder_kind)
    others = [buffers.empty(BIG, torch.float32, torch.device("cpu")) for _ in range(6)]
    torch._foreach_zero_(others)
    assert ptr not in {o.data_ptr() for o in others}
    assert _pattern_intact(holder_kind, kept)
    del kept, others
    assert buffers.stats()[:3] == (7, 7 * 4 * BIG[0] * BIG[1], 7)  # all dropped now: all reusable


def _tensors(tree):
    """Every tensor in a state / params / updates tree, QTensor records opened up."""
    out = []
    for x in lt.tree_utils.flatten(tree)[0]:
        if isinstance(x, lt.QTensor):
            out += [x.codes.view(torch.uint8) if x.codes.dtype == torch.float8_e4m3fn else x.codes, x.scale]
        elif isinstance(x, torch.Tensor):
            out.append(x)
    return out


def test_dropped_buffers_are_reused_and_release_frees_them():
    a = buffers.empty(BIG, torch.float32, torch.device("cpu"))
    pa = a.data_ptr()
    del a
    b = buffers.empty(BIG, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == pa and b.shape == BIG and b.is_contiguous()
    c = buffers.empty(BIG, torch.float32, torch.device("cpu"))  # b is alive: new memory
    assert c.data_ptr() != pa
    s = buffers.stats()
    assert (s.buffers, s.idle_buffers, s.bytes) == (2, 0, 2 * 4 * BIG[0] * BIG[1])
    del c
    assert buffers.stats().idle_buffers == 1
    assert buffers.release() == 4 * BIG[0] * BIG[1]
    assert buffers.stats() == buffers.PoolStats(1, 4 * BIG[0] * BIG[1], 0, 0)
    assert b.data_ptr() == pa  # still in use, still tracked
    del b


def test_small_and_non_cpu_tensors_bypass_the_pool():
    small = buffers.empty((3, 5), torch.float32, torch.device("cpu"))
    meta = buffers.empty(BIG, torch.float32, torch.device("meta"))
    assert small.shape == (3, 5) and meta.device.type == "meta" and buffers.stats().buffers == 0


def test_switch(monkeypatch):
    monkeypatch.setenv("LOWBIT_TREE_RECYCLE", "0")
    a = buffers.empty(BIG, torch.float32, torch.device("cpu"))
    assert not buffers.enabled() and buffers.stats().buffers == 0 and a.shape == BIG
    monkeypatch.setenv("LOWBIT_TREE_RECYCLE", "yes")
    with pytest.raises(ValueError, match="LOWBIT_TREE_RECYCLE"):
        buffers.empty(BIG, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("state_format", ["fp32", "8bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pure_loop_keeping_every_state_sees_none_of_them_change(state_format, dtype, monkeypatch):
    """A caller that keeps every step's state, update and params (pure semantics): none of
    them is overwritten by later steps, and the run equals the same run without the pool."""
    gen = torch.Generator().manual_seed(11)
    params = [torch.randn(600, 700, generator=gen).to(dtype), torch.randn(1000, 520, generator=gen).to(dtype)]
    grads = [[torch.randn(p.shape, generator=gen).to(dtype) * 1e-2 for p in params] for _ in range(5)]

    def run():
        tx = lt.adamw(1e-2, weight_decay=0.1, state_format=state_format)
        p, st = params, tx.init(params)
        kept = []
        for g in grads:
            u, st = tx.update(g, st, p)
            p = lt.apply_updates(p, u)
            kept.append((p, u, st))
        return kept

    kept = run()
    snapshot = [[x.clone() for x in _tensors(k)] for k in kept]
    assert buffers.stats().buffers > 0  # the pool was used
    kept_again = run()  # more steps through the pool while `kept` is alive
    for k, snap in zip(kept, snapshot):
        assert all(torch.equal(a, b) for a, b in zip(_tensors(k), snap))
    monkeypatch.setenv("LOWBIT_TREE_RECYCLE", "0")
    plain = run()
    for a, b in zip(kept_again, plain):
        assert all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b)))


def test_threads_never_share_a_buffer():
    """Eight threads take and drop buffers of one size at once: no two live tensors ever
    share memory (the scan and hand-out are one step under a lock; without it this failed
    in 1 of 5 runs here)."""
    import threading

    live, errors, guard = {}, [], threading.Lock()

    def worker(k):
        try:
            take_and_drop(k)
        except Exception as e:  # noqa: BLE001 - a thread's exception would not fail the test itself
            errors.append(repr(e))

    def take_and_drop(k):
        for _ in range(200):
            t = buffers.empty(BIG, torch.float32, torch.device("cpu"))
            with guard:
                if t.data_ptr() in live:
                    errors.append(t.data_ptr())
                live[t.data_ptr()] = k
            t.fill_(k)
            ok = bool((t == k).all())
            with guard:
                del live[t.data_ptr()]
            if not ok:
                errors.append("overwritten")
            del t

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
