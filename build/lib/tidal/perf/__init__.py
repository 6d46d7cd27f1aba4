"""Step-latency models: OOCO roofline, HyGen regression, OmniServe module-wise; calibration,
bottleneck analysis and the SLO-aware latency-budget profiler."""

from __future__ import annotations

from tidal.perf.api import BatchShape, StepModel
from tidal.perf.catalog import HARDWARE, MODELS, HardwareSpec, ModelSpec, hardware_spec, model_spec
from tidal.perf.factory import make_step_model
from tidal.perf.helpers import (
    add_prefill,
    kv_bytes_per_token,
    kv_capacity_blocks,
    kv_capacity_tokens,
    max_prefill_tokens,
)
from tidal.perf.modulewise import ModuleWiseModel, build_dense_table
from tidal.perf.profiler import BudgetResult, QueueEvaluator, find_latency_budget
from tidal.perf.regression import RegressionModel, fit_regression
from tidal.perf.roofline import Bottleneck, RooflineModel, RooflineParams, StepAnalysis

__all__ = [
    "HARDWARE",
    "MODELS",
    "BatchShape",
    "Bottleneck",
    "BudgetResult",
    "HardwareSpec",
    "ModelSpec",
    "ModuleWiseModel",
    "QueueEvaluator",
    "RegressionModel",
    "RooflineModel",
    "RooflineParams",
    "StepAnalysis",
    "StepModel",
    "add_prefill",
    "build_dense_table",
    "find_latency_budget",
    "fit_regression",
    "hardware_spec",
    "kv_bytes_per_token",
    "kv_capacity_blocks",
    "kv_capacity_tokens",
    "make_step_model",
    "max_prefill_tokens",
    "model_spec",
]
