"""tcprec.distributed: low-precision gradient all-reduce with Auto Precision Scaling (APS)."""

from .algorithms import ALGORITHMS
from .lowp import (TRANSPORTS, LowpAllreduceHook, allreduce_lowp, aps_top_exponent, check_aps_format,
                   lowp_allreduce_hook, release_graphs)
from .model import allreduce_model
from .nodes import EmulatedNodes

__all__ = ["lowp_allreduce_hook", "LowpAllreduceHook", "allreduce_lowp", "check_aps_format", "aps_top_exponent",
           "EmulatedNodes", "TRANSPORTS", "ALGORITHMS", "allreduce_model", "release_graphs"]
