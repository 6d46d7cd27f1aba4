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
HEARTBEAT_S = EnvVar("TIDAL_HEARTBEAT_S", "0.5", "seconds between service heartbeats")
CACHE_DIR = EnvVar(
    "TIDAL_CACHE_DIR", str(Path.home() / ".cache" / "tidal"), "converted model weights"
)
DATA_DIR = EnvVar(
    "TIDAL_DATA_DIR", "", "traces and kernel timings (default: the repository's data/)"
)
DTYPE = EnvVar(
    "TIDAL_DTYPE", "", "torch engine dtype (float32 | bfloat16); default: measured fastest"
)

SIM_KV_PAYLOAD_BYTES_PER_TOKEN = EnvVar(
    "TIDAL_SIM_KV_PAYLOAD_BYTES_PER_TOKEN",
    "",
    "sim engine: bytes of emulated KV a migration ships per token (default: all of them)",
)

ALL = (
    NATS_URL,
    LOG_LEVEL,
    HEARTBEAT_S,
    CACHE_DIR,
    DATA_DIR,
    DTYPE,
    SIM_KV_PAYLOAD_BYTES_PER_TOKEN,
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
