"""The model a `tidal up` / `tidal serve` stack serves, in vLLM's words: a positional MODEL (a
local Hugging Face directory or GGUF file; no download), `--served-model-name`, `--device` and
`--dtype`. Checked once here, then handed to every instance as its own options."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def add_model_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "model_path",
        nargs=None if required else "?",
        default="",
        metavar="MODEL",
        help="torch/sglang: a local Hugging Face model directory (config.json + *.safetensors + "
        "tokenizer.json; Llama, Qwen2 or Mistral architecture) or a GGUF file; sim: a directory "
        "whose tokenizer it counts with, or just a name. Default: the embedded SmolLM2-135M",
    )
    p.add_argument("--model", default="", help="the same as MODEL (either, not both)")
    p.add_argument(
        "--served-model-name",
        default="",
        help="the model name clients send and /v1/models lists (default: the directory's name, "
        "SmolLM2-135M-Instruct for the embedded model, tidal-sim for the sim engine)",
    )
    p.add_argument(
        "--device", default="cpu", help="torch engine device: cpu, cuda or cuda:N (default cpu)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="torch engine weights and KV dtype (auto: measured fastest on this machine, "
        "$TIDAL_DTYPE if set)",
    )


def check_model_args(a: argparse.Namespace) -> None:
    """Merge MODEL into `a.model`; ValueError with a message a user can act on."""
    positional = getattr(a, "model_path", "") or ""
    if positional and a.model and positional != a.model:
        raise ValueError(f"MODEL {positional!r} and --model {a.model!r} disagree; give one")
    a.model = positional or a.model
    if not _DEVICE.match(a.device):
        raise ValueError(f"--device {a.device!r}: expected cpu, cuda or cuda:N")
    if a.engine == "torch" and a.model and not Path(a.model).expanduser().exists():
        raise ValueError(
            f"model {a.model} does not exist: the torch engine serves a local Hugging Face "
            "directory or a GGUF file (nothing is downloaded)"
        )
    if a.engine == "torch" and a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {a.device}: this PyTorch sees no CUDA device")


def instance_model_argv(a: argparse.Namespace) -> list[str]:
    """The options every instance of the stack gets for its model."""
    out = ["--device", a.device, "--dtype", a.dtype]
    if a.model:
        out += ["--model", a.model]
    if a.served_model_name:
        out += ["--served-model-name", a.served_model_name]
    return out
