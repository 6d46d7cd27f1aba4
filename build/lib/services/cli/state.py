"""Where a running `tidal up` leaves its addresses, so `tidal ctl` finds the bus by itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tidal import envs


def state_path() -> Path:
    return Path(os.environ.get("TIDAL_STATE_FILE", Path(envs.CACHE_DIR.get()) / "up.json"))


def write_state(nats_url: str, api_url: str) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)  # it holds the bus token
    path.write_text(json.dumps({"nats_url": nats_url, "api_url": api_url, "pid": os.getpid()}))


def clear_state() -> None:
    path = state_path()
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def default_nats_url() -> str:
    """$TIDAL_NATS_URL, else the bus of a running `tidal up`, else the standard local port."""
    if envs.NATS_URL.name in os.environ:
        return envs.NATS_URL.get()
    try:
        state = json.loads(state_path().read_text())
        os.kill(int(state["pid"]), 0)  # is that `tidal up` still alive?
        return str(state["nats_url"])
    except (OSError, ValueError, KeyError, TypeError):
        return envs.NATS_URL.get()
