"""`load_torch_engine`: a model from disk (or the embedded one) into a `TorchEngine`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tidal.engine.torch.dtype_choice import DtypeChoice, choose_dtype, weight_rows
from tidal.engine.torch.engine import TorchEngine
from tidal.engine.torch.engine_config import EngineConfig
from tidal.engine.torch.model_config import ModelConfig

log = logging.getLogger(__name__)


def load_torch_engine(
    model: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    bf16_weight_rows: int | None = None,
    **kwargs: Any,
) -> TorchEngine:
    """Load a model (None = the embedded SmolLM2-135M-Instruct GGUF; else an HF directory or a
    GGUF file) and build an engine, in `dtype` or (None) the one `choose_dtype` measures fastest
    on this machine (`engine.dtype_choice` says which and why). An fp32 model on CPU runs its
    matmuls of up to `bf16_weight_rows` rows on bf16 weight copies (`small_rows`); None:
    for a chosen dtype `TIDAL_BF16_WEIGHT_ROWS`, else the measured choice's (none for an
    explicit dtype).
    `kwargs` are `EngineConfig` fields, plus `model_name` and `planner`. Raises
    `ModelLoadError` (one line naming the path) for a missing/corrupt model."""
    from tidal.engine.torch.weights import EMBEDDED_NAME, build_model, embedded_model_path

    path = embedded_model_path() if model is None else Path(model)
    dev = torch.device(device)
    choice: DtypeChoice | None = None
    if dtype:
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        lm, tok = build_model(path, dev, dt)
    else:

        def measured(cfg: ModelConfig) -> torch.dtype:
            nonlocal choice
            choice = choose_dtype(cfg, dev)
            log.info("torch engine dtype %s: %s", choice.dtype, choice.reason)
            return choice.torch_dtype

        lm, tok = build_model(path, dev, measured)
    rows = bf16_weight_rows
    if rows is None and choice is not None:  # chosen here: the env var, else the measurement
        rows = weight_rows(choice)
    if rows and not lm.use_bf16_weights(rows):
        log.info("no bf16 weight copies: only for an fp32 CPU model up to 4 GiB of weights")
    name = kwargs.pop("model_name", None) or (
        EMBEDDED_NAME if model is None else path.stem if path.is_file() else path.name
    )
    planner = kwargs.pop("planner", None)
    engine = TorchEngine(lm, tok, name, EngineConfig(**kwargs), planner)
    engine.dtype_choice = choice
    return engine
