"""Pull batch lines off the JetStream work queue and run them in the cluster's slack.

At most `max_inflight` lines run at once; each is routed as an offline request, so the policy
decides when it runs (online traffic never waits for a batch: an offline route is held in the
scheduler's queue until the policy admits it). Per line:

* a job whose batch is gone, cancelled or past its window is acknowledged and not run;
* a job that already has a stored result (a redelivery after a crash) is acknowledged, not rerun;
* a job delivered more than `MAX_DELIVER` times (it keeps failing, or keeps killing its worker)
  is given up: its error line is stored, and the batch still completes;
* while a line runs, its ack deadline is extended (`in_progress`); it is acknowledged
  (`ack_sync`) only after its result line is durably stored (first writer wins);
* a line delivered again while it runs here (JetStream redelivered it) is not run a second
  time beside the first: that delivery waits, kept alive, for the run, then finds the stored
  result and is acknowledged (or runs the line, if the first run put it back);
* a busy cluster (429/503) is waited out, the job held; a failed generation is tried again up to
  `MAX_DELIVER` times, then its error goes in the error file.

The consumer has no server-side `max_deliver`: a message the server stops delivering would sit
on the work queue forever and its batch would never finish; counting deliveries here instead
puts the line in the error file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from services.batch.runner import Outcome, run_line
from services.common.batch_store import (
    ACK_WAIT_S,
    DISPATCH_CONSUMER,
    JOBS_STREAM,
    JOBS_SUBJECT,
    MAX_DELIVER,
    BatchStore,
)
from services.common.client.bus import RequestBus
from services.common.client.stream import RequestHandle
from tidal.batch.lines import error_line, response_line
from tidal.config.classes import RequestClassSpec, default_table

log = logging.getLogger("tidal.batch")

RETRY_DELAY_S = 1.0  # first wait before a line the cluster could not take runs again
MAX_RETRY_DELAY_S = 10.0
BUSY_STATUSES = (404, 429, 503)  # the cluster is busy or restarting: wait, however long
FETCH_TIMEOUT_S = 1.0
STOPPED = ("cancelling", "cancelled", "expired", "failed", "completed")


class JobPayload(msgspec.Struct, frozen=True):
    batch_id: str
    custom_id: str
    index: int  # 0-based position among the batch's requests
    endpoint: str
    body: dict[str, Any]


@dataclass
class Counters:
    done: int = 0
    failed: int = 0
    output_tokens: int = 0  # of lines with a stored result, counted when stored
    generated_tokens: int = 0  # as the tokens arrive, every line (stored, retried, cancelled)


@dataclass
class Dispatcher:
    store: BatchStore
    bus: RequestBus
    max_inflight: int
    lane: RequestClassSpec = field(default_factory=lambda: default_table().lowest)  # lines' class
    counters: Counters = field(default_factory=Counters)
    # batch_id -> custom_id -> the tasks of that line's deliveries here: the first runs it, each
    # later one (a redelivery) waits for the one before
    tasks: dict[str, dict[str, list[asyncio.Task[None]]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    handles: dict[str, RequestHandle] = field(default_factory=dict)
    _freed: asyncio.Event = field(default_factory=asyncio.Event)
    _pending: set[asyncio.Task[None]] = field(default_factory=set)  # fire-and-forget acks

    @property
    def num_inflight(self) -> int:
        """Lines being handled here, each until its last delivery is done (one at a time runs:
        a redelivery waits, holding no request on the bus). A fetch may hand over more lines
        than it asked for (`_pull`): they count too, so nothing more is fetched meanwhile."""
        return sum(len(lines) for lines in self.tasks.values())

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            sub = None
            try:
                sub = await self._bind()
                await self._pull(sub, stop)
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                # NOTE: a pull subscription can stop working after nats-server restarts; bind it
                # again rather than trust it.
                log.warning("batch dispatch: %r; binding the consumer again", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
            finally:
                if sub is not None:  # an orphaned pull request would capture the next jobs
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
        await self.cancel_all()

    async def _bind(self) -> Any:
        config = api.ConsumerConfig(
            durable_name=DISPATCH_CONSUMER,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT_S,
            max_ack_pending=-1,
            filter_subject=JOBS_SUBJECT + ".>",
        )
        return await self.store.js.pull_subscribe(
            JOBS_SUBJECT + ".>", durable=DISPATCH_CONSUMER, stream=JOBS_STREAM, config=config
        )

    async def _pull(self, sub: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            free = self.max_inflight - self.num_inflight
            if free <= 0:
                self._freed.clear()
                with contextlib.suppress(TimeoutError):  # look at `stop` at least every second
                    await asyncio.wait_for(self._freed.wait(), timeout=FETCH_TIMEOUT_S)
                continue
            try:
                # NOTE: nats-py may return more than `free` messages: a fetch first takes all
                # its subscription holds, which includes what an earlier pull request (one the
                # client timed out on, still open on the server) delivered late. They all
                # start, and count, so nothing more is fetched until they are done.
                msgs = await sub.fetch(free, timeout=FETCH_TIMEOUT_S)
            except TimeoutError:  # NOTE: nats-py raises asyncio's, not only its own subclass
                continue
            for msg in msgs:
                self._start(msg)

    def _start(self, msg: Msg) -> None:
        try:
            job = msgspec.json.decode(msg.data, type=JobPayload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("batch dispatch: dropping a malformed job (%s)", exc)
            term = asyncio.create_task(msg.term())
            self._pending.add(term)
            term.add_done_callback(self._pending.discard)
            return
        line = self.tasks[job.batch_id].setdefault(job.custom_id, [])
        before = line[-1] if line else None
        if before is not None:
            # NOTE: a copy left in nats-py's queue past the ack deadline was delivered again;
            # two runs of the line at once put one more request on the bus than it takes
            # (429s, waited out behind every newly fetched line: a line done minutes late).
            log.info(
                "batch line %s/%s delivered again while it runs here; it waits for that run",
                job.batch_id,
                job.custom_id,
            )
        task = asyncio.create_task(self._job(job, msg, before))
        line.append(task)
        # NOTE: not in `_job`'s `finally`: a task cancelled before it first ran never enters it
        task.add_done_callback(lambda t: self._forget(job, t))

    async def _job(self, job: JobPayload, msg: Msg, before: asyncio.Task[None] | None) -> None:
        keepalive = asyncio.create_task(_keep_alive(msg))
        try:
            if before is not None:  # the same line's earlier delivery runs here: after it
                await asyncio.wait([before])
            await self._run_held(job, msg)
        except asyncio.CancelledError:
            # cancelled batch (its finalizer accounts for the line) or stopping service (the
            # job is redelivered to whoever runs next)
            with contextlib.suppress(Exception):
                batch = await self.store.batch(job.batch_id)
                if batch is None or batch.status in STOPPED:
                    await msg.ack()
                else:
                    await msg.nak()
        except Exception:
            log.exception(
                "batch line %s/%s failed; it will be retried", job.batch_id, job.custom_id
            )
            with contextlib.suppress(Exception):
                await msg.nak(delay=RETRY_DELAY_S)
        finally:
            keepalive.cancel()

    def _forget(self, job: JobPayload, task: asyncio.Task[None]) -> None:
        """`task`, one delivery of `job`'s line, is done: its place in flight is free."""
        lines = self.tasks.get(job.batch_id, {})
        line = lines.get(job.custom_id, [])
        if task in line:
            line.remove(task)
        if not line:
            lines.pop(job.custom_id, None)
        if not lines:
            self.tasks.pop(job.batch_id, None)
        self._freed.set()

    async def _run_held(self, job: JobPayload, msg: Msg) -> None:
        """`_run_job`, waiting out a store or bus that cannot answer now with the job held.
        NOTE: JetStream has no quorum for seconds after a partition heals (leaders are
        elected again); a nak per failed store read redelivered the job every second, used up
        its `MAX_DELIVER` deliveries, and a line that never failed went to the error file."""
        delay = RETRY_DELAY_S
        while True:
            try:
                await self._run_job(job, msg)
                return
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning(
                    "batch line %s/%s waits for the store (%r); held, trying again in %.0f s",
                    *(job.batch_id, job.custom_id, exc, delay),
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_DELAY_S)

    async def _run_job(self, job: JobPayload, msg: Msg) -> None:
        batch = await self.store.batch(job.batch_id)
        if batch is None or batch.status in STOPPED or time.time() >= batch.expires_at:
            await msg.ack_sync()
            return
        if await self.store.has_result(job.batch_id, job.custom_id):
            await msg.ack_sync()  # a redelivery of a line that already ran
            return
        delivered = msg.metadata.num_delivered or 1
        if delivered > MAX_DELIVER:
            line = error_line(
                job.batch_id,
                job.custom_id,
                "max_deliveries_exceeded",
                f"the request was tried {MAX_DELIVER} times and failed each time",
            )
            await self._store(job, line, ok=False, tokens=0)
            await msg.ack_sync()
            return
        key = f"{job.batch_id}/{job.custom_id}"
        failures = 0
        delay = RETRY_DELAY_S
        while True:
            out: Outcome = await run_line(
                self.bus, job.endpoint, job.body, self.handles, key, self._generated, self.lane
            )
            if not out.retry:
                break
            # NOTE: retried here, the job held (its deadline kept extended), not put back: a
            # busy cluster must not use up the deliveries that catch a line that kills workers.
            failures += out.status_code not in BUSY_STATUSES
            if failures >= MAX_DELIVER:
                break  # a generation that fails every time: its error goes in the error file
            reason = out.body.get("error", {}).get("message")
            log.info("batch line %s: %s; trying again in %.0f s", key, reason, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_DELAY_S)
            batch = await self.store.batch(job.batch_id)
            if batch is None or batch.status in STOPPED or time.time() >= batch.expires_at:
                await msg.ack_sync()  # its finalizer accounts for the line
                return
        line = response_line(job.batch_id, job.custom_id, out.status_code, out.request_id, out.body)
        await self._store(job, line, ok=out.status_code == 200, tokens=out.output_tokens)
        await msg.ack_sync()

    async def _store(self, job: JobPayload, line: dict[str, Any], ok: bool, tokens: int) -> None:
        stored = await self.store.put_result(
            job.batch_id, job.custom_id, {"index": job.index, "ok": ok, "line": line}
        )
        if stored:
            self.counters.done += 1
            self.counters.failed += 0 if ok else 1
            self.counters.output_tokens += tokens

    def _generated(self, num_tokens: int) -> None:
        self.counters.generated_tokens += num_tokens

    async def cancel_batch(self, batch_id: str) -> int:
        """Abort the lines of `batch_id` running here; how many there were."""
        tasks = [t for line in self.tasks.get(batch_id, {}).values() for t in line]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)

    async def cancel_all(self) -> None:
        for batch_id in list(self.tasks):
            await self.cancel_batch(batch_id)


async def _keep_alive(msg: Msg) -> None:
    """Extend a running job's ack deadline until it ends."""
    while True:
        await asyncio.sleep(ACK_WAIT_S / 3)
        with contextlib.suppress(Exception):
            await msg.in_progress()
