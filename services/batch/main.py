"""The batch service: runs the OpenAI Batch API's lines in the cluster's slack.

    python -m services.batch --id batch-0 [--max-inflight 32]

Its own service rather than a task of the scheduler or the gateway: it holds a request's whole
life (route, stream, store) for many lines at once, which is the gateway's job shape, not the
scheduler's; kept out of the gateway, a burst of batch work never shares an event loop with
online requests, and it can be killed and restarted on its own (JetStream keeps every line).
The gateway only records files and batches; this service validates, queues, dispatches,
counts, cancels, expires and finalizes (`dispatch.py`, `keeper.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import os
import time

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from services.batch.dispatch import Dispatcher
from services.batch.keeper import ACTIVE, Keeper
from services.common.args import add_bus_args
from services.common.batch_store import DISPATCH_CONSUMER, JOBS_STREAM, BatchStore
from services.common.bus import connect
from services.common.client.bus import RequestBus
from services.common.heartbeat import heartbeat_loop
from services.common.lifecycle import run_service
from tidal import envs
from tidal.config.cluster import load_config
from tidal.schemas import codec, subjects
from tidal.schemas.messages import BatchStats, Heartbeat

log = logging.getLogger("tidal.batch")

STATS_S = 1.0
# With no batch under way, nothing queued and no line in flight, the store is read (three
# JetStream API calls) and the stats published this seldom; a line starting or a batch opening
# is noticed within STATS_S (a look at the service's own state, no call)
IDLE_STATS_S = 10.0


async def _open_store(nc: NATS, stop: asyncio.Event) -> BatchStore | None:
    """The store, once JetStream answers (it may still be starting, or restarting)."""
    while not stop.is_set():
        try:
            return await BatchStore.open(nc)
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            log.warning("batch: JetStream not available yet (%s); retrying", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
    return None


async def _stats_loop(
    nc: NATS,
    service_id: str,
    store: BatchStore,
    dispatcher: Dispatcher,
    keeper: Keeper,
    stop: asyncio.Event,
) -> None:
    started = time.time()
    while not stop.is_set():
        queued, oldest_s = 0, 0.0
        with contextlib.suppress(Exception):
            info = await store.js.consumer_info(JOBS_STREAM, DISPATCH_CONSUMER)
            queued = info.num_pending or 0
            stream = await store.js.stream_info(JOBS_STREAM)
            if stream.state.messages and stream.state.first_seq:
                first = await store.js.get_msg(JOBS_STREAM, stream.state.first_seq)
                oldest_s = max(0.0, time.time() - _msg_time(first.time))
        c = dispatcher.counters
        stats = BatchStats(
            service_id=service_id,
            started_unix_s=started,
            batches_by_status=dict(keeper.by_status),
            lines_queued=queued,
            lines_in_flight=dispatcher.num_inflight,
            lines_done_total=c.done,
            lines_failed_total=c.failed,
            output_tokens_total=c.output_tokens,
            generated_tokens_total=c.generated_tokens,
            oldest_job_age_s=oldest_s,
        )
        published = _follows(keeper, dispatcher)  # what `stats` carries, read at the same moment
        with contextlib.suppress(Exception):
            await nc.publish(subjects.BATCH_STATS, codec.encode(stats))
        quiet_until = time.monotonic() + IDLE_STATS_S
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=STATS_S)
            if stop.is_set() or not _idle(queued, dispatcher, keeper):
                break
            if _follows(keeper, dispatcher) != published:
                break  # something counted since: publish it now
            if time.monotonic() >= quiet_until:
                break


def _follows(keeper: Keeper, dispatcher: Dispatcher) -> tuple[object, ...]:
    """What the stats carry of the service's own state (no store call)."""
    c = dispatcher.counters
    return dict(keeper.by_status), c.done, c.failed, c.output_tokens, c.generated_tokens


def _idle(queued: int, dispatcher: Dispatcher, keeper: Keeper) -> bool:
    """Nothing for the stats to follow: no batch under way, nothing queued, no line in flight."""
    active = any(keeper.by_status.get(st) for st in ACTIVE)
    return not active and queued == 0 and dispatcher.num_inflight == 0


def _msg_time(ts: object) -> float:
    """A stored message's time as unix seconds (now when the server did not say)."""
    if isinstance(ts, datetime.datetime):
        return ts.timestamp()
    if isinstance(ts, str):
        with contextlib.suppress(ValueError):
            return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")[:26]).timestamp()
    return time.time()


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    subjects.check_token(args.id, "batch service id")
    nc = await connect(args.nats_url, f"batch-{args.id}", args.connect_timeout_s)
    started = time.time()
    bus = RequestBus(nc, args.id, args.max_inflight)
    await bus.start()
    dispatcher: Dispatcher | None = None

    def beat(status: str = "ok") -> Heartbeat:
        inflight = dispatcher.num_inflight if dispatcher is not None else 0
        return Heartbeat(
            service_id=args.id,
            kind="batch",
            pid=os.getpid(),
            started_unix_s=started,
            sent_unix_s=time.time(),
            status=status,
            info={"lines_in_flight": str(inflight), "max_inflight": str(args.max_inflight)},
        )

    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(nc.drain)
        beats = asyncio.create_task(heartbeat_loop(nc, beat, stop, envs.heartbeat_s()))
        store = await _open_store(nc, stop)
        if store is not None:
            dispatcher = Dispatcher(store, bus, args.max_inflight, args.lane)
            keeper = Keeper(store, bus, dispatcher, max_backlog=args.max_backlog)
            log.info(
                "batch service %s ready (%d lines in flight at most)", args.id, args.max_inflight
            )
            await asyncio.gather(
                dispatcher.run(stop),
                keeper.run(stop),
                _stats_loop(nc, args.id, store, dispatcher, keeper, stop),
            )
        await beats
        await nc.publish(subjects.heartbeat("batch", args.id), codec.encode(beat("stopped")))
    log.info("batch service %s stopped", args.id)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m services.batch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bus_args(p)
    p.add_argument("--id", default="batch-0", help="service id (letters, digits, _ -)")
    p.add_argument("--max-inflight", type=int, default=32, help="batch lines running at once")
    p.add_argument(
        "--max-backlog",
        type=int,
        default=0,
        help="lines queued over all batches past which a new batch fails (0: no bound)",
    )
    p.add_argument(
        "--config",
        default="",
        help="cluster config YAML: its lowest request class takes the lines (docs/classes.md; "
        "default: configs/embedded.yaml, class offline)",
    )
    args = p.parse_args(argv)
    if args.max_backlog < 0:
        p.error("--max-backlog must be >= 0")
    if args.max_inflight < 1:
        p.error("--max-inflight must be at least 1")
    try:
        args.lane = load_config(args.config or "embedded.yaml").classes.lowest
    except (OSError, ValueError) as exc:
        p.error(f"--config: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("batch", lambda stop: serve(args, stop))
