"""`tidal bench replay`'s record of where a window's time went live: every migration the scheduler
reports (`subjects.MIGRATION_EVENTS`: push or pull, bytes, data-plane seconds, handshake
seconds), stamped with the moment it ended, and (`--trace-dir`) the sim engine's step traces and
the stack's log kept for later reading.

Each event's `start_unix_s` is its end less its handshake (`total_s`: the migrate command at the
source to the commit's answer), so a window's transfers can be laid beside each other and beside
the engine's steps (`tidal.engine.sim.engine` trace lines carry `unix_s` too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tidal.schemas import codec, subjects
from tidal.schemas.messages import MigrationEvent


def find_bus(base: str) -> tuple[str, Path] | None:
    """(NATS URL, its `tidal up`'s directory) of the stack serving `base`, from the state file
    `tidal_bench.kit.stack` has it write (`TIDAL_STATE_FILE` in its own temporary directory); None
    when no such stack is found."""
    for path in sorted(Path(tempfile.gettempdir()).glob("tidal-bench-*/up.json")):
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(path.read_text())
            if state.get("api_url", "").rstrip("/") == base.rstrip("/"):
                return str(state["nats_url"]), path.parent
    return None


def event_row(ev: MigrationEvent, end_unix_s: float) -> dict[str, Any]:
    """One migration as the replay keeps it: the event's fields, when it ended and started."""
    return {
        "req_id": ev.req_id,
        "kind": ev.kind,
        "src": ev.src_instance_id,
        "dst": ev.dst_instance_id,
        "outcome": ev.outcome,
        "num_bytes": ev.num_bytes,
        "transfer_s": ev.transfer_s,
        "total_s": ev.total_s,
        "end_unix_s": end_unix_s,
        "start_unix_s": end_unix_s - ev.total_s,
    }


@contextlib.asynccontextmanager
async def migration_log(nats_url: str) -> AsyncIterator[list[dict[str, Any]]]:
    """Collects every migration event the scheduler publishes while the block runs."""
    from services.common.bus import connect

    rows: list[dict[str, Any]] = []
    nc = await connect(nats_url, "bench-replay")

    async def on_event(msg: Any) -> None:
        with contextlib.suppress(codec.DecodeError):
            rows.append(event_row(codec.decode(msg.data, MigrationEvent), time.time()))

    try:
        await nc.subscribe(subjects.MIGRATION_EVENTS, cb=on_event)
        yield rows
        await nc.flush()
        await asyncio.sleep(0.2)  # the last window's events are on their way
    finally:
        quiet = logging.getLogger("services.common.bus")
        level, quiet.disabled = quiet.disabled, True  # our own drain is no "disconnected"
        try:
            await nc.drain()
        finally:
            quiet.disabled = level


def summarize_migrations(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind (push, pull): how many, their bytes and seconds (handshake and data plane)."""
    out: dict[str, Any] = {}
    for kind in sorted({r["kind"] for r in rows}):
        ok = [r for r in rows if r["kind"] == kind and r["outcome"] == "ok"]
        out[kind] = {
            "num": sum(r["kind"] == kind for r in rows),
            "num_ok": len(ok),
            "gb": sum(r["num_bytes"] for r in ok) / 1e9,
            "total_s": sum(r["total_s"] for r in ok),
            "transfer_s": sum(r["transfer_s"] for r in ok),
        }
    return out


def handoff_delays(rows: list[dict[str, Any]], events: dict[str, dict[str, float]]) -> list[float]:
    """Per push: seconds from its first token (the engine's `first` event: the prefill step's
    end) to its source's migrate command (the migration's start): the report, the scheduler's
    tick and the command, before the source can export it."""
    out = []
    for r in rows:
        first = events.get(r["req_id"], {}).get("first")
        if r["kind"] == "push" and first is not None:
            out.append(max(0.0, r["start_unix_s"] - first))
    return out


def keep(trace_dir: Path, stack_dir: Path | None, dest: Path, rows: list[dict[str, Any]]) -> None:
    """Copy a window's step traces, its stack log and its migration events to `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in trace_dir.glob("*.jsonl"):
        shutil.copy(path, dest / path.name)
    if stack_dir is not None and (stack_dir / "up.log").exists():
        shutil.copy(stack_dir / "up.log", dest / "up.log")
    (dest / "migrations.json").write_text(json.dumps(rows, indent=1))
