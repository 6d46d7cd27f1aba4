"""A batch's life outside its lines: validate and queue, count progress, cancel, expire, finalize.

Every step reads the stored batch and writes it back with a revision check, and every step can
run again after a crash with the same outcome:

* validation re-publishes the same jobs (same message ids: the stream drops the repeats);
* progress is counted from the stored results (a KV watcher over the results bucket), never from
  a counter a crash could skew;
* finalization writes the output and error files under ids derived from the batch id, from the
  stored results in input order, so two finalizers write one identical file each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from services.batch.dispatch import Dispatcher, JobPayload
from services.common.batch_store import BatchStore, decode_or_none
from services.common.client.bus import RequestBus
from services.common.lifecycle import wait_either
from services.common.protocol import ApiError
from tidal.batch.lines import Checked, check_lines, error_line, split_lines
from tidal.batch.objects import Batch, BatchError, Errors, FileObject, RequestCounts, Usage, advance

log = logging.getLogger("tidal.batch")

POLL_S = 0.5
# With no batch validating, running, finalizing or cancelling there is nothing to look at until
# a batch is created or cancelled, which wakes the keeper at once (its watchers): a listing of
# the batches every POLL_S cost the idle service most of its CPU (issue 38).
IDLE_POLL_S = 5.0
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
PUBLISH_WINDOW = 256  # job publishes awaited together
ENDS_PER_STEP = 4  # batches finalized (completed, cancelled, expired) per keeper step
_UNRUN = {
    "expired": (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    "cancelled": ("batch_cancelled", "The batch was cancelled before this request ran."),
}


@dataclass
class Tally:
    """Results stored per batch, as the results bucket's watcher saw them: key -> succeeded."""

    by_batch: dict[str, dict[str, bool]] = field(default_factory=lambda: defaultdict(dict))
    ready: bool = False  # the watcher has read everything stored when it started

    def counts(self, batch_id: str) -> tuple[int, int]:
        seen = self.by_batch.get(batch_id, {})
        ok = sum(seen.values())
        return ok, len(seen) - ok


@dataclass
class Keeper:
    store: BatchStore
    bus: RequestBus
    dispatcher: Dispatcher
    tally: Tally = field(default_factory=Tally)
    kick: asyncio.Event = field(default_factory=asyncio.Event)
    by_status: dict[str, int] = field(default_factory=dict)
    max_backlog: int = 0  # lines queued over all batches past which a new batch fails (0: none)

    async def run(self, stop: asyncio.Event) -> None:
        watchers = [
            asyncio.create_task(self._watch_results(stop)),
            asyncio.create_task(self._watch_batches(stop)),
        ]
        try:
            while not stop.is_set():
                self.kick.clear()
                idle = False
                try:
                    await self.step(time.time())
                    idle = not any(self.by_status.get(st) for st in ACTIVE)
                except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                    log.warning("batch keeper: %s; trying again", exc or repr(exc))  # says why
                # a batch created, cancelled or counted wakes the keeper at once; expiry and
                # progress are looked at every POLL_S anyway (IDLE_POLL_S with none under way)
                await wait_either(self.kick, stop, IDLE_POLL_S if idle else POLL_S)
        finally:
            for w in watchers:
                w.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _watch_batches(self, stop: asyncio.Event) -> None:
        """Wake the keeper whenever a batch is created or changed (a new one, a cancel)."""

        def on_entry(entry: Any) -> None:
            if entry is not None:
                self.kick.set()

        await _follow(stop, "batch watcher", lambda: self.store.batches.watch(">", meta_only=True),
                      on_entry)  # fmt: skip

    async def step(self, now_s: float) -> None:
        batches = await self.store.list_batches()
        self.by_status = {}
        for b in batches:
            self.by_status[b.status] = self.by_status.get(b.status, 0) + 1
        backlog = sum(
            b.request_counts.total - b.request_counts.completed - b.request_counts.failed
            for b in batches
            if b.status in ("in_progress", "finalizing") and b.request_counts is not None
        )
        # New batches first, and at most ENDS_PER_STEP batches ended a step (each end reads the
        # input and the results and writes two files): a pile of cancelled batches held a new
        # batch in `validating` for over 120 s while they were finalized one after another.
        for b in batches:
            if b.status == "validating":
                backlog += await self.validate(b, now_s, backlog)
        ends = 0
        for b in batches:
            if ends >= ENDS_PER_STEP:
                self.kick.set()  # the rest in the next step, after any new batch
                break
            if b.status == "cancelling":
                await self.dispatcher.cancel_batch(b.id)
                await self.finalize(b, "cancelled", now_s)
                ends += 1
            elif b.status in ("in_progress", "finalizing"):
                ends += await self.progress(b, now_s)

    # -- validation ---------------------------------------------------------------------------

    async def validate(self, batch: Batch, now_s: float, backlog: int = 0) -> int:
        """Validate and queue a batch's lines; returns how many were queued. `backlog`: lines
        of other batches still to run, for the `max_backlog` bound."""
        try:
            models = set(await self.bus.models())
        except ApiError as exc:
            log.info("batch %s waits to be validated: %s", batch.id, exc.message)
            return 0
        checked = await self._check(batch, models)
        if checked is None:
            errors = Errors(data=[_error("file_not_found", "the input file was deleted")])
            await self.store.update_batch(batch.id, _fail(errors, now_s))
            return 0
        if checked.errors:
            log.info("batch %s failed validation (%d errors)", batch.id, checked.num_errors)
            await self.store.update_batch(batch.id, _fail(Errors(data=checked.errors), now_s))
            return 0
        if self.max_backlog and backlog + len(checked.jobs) > self.max_backlog:
            # OpenAI fails a batch past its enqueued limit the same way (token_limit_exceeded)
            why = (
                f"{backlog} lines of other batches are still queued; this batch's "
                f"{len(checked.jobs)} would pass the offline backlog bound of {self.max_backlog} "
                "lines: submit it again later"
            )
            log.info("batch %s refused: %s", batch.id, why)
            errors = Errors(data=[_error("backlog_limit_exceeded", why)])
            await self.store.update_batch(batch.id, _fail(errors, now_s))
            return 0
        jobs = [
            JobPayload(batch.id, j.custom_id, j.index, batch.endpoint, j.body) for j in checked.jobs
        ]
        for i in range(0, len(jobs), PUBLISH_WINDOW):
            await asyncio.gather(
                *(
                    self.store.publish_job(j.batch_id, j.custom_id, msgspec.to_builtins(j))
                    for j in jobs[i : i + PUBLISH_WINDOW]
                )
            )

        def start(b: Batch) -> Batch | None:
            if b.status != "validating":
                return None  # cancelled meanwhile: its finalizer drops the queued jobs
            b = advance(b, "in_progress", time.time())
            counts = RequestCounts(total=len(jobs))
            return msgspec.structs.replace(b, request_counts=counts, model=checked.model)

        await self.store.update_batch(batch.id, start)
        log.info("batch %s: %d requests queued", batch.id, len(jobs))
        return len(jobs)

    async def _check(self, batch: Batch, models: set[str] | None) -> Checked | None:
        """The input file validated, read in the store's chunks; None if the file is gone."""
        try:
            chunks = [c async for c in self.store.file_chunks(batch.input_file_id)]
        except nats.js.errors.NotFoundError:
            return None
        return check_lines(split_lines(chunks), batch.endpoint, models)

    # -- progress and the end -----------------------------------------------------------------

    async def progress(self, batch: Batch, now_s: float) -> bool:
        """Count a running batch's results, or end it; whether it was ended (finalized)."""
        if not self.tally.ready:
            return False
        ok, failed = self.tally.counts(batch.id)
        total = batch.request_counts.total
        if batch.status == "finalizing" or ok + failed >= total:
            await self.finalize(batch, "completed", now_s)
            return True
        if now_s >= batch.expires_at:
            await self.dispatcher.cancel_batch(batch.id)
            await self.finalize(batch, "expired", now_s)
            return True
        if (ok, failed) != (batch.request_counts.completed, batch.request_counts.failed):
            counts = RequestCounts(total=total, completed=ok, failed=failed)

            def count(b: Batch) -> Batch | None:
                if b.status != "in_progress":
                    return None
                return msgspec.structs.replace(b, request_counts=counts)

            await self.store.update_batch(batch.id, count)
        return False

    async def finalize(self, batch: Batch, final: str, now_s: float) -> None:
        """Assemble the output and error files in input order and end the batch as `final`."""
        if final == "completed" and batch.status == "in_progress":
            stored = await self.store.update_batch(
                batch.id,
                lambda b: advance(b, "finalizing", now_s) if b.status == "in_progress" else None,
            )
            if stored is None or stored.status != "finalizing":
                return
            batch = stored
        checked = await self._check(batch, None)
        order = [j.custom_id for j in checked.jobs] if checked is not None else []
        results = {r["line"]["custom_id"]: r for r in await self.store.results_of(batch.id)}
        if final == "completed" and len(results) < batch.request_counts.total:
            # every line has a stored result (that is why we are here), so a short read is the
            # store's, not the batch's: never write an output file with lines missing
            log.warning("batch %s: read %d of %d results; finalizing again shortly", batch.id,
                        len(results), batch.request_counts.total)  # fmt: skip
            return
        out_lines: list[dict[str, Any]] = []
        err_lines: list[dict[str, Any]] = []
        usage = Usage()
        for custom_id in order or list(results):
            r = results.get(custom_id)
            if r is not None:
                (out_lines if r["ok"] else err_lines).append(r["line"])
                if r["ok"]:
                    u = r["line"]["response"]["body"].get("usage", {})
                    usage.input_tokens += int(u.get("prompt_tokens", 0))
                    usage.output_tokens += int(u.get("completion_tokens", 0))
            elif final in _UNRUN:
                err_lines.append(error_line(batch.id, custom_id, *_UNRUN[final]))
        usage.total_tokens = usage.input_tokens + usage.output_tokens
        output_id = await self._write(batch, "output", out_lines, now_s)
        error_id = await self._write(batch, "errors", err_lines, now_s)
        ok = sum(1 for r in results.values() if r["ok"])
        counts = RequestCounts(
            total=batch.request_counts.total, completed=ok, failed=len(results) - ok
        )

        def end(b: Batch) -> Batch | None:
            if b.is_terminal:
                return None  # another finalizer got there first
            if final == "cancelled" and b.status != "cancelling":
                return None
            b = advance(b, final, time.time())
            return msgspec.structs.replace(
                b,
                output_file_id=output_id,
                error_file_id=error_id,
                request_counts=counts,
                usage=usage,
            )

        stored = await self.store.update_batch(batch.id, end)
        if stored is not None and stored.status == final:
            log.info(
                "batch %s %s: %d completed, %d failed of %d",
                batch.id,
                final,
                counts.completed,
                counts.failed,
                counts.total,
            )

    async def _write(
        self, batch: Batch, kind: str, lines: list[dict[str, Any]], now_s: float
    ) -> str | None:
        if not lines:
            return None
        data = b"".join(msgspec.json.encode(line) + b"\n" for line in lines)
        meta = FileObject(
            id=f"file-{batch.id.removeprefix('batch_')}-{kind}",
            bytes=len(data),
            created_at=int(now_s),
            filename=f"{batch.id}_{kind}.jsonl",
            purpose="batch_output",
            owner=batch.owner,
        )
        await self.store.put_file(meta, data)
        return meta.id

    async def _watch_results(self, stop: asyncio.Event) -> None:
        """Keep `tally` equal to the results bucket: read it all, then follow new results."""

        def reset() -> None:
            self.tally = Tally()

        def on_entry(entry: Any) -> None:
            if entry is None:
                self.tally.ready = True
                return
            if not entry.value:
                return
            batch_id = entry.key.split(".", 1)[0]
            result = decode_or_none(entry.value, dict, f"result {entry.key}")
            if result is None:
                return
            self.tally.by_batch[batch_id][entry.key] = bool(result.get("ok"))
            self.kick.set()

        await _follow(stop, "batch results watcher", lambda: self.store.results.watch(">"),
                      on_entry, reset)  # fmt: skip


async def _follow(
    stop: asyncio.Event,
    name: str,
    watch: Callable[[], Awaitable[Any]],
    on_entry: Callable[[Any], None],
    reset: Callable[[], None] | None = None,
) -> None:
    """Hand every update of a KV watcher to `on_entry` (None once it has read what was stored),
    until `stop`; after a bus error, `reset` and watch again from the start."""
    while not stop.is_set():
        if reset is not None:
            reset()
        try:
            watcher = await watch()
            try:
                while True:
                    try:
                        entry = await watcher.updates(timeout=5.0)
                    except nats.errors.TimeoutError:
                        continue
                    on_entry(entry)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            log.warning("%s: %r; watching again", name, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)


def _error(code: str, message: str, line: int | None = None) -> BatchError:
    return BatchError(code=code, message=message, line=line)


def _fail(errors: Errors, now_s: float) -> Any:
    def change(b: Batch) -> Batch | None:
        if b.status != "validating":
            return None
        return msgspec.structs.replace(advance(b, "failed", now_s), errors=errors)

    return change
