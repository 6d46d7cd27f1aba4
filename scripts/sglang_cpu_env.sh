#!/usr/bin/env bash
# A scratch venv with a real SGLang that runs on this CPU, for `make test-sglang` (opt-in; never
# part of `make test`). Usage: scripts/sglang_cpu_env.sh VENV
#
# SGLang 0.5.23 from PyPI, installed without its dependency pins (they name torch 2.14.1 with
# CUDA 13, flashinfer, sglang-kernel: GPU builds), beside the CPU torch Tidal pins, plus the
# pure-Python packages its server imports. Two things stand in for GPU-only builds:
# - `sgl_kernel`: the PyPI `sglang-kernel` is CUDA-only and SGLang's CPU kernels build only from
#   its repository, so scripts/sgl_kernel_stub (import-only names; see its docstring) goes on the
#   venv's path and SGLang takes its torch-native CPU paths;
# - torchvision: SGLang's config modules import `torchvision.transforms`. A CPU build comes from
#   download.pytorch.org where that is reachable; otherwise the PyPI wheel (built against CUDA
#   torch) is installed and its op registrations, which need its CUDA-linked `_C.so`, are skipped.
set -euo pipefail
VENV=${1:?usage: scripts/sglang_cpu_env.sh VENV}
PYTHON=${PYTHON:-python3.11}
HERE=$(cd "$(dirname "$0")" && pwd)
STAMP=$VENV/.sglang-0.5.23
[ -f "$STAMP" ] && exit 0

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" aiohttp anthropic blobfile "compressed-tensors==0.18.0" dill distro easydict einops \
    fastapi gguf huggingface_hub interegular IPython "llguidance>=1.7.6,<2" mistral_common \
    modelscope msgspec "numba==0.65.1" numpy "openai==2.8.0" "openai-harmony==0.0.4" orjson \
    packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 pydantic \
    "python-dateutil<3" python-multipart pyzmq regex requests safetensors scipy \
    "sentencepiece==0.2.1" setproctitle soundfile tiktoken "tokenizers==0.23.2" tqdm \
    "transformers==5.19.0" "uvicorn>=0.51" uvloop watchfiles "xgrammar==0.2.7" xxhash zstandard
# what pip pulled in that SGLang pins to GPU builds or that cannot load beside a CPU torch
"$VENV/bin/python" -m pip uninstall -q -y torchaudio timm torchvision 2>/dev/null || true

timeout 120 "${PIP[@]}" --no-deps torchvision==0.28.0 \
    --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
    || "${PIP[@]}" --no-deps torchvision==0.28.0
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# harmless on a CPU build (its ops load); needed on the CUDA-built one
"$VENV/bin/python" - "$SITE/torchvision/__init__.py" <<'PY'
import pathlib, sys
init = pathlib.Path(sys.argv[1])
src = init.read_text()
old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
new = ("if extension._has_ops():  # Tidal's scripts/sglang_cpu_env.sh: CUDA-built ops absent\n"
       "    from torchvision import _autograd_registrations, _meta_registrations  # noqa\n"
       "from torchvision import (\n")
if old in src:
    init.write_text(src.replace(old, new))
PY
echo "$HERE/sgl_kernel_stub" > "$SITE/tidal_sgl_kernel_stub.pth"
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "import sglang.srt.entrypoints.http_server" \
    || { echo "SGLang does not import in $VENV"; exit 1; }
touch "$STAMP"
echo "SGLang 0.5.23 (CPU, torch-native paths) ready in $VENV"
