"""SOAP (Vyas et al. 2024, arXiv 2409.11321): Adam in the eigenbasis of Shampoo's preconditioner,
with states that may be low-bit.

The reference is ``soap.py`` of github.com/nikhilvyas/SOAP at commit ``a1e5535`` (the merge of
pull request 18, "momentum change", where ``exp_avg`` lives in the eigenbasis and is rotated
when the basis changes). Per leaf and per gradient, as it does:

1. The leaf's first gradient only builds the preconditioner: for each *rotated* dimension ``d``
   (size <= ``max_precond_dim``; a 1-D leaf only with ``precondition_1d``) the factor
   ``GG_d = (1 - shampoo_beta) G_(d) G_(d)^T`` (``G_(d)``: the gradient unfolded along ``d``) and
   its eigenbasis ``Q_d``: ``torch.linalg.eigh(GG_d + 1e-30 I)`` in float32 (float64 if that
   raises), columns by descending eigenvalue. The update is zero: params do not move, not even
   by weight decay.
2. Every later gradient, Adam step ``t = 1, 2, ...``: ``P = G x_d Q_d^T`` (the gradient in the
   eigenbasis; a dimension that is not rotated keeps its coordinates); ``m = b1 m + (1 - b1) P``,
   ``v = b2 v + (1 - b2) P^2``; ``u = (m / (sqrt(v) + eps)) x_d Q_d`` (back to the param's
   coordinates), optionally ``u / (1e-30 + rms(u))`` (``normalize_grads``); the param step
   ``p <- p - lr sqrt(1 - b2^t) / (1 - b1^t) u`` (without ``bias_correction``: ``lr u``), then
   ``p <- p - lr wd p`` (the reference decays *after* the step).
3. Then the factors take this gradient: ``GG_d <- lerp(GG_d, G_(d) G_(d)^T, 1 - shampoo_beta)``;
   and when ``t % precondition_frequency == 0`` each basis is refreshed by one power iteration
   and a QR: the columns of ``Q_d`` sorted by ``diag(Q_d^T GG_d Q_d)`` descending (``v``'s
   entries along ``d`` re-ordered the same way), ``Q_d <- qr(GG_d Q_d)``; ``m`` is rotated into
   the new basis (``v`` is only re-ordered, as in the reference).

``merge_dims`` (the reference's folding of small dimensions) is not implemented, so
``data_format``, which only matters there, is accepted and checked but changes nothing.

**How the factors are kept** (docs/guide/soap.md): not ``GG_d`` itself but its coordinates in
its own eigenbasis, ``S_d = Q_d^T GG_d Q_d`` (nearly diagonal: its off-diagonal is what a
refresh rotates away). Stored are ``Q_d`` (``basis``), ``diag(S_d)`` in float32
(``eigenvalues``: the eigenvalue estimates the refresh sorts by) and ``S_d`` with a zero diagonal
(``coupling``). The math is the reference's, re-expressed: the factor update is
``S_d <- lerp(S_d, P_(d) P_(d)^T, 1 - shampoo_beta)`` (``P`` already holds ``Q_d^T G``, and the
other dimensions' rotations cancel in the product), the power iteration is
``Q_d S_d[:, order]``, and after ``Q_d' = qr(...)``, with ``R = Q_d^T Q_d'``: ``S_d <- R^T S_d R``
and ``m <- m x_d R^T``. With ``precond_format="fp32"`` these are float32 tensors (24 state bytes
a param on a square matrix, as the reference); with ``"8bit"`` / ``"4bit"`` ``basis`` and
``coupling`` are block-wise records (:data:`PRECOND_FORMATS`, blocks of
:data:`PRECOND_BLOCK_SIZE`), as 4-bit Shampoo (Wang et al., NeurIPS 2024) keeps eigenvectors,
and each decoded basis is made orthogonal again by ``bjorck_steps`` iterations
(``DEFAULT_BJORCK_STEPS``) of
``Q <- 1.5 Q - 0.5 Q Q^T Q``. The Adam moments take ``state_format`` like
:func:`~lowbit_tree.scale_by_adam`'s (via :mod:`lowbit_tree.moments`).

**Failures** (the same on every process that holds the same factor): an eigendecomposition
that raises in float32 and float64, a factor or a result with a NaN or infinity, leave that
dimension's basis (and its ``S_d``) as they were -- the identity's columns reversed at the first
gradient -- and add one to the leaf's ``precond_failures`` (:func:`soap_report` lists it). A
non-finite gradient otherwise goes into the moments and the param as in Adam (the bridge's
``skip_nonfinite`` skips such a step whole).
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from . import kernels, moments, records
from .base import STEP, GradientTransformation, ScalarOrSchedule, copy_into, init_count, renamed_argument, scalar_value
from .qtensor import QTensor, row_layout
from .tree_utils import flatten, map_leaves

__all__ = [
    "PRECOND_FORMATS",
    "PRECOND_BLOCK_SIZE",
    "DATA_FORMATS",
    "ScaleBySoapState",
    "SoapLeafReport",
    "rotated_dims",
    "bjorck",
    "scale_by_soap",
    "soap",
    "soap_report",
]

PRECOND_FORMATS = {"fp32": None, "8bit": "dynamic8", "4bit": "normal4"}
"""``precond_format`` -> the block format of ``basis`` and ``coupling`` (``None``: float32
tensors). 4-bit takes the normal-float map: an eigenbasis's entries are spread like a normal
sample, and on a random orthogonal 512 x 512 matrix (blocks of 64, two Bjorck steps) it lands
0.065 (RMS per entry, times sqrt(n)) from the exact one against 0.099 for the signed dynamic 4-bit
map (tests/test_soap_lowbit.py::test_normal_float_4bit_bases_land_nearer_than_dynamic_4bit)."""

PRECOND_BLOCK_SIZE = 64
DEFAULT_BJORCK_STEPS = {"fp32": 0, "8bit": 2, "4bit": 3}
"""Bjorck iterations after decoding a basis, per ``precond_format``: the fewest that bring a
decoded eigenbasis of a 96 x 96 factor to ``max |Q^T Q - I| < 1e-6`` (8-bit: 0.007, 2e-4, 5e-7;
4-bit: 0.077, 0.017, 4e-4, 8e-7 after 0, 1, 2, 3; tests/test_soap_lowbit.py)."""
DATA_FORMATS = ("channels_first", "channels_last")
FAILURE = "precond_failures"


class ScaleBySoapState(NamedTuple):
    count: torch.Tensor  # int32, 0-d: updates taken (a learning-rate schedule's argument)
    steps: Any  # per leaf, int32 0-d: gradients seen (0: no preconditioner yet; Adam's t is steps)
    exp_avg: Any  # per leaf, shaped like the param, in the eigenbasis' coordinates
    exp_avg_sq: Any  # per leaf, shaped like the param, in the eigenbasis' coordinates
    basis: Any  # per leaf, a tuple per dimension: Q_d (n, n) float32 or record, or None (not rotated)
    eigenvalues: Any  # per leaf, a tuple per dimension: diag(S_d) float32 (n,), or None
    coupling: Any  # per leaf, a tuple per dimension: S_d with a zero diagonal (n, n), or None
    failures: Any  # per leaf, int32 0-d: refreshes that kept the old basis (module docstring)

    # a per-dimension field's role names one state per rotated dimension d ("eigenbasis_0", ...):
    # ``{dim}`` is filled with the index after the leaf's (lowbit_tree.base.state_roles)
    roles = {"count": STEP, "steps": "soap_step", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
             "basis": "eigenbasis_{dim}", "eigenvalues": "eigenvalues_{dim}", "coupling": "coupling_{dim}",
             "failures": FAILURE}


LEAF_FIELDS = ("steps", "exp_avg", "exp_avg_sq", "basis", "eigenvalues", "coupling", "failures")
"""The fields of :class:`ScaleBySoapState` that hold one entry per leaf, in order (all but ``count``)."""


class SoapLeafReport(NamedTuple):
    """One leaf's preconditioner: its ``shape``, which dimensions are ``rotated``, the gradients
    it has seen (``steps``) and the refreshes that kept an old basis (``failures``)."""

    index: int
    shape: tuple
    rotated: tuple
    steps: int
    failures: int


def rotated_dims(shape: Sequence[int], max_precond_dim: int, precondition_1d: bool) -> tuple[bool, ...]:
    """Which dimensions of a param of ``shape`` get an eigenbasis (the reference's
    ``init_preconditioner``, without ``merge_dims``)."""
    shape = tuple(shape)
    if len(shape) == 1:
        return (bool(precondition_1d) and shape[0] <= max_precond_dim,)
    return tuple(n <= max_precond_dim for n in shape)


def bjorck(q: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` Bjorck iterations ``Q <- 1.5 Q - 0.5 Q (Q^T Q)`` toward the nearest orthogonal
    matrix (a new tensor; ``q`` is not modified)."""
    for _ in range(steps):
        q = 1.5 * q - 0.5 * (q @ (q.T @ q))
    return q


# ----------------------------------------------------------------------------
# Per-leaf math (float32 work tensors)
# ----------------------------------------------------------------------------
def _project(x: torch.Tensor, bases: Sequence[Optional[torch.Tensor]], back: bool) -> torch.Tensor:
    """``x`` in the eigenbasis (``back=False``: ``x x_d Q_d^T``) or back (``x x_d Q_d``), one
    dimension after the other as the reference's ``project`` / ``project_back`` (each step
    moves the first dimension last)."""
    for q in bases:
        if q is None:
            x = x.permute(*range(1, x.ndim), 0)
        else:
            x = torch.tensordot(x, q, dims=([0], [1 if back else 0]))
    return x


def _gram(x: torch.Tensor, d: int) -> torch.Tensor:
    """``X_(d) X_(d)^T``: contracted over every dimension but ``d``."""
    other = [k for k in range(x.ndim) if k != d]
    return torch.tensordot(x, x, dims=(other, other))


def _eigenbasis(gg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``get_orthogonal_matrix`` for one factor: ``(eigenvectors by descending
    eigenvalue, True)``; where the factor or its decomposition is not finite, or eigh fails,
    ``(the identity's columns reversed, False)``. The flag is a 0-d bool tensor on the factor's
    device, chosen there (``torch.where``): no host sync (a non-finite factor is decomposed as the
    identity, so eigh does not see it)."""
    eye = torch.eye(gg.shape[0], dtype=gg.dtype, device=gg.device)
    reversed_eye = torch.flip(eye, [1])
    ok = torch.isfinite(gg).all()
    m = torch.where(ok, gg + 1e-30 * eye, eye)
    try:
        _, q = torch.linalg.eigh(m)
    except torch.linalg.LinAlgError:
        try:
            _, q = torch.linalg.eigh(m.double())
        except torch.linalg.LinAlgError:
            return reversed_eye, torch.zeros((), dtype=torch.bool, device=gg.device)
        q = q.float()
    q = torch.flip(q, [1])
    ok = ok & torch.isfinite(q).all()
    return torch.where(ok, q, reversed_eye), ok


def _chosen(ok: torch.Tensor, new: Any, old: Any) -> Any:
    """``new`` where the 0-d flag ``ok`` is true, else ``old``: part by part for a record (chosen
    on the device, no host sync)."""
    kind = records.kind_of(old)
    if kind is None:
        return torch.where(ok, new, old)
    new_parts = kind.parts_of(new)
    parts = {name: torch.where(ok, new_parts[name], t) for name, t in kind.parts_of(old).items()}
    return kind.make(parts, tuple(old.shape), kind.meta_of(old))


def _split(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``S`` as (its diagonal, itself with a zero diagonal)."""
    diag = s.diagonal().clone()
    off = s.clone()
    off.diagonal().zero_()
    return diag, off


def _joined(diag: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    s = off.clone()
    s.diagonal().copy_(diag)
    return s


def _load(leaf: Any) -> torch.Tensor:
    """A stored leaf as float32 (block records through the kernels' decoder: the same bits as
    :func:`lowbit_tree.records.load`, faster)."""
    if isinstance(leaf, QTensor):
        return kernels.dequantize_fast(leaf)
    return records.load(leaf)


def _store(x: torch.Tensor, like: Any) -> Any:
    """``x`` stored as ``like`` (block records through the kernels' encoder, the reference's bits)."""
    if isinstance(like, QTensor):
        codes, scale = kernels.quantize_rows_fast(x.reshape(row_layout(x.shape)), like.format, like.block_size)
        return QTensor.unchecked(codes, scale, like.shape, like.block_size, like.format)
    return records.store(x, like)


class _Leaf:
    """One leaf's stored state, decoded to float32 work tensors, and written back. ``steps`` is
    the leaf's count of gradients seen as a host int (the plan keeps it there; the stored
    ``steps`` tensor is only advanced on the device), ``failures`` stays a tensor: nothing here
    reads a tensor on the host."""

    def __init__(self, steps: int, m, v, basis, eig, coupling, failures, bjorck_steps):
        self.like = (m, v, basis, coupling)
        self.steps, self.failures = steps, failures
        self.m, self.v = _load(m), _load(v)
        self.q = [None if b is None else bjorck(_load(b), bjorck_steps if records.is_record(b) else 0)
                  for b in basis]
        # per dimension: False (the stored basis is kept: re-encoding its rectified decode every step
        # would walk it away from its value), True (built this step: stored), or a 0-d bool tensor
        # (refreshed where it is true: stored there, else the stored codes are kept)
        self.new_basis: list = [False] * len(basis)
        self.s = [None if e is None else _joined(e.float(), _load(c)) for e, c in zip(eig, coupling)]

    def failed_unless(self, ok: torch.Tensor) -> None:
        """One more failure where the 0-d flag ``ok`` is false (on the device)."""
        self.failures = self.failures + (~ok).to(self.failures.dtype)

    def stored(self, inplace: bool, old: tuple) -> tuple:
        """``(steps, m, v, basis, eigenvalues, coupling, failures)`` in the stored kinds; with
        ``inplace`` written into the ``old`` tensors."""
        m_like, v_like, basis_like, coupling_like = self.like
        # contiguous: a QR's column-major result would take other BLAS paths than the in-place
        # form's copy into the old tensor, and the two forms must give the same bits
        m = _store(self.m.contiguous(), m_like)
        v = _store(self.v.contiguous(), v_like)
        basis = []
        for q, b, new in zip(self.q, basis_like, self.new_basis):
            if q is None or new is False:
                basis.append(b)
            elif new is True:
                basis.append(_store(q.contiguous(), b))
            else:
                basis.append(_chosen(new, _store(q.contiguous(), b), b))
        eig, coupling = [], []
        for s, c in zip(self.s, coupling_like):
            if s is None:
                eig.append(None)
                coupling.append(None)
                continue
            diag, off = _split(s)
            eig.append(diag)
            coupling.append(_store(off.contiguous(), c))
        new = (old[0] + 1, m, v, tuple(basis), tuple(eig), tuple(coupling), self.failures)
        if not inplace:
            return new
        copy_into(old, new)
        return old


# ----------------------------------------------------------------------------
# The transformation
# ----------------------------------------------------------------------------
def _check(b1, b2, shampoo_beta, eps, weight_decay, precondition_frequency, max_precond_dim, precondition_1d,
           normalize_grads, data_format, bias_correction, precond_format, bjorck_steps) -> None:
    for name, value in (("b1", b1), ("b2", b2)):
        if isinstance(value, numbers.Real) and not 0 <= value < 1:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if shampoo_beta is not None and not isinstance(shampoo_beta, torch.Tensor) and not (
            isinstance(shampoo_beta, numbers.Real) and shampoo_beta < 1):
        raise ValueError(f"shampoo_beta must be a number < 1 (negative or None: b2, as the reference's -1), "
                         f"got {shampoo_beta!r}")
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(value, numbers.Real) and not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    for name, value in (("precondition_frequency", precondition_frequency), ("max_precond_dim", max_precond_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, value in (("precondition_1d", precondition_1d), ("normalize_grads", normalize_grads),
                        ("bias_correction", bias_correction)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format must be one of {DATA_FORMATS}, got {data_format!r}")
    if precond_format not in PRECOND_FORMATS:
        raise ValueError(f"precond_format must be one of {tuple(PRECOND_FORMATS)}, got {precond_format!r}")
    if bjorck_steps is not None and (isinstance(bjorck_steps, bool) or not isinstance(bjorck_steps, int)
                                     or bjorck_steps < 0):
        raise ValueError(f"bjorck_steps must be an int >= 0 or None (the format's default), got {bjorck_steps!r}")


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: Optional[float] = None,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    data_format: str = "channels_first",
    bias_correction: bool = True,
    *,
    correct_bias: Optional[bool] = None,
    learning_rate: Optional[ScalarOrSchedule] = None,
    weight_decay: float = 0.0,
    state_format: moments.StateFormat = "fp32",
    precond_format: str = "fp32",
    bjorck_steps: Optional[int] = None,
    block_size: Optional[int] = None,
    min_quant_size: int = 4096,
    whole_step: Optional[Callable] = None,
) -> GradientTransformation:
    """SOAP's update (the module docstring's steps, the reference's arguments and defaults).

    Args:
      b1, b2, shampoo_beta, eps: the reference's (``betas = (b1, b2)``; ``shampoo_beta`` ``None``
        or negative: ``b2``).
      precondition_frequency, max_precond_dim, precondition_1d, normalize_grads, data_format: the
        reference's; ``data_format`` changes nothing here (it only matters with the reference's
        ``merge_dims``, which this does not implement).
      bias_correction: the reference's bias correction (its ``correct_bias``, the name this
        function took before and still takes, deprecated, for one release).
      learning_rate, weight_decay: ``None`` (default): the update is the step's direction
        ``sqrt(1 - b2^t) / (1 - b1^t) u`` (``u`` without ``bias_correction``), to chain with
        :func:`~lowbit_tree.add_decayed_weights` and :func:`~lowbit_tree.scale_by_learning_rate`
        (which decay before the step: AdamW's order, not the reference's); a non-zero
        ``weight_decay`` is then refused (a ValueError). A float, 0-d tensor or schedule: the
        update is the reference's whole param step, decay after (needs params).
      state_format, block_size, min_quant_size: the Adam moments' storage, as
        :func:`~lowbit_tree.scale_by_adam`'s (default ``"fp32"``; a mapping names ``exp_avg`` /
        ``exp_avg_sq``; 4-bit second moments are rank-1 normalized).
      precond_format: ``"fp32"``, ``"8bit"`` or ``"4bit"``: the bases and couplings
        (``PRECOND_FORMATS``) of ``n x n >= min_quant_size``; smaller ones and the
        eigenvalues are float32 in every format.
      bjorck_steps: Bjorck iterations after decoding a quantized basis (``None``:
        ``DEFAULT_BJORCK_STEPS``; float32 bases take none).
      whole_step: where the in-place plan's leaves are stepped: ``whole_step(index, old, param,
        grad, step) -> update`` for each leaf with a gradient (``index``: its position plus the
        plan's ``leaf_offset``; ``old``: its state ``(steps, exp_avg, exp_avg_sq, bases,
        eigenvalues, couplings, failures)``), where ``step(old, param, grad) -> update`` steps a
        whole leaf's state in place. A sharded caller gathers the leaf's blocks, runs ``step`` on
        one process and returns each process its block of the update (in the param's dtype);
        ``None`` (default): ``step`` on the leaf as it is. Each leaf's count advances on every
        process alike (kept on the host).
    Returns:
      A transformation with state :class:`ScaleBySoapState`; updates are float32.
    """
    bias_correction = renamed_argument("correct_bias", correct_bias, "bias_correction", bias_correction, True)
    _check(b1, b2, shampoo_beta, eps, weight_decay, precondition_frequency, max_precond_dim, precondition_1d,
           normalize_grads, data_format, bias_correction, precond_format, bjorck_steps)
    if learning_rate is None and isinstance(weight_decay, (numbers.Real, torch.Tensor)) and float(weight_decay) != 0:
        raise ValueError(f"scale_by_soap: weight_decay={weight_decay!r} needs a learning_rate (the decay is "
                         "p <- p - lr wd p); pass learning_rate, or weight_decay=0 and chain "
                         "add_decayed_weights(wd) and scale_by_learning_rate(lr)")
    formats = moments.state_formats(state_format, ("exp_avg", "exp_avg_sq"))
    rank1 = moments.resolve_rank1(None, formats["exp_avg_sq"])
    block_format = PRECOND_FORMATS[precond_format]
    n_bjorck = DEFAULT_BJORCK_STEPS[precond_format] if bjorck_steps is None else bjorck_steps

    def sb() -> float:
        beta = None if shampoo_beta is None else float(shampoo_beta)
        return float(b2) if beta is None or beta < 0 else beta

    def square(n: int, device) -> Any:
        if block_format is None or not moments.should_quantize((n, n), min_quant_size):
            return torch.zeros((n, n), dtype=torch.float32, device=device)
        return records.BLOCK.zeros((n, n), {"format": block_format, "block_size": PRECOND_BLOCK_SIZE}, device)

    def init(params):
        def counter(p):
            return None if p is None else torch.zeros((), dtype=torch.int32, device=p.device)

        def moment(signed: bool, name: str):
            return lambda p: moments.init_moment(p, formats[name], signed=signed, block_size=block_size,
                                                 min_quant_size=min_quant_size, rank1=rank1 and not signed)

        def per_dim(make):
            def leaf(p):
                if p is None:
                    return None
                rot = rotated_dims(p.shape, max_precond_dim, precondition_1d)
                return tuple(make(n, p.device) if r else None for n, r in zip(p.shape, rot))
            return leaf

        return ScaleBySoapState(
            init_count(params), map_leaves(counter, params),
            map_leaves(moment(True, "exp_avg"), params), map_leaves(moment(False, "exp_avg_sq"), params),
            map_leaves(per_dim(square), params),
            map_leaves(per_dim(lambda n, dev: torch.zeros((n,), dtype=torch.float32, device=dev)), params),
            map_leaves(per_dim(square), params), map_leaves(counter, params))

    def build(leaf: _Leaf, g: torch.Tensor) -> None:
        """Step 1 of the module docstring."""
        beta = sb()
        for d, q in enumerate(leaf.q):
            if q is None:
                continue
            gg = torch.zeros_like(leaf.s[d]).lerp_(_gram(g, d), 1 - beta)
            new, ok = _eigenbasis(gg)
            leaf.failed_unless(ok)
            leaf.q[d], leaf.new_basis[d] = new, True
            leaf.s[d] = new.T @ gg @ new

    def refresh(leaf: _Leaf) -> None:
        """Step 3's refresh, in the eigenbasis' coordinates (module docstring). A dimension whose
        factor, basis or QR is not finite keeps its basis, ``S_d`` and moments: chosen on the
        device (``torch.where``; a non-finite input is decomposed as the identity instead)."""
        for d, q in enumerate(leaf.q):
            if q is None:
                continue
            s = leaf.s[d]
            ok = torch.isfinite(s).all() & torch.isfinite(q).all()
            order = torch.argsort(s.diagonal(), descending=True)
            x = torch.where(ok, q @ s[:, order], torch.eye(q.shape[0], dtype=q.dtype, device=q.device))
            new, _ = torch.linalg.qr(x)
            ok = ok & torch.isfinite(new).all()
            leaf.failed_unless(ok)
            r = q.T @ new
            leaf.v = torch.where(ok, leaf.v.index_select(d, order), leaf.v)
            leaf.m = torch.where(ok, _rotate(leaf.m, d, r), leaf.m)
            leaf.s[d] = torch.where(ok, r.T @ s @ r, s)
            leaf.q[d], leaf.new_basis[d] = torch.where(ok, new, q), ok

    def step_leaf(g, p, leaf: _Leaf, lr, wd) -> Optional[torch.Tensor]:
        g = g.float()
        if leaf.steps == 0:
            build(leaf, g)
            leaf.steps = 1
            return torch.zeros_like(g)
        t, b1f, b2f = leaf.steps, float(b1), float(b2)
        proj = _project(g, leaf.q, back=False)
        leaf.m = leaf.m.mul(b1f).add_(proj, alpha=1.0 - b1f)
        leaf.v = leaf.v.mul(b2f).add_(proj.square(), alpha=1.0 - b2f)
        u = _project(leaf.m / leaf.v.sqrt().add_(float(eps)), leaf.q, back=True)
        if normalize_grads:
            u = u / (1e-30 + torch.mean(u ** 2) ** 0.5)
        ratio = 1.0
        if bias_correction:
            ratio = (1.0 - b2f ** t) ** 0.5 / (1.0 - b1f ** t)
        beta = sb()
        for d, s in enumerate(leaf.s):
            if s is not None:
                leaf.s[d] = s.lerp(_gram(proj, d), 1 - beta)
        if t % precondition_frequency == 0:
            refresh(leaf)
        leaf.steps = t + 1
        if lr is None:
            return u.mul_(ratio)
        pf = p.float()
        new = pf.add(u, alpha=-(lr * ratio))
        if wd > 0:
            new.add_(new, alpha=-(lr * wd))
        return new.sub_(pf)

    def run(updates, state, params, inplace: bool, host_steps: Optional[list] = None, leaf_offset: int = 0):
        """The step over every leaf with a gradient. ``host_steps``: each leaf's gradients seen as
        host ints (the plan's, advanced here, each leaf stepped through ``whole_step``); ``None``:
        read from ``state.steps`` (``update``)."""
        g_leaves, treespec = flatten(updates)
        fields = [treespec.flatten_up_to(getattr(state, f)) for f in LEAF_FIELDS]
        if learning_rate is not None and params is None:
            raise ValueError("scale_by_soap(learning_rate=...) needs params: call update(updates, state, params)")
        p_leaves = treespec.flatten_up_to(params) if params is not None else [None] * len(g_leaves)
        lr = None if learning_rate is None else float(scalar_value(learning_rate, state.count))
        wd = float(weight_decay)
        out, new_fields = list(g_leaves), [list(f) for f in fields]
        for i, g in enumerate(g_leaves):
            if g is None:
                continue
            old = tuple(f[i] for f in fields)
            if old[1] is None:
                raise ValueError(f"scale_by_soap: leaf {i} has a gradient but no state (its param was None at init)")
            steps = int(old[0]) if host_steps is None else host_steps[i]

            def one(old, p, g, steps=steps, i=i):
                leaf = _Leaf(steps, *old[1:], bjorck_steps=n_bjorck)
                u = step_leaf(g, p, leaf, lr, wd)
                for f, value in zip(new_fields, leaf.stored(inplace, old)):
                    f[i] = value
                return u

            if host_steps is None:
                out[i] = one(old, p_leaves[i], g)
                continue
            out[i] = (whole_step or _here)(i + leaf_offset, old, p_leaves[i], g, one)
            host_steps[i] = steps + 1
        return treespec.unflatten(out), [treespec.unflatten(f) for f in new_fields]

    def update(updates, state, params=None, **extra):
        out, fields = run(updates, state, params, False)
        return out, ScaleBySoapState(state.count + 1, *fields)

    def plan(state, params, *, write=False, leaf_offset=0):
        """The in-place step over ``state``: each leaf's gradients seen are read here, once, and
        kept as host ints beside the state (a step reads no tensor on the host: the refresh's
        schedule and Adam's ``t`` come from them). A step reads the leaves of ``state``'s per-leaf
        lists and of ``params`` when it is called, so a caller may point one at another tensor of
        the same shape and kind between steps (the bridge's owner of a sharded param points them
        at the states it gathers). With ``write`` each update is added to its param (in the
        param's dtype) and ``None`` returned for it."""
        treespec = flatten(params)[1]
        host_steps = [None if n is None else int(n) for n in treespec.flatten_up_to(state.steps)]

        def step(updates: list) -> list:
            out, _ = run(treespec.unflatten(list(updates)), state, params, True, host_steps, leaf_offset)
            state.count.add_(1)
            out = treespec.flatten_up_to(out)
            if not write:
                return out
            p_leaves = treespec.flatten_up_to(params)
            for k, u in enumerate(out):
                if u is not None and updates[k] is not None:
                    p_leaves[k].add_(u.to(p_leaves[k].dtype))
                    out[k] = None
            return out

        return step

    return GradientTransformation(init, update, plan)


def _here(index: int, old: tuple, param, grad, step: Callable):
    """The default ``whole_step``: the leaf stepped as it is."""
    return step(old, param, grad)


def _rotate(x: torch.Tensor, d: int, r: torch.Tensor) -> torch.Tensor:
    """``x`` with dimension ``d`` multiplied by ``R^T`` (coordinates in basis ``Q`` to ``Q R``)."""
    return torch.movedim(torch.tensordot(x, r, dims=([d], [0])), -1, d)


def soap(
    learning_rate: ScalarOrSchedule = 3e-3,
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: Optional[float] = None,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    precondition_1d: bool = False,
    normalize_grads: bool = False,
    data_format: str = "channels_first",
    bias_correction: bool = True,
    *,
    correct_bias: Optional[bool] = None,
    state_format: moments.StateFormat = "fp32",
    precond_format: str = "fp32",
    bjorck_steps: Optional[int] = None,
    block_size: Optional[int] = None,
    min_quant_size: int = 4096,
) -> GradientTransformation:
    """The reference's ``SOAP`` optimizer (its defaults, ``lr=3e-3``, ``weight_decay=0.01``): the
    update is the whole param step (:func:`scale_by_soap` with ``learning_rate``); add it with
    :func:`~lowbit_tree.apply_updates`."""
    return scale_by_soap(b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim, precondition_1d,
                         normalize_grads, data_format, renamed_argument("correct_bias", correct_bias,
                                                                        "bias_correction", bias_correction, True),
                         learning_rate=learning_rate,
                         weight_decay=weight_decay, state_format=state_format, precond_format=precond_format,
                         bjorck_steps=bjorck_steps, block_size=block_size, min_quant_size=min_quant_size)


def soap_report(state: ScaleBySoapState) -> list:
    """One row per leaf with a state: its preconditioner's shape, rotated dimensions, gradients
    seen and failed refreshes (``SoapLeafReport`` rows; the module docstring's "Failures")."""
    rows = []
    steps = flatten(state.steps)[0]
    treespec = flatten(state.steps)[1]
    fields = [treespec.flatten_up_to(getattr(state, f)) for f in ("exp_avg", "basis", "failures")]
    for i, (n, m, basis, fails) in enumerate(zip(steps, *fields)):
        if n is None:
            continue
        rows.append(SoapLeafReport(i, tuple(m.shape), tuple(b is not None for b in basis), int(n), int(fails)))
    return rows


torch.serialization.add_safe_globals([ScaleBySoapState])
