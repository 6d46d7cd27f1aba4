"""The default stack on a CPU without AVX-512 (it did not start there: oneDNN refused to pack bf16
weights during the dtype calibration). Emulated on any x86 machine with the three knobs together:
Tidal's `TIDAL_CPU_ISA=avx2` (its own answer, `tidal.engine.torch.cpu_caps`), torch's
`ATEN_CPU_CAPABILITY=avx2` (ATen's kernels) and oneDNN's `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN's
kernels: the packing trial is then refused with torch's own message, as on that CPU). A fresh
`TIDAL_CACHE_DIR`, so the calibration runs under them instead of reusing this machine's entry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import pytest

from services.cli import natsd

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.slow]

AVX2_ONLY = {"TIDAL_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_default_stack_starts_and_answers_without_avx512() -> None:
    port = natsd.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tidal-e2e-avx2-"))
    cache = tmp / "cache"
    env = {**os.environ, **AVX2_ONLY, "TIDAL_CACHE_DIR": str(cache)}
    env |= {"TIDAL_STATE_FILE": str(tmp / "up.json"), "TIDAL_LOG_LEVEL": "INFO"}
    for name in ("TIDAL_DTYPE", "TIDAL_NATS_URL", "TIDAL_NATIVE"):
        env.pop(name, None)  # dtype `auto`, the stack's own bus, the native kernels on
    tidal = str(Path(sys.executable).parent / "tidal")
    log_path = tmp / "up.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [tidal, "up", "--port", str(port), "--cpu-attn", "0", "--store-dir", str(tmp / "js")],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        deadline = time.monotonic() + 180
        models: list[str] = []
        while not models and time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            try:
                models = [m.id for m in client.models.list()]
            except openai.APIError:
                time.sleep(0.5)
        assert models == ["SmolLM2-135M-Instruct"], log_path.read_text()
        reply = client.chat.completions.create(
            model=models[0],
            temperature=0,
            max_tokens=24,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert reply.system_fingerprint == "tidal-torch"  # the real engine, not emulation
        assert "Paris" in (reply.choices[0].message.content or "")
        # both instances calibrated under the forced answer, into one entry of the fresh cache
        (choice,) = json.loads((cache / "dtype-choice.json").read_text()).values()
        assert "torch ISA AVX2, no AVX-512" in choice["cpu"], choice
        assert "forced by TIDAL_CPU_ISA=avx2" in choice["cpu"], choice
        refusal = "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert"
        assert (
            f"bf16 timed on plain matmuls (oneDNN bf16 packing off: {refusal}" in (choice["reason"])
        ), choice
        assert set(choice["matmul_ms"]) == {"float32", "bfloat16"} and not choice["skipped"]
        text = log_path.read_text()
        assert f"oneDNN bfloat16 packing off: {refusal}" in text, text[-4000:]
        if choice["dtype"] == "bfloat16":  # the native kernels serve bf16 only: without AVX-512
            assert "native decode kernels built with -march=native -mno-avx512f" in text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        log.close()
