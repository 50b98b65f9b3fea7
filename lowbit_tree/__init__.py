"""lowbit-tree: block-wise quantized (8-bit, 4-bit, FP8) optimizer states as pytrees.

The functional core: quantized records (``QTensor``), optax-style
transformations over pytrees of torch tensors, schedules and checkpoint helpers.
Depends on torch, optree and numpy only.
"""
from .formats import FORMATS, STATE_FORMATS, Format, get_format
from .qtensor import QTensor, dequantize, has_nonfinite, quantize, row_layout, zeros
from .base import HYPERPARAMS, SEED, STEP, EmptyState, GradientTransformation, Schedule, identity, in_place, state_roles
from .combine import PartitionState, chain, named_chain, partition
from .transform import (
    ScaleByAdamState,
    ScaleByAdEMAMixState,
    ScaleByLionState,
    ScaleByRmsState,
    ScaleByRssState,
    ScaleByAdamaxState,
    ScaleByAdadeltaState,
    ScaleByRAdamState,
    ScaleByNAdamState,
    ScaleByScheduleState,
    Fusion,
    TraceState,
    add_decayed_weights,
    flip_sign,
    clip_by_global_norm,
    scale,
    scale_by_adam,
    scale_by_adadelta,
    scale_by_adamax,
    scale_by_ademamix,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_nadam,
    scale_by_radam,
    scale_by_rms,
    scale_by_rss,
    trace,
)
from .wrappers import InjectHyperparamsState, MaskedState, inject_hyperparams, masked
from .schedule import (
    constant_schedule,
    cosine_decay_schedule,
    join_schedules,
    linear_schedule,
    polynomial_schedule,
    warmup_cosine_decay_schedule,
)
from .muon_transform import ScaleByMuonState, newton_schulz, scale_by_muon
from .soap_transform import ScaleBySoapState, scale_by_soap, soap, soap_report
from .alias import adadelta, adagrad, adam, adamax, adamw, ademamix, lion, muon, nadam, radam, rmsprop, sgd
from .correction import ParamCorrectionState, from_master, master_weights, param_correction
from .update import StochasticRoundingState, apply_updates, rounding_key, step_, stochastic_round, stochastic_rounding
from .update_step import UpdateStep
from .moments import Rank1QTensor, ReportRow, format_state_report, should_quantize, state_report
from .checkpoint import state_from_dict, state_to_dict

__version__ = "0.1.0"

# The public API, in the order the API reference lists it (docs/api/lowbit_tree.rst).
__all__ = [
    # records and formats
    "QTensor", "Rank1QTensor", "quantize", "dequantize", "zeros", "has_nonfinite", "row_layout",
    "Format", "FORMATS", "STATE_FORMATS", "get_format",
    # transformations
    "GradientTransformation", "Schedule", "EmptyState", "identity", "in_place", "state_roles", "STEP", "SEED",
    "HYPERPARAMS",
    "scale_by_adam", "scale_by_ademamix", "scale_by_lion", "scale_by_muon", "scale_by_rms", "scale_by_rss",
    "scale_by_adamax", "scale_by_adadelta", "scale_by_radam", "scale_by_nadam", "trace",
    "newton_schulz", "scale_by_soap", "soap_report",
    "flip_sign", "add_decayed_weights", "scale", "scale_by_learning_rate", "clip_by_global_norm",
    "chain", "named_chain", "partition", "masked", "inject_hyperparams", "Fusion",
    # aliases
    "adam", "adamw", "ademamix", "lion", "sgd", "muon", "rmsprop", "adagrad", "adamax", "adadelta", "radam", "nadam", "soap",
    # applying updates
    "UpdateStep", "apply_updates", "step_", "stochastic_round", "stochastic_rounding", "rounding_key",
    "param_correction", "master_weights", "from_master",
    # schedules
    "constant_schedule", "linear_schedule", "polynomial_schedule", "cosine_decay_schedule",
    "warmup_cosine_decay_schedule", "join_schedules",
    # state: reports and checkpoints
    "should_quantize", "state_report", "format_state_report", "ReportRow", "state_to_dict", "state_from_dict",
    # state types
    "ScaleByAdamState", "ScaleByAdEMAMixState", "ScaleByLionState", "ScaleByMuonState", "ScaleByRmsState",
    "ScaleByRssState", "ScaleByAdamaxState", "ScaleByAdadeltaState", "ScaleByRAdamState", "ScaleByNAdamState", "ScaleBySoapState",
    "ScaleByScheduleState",
    "TraceState", "PartitionState", "MaskedState", "InjectHyperparamsState", "StochasticRoundingState",
    "ParamCorrectionState",
]
