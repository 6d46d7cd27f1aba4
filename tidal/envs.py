"""Every environment variable Tidal reads, in one typed registry (all prefixed `TIDAL_`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)


NATS_URL = EnvVar("TIDAL_NATS_URL", "nats://127.0.0.1:4222", "NATS server the services join")
LOG_LEVEL = EnvVar("TIDAL_LOG_LEVEL", "INFO", "log level of every service")
ADVERTISE_HOST = EnvVar(
    "TIDAL_ADVERTISE_HOST",
    "",
    "address other hosts reach this host's data planes on (default: the interface that routes "
    "to the NATS server)",
)
HEARTBEAT_S = EnvVar("TIDAL_HEARTBEAT_S", "0.5", "seconds between service heartbeats")
MAX_HOLD_S = EnvVar(
    "TIDAL_MAX_HOLD_S",
    "600",
    "longest a request waits for room (the scheduler's hold; the gateway waits a little longer)",
)
CACHE_DIR = EnvVar(
    "TIDAL_CACHE_DIR", str(Path.home() / ".cache" / "tidal"), "converted model weights"
)
DATA_DIR = EnvVar(
    "TIDAL_DATA_DIR", "", "traces and kernel timings (default: the repository's data/)"
)
DTYPE = EnvVar(
    "TIDAL_DTYPE", "", "torch engine dtype (float32 | bfloat16); default: measured fastest"
)
NATIVE = EnvVar(
    "TIDAL_NATIVE",
    "1",
    "torch engine on CPU: 0 turns off the native decode kernels (built with g++ on first use)",
)
BF16_WEIGHT_ROWS = EnvVar(
    "TIDAL_BF16_WEIGHT_ROWS",
    "",
    "torch engine on CPU, fp32 model of a measured (or TIDAL_DTYPE) dtype: matmuls of up to "
    "this many rows run on bf16 weight copies "
    "(0: none); unset: as the dtype calibration measured",
)
CPU_ISA = EnvVar(
    "TIDAL_CPU_ISA",
    "",
    "torch engine on CPU: avx2 behaves as an AVX2-only CPU (no AVX-512 or AMX, no oneDNN "
    "bf16 packing, native kernels without AVX-512) whatever this CPU has; unset: probed",
)

NATS_REPLICAS = EnvVar(
    "TIDAL_NATS_REPLICAS",
    "1",
    "replicas of the Batch API's JetStream streams and buckets: 1 on one nats-server, 3 on a "
    "3-node cluster (survives the loss of one node)",
)
SIM_KV_PAYLOAD_BYTES_PER_TOKEN = EnvVar(
    "TIDAL_SIM_KV_PAYLOAD_BYTES_PER_TOKEN",
    "",
    "sim engine: bytes of emulated KV a migration ships per token (default: all of them)",
)
SIM_STEP_TRACE_DIR = EnvVar(
    "TIDAL_SIM_STEP_TRACE_DIR",
    "",
    "sim engine: a directory where each instance writes its steps' wall timings (ID.jsonl) "
    "and the scheduler its dispatches and migrations (scheduler.ndjson)",
)
OFFLINE_CHUNK_TOKENS = EnvVar(
    "TIDAL_OFFLINE_CHUNK_TOKENS",
    "32",
    "instance: an offline request's tokens are published together once this many are held "
    "(0 or 1: one chunk per step, as online requests)",
)
OFFLINE_CHUNK_S = EnvVar(
    "TIDAL_OFFLINE_CHUNK_S",
    "0.25",
    "instance: ...or once the oldest held token is this many seconds old (0: every step)",
)
OVERLAP = EnvVar(
    "TIDAL_OVERLAP",
    "1",
    "instance: plan, publish and report while the engine computes (0: only between steps)",
)

ALL = (
    NATS_URL,
    LOG_LEVEL,
    ADVERTISE_HOST,
    HEARTBEAT_S,
    MAX_HOLD_S,
    CACHE_DIR,
    DATA_DIR,
    DTYPE,
    NATIVE,
    BF16_WEIGHT_ROWS,
    CPU_ISA,
    NATS_REPLICAS,
    SIM_KV_PAYLOAD_BYTES_PER_TOKEN,
    SIM_STEP_TRACE_DIR,
    OFFLINE_CHUNK_TOKENS,
    OFFLINE_CHUNK_S,
    OVERLAP,
)


def heartbeat_s() -> float:
    value = HEARTBEAT_S.get()
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{HEARTBEAT_S.name}={value!r} is not a number of seconds") from None
    if not 0.05 <= seconds <= 60:
        raise ValueError(f"{HEARTBEAT_S.name}={seconds} must be in [0.05, 60] seconds")
    return seconds


def max_hold_s() -> float:
    value = MAX_HOLD_S.get()
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{MAX_HOLD_S.name}={value!r} is not a number of seconds") from None
    if not 1 <= seconds <= 86_400:
        raise ValueError(f"{MAX_HOLD_S.name}={seconds} must be in [1, 86400] seconds")
    return seconds


def nats_replicas() -> int:
    value = NATS_REPLICAS.get()
    try:
        replicas = int(value)
    except ValueError:
        raise ValueError(f"{NATS_REPLICAS.name}={value!r} is not a whole number") from None
    if not 1 <= replicas <= 5:  # JetStream's own bound
        raise ValueError(
            f"{NATS_REPLICAS.name}={replicas} must be in [1, 5] (3 on a 3-node cluster)"
        )
    return replicas
