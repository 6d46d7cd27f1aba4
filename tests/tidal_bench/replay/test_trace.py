"""`tidal bench replay`'s migration record: events as kept, their summary, the hand-off delay
the probe measures and the calibration that carries it; the event log on a real nats-server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from tidal.config.cluster import load_config
from tidal.schemas import codec, subjects
from tidal.schemas.messages import MigrationEvent
from tidal_bench.replay import probe
from tidal_bench.replay import trace as trc


def _event(
    rid: str, kind: str = "push", nbytes: int = 1000, total_s: float = 0.05
) -> MigrationEvent:
    return MigrationEvent(rid, kind, "instance-0", "instance-1", "ok", "", nbytes, 0.02, total_s)


def test_event_row_starts_its_handshake_before_it_ended() -> None:
    row = trc.event_row(_event("a", total_s=0.25), end_unix_s=100.0)
    assert row["start_unix_s"] == pytest.approx(99.75)
    assert (row["kind"], row["src"], row["dst"], row["num_bytes"]) == (
        "push",
        "instance-0",
        "instance-1",
        1000,
    )


def test_summarize_migrations_per_kind() -> None:
    rows = [trc.event_row(_event(f"p{i}", nbytes=10**9), 10.0) for i in range(2)]
    rows.append(trc.event_row(_event("q", kind="pull", nbytes=5 * 10**8, total_s=0.1), 11.0))
    rows.append(dict(trc.event_row(_event("x", kind="pull"), 12.0), outcome="refused"))
    got = trc.summarize_migrations(rows)
    assert got["push"] == {"num": 2, "num_ok": 2, "gb": 2.0, "total_s": 0.1, "transfer_s": 0.04}
    assert got["pull"]["num"] == 2 and got["pull"]["num_ok"] == 1 and got["pull"]["gb"] == 0.5


def test_handoff_delays_are_first_token_to_command() -> None:
    rows = [
        trc.event_row(_event("a", total_s=0.1), 10.1),  # started 10.0
        trc.event_row(_event("b", total_s=0.1), 20.1),  # no first event: skipped
        trc.event_row(_event("c", kind="pull", total_s=0.1), 30.1),  # a pull: not a hand-off
    ]
    events = {"a": {"add": 9.5, "first": 9.99}, "c": {"first": 29.0}}
    assert trc.handoff_delays(rows, events) == [pytest.approx(0.01)]


def test_calibration_carries_the_handoff_delay_within_the_link_latency() -> None:
    cfg = load_config("configs/ooco.yaml")
    cfg = dataclasses.replace(cfg, cpu_workers=dataclasses.replace(cfg.cpu_workers, count=0))
    sent = [probe.Lone(n, 2.0 * i, 0.0, 0.0) for i, n in enumerate([100, 2000, 4000])]
    sim = probe.simulated_lone(cfg, "ooco", sent)
    live = [dataclasses.replace(s, decode_s=s.decode_s + 0.02) for s in sim]  # 20 ms hand-off
    cal = probe.calibrate(cfg, "ooco", live, [0.004, 0.006, 0.5])  # median 6 ms
    assert cal["handoff_delay_ms"] == pytest.approx(6.0)
    assert cal["link_latency_ms"] == pytest.approx(cfg.link_latency_ms + 20.0, abs=1e-6)
    assert probe.with_calibration(cfg, cal).handoff_delay_ms == pytest.approx(6.0)
    capped = probe.calibrate(cfg, "ooco", live, [1.0])  # never more than the fixed part
    assert capped["handoff_delay_ms"] == pytest.approx(capped["link_latency_ms"])
    assert probe.calibrate(cfg, "ooco", live)["handoff_delay_ms"] == 0.0


def test_keep_copies_traces_log_and_events(tmp_path: Path) -> None:
    traces, stack_dir, dest = tmp_path / "t", tmp_path / "s", tmp_path / "d" / "ooco-ooco-0"
    traces.mkdir()
    stack_dir.mkdir()
    (traces / "instance-0.jsonl").write_text('{"event": "add"}\n')
    (stack_dir / "up.log").write_text("log\n")
    rows = [trc.event_row(_event("a"), 1.0)]
    trc.keep(traces, stack_dir, dest, rows)
    assert (dest / "instance-0.jsonl").read_text() == '{"event": "add"}\n'
    assert (dest / "up.log").read_text() == "log\n"
    assert json.loads((dest / "migrations.json").read_text()) == rows


@pytest.mark.nats
def test_migration_log_records_published_events(nats_url: str) -> None:
    from services.common.bus import connect

    async def go() -> list[dict[str, object]]:
        nc = await connect(nats_url, "test-publisher")
        try:
            async with trc.migration_log(nats_url) as rows:
                await asyncio.sleep(0.1)  # the subscription is in place
                await nc.publish(subjects.MIGRATION_EVENTS, codec.encode(_event("a")))
                await nc.publish(subjects.MIGRATION_EVENTS, b"not msgpack")  # dropped
                await nc.flush()
            return rows
        finally:
            await nc.drain()

    rows = asyncio.run(go())
    assert [r["req_id"] for r in rows] == ["a"]
    assert rows[0]["start_unix_s"] == pytest.approx(rows[0]["end_unix_s"] - 0.05)  # type: ignore[operator]


def test_trace_dir_is_an_option_off_by_default() -> None:
    import argparse

    from tidal_bench.replay import run as replay_run

    parser = argparse.ArgumentParser()
    replay_run.register(parser.add_subparsers())
    assert parser.parse_args(["replay"]).trace_dir == ""
    assert parser.parse_args(["replay", "--trace-dir", "/tmp/x"]).trace_dir == "/tmp/x"
