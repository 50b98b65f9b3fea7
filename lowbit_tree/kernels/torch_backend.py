"""The torch backend: quantize, dequantize and every rule's step as torch ops.

Runs on any device: compiled (``torch.compile(dynamic=True, fullgraph=True)``,
one graph per static combination of rule, formats, block sizes and dtypes, never
per shape) on CUDA and wherever ``LOWBIT_TREE_BACKEND=compiled``; eagerly with
``LOWBIT_TREE_BACKEND=eager`` and on CPUs without a C compiler. Codes are
bit-identical to the reference quantizer (:func:`lowbit_tree.qtensor.quantize_rows`)
and the float math is :mod:`.spec`'s, operation by operation, so results equal the
native backend's bit for bit.

Float contract. On CPU inductor compiles without floating-point contraction
(``-ffp-contract=off``) and its float32 ``sqrt`` and division are correctly
rounded, so compiled and eager results agree bit for bit. Every compiled graph
is built with ``emulate_precision_casts``: it keeps each cast to a 16-bit dtype (a
param correction's rest is ``x - float(bfloat16(x))``) and on CUDA turns Triton's
FMA fusion off; on CUDA its division is ``div_rn`` only under the division-rounding option
(:func:`_compile_options`), and the scale divisors are tensors (a division by a constant
would become a reciprocal multiply); compiled CUDA results are not claimed bit-exact until a
GPU has checked them (the automatic choice there is the triton kernels). Eager CPU ``torch.sqrt(float32)`` is
not correctly rounded, so the eager path takes the square root in float64
(:func:`_exact_sqrt`), as the reference does.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Optional, Sequence

import torch

from ..correction import master_value, split_master
from ..formats import FORMATS
from ..rounding import stochastic_round
from .spec import NHYPER, Hyper, StepSpec
from .tables import CPU_TABLES, code_table

__all__ = ["quantize_rows", "dequantize_rows", "step_leaf"]


def _exact_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt (eager CPU's float32 sqrt is not)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return torch.sqrt(x)
    return torch.sqrt(x.double()).float()


# --------------------------------------------------------------------------- codes


def _nearest_index(n: torch.Tensor, fmt_name: str, base: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """int32 index of the nearest map value to float32 ``n`` (ties up; NaN -> last)."""
    tab = CPU_TABLES[fmt_name]  # static ints only; the tensors come as arguments
    bits = n.view(torch.int32)
    rel = (bits & 0x7FFFFFFF).clamp(tab.key_min, tab.key_max) - tab.key_min
    key = torch.where(n < 0, ~rel, rel) if FORMATS[fmt_name].signed else rel
    # the clamps are no-ops that tell inductor the gathers are in bounds (no
    # wrap-around of negative indices, no bounds checks, vectorized code)
    bucket = ((key >> tab.shift) - tab.bucket_offset).clamp(0, tab.base.numel() - 1)
    b = base[bucket].clamp(0, tab.last + 1)
    idx = b + (n >= thresholds[b]).to(torch.int32)
    return idx.clamp(0, tab.last)


def _block_index(r: int, block_size: int, nblocks, device) -> torch.Tensor:
    """The block of each element of a row. The clamp changes nothing, but without
    it inductor 2.13 (CPU, dynamic shapes) reads garbage from a ``(rows, 1)`` scale
    (one block per row, rows shorter than a block): its C++ loop split drops a loop's
    last ``R % block_size`` iterations (pytorch issue 195582); with one block the
    clamp folds the index to 0, leaving no ``// block_size`` to split."""
    return (torch.arange(r, device=device) // block_size).clamp(0, nblocks - 1)


def _quantize_core(
    x2: torch.Tensor,
    base: torch.Tensor,
    thresholds: torch.Tensor,
    encode: torch.Tensor,
    divisor: torch.Tensor,
    fmt_name: str,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (rows, R) -> (codes uint8, scale float32); the reference's math."""
    fmt = FORMATS[fmt_name]
    rows, r = x2.shape
    nblocks = (r + block_size - 1) // block_size
    if not fmt.signed:
        x2 = torch.where(x2 < 0, float("nan"), x2)
    if fmt.sqrt:
        x2 = _exact_sqrt(x2)
    pad = nblocks * block_size - r
    xb = torch.nn.functional.pad(x2, (0, pad)).reshape(rows, nblocks, block_size)
    absmax = xb.abs().amax(dim=-1)
    absmax = torch.where(torch.isfinite(absmax), absmax, float("nan"))
    scale = absmax / divisor  # a tensor (CodeTable.divisor): inductor keeps it a true division
    safe = torch.where(scale > 0, scale, 1.0)
    n = x2 / safe[:, _block_index(r, block_size, nblocks, x2.device)]
    idx = _nearest_index(n, fmt_name, base, thresholds)
    if fmt.bits == 4:
        idx = torch.nn.functional.pad(idx, (0, r % 2)).reshape(rows, (r + 1) // 2, 2)
        codes = (idx[..., 0] | (idx[..., 1] << 4)).to(torch.uint8)
    elif fmt.float8:
        codes = encode[idx]
    else:
        codes = idx.to(torch.uint8)
    return codes, scale


def _dequantize_core(
    codes: torch.Tensor, scale: torch.Tensor, decode: torch.Tensor, fmt_name: str, block_size: int, odd: bool
) -> torch.Tensor:
    """(uint8 codes, scale) -> float32 (rows, R); the reference's math.

    ``odd``: 4-bit rows hold an odd number R of codes (the last high nibble is padding).
    """
    fmt = FORMATS[fmt_name]
    rows = codes.shape[0]
    r = 2 * codes.shape[1] - int(odd) if fmt.bits == 4 else codes.shape[1]
    if fmt.bits == 4:
        c = codes.to(torch.int32)
        idx = torch.stack([c & 0x0F, c >> 4], dim=-1).reshape(rows, 2 * codes.shape[1])[:, :r]
    else:
        idx = codes.to(torch.int32)
    out = decode[idx] * scale[:, _block_index(r, block_size, scale.shape[1], codes.device)]
    if fmt.sqrt:
        out = out * out
    return out




# --------------------------------------------------------------------------- one step


def _fma(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """float32 ``x * y + z`` rounded once, from float64 operations only (what inductor's CPU
    code can express): the product is exact in float64; the sum is made round-to-odd (TwoSum
    gives its exact error; an inexact even result steps to its odd neighbour towards the exact
    value), and a round-to-odd float64 rounds to float32 correctly (53 >= 24 + 2 bits)."""
    p = x.double() * y.double()
    zd = z.double()
    s = p + zd
    bb = s - p
    err = (p - (s - bb)) + (zd - bb)
    bits = s.view(torch.int64)
    step = torch.where((err > 0) == (s > 0), 1, -1)
    fix = (err != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    return torch.where(fix, bits + step, bits).view(torch.float64).float()


def _lerp(a: torch.Tensor, c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch.lerp's float32 result, one rounding: ``fma(w, c - a, a)`` if ``|w| < 0.5`` else
    ``fma(w - 1, c - a, c)`` (the bits torch.optim.Muon's momentum has; cpu.c: ``fmaf``).
    Eagerly torch.lerp itself; compiled, :func:`_fma` (inductor has no CPU fma)."""
    if not torch.compiler.is_compiling():
        return torch.lerp(a, c, w)
    d = c - a
    small = w.abs() < 0.5
    return _fma(torch.where(small, w, w - 1), d, torch.where(small, a, c))


def _hyper(hyper) -> Hyper:
    """The vector's entries by name (spec.HYPER_NAMES); a :class:`Hyper` passes through (a
    graph of several leaves unbinds the vector once)."""
    return hyper if isinstance(hyper, Hyper) else Hyper(*hyper.unbind(0))


def _rule(spec: StepSpec, hyper, g: torch.Tensor, p: Optional[torch.Tensor], olds: list):
    """The float32 math of one step (:mod:`.spec`, operation by operation): returns
    the update after the epilogue and the new (untransformed) states."""
    h = _hyper(hyper)
    if spec.maximize:
        g = -g
    if spec.l2:
        g = g + h.l2 * p
    if spec.rule in ("adam", "ademamix"):  # ademamix: adam's m and v plus a slow EMA in the numerator
        m = h.b1 * olds[0] + h.omb1 * g
        v = h.b2 * olds[1] + h.omb2 * (g * g)
        news, root, num = [m, v], v, m * h.rbc1
        if spec.amsgrad:
            root = torch.maximum(olds[2], v)
            news.append(root)
        if spec.rule == "ademamix":
            slow = h.b3 * olds[2] + h.omb3 * g
            news.append(slow)
            num = num + h.alpha * slow
        u = num / (_exact_sqrt(root) * h.rsbc2 + h.eps)
    elif spec.rule == "lion":
        u = torch.sign(h.b1 * olds[0] + h.omb1 * g)
        news = [h.b2 * olds[0] + h.omb2 * g]
    elif spec.rule == "muon":
        b = _lerp(olds[0], g, h.omb1)
        u = _lerp(g, b, h.b1) if spec.nesterov else b
        news = [b]
    elif spec.rule == "rmsprop":  # states (square_avg, [momentum_buffer], [grad_avg]); b1 momentum, b2 alpha
        v = h.b2 * olds[0] + h.omb2 * (g * g)
        news = [v]
        if spec.centered:
            a = _lerp(olds[-1], g, h.omb2)
            d = _exact_sqrt(v - a * a) + h.eps
        else:
            d = _exact_sqrt(v) + h.eps
        u = g / d
        if spec.has_momentum:
            u = h.b1 * olds[1] + u
            news.append(u)
        if spec.centered:
            news.append(a)
    elif spec.rule == "adagrad":  # b1: the initial accumulator value
        s = torch.where(olds[0] < h.b1, h.b1, olds[0]) + g * g  # max, NaN kept (where picks a NaN state)
        u = g / (_exact_sqrt(s) + h.eps)
        news = [s]
    elif spec.rule == "adamax":  # states (exp_inf, exp_avg)
        e = torch.maximum(h.b2 * olds[0], g.abs() + h.eps)  # NaN if either is (cpu.c: amsgrad_max)
        m = h.b1 * olds[1] + h.omb1 * g
        u = (m * h.rbc1) / e
        news = [e, m]
    elif spec.rule == "adadelta":  # states (square_avg, acc_delta); b2: rho
        v = h.b2 * olds[0] + h.omb2 * (g * g)
        u = (_exact_sqrt(olds[1] + h.eps) / _exact_sqrt(v + h.eps)) * g
        news = [v, h.b2 * olds[1] + h.omb2 * (u * u)]
    elif spec.rule == "radam":  # states (exp_avg_sq, exp_avg); cm, rect: spec.radam_terms
        v = h.b2 * olds[0] + h.omb2 * (g * g)
        m = h.b1 * olds[1] + h.omb1 * g
        num = m * h.cm
        u = torch.where(h.rect != 0, num / (_exact_sqrt(v) + h.eps), num)
        news = [v, m]
    elif spec.rule == "nadam":  # states (exp_avg_sq, exp_avg); cg, cm: spec.nadam_terms
        v = h.b2 * olds[0] + h.omb2 * (g * g)
        m = h.b1 * olds[1] + h.omb1 * g
        u = (h.cg * g + h.cm * m) / (_exact_sqrt(v) * h.rsbc2 + h.eps)
        news = [v, m]
    else:
        b = h.b1 * olds[0] + g
        u = g + h.b1 * b if spec.nesterov else b
        news = [b]
    if spec.decay:
        u = u + h.wd * p
    if spec.lr:
        u = (-h.lr) * u
    return u, news


def _step_core(p, g, hyper, key, leaf_index, corr, *state_tensors, spec, storages, write, sr):
    """One leaf's step on plain tensors (eager, or compiled by :func:`_compiled`).

    ``leaf_index`` (the leaf's stochastic-rounding index) is a 0-d int64 tensor, not a
    static argument, so leaves of one static combination share one compiled graph.
    ``corr`` (with ``write``; else ``None``): the param's int8 correction
    (:mod:`lowbit_tree.correction`): the new param is rounded from the corrected master
    value, and the new correction follows ``out`` in the results.

    ``state_tensors``: per state, ``(codes, scale, decode, base, thresholds, encode, divisor)``
    for ``("q", ...)`` storages, ``(values,)`` for plain ones. Returns ``(out, *new
    state tensors)``: ``out`` the float32 update, or with ``write`` the new param
    in ``p``'s dtype.
    """
    # the (rows, R) row view (non-empty leaves only: the caller handles empty ones)
    g2 = (g.reshape(g.shape[0], -1) if g.dim() >= 2 else g.reshape(1, -1)).float()
    rows, r = g2.shape
    p2 = None if p is None else p.reshape(rows, r).float()
    # the row's parity matters to 4-bit codes only; asked otherwise it would be a guard (a graph per parity)
    odd = bool(r % 2) if any(k[0] == "q" and FORMATS[k[1]].bits == 4 for k in storages) else False
    olds, it = [], iter(state_tensors)
    for storage in storages:
        if storage[0] == "q":
            codes, scale, decode = next(it), next(it), next(it)
            next(it), next(it), next(it), next(it)
            olds.append(_dequantize_core(codes, scale, decode, storage[1], storage[2], odd))
        else:
            olds.append(next(it).reshape(rows, r).float())
    u, news = _rule(spec, hyper, g2, p2, olds)
    new_corr = None
    if write:
        if corr is not None:
            out, new_corr = split_master(master_value(p.reshape(rows, r), corr.reshape(rows, r)) + u, p.dtype)
        else:
            x = p2 + u
            if sr:
                out = stochastic_round(x, p.dtype, key, leaf_index)
            else:
                out = x.to(p.dtype)
    else:
        out = u
    results, it = [out.reshape(g.shape)], iter(state_tensors)
    if new_corr is not None:
        results.append(new_corr.reshape(g.shape))
    for storage, new in zip(storages, news):
        if storage[0] == "q":
            next(it), next(it), next(it)
            base, thresholds, encode, divisor = next(it), next(it), next(it), next(it)
            results.extend(_quantize_core(new, base, thresholds, encode, divisor, storage[1], storage[2]))
        else:
            values = next(it)
            results.append(new.to(storage[1]).reshape(values.shape))
    return tuple(results)


def _step_many_core(hyper, key, *flat, spec, storages, write, sr, width):
    """:func:`_step_core` of several leaves of one static combination in one graph: ``flat``
    holds ``width`` tensors per leaf (param, gradient, index, correction, then its state
    tensors).
    The code tables (a quantized state's decode / base / thresholds / encode) are per
    format, the same for every leaf."""
    out = []
    hyper = _hyper(hyper)
    for k in range(0, len(flat), width):
        p, g, index, corr, *tensors = flat[k:k + width]
        out.extend(_step_core(p, g, hyper, key, index, corr, *tensors, spec=spec, storages=storages, write=write,
                              sr=sr))
    return tuple(out)


def _consts_layout(formats: tuple) -> tuple[int, dict]:
    """The words (int32) of a compiled in-place call's constants buffer: the hyperparameter
    vector (float32 bits) first, then per format its decode, base, thresholds and encode
    tables and its divisor. Returns (total words, {format: five (start, end) word ranges})."""
    end, where = NHYPER, {}
    for f in formats:
        tab = CPU_TABLES[f]
        where[f] = []
        for t in (tab.decode, tab.base, tab.thresholds, tab.encode, tab.divisor):
            where[f].append((end, end + t.numel()))
            end += t.numel()
    return end, where


def _pack_consts(formats: tuple, device: torch.device) -> torch.Tensor:
    """The constants buffer of :func:`_consts_layout` on ``device``, tables filled in (the
    hyperparameters are written at each step). One input instead of one per table and the
    hyperparameters: each tensor input costs a compiled call about a microsecond."""
    total, where = _consts_layout(formats)
    buf = torch.zeros(total, dtype=torch.int32, device=device)
    for f in formats:
        tab = code_table(f, device)
        for (a, b), t in zip(where[f], (tab.decode, tab.base, tab.thresholds, tab.encode, tab.divisor)):
            buf[a:b] = t.view(torch.int32) if t.dtype == torch.float32 else t.to(torch.int32)
    torch._dynamo.mark_static(buf)  # its size is a constant of the graph, not a symbol
    return buf


def _step_inplace_core(key, consts, *flat, spec, storages, write, sr, formats, leaf_class):
    """:func:`_step_core` of several leaves of one static combination in one graph, in place:
    each leaf's new state tensors (and with ``write`` its new param and correction) are
    copied into its own tensors inside the graph, so inductor writes them where they lie.
    ``consts``: the hyperparameters and the code tables of ``formats`` in one int32 buffer
    (:func:`_pack_consts`). ``flat``: per leaf its param, gradient, index, correction and own
    state tensors (``codes, scale`` of a quantized state, ``values`` of a plain one). Returns
    the float32 updates (without ``write``), else nothing. ``leaf_class`` (the leaves' shape
    class, param and gradient dtypes, with or without a correction) is not read: as a static
    argument it gives each its own compiled function, each with one graph."""
    words = consts.view(torch.float32)
    hyper = _hyper(words[:NHYPER])
    tables = {}
    for f, ((d0, d1), (b0, b1), (t0, t1), (e0, e1), (v0, v1)) in _consts_layout(formats)[1].items():
        tables[f] = (words[d0:d1], consts[b0:b1], words[t0:t1], consts[e0:e1].to(torch.uint8), words[v0:v1])
    width = 4 + sum(2 if storage[0] == "q" else 1 for storage in storages)
    outs = []
    for k in range(0, len(flat), width):
        p, g, index, corr, *own = flat[k:k + width]
        tensors, it = [], iter(own)
        for storage in storages:
            tensors += [next(it), next(it), *tables[storage[1]]] if storage[0] == "q" else [next(it)]
        res = iter(_step_core(p, g, hyper, key, index, corr, *tensors, spec=spec, storages=storages, write=write,
                              sr=sr))
        out = next(res)
        if write:
            p.copy_(out)
        else:
            outs.append(out)
        if corr is not None:
            corr.copy_(next(res))
        for t in own:  # the order of _step_core's results: codes, scale per quantized state, values per plain
            t.copy_(next(res))
    return tuple(outs)


def _bound(*tensors):
    return _CORE(*tensors, **_STATIC)


def _bind_static(core, static: dict):
    """``core`` with its static keyword arguments fixed, as a function with its own
    code object and globals: dynamo caches (and counts recompilations) per code
    object, and specializes on globals (block sizes stay compile-time constants
    even under ``dynamic=True``)."""
    glb = dict(globals())
    glb["_CORE"], glb["_STATIC"] = core, static
    code = _bound.__code__.replace(co_name=f"{core.__name__}_bound")
    return types.FunctionType(code, glb, code.co_name)


def _compile_options(device_type: str) -> dict:
    """Inductor's options, the same on every device.

    - ``emulate_precision_casts``: without it inductor drops a cast down and back up
      (``x.to(bfloat16).float()`` becomes ``x``; on the CPU too), so a param correction's
      rest ``x - float(p')`` came out 0; in Triton it also keeps mul/add uncontracted (no
      FMA), so results equal eager's exactly.
    - division rounding (:func:`_division_rounding_option`): inductor's Triton code divides
      float32 with ``/``, which lowers to an approximate PTX division (``div.full.f32``, within
      2 ulp), unless this option makes it ``div_rn``; the C++ it makes for the CPU divides
      exactly either way. A division by a constant would still become a multiply by its
      reciprocal on a non-CPU device, so the scale divisors are tensors (``CodeTable.divisor``).
      With ``eager_numerics.disable_ftz`` (where it exists) no subnormal is flushed. None of it
      has run on a GPU: the compiled backend on CUDA is unverified (``docs/guide/gpu.md``); the
      automatic choice there takes the triton kernels.
    - ``size_asserts`` off: the generated wrapper re-checked every input's sizes and strides
      on each call, which dynamo's guards have already checked (a new stride pattern
      recompiles); about half a microsecond an input.
    - ``cpp.enable_loop_tail_vec`` off (CPU code only): a loop's last partial vector runs as
      scalar code instead of a second, masked vector loop; the step's C++ then compiles in
      about half the time, with the same bits.
    """
    options = {"emulate_precision_casts": True, "size_asserts": False, "cpp.enable_loop_tail_vec": False}
    rounding = _division_rounding_option()
    if rounding is not None:
        options[rounding] = True
        if rounding.startswith("eager_numerics."):
            options["eager_numerics.disable_ftz"] = True
    elif device_type != "cpu":
        raise RuntimeError(f"torch {torch.__version__}'s inductor has no float32 division-rounding option "
                           "(eager_numerics.division_rounding, or emulate_divison_rounding before it): its GPU code "
                           "would divide approximately; use LOWBIT_TREE_BACKEND=triton (or auto) on this device")
    return options


def _division_rounding_option() -> Optional[str]:
    """The name of inductor's option that makes float32 division ``div_rn`` in its Triton code, in
    the installed torch: ``eager_numerics.division_rounding`` (read in the config of torch 2.11,
    2.13 and 2.14), ``emulate_divison_rounding`` (its spelling, with the typo, in earlier
    releases); ``None`` where there is neither."""
    from torch._inductor import config

    if hasattr(getattr(config, "eager_numerics", None), "division_rounding"):
        return "eager_numerics.division_rounding"
    if hasattr(config, "emulate_divison_rounding"):
        return "emulate_divison_rounding"
    return None


_CORES = {"quantize": _quantize_core, "dequantize": _dequantize_core, "step": _step_core,
          "step_many": _step_many_core, "step_inplace": _step_inplace_core}


@functools.lru_cache(maxsize=None)
def _compiled(core: str, static: tuple, device_type: str):
    """One compiled callable per (kernel, static arguments, device type): dynamic shapes,
    without duck sizing (two sizes that happen to be equal at the first call would
    otherwise become one symbol, and the next shape a second graph). Duck sizing is switched
    off around every call, not only the first: dynamo's guards check the setting, and a
    call without it compiles again."""
    fn = torch.compile(
        _bind_static(_CORES[core], dict(static)), dynamic=True, fullgraph=True, options=_compile_options(device_type)
    )
    patch = _no_duck_shapes()  # one context manager, entered at each call (building one costs a class)

    def call(*tensors):
        with patch:
            return fn(*tensors)

    return call


def _no_duck_shapes():
    from torch.fx.experimental import _config

    return _config.patch(use_duck_shape=False)


def _run(core: str, tensors: tuple, static: dict, device: torch.device, compile: bool):
    if compile:
        return _compiled(core, tuple(sorted(static.items())), device.type)(*tensors)
    return _CORES[core](*tensors, **static)


BATCH = 2
"""Leaves a compiled call takes. The leaves of one static combination and shape class
(:func:`shape_class`) run in calls of 2, the last call filled up (:func:`_chunks`): one graph
per combination and class, whatever the number of params or their sizes. The graph's compile
time grows with its leaves and a call's host cost is mostly fixed (dynamo's call of a graph
with 13 tensor inputs, about 40 us here), so this trades the first step against every later
one. Measured on this 2-core CPU, 200 AdamW8bit params of 8x8..32x4, one process, one period
(torch's fused AdamW 1.0 ms a step): 2 leaves a call 37-42 us a param over torch's fused AdamW
and a 9.5 s first step from scratch, 3 leaves 32-37 us and 15.2 s, 4 leaves 29-33 us and 19 s."""


def _chunks(count: int) -> list:
    """Positions ``0 .. count - 1`` as the calls take them: :data:`BATCH` a call, the last call
    filled up with ``None`` (a leaf whose results are dropped)."""
    return [[k if k < count else None for k in range(s, s + BATCH)] for s in range(0, count, BATCH)]


def compiles(shape, storages: tuple) -> bool:
    """Whether a leaf of this shape with states ``storages`` runs through a compiled graph; else
    eagerly (the same bits). A single row (its 2-D row view) with a quantized state does not:
    inductor 2.13 (CPU, ``dynamic=True``) miscompiles block quantization of a ``(1, R)`` row
    view (a size-1 dim that dynamo makes a constant): the codes came out all zero, and with two
    blocks a row the dequantized values were wrong too (``tests/test_kernels_step.py``,
    ``test_compiled_single_row_runs_eagerly``). The cause is inductor's C++ loop split, which
    drops a loop's last ``R % block_size`` iterations (pytorch issue 195582)."""
    from ..qtensor import row_layout

    return row_layout(shape)[0] != 1 or not any(storage[0] == "q" for storage in storages)


def shape_class(shape, storages: tuple) -> tuple:
    """What a compiled graph is specialized on besides its static combination, for a leaf of
    this shape and state storages: which dims are 1 (dynamo makes a size-1 dim a constant), and
    per quantized state whether a row is a single block (its scale then has a size-1 dim),
    with 4-bit codes also the row's parity and whether its codes are one byte. Leaves of one
    class share a graph whatever their sizes; a call takes leaves of one class only."""
    from ..qtensor import row_layout

    r = row_layout(shape)[1]
    per_state = tuple(
        (-(-r // storage[2]) == 1,) + ((r % 2, (r + 1) // 2 == 1) if FORMATS[storage[1]].bits == 4 else ())
        for storage in storages if storage[0] == "q"
    )
    return tuple(d == 1 for d in shape), per_state


def leaf_class(p, g, storages: tuple, corr) -> tuple:
    """What leaves must share to go through one compiled call: :func:`shape_class`, the
    param's and the gradient's dtypes, with or without a correction (each a graph of its own)."""
    return shape_class(g.shape, storages), None if p is None else p.dtype, g.dtype, corr is not None


def quantize_rows(x2: torch.Tensor, fmt_name: str, block_size: int, *, compile: bool):
    """float ``(rows, R)`` -> ``(codes uint8, scale float32)``, the reference's codes."""
    tab = code_table(fmt_name, x2.device)
    return _run("quantize", (x2.detach().float(), tab.base, tab.thresholds, tab.encode, tab.divisor),
                {"fmt_name": fmt_name, "block_size": block_size}, x2.device,
                compile and compiles(x2.shape, (("q", fmt_name, block_size),)))


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, fmt_name: str, block_size: int, r: int, *,
                    compile: bool) -> torch.Tensor:
    """``(codes, scale)`` of a ``(rows, r)`` view -> float32 ``(rows, r)``."""
    tab = code_table(fmt_name, codes.device)
    return _run("dequantize", (codes, scale, tab.decode),
                {"fmt_name": fmt_name, "block_size": block_size, "odd": bool(r % 2)}, codes.device,
                compile and compiles(codes.shape, (("q", fmt_name, block_size),)))


def step_leaf(spec: StepSpec, hyper: torch.Tensor, p, g, states: Sequence[Any], *, write: bool, sr: bool = False,
              key: Optional[torch.Tensor] = None, leaf_index: int = 0, compile: bool = False,
              correction: Optional[torch.Tensor] = None):
    """One leaf's step (pure: new tensors out). ``states``: QTensor records or plain
    float tensors. Returns ``(out, new_states, new_correction)`` (see :func:`_step_core`;
    ``new_correction`` is ``None`` without a ``correction``)."""
    device = g.device
    storages, tensors = _state_inputs(states, device)
    static = {"spec": spec, "storages": storages, "write": write, "sr": sr}
    h = hyper.to(device=device, dtype=torch.float32)
    index = torch.tensor(leaf_index, dtype=torch.int64, device=device) if sr else None
    if isinstance(p, torch.nn.Parameter):  # dynamo keeps a Parameter's shape static: one graph per shape
        p = p.detach()
    compile = compile and compiles(g.shape, storages)
    res = _run("step", (p, g, h, key, index, correction, *tensors), static, device, compile)
    k = 1 if correction is None else 2
    return res[0], _new_states(states, res[k:]), (res[1] if correction is not None else None)


def state_storages(states) -> tuple:
    """The static description of a leaf's states: ``("q", format, block size)`` per
    quantized record, ``("plain", dtype)`` per tensor."""
    from ..qtensor import QTensor

    return tuple(("q", s.format, s.block_size) if isinstance(s, QTensor) else ("plain", s.dtype) for s in states)


def _state_inputs(states, device) -> tuple[tuple, list]:
    from ..qtensor import QTensor

    tensors = []
    for s in states:
        if isinstance(s, QTensor):
            tab = code_table(s.format, device)
            tensors += [s.codes.view(torch.uint8), s.scale, tab.decode, tab.base, tab.thresholds, tab.encode,
                        tab.divisor]
        else:
            tensors.append(s)
    return state_storages(states), tensors


def _new_states(states, results) -> list:
    from ..qtensor import QTensor

    it, out = iter(results), []
    for s in states:
        if isinstance(s, QTensor):
            codes, scale = next(it), next(it)
            if FORMATS[s.format].float8:
                codes = codes.view(torch.float8_e4m3fn)
            out.append(QTensor(codes, scale, s.shape, s.block_size, s.format))
        else:
            out.append(next(it))
    return out


def step_leaves(spec: StepSpec, hyper: torch.Tensor, leaves: Sequence, *, write: bool, sr: bool = False,
                key: Optional[torch.Tensor] = None) -> list:
    """The compiled step of several leaves ``(param, grad, states, leaf_index, correction)``
    (pure: new tensors out), those of one static combination (rule, state storages and formats,
    ``write``, ``sr``, with or without a correction) and shape class in calls of
    :data:`BATCH` (the last call filled up with a repeat of its first leaf, whose results are
    dropped). Returns ``(out, new_states, new_correction)`` per leaf, the bits of
    :func:`step_leaf` on each."""
    groups: dict = {}
    prepared, eager = [], []
    for p, g, states, index, corr in leaves:
        storages, tensors = _state_inputs(states, g.device)
        if isinstance(p, torch.nn.Parameter):
            p = p.detach()
        idx = torch.tensor(index, dtype=torch.int64, device=g.device) if sr else None
        prepared.append((p, g, idx, corr, tensors, states))
        if not compiles(g.shape, storages):
            eager.append((len(prepared) - 1, index))
            continue
        groups.setdefault((storages, g.device, leaf_class(p, g, storages, corr)), []).append(len(prepared) - 1)
    results: list = [None] * len(prepared)
    for j, index in eager:
        p, g, _, corr, _, states = prepared[j]
        results[j] = step_leaf(spec, hyper, p, g, states, write=write, sr=sr, key=key, leaf_index=index,
                               correction=corr)
    for (storages, device, (*_, corrected)), members in groups.items():
        static = {"spec": spec, "storages": storages, "write": write, "sr": sr}
        width = 4 + len(prepared[members[0]][4])
        h = hyper.to(device=device, dtype=torch.float32)
        fn = _compiled("step_many", tuple(sorted({**static, "width": width}.items())), device.type)
        for positions in _chunks(len(members)):
            chunk = [members[m if m is not None else positions[0]] for m in positions]
            flat = []
            for j in chunk:
                p, g, idx, corr, tensors, _ = prepared[j]
                flat += [p, g, idx, corr, *tensors]
            res = fn(h, key, *flat)
            per = len(res) // len(chunk)
            k = 2 if corrected else 1
            for m, j in zip(positions, chunk):
                if m is None:
                    continue
                part = res[m % BATCH * per:(m % BATCH + 1) * per]
                results[j] = (part[0], _new_states(prepared[j][5], part[k:]), part[1] if corrected else None)
    return results


def _scratch_leaf(p, g, states, index, corr) -> list:
    """The tensors of a leaf of the same shape class as ``(p, g, states, index, corr)`` with
    at most 2 rows, all zero: what fills up a compiled in-place call (its writes land here).
    Its step on zeros is finite (no division by zero: the rules add eps)."""
    from ..qtensor import QTensor

    def small(t, dtype=None):
        if t is None:
            return None
        shape = tuple(t.shape) if t.dim() < 2 else (min(t.shape[0], 2), *t.shape[1:])
        return torch.zeros(shape, dtype=dtype or t.dtype, device=t.device)

    own = []
    for s in states:
        own += [small(s.codes, torch.uint8), small(s.scale)] if isinstance(s, QTensor) else [small(s)]
    idx = None if index is None else torch.zeros_like(index)
    return [small(p), small(g), idx, small(corr), *own]


class CompiledSteps:
    """The compiled in-place step of fixed leaves ``(param, gradient, states, leaf_index,
    correction)`` of one static combination (rule, state storages and formats, ``write``, ``sr``,
    with or without a correction; one device) and shape class (:func:`shape_class`),
    prepared once: the arguments of each call (the shared code tables once, then per leaf its
    tensors) are laid out at construction, and a step puts in the gradients and makes one call
    per :data:`BATCH` leaves, the last call filled up with a scratch leaf
    (:func:`_scratch_leaf`): one graph. The gradients given here only tell the shape and dtype
    of the scratch leaf's; a step takes its own. The bits of :func:`step_leaf` on each leaf;
    states (and params with ``write``) are overwritten."""

    def __init__(self, spec: StepSpec, leaves: Sequence, *, write: bool, sr: bool):
        from ..qtensor import QTensor

        storages = state_storages(leaves[0][2])
        classes = {leaf_class(p, g, state_storages(states), corr) for p, g, states, _, corr in leaves}
        if len(classes) != 1:
            raise ValueError(f"CompiledSteps takes leaves of one shape class, param and gradient dtype, with or "
                             f"without a correction; got {len(classes)} classes")
        if not all(compiles(g.shape, storages) for _, g, _, _, _ in leaves):
            raise ValueError("CompiledSteps takes no single-row leaf with quantized states (see compiles)")
        formats = tuple(dict.fromkeys(storage[1] for storage in storages if storage[0] == "q"))
        self.write, self.sr = write, sr
        self.device = None
        per_leaf = []
        for p, g, states, index, corr in leaves:
            own = []
            for s in states:
                own += [s.codes.view(torch.uint8), s.scale] if isinstance(s, QTensor) else [s]
            device = own[0].device if own else g.device
            if self.device is None:
                self.device = device
            idx = torch.tensor(index, dtype=torch.int64, device=device) if sr else None
            per_leaf.append([None if p is None else p.detach(), None, idx, corr, *own])
        if len(per_leaf) % BATCH:
            p, g, states, _, corr = min(leaves, key=lambda leaf: leaf[1].numel())
            per_leaf.append(_scratch_leaf(None if p is None else p.detach(), g, states,
                                          per_leaf[0][2], corr))
        static = {"spec": spec, "storages": storages, "write": write, "sr": sr, "formats": formats,
                  "leaf_class": classes.pop()}
        self._fn = _compiled("step_inplace", tuple(sorted(static.items())), self.device.type)
        self._consts = _pack_consts(formats, self.device)
        self._hyper = self._consts.view(torch.float32)[:NHYPER]
        self._calls = []  # (leaf positions, flat argument list, gradient slots in it)
        for chunk in _chunks(len(leaves)):
            flat = [self._consts]
            slots = []
            for m in chunk:
                slots.append(len(flat) + 1)
                flat += per_leaf[m if m is not None else len(leaves)]
            real = [(m, slot) for m, slot in zip(chunk, slots) if m is not None]
            self._calls.append(([m for m, _ in real], flat, [slot for _, slot in real]))

    def run(self, grads: Sequence[torch.Tensor], hyper: torch.Tensor, key: Optional[torch.Tensor] = None) -> list:
        """One step; ``grads`` in the leaves' order. Returns the float32 updates (``None``
        per leaf with ``write``)."""
        self._hyper.copy_(hyper)
        outs: list = [None] * len(grads)
        for positions, flat, slots in self._calls:
            for m, slot in zip(positions, slots):
                flat[slot] = grads[m]
            res = self._fn(key, *flat)
            for slot in slots:  # hold no gradient between steps (the scratch leaf keeps its own)
                flat[slot] = None
            if not self.write:
                for m, u in zip(positions, res):
                    outs[m] = u
        return outs
