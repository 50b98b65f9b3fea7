"""Every optimizer state is a tensor: the record protocol (lowbit_tree/records.py) seen through
``optimizer.state`` as torch.optim users walk it, and torch.optim's contract (copies, pickles,
foreign keys, meta params) checked against torch's own AdamW."""
import copy
import io
import pickle

import pytest
import torch

import bridge
from bridge import QState
from lowbit_tree import records
from lowbit_tree.moments import STATE_FORMAT_NAMES

FAMILIES = ("Adam", "AdamW", "Lion", "SGD", "AdEMAMix", "Muon")


def _configs():
    """(class name, keyword arguments) for every family x state format, rank-1 on and off for
    4-bit second moments, momentum_rank 0 and 16 for Muon's quantized buffers."""
    out = []
    for fam in FAMILIES:
        for fmt in STATE_FORMAT_NAMES:
            kw = {"state_format": fmt}
            if fam == "SGD":
                kw["momentum"] = 0.9
            if fam in ("Adam", "AdamW") and fmt in ("4bit", "nf4"):
                out += [(fam, dict(kw, rank1_normalization=r)) for r in (True, False)]
            elif fam == "Muon" and fmt not in ("fp32", "bf16"):
                out += [(fam, dict(kw, momentum_rank=r)) for r in (0, 16)]
            else:
                out.append((fam, kw))
    named = ["Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8", "Lion8bit", "Lion4bit",
             "AdEMAMix8bit", "AdEMAMix4bit", "Muon8bit", "Muon4bit"]
    out += [(n, {}) for n in named] + [("SGD8bit", {"momentum": 0.9})]
    return out


CONFIGS = _configs()


def _ids(c):
    return c[0] + "-" + "-".join(f"{k}={v}" for k, v in c[1].items())


def _trained(name, kw, steps=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(48, 64, generator=gen)), torch.nn.Parameter(torch.randn(96, generator=gen))]
    groups = [{"params": [params[0]]}, {"params": [params[1]]}]
    if name.startswith("Muon"):
        groups[1]["use_muon"] = False
    opt = getattr(bridge, name)(groups, min_quant_size=1, **kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def _state_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_every_state_is_a_tensor_that_moves_copies_saves_and_dequantizes(config):
    """Every value of ``opt.state[p]`` is a ``torch.Tensor`` of the param's shape; the
    move-to-device idiom moves every one (same kind, same bits); their bytes sum to
    ``state_report``'s; clone / detach / copy_ / dequantize work, and torch.save of the whole
    ``opt.state`` loads with ``weights_only=True`` bit for bit."""
    params, opt = _trained(*config)
    kinds = set()
    for p in params:
        for name, v in opt.state[p].items():
            assert isinstance(v, torch.Tensor), (name, type(v))
            if name != "step":
                assert tuple(v.shape) == tuple(p.shape), (name, v.shape)
            if isinstance(v, QState):
                kinds.add(v.kind_name)
                assert v.dtype == torch.float32
                ref = v.dequantize()
                assert ref.dtype == torch.float32 and ref.shape == p.shape
                assert torch.equal(records.load(v.record), ref)  # the core's reading of the same record
                assert torch.equal(v.clone(), v) and torch.equal(v.detach(), v)
                assert v.clone().parts["codes"].data_ptr() != v.parts["codes"].data_ptr()
                dst = torch.zeros_like(v)
                assert isinstance(dst, QState) and dst.kind_name == v.kind_name and not dst.dequantize().any()
                dst.copy_(v)
                assert torch.equal(dst, v)
    if config[1].get("state_format") not in ("fp32", "bf16"):
        assert kinds, config  # a quantized format keeps records (the named classes all do)
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    # the move-to-device idiom: every state moves (CPU to CPU here: a new tensor of the same kind)
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v):
                st[k] = v.to("cpu", copy=True)
    for p in params:
        for k, v in opt.state[p].items():
            assert type(v) is type(before[id(p)][k]) and torch.equal(v, before[id(p)][k]), k
    total = sum(v.state_nbytes if isinstance(v, QState) else v.numel() * v.element_size()
                for st in opt.state.values() for k, v in st.items() if k != "step")
    assert total == opt.state_bytes() == sum(r.nbytes for r in opt.state_report())
    buf = io.BytesIO()
    torch.save(dict(opt.state), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert len(loaded) == len(opt.state)
    for (k, st), p in zip(loaded.items(), opt.state.keys()):  # the same order, new param objects
        assert torch.equal(k, p) and _state_equal(st, opt.state[p])


@pytest.mark.parametrize("kind", ["block", "rank1", "lowrank"])
def test_unsupported_ops_raise_naming_the_op_and_the_kind(kind):
    x = torch.rand(8, 64, generator=torch.Generator().manual_seed(1))
    rec = {"block": lambda: records.BLOCK.from_float(x, records.BLOCK.zeros((8, 64), {"format": "dynamic8",
                                                                                    "block_size": 16}, "cpu")),
           "rank1": lambda: records.RANK1.from_float(x, records.RANK1.zeros((8, 64), {}, "cpu")),
           "lowrank": lambda: records.LOWRANK.from_float(x, records.LOWRANK.zeros(
               (8, 64), {"format": "dynamic8", "block_size": 16, "rank": 2}, "cpu"))}[kind]()
    q = QState(rec)
    # read-only ops answer on the float32 value (tests/test_qstate.py); writes into the state raise
    assert torch.equal(q * 2, q.dequantize() * 2)
    with pytest.raises(NotImplementedError, match=rf"{kind} record.*aten\.mul_"):
        q.mul_(2)
    with pytest.raises(NotImplementedError, match=rf"{kind} record.*bfloat16"):
        q.to(torch.bfloat16)
    # a value stored into the record's kind, read back: close to x (4-bit rank-1 is the coarsest)
    assert torch.allclose(q.dequantize(), x, atol=0.1 * float(x.max()), rtol=0)


def test_equal_and_eq_compare_records():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 256, generator=gen)
    a = QState.from_float(x, "8bit")
    b = QState.from_float(x, "8bit")
    c = QState.from_float(x + 1, "8bit")
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, QState.from_float(x, "8bit", 128))  # another layout is another record
    eq = a == b
    assert eq.dtype == torch.bool and eq.shape == x.shape and bool(eq.all())
    assert torch.equal(a == c, a.dequantize() == c.dequantize())
    assert torch.equal(a == 0, a.dequantize() == 0)


def test_one_dimensional_records_slice_on_block_boundaries():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    q = QState.from_float(x, "8bit")  # blocks of 256
    for a, b in ((0, 2048), (256, 4096), (512, 768)):
        part = q[a:b]
        assert part.shape == (b - a,)
        assert torch.equal(part.dequantize(), q.dequantize()[a:b])
        assert torch.equal(part, QState.from_float(x[a:b].contiguous(), "8bit"))  # the record of those values
    with pytest.raises(NotImplementedError, match="units of 256 columns.*cuts a block"):
        q[:100]


# ---- torch.optim's contract, against torch's own AdamW --------------------------------------
def _pair(name="AdamW8bit", **kw):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(32, 64, generator=gen)
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    return (ours, getattr(bridge, name)([ours], min_quant_size=1, **kw)), (theirs, torch.optim.AdamW([theirs]))


def _step(p, opt, seed):
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
    opt.step()


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamW", "SGD", "Muon4bit", "AdEMAMix8bit"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_and_pickles_step_with_the_same_bits(name, how):
    """As torch's optimizers: ``copy.deepcopy(opt)`` and a pickle round trip give an optimizer
    that steps, with the same bits as the original."""
    kw = {"momentum": 0.9} if name == "SGD" else {}
    (p, opt), (tp, topt) = _pair(name, **kw)
    _step(p, opt, 0)
    _step(tp, topt, 0)
    for o, param in ((opt, p), (topt, tp)):
        if how == "deepcopy":
            o2 = copy.deepcopy(o)
        else:
            o2 = pickle.loads(pickle.dumps(o))
        p2 = o2.param_groups[0]["params"][0]
        assert p2 is not param and torch.equal(p2, param)
        _step(param, o, 1)
        _step(p2, o2, 1)
        assert torch.equal(p2, param)
        assert _state_equal(o2.state[p2], o.state[param])


def test_keys_that_are_not_params_pass_through_state_dicts_as_torchs_do():
    (p, opt), (tp, topt) = _pair()
    for o, param in ((opt, p), (topt, tp)):
        _step(param, o, 0)
        o.state["ema_note"] = {"decay": torch.tensor(0.5)}
    sd, tsd = opt.state_dict(), topt.state_dict()
    assert torch.equal(sd["state"]["ema_note"]["decay"], tsd["state"]["ema_note"]["decay"])
    (p2, opt2), (tp2, topt2) = _pair()
    opt2.load_state_dict(sd)
    topt2.load_state_dict(tsd)
    assert torch.equal(opt2.state["ema_note"]["decay"], topt2.state["ema_note"]["decay"])
    assert _state_equal(opt2.state[p2], opt.state[p])
    assert torch.equal(opt.torch_state_dict()["state"]["ema_note"]["decay"], torch.tensor(0.5))


def test_meta_params_construct_with_fused_and_refuse_only_at_step():
    """torch builds ``AdamW(fused=True)`` over meta params (materialized later) and raises only
    if ``step()`` runs on them: the same here."""
    p = torch.nn.Parameter(torch.empty(16, 16, device="meta"))
    tp = torch.nn.Parameter(torch.empty(16, 16, device="meta"))
    opt = bridge.AdamW8bit([p], fused=True)
    topt = torch.optim.AdamW([tp], fused=True)
    p.grad, tp.grad = torch.empty_like(p), torch.empty_like(tp)
    with pytest.raises(RuntimeError):
        topt.step()
    with pytest.raises(RuntimeError, match="fused=True.*meta"):
        opt.step()
    # materialized on the CPU, the same optimizer object steps
    q = torch.nn.Parameter(torch.randn(16, 16, generator=torch.Generator().manual_seed(5)))
    opt2 = bridge.AdamW8bit([q], fused=True, min_quant_size=1)
    _step(q, opt2, 0)
    assert opt2.state[q]["exp_avg"].kind_name == "block"


def test_a_gathered_record_state_loads_into_load_state_dict():
    """A state dict whose record states are the tensors of ``opt.state`` themselves (what a
    full-state gather with ``full_tensor()`` produces) loads bit for bit; a record of another
    layout is refused naming both."""
    (p, opt), _ = _pair("AdamW4bit")
    _step(p, opt, 0)
    sd = {"state": {0: dict(opt.state[p])}, "param_groups": opt.state_dict()["param_groups"]}
    (p2, opt2), _ = _pair("AdamW4bit")
    opt2.load_state_dict(sd)
    assert _state_equal(opt2.state[p2], opt.state[p])
    (p3, opt3), _ = _pair("AdamW4bit", rank1_normalization=False)
    with pytest.raises(ValueError):
        opt3.load_state_dict(sd)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "Muon4bit", "AdamWFp8"])
def test_the_move_to_device_idiom_moves_every_state_to_cuda_and_back(name):
    params, opt = _trained(name, {})
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                st[k] = v.to("cuda")
    for p in params:
        for k, v in opt.state[p].items():
            if k != "step":
                assert v.device.type == "cuda" and all(t.is_cuda for t in getattr(v, "parts", {"v": v}).values())
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v):
                st[k] = v.cpu()
    for p in params:
        assert _state_equal(opt.state[p], before[id(p)])


# ----------------------------------------------------------------------------------------------
# The record classes' shared base (lowbit_tree/record_base.py) and what the kernels read off it
# ----------------------------------------------------------------------------------------------
def _one_of_each_kind():
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(6, 40, generator=gen)
    return {"block": records.BLOCK.from_float(x, records.BLOCK.zeros((6, 40), {"format": "e4m3",
                                                                            "block_size": 16}, "cpu")),
            "rank1": records.RANK1.from_float(x, records.RANK1.zeros((6, 40), {}, "cpu")),
            "lowrank": records.LOWRANK.make({"codes": torch.randint(0, 255, (6, 20), dtype=torch.uint8, generator=gen),
                                             "scale": torch.rand(6, 3, generator=gen),
                                             "row_factor": torch.randn(6, 2, generator=gen).bfloat16(),
                                             "col_factor": torch.randn(40, 2, generator=gen).bfloat16()},
                                            (6, 40), {"format": "normal4", "block_size": 16})}


def _same_bits(a, b) -> bool:
    """Same class, metadata and wiring, and tensors equal as bytes (NaN scales included)."""
    if type(a) is not type(b) or any(getattr(a, k) != getattr(b, k) for k in a.STATIC):
        return False
    return all(torch.equal(getattr(a, k).view(torch.uint8), getattr(b, k).view(torch.uint8)) for k in a.CHILDREN)


def test_each_kind_declares_its_parts_once():
    """The kind's parts are its class's tensors in constructor order, its metadata the class's
    static fields but shape and wiring: records.py reads the class's names, nothing repeats them."""
    for kind in records.KINDS:
        assert tuple(p.name for p in kind.parts) == kind.cls.CHILDREN, kind.name
        assert set(kind.meta) | {"shape"} | set(kind.wiring) == set(kind.cls.STATIC), kind.name
        assert kind.wiring == kind.cls.WIRING and kind.kernel == kind.cls.KERNEL
    assert [k.kernel for k in records.KINDS] == [records.KERNEL_BLOCKS, records.KERNEL_VALUES, None]


@pytest.mark.parametrize("name", ["block", "rank1", "lowrank"])
def test_record_base_pytree_pickle_clone_copy(name):
    import optree
    import torch.utils._pytree as torch_pytree

    rec = _one_of_each_kind()[name]
    kind = records.kind_of(rec)
    # pytree: optree's global namespace and torch's, children named as the parts
    leaves, spec = optree.tree_flatten(rec)
    assert len(leaves) == len(kind.parts) and all(a is b for a, b in zip(leaves, kind.parts_of(rec).values()))
    assert _same_bits(optree.tree_unflatten(spec, leaves), rec)
    assert [path for path, _ in zip(optree.tree_paths(rec), leaves)] == [(k,) for k in kind.cls.CHILDREN]
    tleaves, tspec = torch_pytree.tree_flatten(rec)
    assert _same_bits(torch_pytree.tree_unflatten(tleaves, tspec), rec)
    # pickling, the weights_only way torch.load reads it
    buf = io.BytesIO()
    torch.save(rec, buf)
    buf.seek(0)
    assert _same_bits(torch.load(buf, weights_only=True), rec) and _same_bits(copy.deepcopy(rec), rec)
    # frozen
    with pytest.raises(AttributeError, match="immutable"):
        rec.codes = rec.codes
    with pytest.raises(AttributeError, match="immutable"):
        del rec.codes
    # clone: new tensors, the same bits; copy_: into the same tensors, bit for bit (fp8 as bytes)
    twin = rec.clone()
    assert _same_bits(twin, rec) and all(getattr(twin, k).data_ptr() != getattr(rec, k).data_ptr()
                                          for k in rec.CHILDREN)
    other = _one_of_each_kind()[name].with_parts({k: torch.zeros_like(getattr(rec, k)) for k in rec.CHILDREN})
    ptrs = [getattr(other, k).data_ptr() for k in rec.CHILDREN]
    other.copy_(rec)
    assert _same_bits(other, rec) and ptrs == [getattr(other, k).data_ptr() for k in rec.CHILDREN]
    assert rec.nbytes == records.nbytes_of(kind.parts_of(rec))


def test_with_parts_keeps_the_wiring_that_pickling_drops():
    reduce = lambda r, c: (r, c)  # noqa: E731
    rec = records.RANK1.zeros((4, 6), {}, "cpu").with_parts(
        {"codes": torch.zeros(4, 3, dtype=torch.uint8), "row_max": torch.ones(4), "col_max": torch.ones(6)})
    wired = type(rec)(rec.codes, rec.row_max, rec.col_max, rec.shape, rec.format, reduce)
    assert wired.with_parts(records.parts_of(wired)).reduce is reduce and wired.clone().reduce is reduce
    assert pickle.loads(pickle.dumps(wired)).reduce is None  # wiring, not data


def test_kernel_ready_needs_contiguous_float32_parts():
    rec = _one_of_each_kind()
    assert rec["block"].kernel_ready() and rec["rank1"].kernel_ready()
    assert not rec["lowrank"].kernel_ready()  # no kernel steps a low-rank record (its optimizer does)
    b = rec["block"]
    assert not b.with_parts({"codes": b.codes, "scale": b.scale.double()}).kernel_ready()
    wide = torch.zeros(b.scale.shape[0], 2 * b.scale.shape[1])
    assert not b.with_parts({"codes": b.codes, "scale": wide[:, ::2]}).kernel_ready()
    r = rec["rank1"]
    assert not r.with_parts({"codes": r.codes, "row_max": r.row_max, "col_max": r.col_max.bfloat16()}).kernel_ready()


def test_a_record_class_must_declare_its_fields_in_order():
    from lowbit_tree.record_base import Record

    with pytest.raises(TypeError, match="CHILDREN"):
        class Bad(Record):  # noqa: F841  (slots not the declared fields)
            CHILDREN = ("a",)
            STATIC = ("shape",)
            __slots__ = ("shape", "a")
    with pytest.raises(TypeError, match="WIRING"):
        class Bad2(Record):  # noqa: F841  (wiring not last)
            CHILDREN = ("a",)
            STATIC = ("reduce", "shape")
            WIRING = ("reduce",)
            __slots__ = ("a", "reduce", "shape")


def test_one_report_row_for_a_pytree_and_inspect():
    """lowbit_tree.state_report and ``lowbit-tree inspect`` of the same core pytree give the same
    rows (one row type, one leaf_row): paths, record formats, shapes, bytes, block sizes and
    parts; only a plain tensor's format is named apart (the dtype there, the state-format name in
    inspect)."""
    import lowbit_tree as lt
    from bridge.tools.inspect_state import inspect_core_state

    recs = _one_of_each_kind()
    tree = {"r": [recs["block"], recs["rank1"], recs["lowrank"]], "t": [torch.zeros(3, 5), torch.zeros(7).bfloat16()]}
    core, seen = lt.state_report(tree), inspect_core_state(tree).rows
    assert core[-1].path == "total" and len(core) - 1 == len(seen) == 5
    assert [r.format for r in core[:3]] == ["e4m3", "rank1_linear4_unsigned", "normal4+rank2"]
    assert [r.block for r in core[:3]] == ["16", "-", "16"] and core[0].detail == "codes float8_e4m3fn[6, 40], scale float32[6, 3]"
    for a, b in zip(core, seen):
        assert (a.path, a.shape, a.nbytes, a.block, a.detail) == (b.path, b.shape, b.nbytes, b.block, b.detail)
    assert [(a.format, b.format) for a, b in zip(core[3:], seen[3:])] == [("float32", "fp32"), ("bfloat16", "bf16")]
    assert [r.format for r in core[:3]] == [r.format for r in seen[:3]]
