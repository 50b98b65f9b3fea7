"""Code formats for block-wise quantized tensors.

A *format* says how one block of floats becomes small codes: a sorted table of
representable values (the "map") on a normalized scale, the divisor that turns a
block's absolute maximum into its scale, whether zero is representable, and
whether the values are stored as their square root.

Formats are concrete and static: ``"dynamic8"`` is always the signed 8-bit
dynamic map. The optimizer-level names (``"8bit"``, ``"4bit"``, ``"nf4"``, ``"fp8"``) pick a
pair of formats, one for signed first moments and one for non-negative second
moments (see :data:`STATE_FORMATS`).
"""
from __future__ import annotations

import dataclasses

import torch

# the code tables are module constants on the CPU whatever the default device (kernels move
# them to the data's device)
_CPU = torch.device("cpu")

__all__ = [
    "Format",
    "FORMATS",
    "STATE_FORMATS",
    "get_format",
    "dynamic_map",
    "normal_map",
    "float8_e4m3_values",
]


def dynamic_map(signed: bool, max_exponent_bits: int, total_bits: int) -> torch.Tensor:
    """The dynamic (decimal exponent + linear fraction) map of arXiv 2110.02861.

    Each decade ``10**-(E-1+... )`` gets ``2**i`` (signed) or ``2**(i+1)``
    (unsigned) linearly spaced fractions: bin centres of ``linspace(0.1, 1, n+1)``.
    Zero and 1.0 are always in the map. Built with float32 torch arithmetic so the
    values match bitsandbytes' ``create_dynamic_map`` bit for bit (tested).

    Returns a sorted float32 tensor of ``2**total_bits`` values.
    """
    values: list[float] = []
    non_sign_bits = total_bits - 1
    leftover = 2 ** (non_sign_bits - max_exponent_bits) - 1
    decade = 0
    for i in range(max_exponent_bits):
        extra = 0 if signed else 1
        n = 2 ** (i + non_sign_bits - max_exponent_bits + extra) + 1
        edges = torch.linspace(0.1, 1, n, dtype=torch.float32, device=_CPU)
        centres = (edges[:-1] + edges[1:]) / 2.0
        decade = 10 ** (-(max_exponent_bits - 1) + i)
        values += (decade * centres).tolist()
        if signed:
            values += (-decade * centres).tolist()
    if leftover > 0:
        edges = torch.linspace(0.1, 1, leftover + 1, dtype=torch.float32, device=_CPU)
        centres = (edges[:-1] + edges[1:]) / 2.0
        values += (decade * centres).tolist()
        if signed:
            values += (-decade * centres).tolist()
    values += [0.0, 1.0]
    if len(values) != 2**total_bits:
        raise ValueError(f"dynamic map has {len(values)} values, expected {2**total_bits}")
    return torch.tensor(sorted(values), dtype=torch.float32, device=_CPU)


# normal_map() rounded to float32 once (checked against the construction by the tests): the
# table is a constant of every checkpoint that holds "normal4" codes, so it must not depend
# on a platform's ndtri.
_NORMAL4 = (
    -1.0, -0.6961928009986877, -0.5250729322433472, -0.39491742849349976, -0.2844413220882416,
    -0.18477340042591095, -0.09104997664690018, 0.0, 0.07958031445741653, 0.16093014180660248,
    0.24611225724220276, 0.3379151225090027, 0.4407097399234772, 0.5626168847084045, 0.722956657409668, 1.0,
)


def normal_map() -> torch.Tensor:
    """The 4-bit normal-float map (NF4, arXiv 2305.14314): quantiles of a standard normal, 8
    positive and 7 negative, plus zero, scaled so the extremes are exactly -1 and 1.

    The quantiles are taken at ``linspace(o, 0.5, 9)`` (positive side, the 0.5 dropped) and
    ``linspace(o, 0.5, 8)`` (negative side), ``o`` the mean of ``1 - 1/(2*15)`` and
    ``1 - 1/(2*16)`` (the outermost quantile, kept finite). For values of one block divided by
    the block's absmax this spends the codes where a roughly normal block puts its mass, where
    the dynamic map spends three of its 16 on values below 0.04. Computed in float64; returns
    a sorted float32 tensor of 16 values (the table itself is the rounded constant
    ``_NORMAL4``).
    """
    o = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))
    pos = torch.special.ndtri(torch.linspace(o, 0.5, 9, dtype=torch.float64, device=_CPU))[:-1]
    neg = -torch.special.ndtri(torch.linspace(o, 0.5, 8, dtype=torch.float64, device=_CPU))[:-1]
    v = torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64, device=_CPU)])
    return (v / v.abs().max()).sort().values.float()


def float8_e4m3_values(signed: bool) -> torch.Tensor:
    """All finite float8_e4m3fn values (sorted, float32), without -0.

    Unsigned: the strictly positive values only (zero-free).
    """
    bits = torch.arange(256, dtype=torch.int32, device=_CPU).to(torch.uint8)
    vals = bits.view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)]
    vals = torch.unique(vals)  # sorted; merges +0 and -0
    if not signed:
        vals = vals[vals > 0]
    return vals


@dataclasses.dataclass(frozen=True)
class Format:
    """A static description of one code format.

    Attributes:
      name: registry key, stored in every record.
      bits: bits per code (4 formats pack two codes a byte within a row).
      signed: whether negative values are representable. Unsigned formats treat a
        negative input as invalid (its block's scale becomes NaN).
      table: name of the value table (``_table``).
      scale_divisor: a block's scale is ``absmax / scale_divisor``.
      sqrt: store ``sqrt(x)``; ``dequantize`` squares it back.
      default_block_size: block size when none is given.
      float8: codes are ``torch.float8_e4m3fn`` values instead of uint8 indices.
    """

    name: str
    bits: int
    signed: bool
    table: str
    scale_divisor: float
    sqrt: bool
    default_block_size: int
    float8: bool = False

    @property
    def values(self) -> torch.Tensor:
        """The sorted float32 map on the normalized scale (CPU tensor; do not modify)."""
        return TABLES[self.table]

    @property
    def midpoints(self) -> torch.Tensor:
        """float64 midpoints between neighbouring map values (exact for float32 maps)."""
        return MIDPOINTS[self.table]

    @property
    def zero_free(self) -> bool:
        return bool((self.values != 0).all())

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.float8 else torch.uint8


def _build_table(name: str) -> torch.Tensor:
    if name == "dynamic8_signed":
        return dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)
    if name == "dynamic8_unsigned":
        return dynamic_map(signed=False, max_exponent_bits=7, total_bits=8)
    if name == "dynamic8_unsigned_zero_free":
        # bitsandbytes' unsigned map with its 0 replaced by a value one decade
        # below the smallest non-zero entry: nothing rounds to zero any more.
        m = dynamic_map(signed=False, max_exponent_bits=7, total_bits=8).clone()
        m[0] = m[1] / 10
        return m
    if name == "dynamic4_signed":
        return dynamic_map(signed=True, max_exponent_bits=3, total_bits=4)
    if name == "normal4_signed":
        return torch.tensor(_NORMAL4, dtype=torch.float32, device=_CPU)
    if name == "linear4_unsigned_zero_free":
        return torch.arange(1, 17, dtype=torch.float32, device=_CPU) / 16
    if name == "e4m3_signed":
        return float8_e4m3_values(signed=True)
    if name == "e4m3_unsigned_zero_free":
        return float8_e4m3_values(signed=False)
    raise KeyError(name)


_TABLE_NAMES = (
    "dynamic8_signed",
    "dynamic8_unsigned",
    "dynamic8_unsigned_zero_free",
    "dynamic4_signed",
    "normal4_signed",
    "linear4_unsigned_zero_free",
    "e4m3_signed",
    "e4m3_unsigned_zero_free",
)
# Built once at import: constants for eager and compiled code alike.
TABLES: dict[str, torch.Tensor] = {n: _build_table(n) for n in _TABLE_NAMES}
MIDPOINTS: dict[str, torch.Tensor] = {
    n: (t.double()[1:] + t.double()[:-1]) / 2 for n, t in TABLES.items()
}

FORMATS: dict[str, Format] = {
    f.name: f
    for f in [
        # 8-bit: bitsandbytes-identical signed map for first moments.
        Format("dynamic8", 8, True, "dynamic8_signed", 1.0, False, 256),
        # bitsandbytes' unsigned map, kept for parity tests (can flush to zero).
        Format("dynamic8_unsigned", 8, False, "dynamic8_unsigned", 1.0, False, 256),
        # Robust default second moment: sqrt stored, zero-free map.
        Format("dynamic8_sqrt", 8, False, "dynamic8_unsigned_zero_free", 1.0, True, 256),
        # 4-bit (arXiv 2309.01507): signed dynamic exponent / zero-free linear.
        Format("dynamic4", 4, True, "dynamic4_signed", 1.0, False, 128),
        Format("linear4_unsigned", 4, False, "linear4_unsigned_zero_free", 1.0, False, 128),
        # 4-bit normal-float map on blocks of 32 ("nf4"): Muon's 4-bit momentum (design.md, "Muon").
        Format("normal4", 4, True, "normal4_signed", 1.0, False, 32),
        # FP8 e4m3: scale = absmax / 448.
        Format("e4m3", 8, True, "e4m3_signed", 448.0, False, 256, float8=True),
        Format("e4m3_sqrt", 8, False, "e4m3_unsigned_zero_free", 448.0, True, 256, float8=True),
    ]
}

# Optimizer-level state formats: (first-moment format, second-moment format).
STATE_FORMATS: dict[str, tuple[str, str]] = {
    "8bit": ("dynamic8", "dynamic8_sqrt"),
    "8bit_bnb": ("dynamic8", "dynamic8_unsigned"),
    "4bit": ("dynamic4", "linear4_unsigned"),
    "nf4": ("normal4", "linear4_unsigned"),
    "fp8": ("e4m3", "e4m3_sqrt"),
}


def get_format(format: str | Format, signed: bool | None = None) -> Format:
    """Look up a format by name.

    ``format`` may also be an optimizer-level name (``"8bit"``, ``"4bit"``,
    ``"fp8"``, ``"8bit_bnb"``): ``signed=True`` or ``None`` picks its first-moment
    (signed) format, ``signed=False`` its second-moment (non-negative) format.
    """
    if isinstance(format, Format):
        return format
    if format in STATE_FORMATS:
        # signed (the first-moment format, which represents any float) unless
        # signed=False asks for the second-moment format.
        return FORMATS[STATE_FORMATS[format][0 if signed is None or signed else 1]]
    if format not in FORMATS:
        raise ValueError(
            f"unknown format {format!r}; expected one of {sorted(FORMATS)} or "
            f"{sorted(STATE_FORMATS)} with signed=True/False"
        )
    fmt = FORMATS[format]
    if signed is not None and signed != fmt.signed:
        raise ValueError(f"format {format!r} has signed={fmt.signed}, but signed={signed} was asked")
    return fmt
