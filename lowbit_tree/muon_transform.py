"""Muon (torch.optim.Muon's rule) with a low-bit momentum buffer.

Per 2-D leaf, in this order (design.md, "Muon"):

1. the ``muon`` rule of :mod:`lowbit_tree.kernels` (one kernel call for every leaf):
   ``b = lerp(b, g, 1 - momentum)``; ``u = lerp(g, b, momentum)`` (``nesterov``) or ``b``;
   the buffer ``b`` is stored in ``state_format``;
2. the Newton-Schulz input ``x``: ``u`` in the buffer's own storage, i.e. the quantized new
   buffer itself (no nesterov), ``u`` quantized like it (nesterov), or ``u`` rounded to
   bfloat16 for fp32 / bf16 buffers (exactly what Newton-Schulz does first anyway);
3. ``o = newton_schulz(x)``: torch.optim.Muon's quintic iteration, op for op (bfloat16);
4. the update: ``o * ratio`` in float32 (``ratio`` from the matrix's shape, ``adjust_lr_fn``), or,
   with ``learning_rate``, torch.optim.Muon's own param step as an update ``t - p`` where
   ``t = fma(-(lr * ratio), o, p * (1 - lr * wd))`` (its ``mul_`` then ``add_(alpha=...)``; the
   constants in float64, rounded once): ``p + (t - p)`` is ``t`` whenever ``t`` is within a
   factor 2 of ``p`` (Sterbenz), so params track torch's to its last bit but for sign changes.

With ``momentum_rank=K`` (a quantized buffer), the buffer is a
:class:`~lowbit_tree.lowrank.LowRankQTensor`, ``b = L + E``: ``L = P R^T`` from bfloat16 factors
of rank ``K``, ``E`` a quantized residual. Step 1 runs the same ``muon`` rule (the kernels, float32
state) on the residual: state ``E``, input ``g - L``, so ``s' = lerp(E, g - L, 1 - momentum)`` is
the new buffer minus ``L`` and the rule's ``u`` is ``u - L``. Step 2's input is ``L`` plus ``u - L``
in 8 bits (:data:`NS_RESIDUAL_FORMAT`; ``u - L`` is ``s'`` without nesterov). Where
Newton-Schulz runs, the factors are refreshed too: one power iteration warm-started from the old
column factor, on the whole stored-form new buffer ``L + Q(s')``. Last, the residual against the
new factors ``L'`` is rounded once, from the float32 ``s'``: ``E' = Q(s' + L - L')``.

Step 2 is what makes the sharded optimizer exact and cheap: ``x`` of a row shard is rows of
the whole matrix's ``x`` (blocks never straddle a row), so an owner rank can gather the
*stored* rows (1 byte a value for 8-bit, plus scales) and compute the same bits as a single
process. The hook ``orthogonalize`` is where a distributed caller (``bridge.Muon`` under
FSDP2) does that; the default runs each leaf here.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from . import kernels, moments
from .base import GradientTransformation, ScalarOrSchedule, scalar_value, state_names
from .lowrank import FACTOR_DTYPE, LowRankQTensor, lowrank_dequantize, lowrank_expand, lowrank_rank, refresh_factors
from .qtensor import QTensor, row_layout
from .rule_builder import RuleStage, rule_state, staged_rule
from .tree_utils import flatten

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "NS_RESIDUAL_FORMAT",
    "ScaleByMuonState",
    "NSInput",
    "newton_schulz",
    "adjust_lr_ratio",
    "check_ns_args",
    "check_momentum_rank",
    "ns_matrix",
    "local_orthogonalize",
    "refresh_record",
    "scale_by_muon",
]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic coefficients (torch.optim.Muon's defaults)."""

NS_RESIDUAL_FORMAT = "dynamic8"
"""The Newton-Schulz input's residual ``u - L`` with ``momentum_rank``: 8 bits (the signed dynamic
map) on the buffer's blocks, whatever the buffer's format. It is not stored, only handed to
Newton-Schulz (and, sharded, sent to the matrix's owner); a 4-bit input there cost held-out loss
(design.md, "Muon")."""


@rule_state("muon")
class ScaleByMuonState(NamedTuple):
    count: torch.Tensor  # int32, 0-d: steps taken (a learning-rate schedule's argument)
    trace: Any  # the momentum buffer, shaped like params (torch.optim.Muon's ``momentum_buffer``);
    # with momentum_rank, quantized buffers are LowRankQTensor records


class NSInput(NamedTuple):
    """One leaf's Newton-Schulz input as :func:`scale_by_muon` hands it to ``orthogonalize``:
    ``index`` is the leaf's position in the flattened tree (plus a chain's leaf offset), ``x``
    its rows in storage form (a :class:`~lowbit_tree.QTensor`, a
    :class:`~lowbit_tree.lowrank.LowRankQTensor` or a bfloat16 tensor). ``buffer``: with
    ``momentum_rank``, the new buffer in stored form against the old factors (a LowRankQTensor
    sharing ``x``'s factors), whose factors the hook refreshes; else ``None``. ``low``: with a
    buffer, the old factors' product for these rows (float32), for a hook that computes on them
    (``ns_matrix`` and ``refresh_record`` take it); a hook that assembles the whole
    matrix elsewhere rebuilds it there."""

    index: int
    x: Any
    buffer: Any = None
    low: Any = None


def newton_schulz(x: torch.Tensor, coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7) -> torch.Tensor:
    """The orthogonalization of torch.optim.Muon (``_zeropower_via_newtonschulz``), op for op,
    so the bits are torch's: in bfloat16, transposed when taller than wide, normalized by the
    Frobenius norm (at least ``eps``), then ``steps`` quintic iterations. Returns a new bfloat16
    tensor; ``x`` is not modified."""
    if x.ndim != 2:
        raise ValueError(f"newton_schulz takes a 2-D matrix, got shape {tuple(x.shape)}")
    a, b, c = coefficients
    o = x.to(torch.bfloat16, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        o = o.T
    o.div_(o.norm().clamp(min=eps))
    for _ in range(steps):
        gram = o @ o.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        o = torch.addmm(o, poly, o, beta=a)
    return o.T if tall else o


def adjust_lr_ratio(shape: Sequence[int], adjust_lr_fn: Optional[str]) -> float:
    """torch.optim.Muon's learning-rate factor for a ``(A, B)`` matrix: ``sqrt(max(1, A/B))``
    (``None`` / ``"original"``, Keller Jordan) or ``0.2 * sqrt(max(A, B))``
    (``"match_rms_adamw"``, Moonshot: AdamW's lr and decay carry over)."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")


def ns_matrix(x: Any, low: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A Newton-Schulz input in storage form as a 2-D matrix (float32 for a record; ``low``: a
    low-rank record's factor product, if the caller has it)."""
    if isinstance(x, QTensor):
        return kernels.dequantize_fast(x)
    if isinstance(x, LowRankQTensor):
        return lowrank_dequantize(x, low)
    return x


def local_orthogonalize(inputs: Sequence[NSInput], ns: Callable[[torch.Tensor], torch.Tensor]) -> list:
    """The default ``orthogonalize``: every leaf here; ``[(o, matrix shape)]``, and for an input with
    a ``buffer`` ``(o, matrix shape, refresh_record(buffer))``."""
    out = []
    for i in inputs:
        o, shape = ns(ns_matrix(i.x, i.low)), tuple(i.x.shape)
        out.append((o, shape) if i.buffer is None else (o, shape, refresh_record(i.buffer, i.low)))
    return out


def refresh_record(x: LowRankQTensor, low: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """New factors ``(P, R)`` of a *whole* stored low-rank buffer (:func:`~lowbit_tree.lowrank.refresh_factors`
    of its value, warm-started from its column factor; ``low`` as in :func:`ns_matrix`)."""
    return refresh_factors(lowrank_dequantize(x, low), x.col_factor)


def _ns_input(u: torch.Tensor, buf: Any, nesterov: bool) -> Any:
    """Step 2 of the module docstring."""
    if isinstance(buf, LowRankQTensor):  # u is u - L here: its residual in 8 bits, on the buffer's blocks
        codes, scale = kernels.quantize_rows_fast(u.reshape(row_layout(u.shape)), NS_RESIDUAL_FORMAT, buf.block_size)
        return LowRankQTensor(codes, scale, buf.row_factor, buf.col_factor, buf.shape, buf.block_size,
                              NS_RESIDUAL_FORMAT)
    if isinstance(buf, QTensor):
        if not nesterov:
            return buf  # u is the new buffer, whose stored form this is
        codes, scale = kernels.quantize_rows_fast(u.reshape(row_layout(u.shape)), buf.format, buf.block_size)
        return QTensor.unchecked(codes, scale, buf.shape, buf.block_size, buf.format)
    return u.to(torch.bfloat16)


def check_momentum_rank(momentum_rank, state_format: Optional[str]) -> None:
    """``momentum_rank`` checked against the buffer's ``state_format`` (a ValueError naming it;
    ``None``: no buffer here, e.g. a bridge AdamW group, so only the value is checked)."""
    if isinstance(momentum_rank, bool) or not isinstance(momentum_rank, int) or momentum_rank < 0:
        raise ValueError(f"momentum_rank must be an int >= 0, got {momentum_rank!r}")
    if momentum_rank and state_format in ("fp32", "bf16"):
        raise ValueError(f"momentum_rank={momentum_rank} splits a quantized momentum buffer; state_format="
                         f"{state_format!r} keeps it unquantized: use a quantized state_format ('nf4', '8bit', ...) "
                         "or momentum_rank=0")


def check_ns_args(ns_coefficients, ns_steps, adjust_lr_fn) -> tuple:
    """Newton-Schulz's static arguments checked (a ValueError naming the bad one); returns the
    coefficients as a tuple of three floats."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be an int in [0, 100), got {ns_steps!r}")
    if (isinstance(ns_coefficients, (str, bytes)) or not hasattr(ns_coefficients, "__len__")
            or len(ns_coefficients) != 3
            or not all(isinstance(c, numbers.Real) and not isinstance(c, bool) for c in ns_coefficients)):
        raise ValueError(f"ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}")
    adjust_lr_ratio((1, 1), adjust_lr_fn)
    return tuple(float(c) for c in ns_coefficients)


def scale_by_muon(
    momentum: float | torch.Tensor = 0.95,
    nesterov: bool = True,
    ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr_fn: Optional[str] = None,
    *,
    learning_rate: Optional[ScalarOrSchedule] = None,
    weight_decay: float | torch.Tensor = 0.0,
    state_format: moments.StateFormat = "8bit",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    momentum_rank: int = 0,
    orthogonalize: Optional[Callable] = None,
) -> GradientTransformation:
    """Muon's update for 2-D leaves: the momentum's Newton-Schulz orthogonalization times the
    shape's learning-rate ratio (the module docstring's four steps). Chain it with
    :func:`~lowbit_tree.add_decayed_weights` and :func:`~lowbit_tree.scale_by_learning_rate`
    (:func:`lowbit_tree.muon` does).

    Args:
      momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn: torch.optim.Muon's.
      learning_rate, weight_decay: ``None`` (default): the update is ``o * ratio``, to chain with
        other links. A float, 0-d tensor or schedule: the update is torch.optim.Muon's whole
        param step (step 4; needs params; tensor values are read on the host once a step).
      state_format, block_size, min_quant_size: the buffer's storage (as
        :func:`~lowbit_tree.scale_by_adam`; signed formats; a mapping's one name is
        ``"momentum_buffer"``).
      momentum_rank: ``K > 0``: each quantized buffer keeps its top-``K`` part as bfloat16 factors
        and quantizes only the residual (the module docstring; a matrix gets rank ``min(K, m,
        n)``). Needs a quantized ``state_format``. ``0`` (default): the buffer is one record.
      orthogonalize: ``(inputs: list[NSInput], ns) -> [(o rows, matrix shape)]``, where
        ``ns(matrix) -> bfloat16`` is this transformation's :func:`newton_schulz`; default
        ``local_orthogonalize``. A sharded caller gathers each matrix's rows, runs ``ns``
        and returns each leaf's rows of the result with the whole matrix's shape; for an input
        with a ``buffer`` (``momentum_rank``) also ``(P, R)``, the leaf's rows of
        ``refresh_record`` of the whole buffer (its rows of ``P``, its columns' rows of ``R``).
    Returns:
      A transformation with state :class:`ScaleByMuonState`; updates are float32.
    """
    buffer_format = moments.state_formats(state_format, state_names(ScaleByMuonState))["momentum_buffer"]
    coefficients = check_ns_args(ns_coefficients, ns_steps, adjust_lr_fn)
    if isinstance(eps, numbers.Real) and not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if isinstance(momentum, numbers.Real) and not 0 <= momentum:
        raise ValueError(f"momentum must be >= 0, got {momentum!r}")
    check_momentum_rank(momentum_rank, buffer_format)

    def ns(x: torch.Tensor) -> torch.Tensor:
        return newton_schulz(x, coefficients, ns_steps, float(eps))

    stage = _MuonStage(nesterov, momentum_rank, orthogonalize or local_orthogonalize, ns, adjust_lr_fn,
                       learning_rate, weight_decay)
    return staged_rule("muon", ScaleByMuonState, dict(nesterov=nesterov), dict(momentum=momentum),
                       RuleStage(stage.leaf, stage.before, stage.after), state_format=state_format,
                       block_size=block_size, min_quant_size=min_quant_size)


class _MuonStage(NamedTuple):
    """Muon's stage around its kernel rule (the module docstring's steps 2-4, and the low-rank
    buffer's residual in step 1), as :class:`~lowbit_tree.rule_builder.RuleStage` takes it."""

    nesterov: bool
    momentum_rank: int
    hook: Callable
    ns: Callable
    adjust_lr_fn: Optional[str]
    learning_rate: Optional[ScalarOrSchedule]
    weight_decay: Any

    def leaf(self, p, m):
        """The buffer of param ``p`` from the builder's record ``m``: a low-rank record around its
        codes with ``momentum_rank`` (zero factors)."""
        if p is not None and p.ndim != 2:
            raise ValueError(
                f"Muon takes 2-D params (matrices); got one of shape {tuple(p.shape)}: give embeddings, norms, "
                "biases and the head to AdamW (bridge.Muon: a param group with use_muon=False; functional: "
                "lowbit_tree.partition)"
            )
        if self.momentum_rank and isinstance(m, QTensor):  # the quantized buffer is the residual; zero factors
            k = lowrank_rank(m.shape, self.momentum_rank)
            rows, cols = (m.codes.new_zeros((n, k), dtype=FACTOR_DTYPE) for n in m.shape)
            return LowRankQTensor(m.codes, m.scale, rows, cols, m.shape, m.block_size, m.format)
        return m

    def before(self, updates, trees):
        """The kernel's input: the gradients and buffers, or for a low-rank buffer ``g - L`` and
        its residual ``E`` (a new tensor: the rule's scratch state)."""
        (trace,) = trees
        g_leaves, treespec = flatten(updates)
        for g in g_leaves:
            if g is not None and g.ndim != 2:
                raise ValueError(f"Muon takes 2-D gradients (matrices), got shape {tuple(g.shape)}")
        old_leaves = treespec.flatten_up_to(trace)
        low = [i for i, g in enumerate(g_leaves) if g is not None and isinstance(old_leaves[i], LowRankQTensor)]
        if not low:
            return updates, trees, (old_leaves, {})
        g2, t2, old_low = list(g_leaves), list(old_leaves), {}
        for i in low:
            rec = old_leaves[i]
            old_low[i] = lowrank_expand(rec.row_factor, rec.col_factor)
            t2[i] = kernels.dequantize_fast(rec.residual)
            g2[i] = g_leaves[i].float().sub(old_low[i])
        return treespec.unflatten(g2), (treespec.unflatten(t2),), (old_leaves, old_low)

    def after(self, updates, u_tree, new_trees, context, params, count, inplace: bool, offset: int):
        """Newton-Schulz on each leaf's input in storage form, the factors' refresh, the update."""
        old_leaves, old_low = context
        (new_trace,) = new_trees
        g_leaves, treespec = flatten(updates)
        u_leaves = treespec.flatten_up_to(u_tree)
        b_leaves = treespec.flatten_up_to(new_trace)
        where = [i for i, g in enumerate(g_leaves) if g is not None]  # empty ones too: a shard may be empty
        inputs = []
        for i in where:
            if i in old_low:  # the new buffer in stored form against the old factors
                rec, res = old_leaves[i], b_leaves[i]
                codes, scale = kernels.quantize_rows_fast(res.reshape(row_layout(res.shape)), rec.format, rec.block_size)
                buf = LowRankQTensor(codes, scale, rec.row_factor, rec.col_factor, rec.shape, rec.block_size, rec.format)
                inputs.append(NSInput(offset + i, _ns_input(u_leaves[i], buf, self.nesterov), buf, old_low[i]))
            else:
                inputs.append(NSInput(offset + i, _ns_input(u_leaves[i], b_leaves[i], self.nesterov)))
        results = list(self.hook(inputs, self.ns)) if inputs else []
        if len(results) != len(inputs):
            raise RuntimeError(f"orthogonalize returned {len(results)} results for {len(inputs)} inputs")
        if old_low:
            for k, i in enumerate(where):
                if i not in old_low:
                    continue
                if len(results[k]) != 3:
                    raise RuntimeError("orthogonalize must return (o, shape, (row factor, col factor)) for an input "
                                       "with a buffer (momentum_rank): refresh_record(buffer) of the whole matrix")
                o, shape, (pf, rf) = results[k]
                results[k] = (o, shape)
                rec = old_leaves[i]
                e = b_leaves[i].add_(old_low[i]).sub_(lowrank_expand(pf, rf))  # s' + L - L', in the rule's scratch
                codes, scale = kernels.quantize_rows_fast(e.reshape(row_layout(e.shape)), rec.format, rec.block_size)
                if inplace:  # the bridge's step_: the live record's tensors take the new values
                    for dst, src in ((rec.codes, codes), (rec.scale, scale), (rec.row_factor, pf), (rec.col_factor, rf)):
                        dst.copy_(src)
                    b_leaves[i] = rec
                else:
                    b_leaves[i] = LowRankQTensor(codes, scale, pf, rf, rec.shape, rec.block_size, rec.format)
            new_trace = treespec.unflatten(b_leaves)
        out = list(u_leaves)
        if self.learning_rate is None:
            for i, (o, shape) in zip(where, results):
                out[i] = o.float() * adjust_lr_ratio(shape, self.adjust_lr_fn)
        else:
            if params is None:
                raise ValueError("scale_by_muon(learning_rate=...) needs params: call update(updates, state, params)")
            p_leaves = treespec.flatten_up_to(params)
            lr, wd = float(scalar_value(self.learning_rate, count)), float(self.weight_decay)
            for i, (o, shape) in zip(where, results):
                p = p_leaves[i].float()
                t = p * (1.0 - lr * wd)  # then in place on this new tensor: the same ops, one buffer
                t.add_(o, alpha=-(lr * adjust_lr_ratio(shape, self.adjust_lr_fn)))
                out[i] = t.sub_(p)
        return treespec.unflatten(out), (new_trace,)


torch.serialization.add_safe_globals([ScaleByMuonState])
