"""Building the engine an instance hosts, from its command-line options."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from tidal import envs
from tidal.engine.api import ControllableEngine
from tidal.engine.sim.engine import SimEngine, SimEngineConfig
from tidal.perf.spec import parse_step_model

ENGINES = ("sim", "torch", "sglang")


KV_MEMORY_FRACTION = 0.9  # of device memory left after the weights, as vLLM's default


def emulated_geometry(spec: str) -> dict[str, int]:
    """KV geometry of the model a `MODEL@HARDWARE[,tp=N...]` step model emulates: its bytes per
    token (on one of its tp GPUs, as the simulator ships them), its layers and the KV blocks its
    devices hold beside the weights, so migrations move, and memory runs out, as on that model.
    Empty for other specs."""
    if "@" not in spec:
        return {}
    from tidal.perf.spec import parse_spec

    kv_per_token, layers, tokens = parse_spec(spec).kv_geometry(KV_MEMORY_FRACTION)
    return {
        "kv_bytes_per_token": kv_per_token,
        "num_layers": layers,
        "num_kv_blocks": tokens // SimEngineConfig.block_size,
    }


def build_engine(args: argparse.Namespace) -> ControllableEngine:
    served = getattr(args, "served_model_name", "") or ""
    ckpt_gb = getattr(args, "checkpoint_host_gb", None) or 0.0
    if ckpt_gb < 0:
        raise ValueError(f"--checkpoint-host-gb must be >= 0, got {ckpt_gb}")
    if ckpt_gb and args.engine != "torch":
        raise ValueError(
            f"--checkpoint-host-gb: the {args.engine} engine keeps no KV checkpoints "
            "(only --engine torch does)"
        )
    if args.engine == "sim":
        # The engine waits its emulated step time itself (interruptible at layer boundaries).
        sim: dict[str, Any] = emulated_geometry(args.sim_step_model)
        if kv_tokens := getattr(args, "kv_cache_tokens", 0):
            sim["num_kv_blocks"] = kv_tokens // SimEngineConfig.block_size
        if payload := envs.SIM_KV_PAYLOAD_BYTES_PER_TOKEN.get():
            sim["kv_payload_bytes_per_token"] = int(payload)
        # A model directory (or GGUF) stands in with its tokenizer and its name; else MODEL is
        # only a name.
        is_path = bool(args.model) and Path(args.model).expanduser().exists()
        tokenizer = getattr(args, "tokenizer", "") or (args.model if is_path else "")
        name = Path(args.model).name if is_path else args.model
        config = SimEngineConfig(
            model_name=served or name or "tidal-sim",
            max_model_len=args.max_model_len or 8192,
            realtime=True,
            tokenizer=tokenizer,
            **sim,
        )
        sim_engine = SimEngine(config, parse_step_model(args.sim_step_model))
        if trace_dir := envs.SIM_STEP_TRACE_DIR.get():
            path = Path(trace_dir) / f"{getattr(args, 'id', '') or 'instance'}.jsonl"
            sim_engine.step_trace = path.open("a", buffering=1)  # a line a step (replay)
        return sim_engine
    if args.engine == "torch":
        # Imported on demand: the torch engine pulls in PyTorch, which the sim engine never needs.
        loader = importlib.import_module("tidal.engine.torch.loader")
        if args.num_threads:
            import torch

            torch.set_num_threads(args.num_threads)
        kwargs: dict[str, Any] = {}
        if args.max_model_len:
            kwargs["max_model_len"] = args.max_model_len
        if kv_tokens := getattr(args, "kv_cache_tokens", 0):
            kwargs["kv_cache_tokens"] = kv_tokens
        if served:
            kwargs["model_name"] = served
        if ckpt_gb:
            kwargs["checkpoint_host_bytes"] = int(ckpt_gb * 1e9)
        dtype = getattr(args, "dtype", "auto")
        torch_eng = loader.load_torch_engine(
            args.model or None,
            device=args.device,
            dtype=None if dtype == "auto" else dtype,
            **kwargs,
        )
        # every thread that steps takes the count, not only this one (OpenMP's is per thread)
        torch_eng.num_threads = args.num_threads or 0
        if share := getattr(args, "core_share", ""):
            from tidal.engine.torch.core_share import CoreShare

            torch_eng.core_share = CoreShare(Path(share), args.index)
        engine: ControllableEngine = torch_eng
        return engine
    if args.engine == "sglang":
        # An HTTP client of a SGLang server (started here as a child, or --sglang-url): the
        # worker never imports sglang, so the default install stays torch-only.
        from services.instance.sglang.launcher import build_sglang_engine

        sgl: ControllableEngine = build_sglang_engine(args)
        return sgl
    raise ValueError(f"unknown engine {args.engine!r}; expected one of {ENGINES}")
