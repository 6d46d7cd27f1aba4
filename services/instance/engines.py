"""Building the engine an instance hosts, from its command-line options."""

from __future__ import annotations

import argparse
import importlib

from tidal.engine.api import Engine
from tidal.engine.sim import ZERO_STEP_MODEL, LinearStepModel, SimEngine, SimEngineConfig
from tidal.perf.api import StepModel

ENGINES = ("sim", "torch")


def parse_step_model(spec: str) -> StepModel:
    """`zero`, `linear` (defaults), `linear:BASE_S,PREFILL_TOKEN_S,DECODE_REQ_S,CONTEXT_TOKEN_S`,
    or `MODEL@HARDWARE` for a `tidal.perf` model (e.g. `llama-2-7b@a100-80gb`)."""
    if spec == "zero":
        return ZERO_STEP_MODEL
    if spec == "linear":
        return LinearStepModel()
    if spec.startswith("linear:"):
        try:
            coeffs = [float(x) for x in spec.removeprefix("linear:").split(",")]
        except ValueError:
            raise ValueError(f"--sim-step-model {spec!r}: coefficients must be numbers") from None
        if len(coeffs) != 4:
            raise ValueError(f"--sim-step-model {spec!r}: linear takes exactly 4 coefficients")
        return LinearStepModel(*coeffs)
    if "@" in spec:
        from tidal import perf

        model, hardware = spec.split("@", 1)
        make = getattr(perf, "make_step_model", None)
        if make is None:
            raise ValueError("this build has no tidal.perf.make_step_model yet")
        step_model: StepModel = make(model, hardware)
        return step_model
    raise ValueError(f"--sim-step-model {spec!r}: expected zero, linear[:...] or MODEL@HARDWARE")


def build_engine(args: argparse.Namespace) -> Engine:
    if args.engine == "sim":
        config = SimEngineConfig(
            model_name=args.model or "tidal-sim", max_model_len=args.max_model_len or 8192
        )
        return SimEngine(config, parse_step_model(args.sim_step_model))
    if args.engine == "torch":
        # Imported on demand: the torch engine pulls in PyTorch, which the sim engine never needs.
        torch_engine = importlib.import_module("tidal.engine.torch_engine")
        if args.num_threads:
            import torch

            torch.set_num_threads(args.num_threads)
        kwargs = {"max_model_len": args.max_model_len} if args.max_model_len else {}
        engine: Engine = torch_engine.load_torch_engine(
            args.model or None, device=args.device, **kwargs
        )
        return engine
    raise ValueError(f"unknown engine {args.engine!r}; expected one of {ENGINES}")
