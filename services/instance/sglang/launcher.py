"""Start (or attach to) the SGLang server an `--engine sglang` instance drives.

Either `--sglang-url URL` (a server someone else runs, e.g. the compose profile's; with
`--sglang-decode-url URL2` the two are a prefill/decode pair, `pd.PdPairClient`), or the
worker starts `python -m sglang.launch_server` as its child with `--sglang-args` appended
(`services.instance.sglang.api.server_args`) and stops it when it stops. The child's Python is
`--sglang-python` (default: this one), so SGLang can live in a venv of its own with its own
torch, and the worker never imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from services.instance.sglang.api import DEFAULT_HANDOFF_TIMEOUT_S, parse_loads, server_args
from services.instance.sglang.client import SglangClient
from services.instance.sglang.engine import SglangEngine
from services.instance.sglang.pd import PdPairClient
from tidal.engine.tokenizer import load_tokenizer

log = logging.getLogger("tidal.instance.sglang")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SglangProcess:
    """`python -m sglang.launch_server` as a child; its output goes to a log file."""

    def __init__(self, python: str, model: str, host: str, port: int, extra: list[str]) -> None:
        self.url = f"http://{host}:{port}"
        self.log_path = Path(tempfile.gettempdir()) / f"tidal-sglang-{port}.log"
        cmd = [python, "-m", "sglang.launch_server", *server_args(model, host, port, extra)]
        log.info("starting SGLang: %s (log %s)", shlex.join(cmd), self.log_path)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang exited with {self.proc.returncode} before it served; its log "
                    f"({self.log_path}) ends:\n{self.tail()}"
                )
            if healthy(self.url):
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SGLang did not serve within {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no SGLang server answers /health at {url}")
        time.sleep(0.5)


def context_length(model: str, server_info: dict) -> int:
    """The server's context length, else the model's config.json, else 4096."""
    for key in ("context_length", "max_req_input_len"):
        v = server_info.get(key)
        if isinstance(v, int) and v > 0:
            return v
    with contextlib.suppress(OSError, ValueError, TypeError):
        cfg = json.loads((Path(model) / "config.json").read_text())
        return int(cfg["max_position_embeddings"])
    return 4096


def kv_bytes_per_token(model: str) -> float:
    """K and V of every layer in 16-bit, from config.json (0 when unknown): the policy's cost
    model uses it; no KV moves on this backend."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        c = json.loads((Path(model) / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        return float(2 * c["num_hidden_layers"] * kv_heads * head_dim * 2)
    return 0.0


class LaunchedEngine(SglangEngine):
    """An `SglangEngine` that also stops the SGLang child it started."""

    process: SglangProcess | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.process is not None:
                self.process.stop()


def build_sglang_engine(args: argparse.Namespace) -> SglangEngine:
    """`--engine sglang`: the engine for `args` (`--model` is the tokenizer's source and, when
    the worker starts SGLang, its `--model-path`)."""
    if not args.model:
        raise ValueError("--engine sglang needs --model PATH (a Hugging Face model directory)")
    timeout_s = float(args.sglang_start_timeout_s)
    if getattr(args, "sglang_decode_url", "") and not args.sglang_url:
        raise ValueError(
            "--sglang-decode-url pairs with --sglang-url (the prefill server); the worker does "
            "not start a PD pair itself"
        )
    proc: SglangProcess | None = None
    if args.sglang_url:
        url = args.sglang_url.rstrip("/")
        wait_healthy(url, timeout_s)
    else:
        host = "127.0.0.1"
        extra = shlex.split(args.sglang_args or "")
        proc = SglangProcess(
            args.sglang_python or sys.executable, args.model, host, free_port(), extra
        )
        proc.wait_ready(timeout_s)
        url = proc.url
    decode_url = (getattr(args, "sglang_decode_url", "") or "").rstrip("/")
    client = pd_client(args, url, decode_url, timeout_s) if decode_url else SglangClient(url)
    try:
        info = client.get_json("/server_info")
        load = parse_loads(client.get_json("/v1/loads"))
        name = (
            getattr(args, "served_model_name", "")
            or str(info.get("served_model_name") or "")
            or Path(args.model).name
        )
        engine = LaunchedEngine(
            client,
            load_tokenizer(args.model),
            model_name=name,
            max_model_len=args.max_model_len or context_length(args.model, info),
            num_kv_tokens=load.max_total_tokens or int(info.get("max_total_num_tokens", 0)),
            kv_bytes_per_token=kv_bytes_per_token(args.model),
        )
    except Exception:
        client.close()
        if proc is not None:
            proc.stop()
        raise
    if engine.num_kv_blocks <= 0:
        engine.close()
        raise RuntimeError(
            f"SGLang at {client.base_url} reports no KV capacity (max_total_num_tokens)"
        )
    engine.process = proc
    log.info("SGLang at %s: model %s, %d KV tokens", client.base_url, name, engine.num_kv_blocks)
    return engine


def pd_client(
    args: argparse.Namespace, prefill_url: str, decode_url: str, timeout_s: float
) -> PdPairClient:
    """`--sglang-decode-url`: `prefill_url` and `decode_url` as one PD pair. Each must run in
    its mode (`disaggregation_mode` in `/server_info`); the bootstrap port is the prefill's
    `disaggregation_bootstrap_port` there, else `--sglang-bootstrap-port`."""
    wait_healthy(decode_url, timeout_s)
    infos = {}
    for want, u in (("prefill", prefill_url), ("decode", decode_url)):
        infos[want] = info = httpx.get(u + "/server_info", timeout=10.0).raise_for_status().json()
        mode = info.get("disaggregation_mode")
        if mode is not None and mode != want:
            raise ValueError(
                f"{u} runs with --disaggregation-mode {mode}; a PD pair needs it {want} "
                "(--sglang-url is the prefill server, --sglang-decode-url the decode server)"
            )
    port = infos["prefill"].get("disaggregation_bootstrap_port")
    if not isinstance(port, int) or isinstance(port, bool) or port <= 0:
        port = int(args.sglang_bootstrap_port)
    handoff_s = float(getattr(args, "sglang_handoff_timeout_s", 0) or DEFAULT_HANDOFF_TIMEOUT_S)
    return PdPairClient(prefill_url, decode_url, port, handoff_timeout_s=handoff_s)
