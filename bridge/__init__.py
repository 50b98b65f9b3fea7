"""torch.optim optimizers over lowbit_tree's functional core, with FSDP2 and DCP support."""
from .optimizer import STATE_DICT_VERSION, LowBitOptimizer, StateReportRow
from .classes import (
    SGD,
    AdEMAMix,
    AdEMAMix4bit,
    AdEMAMix8bit,
    Adam,
    Adam4bit,
    Adam8bit,
    AdamFp8,
    AdamW,
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    Adagrad,
    Adagrad4bit,
    Adagrad8bit,
    AdagradFp8,
    Adadelta,
    Adadelta4bit,
    Adadelta8bit,
    AdadeltaFp8,
    Adamax,
    Adamax4bit,
    Adamax8bit,
    AdamaxFp8,
    Lion,
    NAdam,
    NAdam4bit,
    NAdam8bit,
    NAdamFp8,
    RAdam,
    RAdam4bit,
    RAdam8bit,
    RAdamFp8,
    Lion4bit,
    Lion8bit,
    SGD8bit,
    RMSprop,
    RMSprop4bit,
    RMSprop8bit,
    RMSpropFp8,
)
from .muon import Muon, Muon4bit, Muon8bit, muon_param_groups
from .soap import SOAP, SOAP4bit, SOAP8bit
from . import dcp  # bridge.dcp.load_optimizer after a plain `import bridge`
from .in_backward import StepInBackward, step_in_backward
from .master import load_master_params, master_params
from .qstate import QState
from .collectives import set_host_group
from .report import TrainingBytes

__all__ = [
    "set_host_group", "LowBitOptimizer", "QState", "STATE_DICT_VERSION", "StateReportRow", "TrainingBytes",
    "Adam", "AdamW", "Lion", "SGD",
    "Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8", "Lion8bit", "Lion4bit", "SGD8bit",
    "AdEMAMix", "AdEMAMix8bit", "AdEMAMix4bit", "RMSprop", "RMSprop8bit", "RMSprop4bit", "RMSpropFp8",
    "Adagrad", "Adagrad8bit", "Adagrad4bit", "AdagradFp8", "Adamax", "Adamax8bit", "Adamax4bit", "AdamaxFp8",
    "Adadelta", "Adadelta8bit", "Adadelta4bit", "AdadeltaFp8",
    "RAdam", "RAdam8bit", "RAdam4bit", "RAdamFp8", "NAdam", "NAdam8bit", "NAdam4bit", "NAdamFp8", "Muon", "Muon8bit", "Muon4bit", "muon_param_groups",
    "SOAP", "SOAP8bit", "SOAP4bit",
    "step_in_backward", "StepInBackward", "master_params", "load_master_params",
]
