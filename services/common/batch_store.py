"""The Batch API's durable state on JetStream (the bus Tidal already runs; no new server).

* files: content in the Object Store bucket `tidal-files` (chunked, never one message), the
  `FileObject` in the KV bucket `tidal-file-meta`;
* batches: the `Batch` in the KV bucket `tidal-batches`, changed only by `update_batch`, a
  read-modify-write with the revision checked (two writers never overwrite each other);
* jobs: one message per input line on the work-queue stream `TIDAL_BATCH_JOBS`, published with
  the message id `batch_id:custom_id`, so publishing a batch again after a crash adds nothing;
* results: one KV entry per line in `tidal-batch-results`, written first-writer-wins
  (`kv.create`), so a job that runs twice stores one result.

Everything is on file storage (`tidal up` keeps the store across restarts), with
$TIDAL_NATS_REPLICAS copies: 1 on one nats-server, 3 on a 3-node cluster (`tidal up
--nats-cluster 3`, compose, Kubernetes), where any one node can be lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from tidal import envs
from tidal.batch.lines import result_key
from tidal.batch.objects import Batch, FileObject
from tidal.schemas import subjects

log = logging.getLogger("tidal.batch")

FILES_BUCKET = "tidal-files"
FILE_META_BUCKET = "tidal-file-meta"
BATCHES_BUCKET = "tidal-batches"
RESULTS_BUCKET = "tidal-batch-results"
JOBS_STREAM = "TIDAL_BATCH_JOBS"
JOBS_SUBJECT = subjects.BATCH_JOBS  # .<batch_id>
DISPATCH_CONSUMER = "tidal-batch-dispatch"
DEDUP_WINDOW_S = 24 * 3600.0  # a re-publish within a day of the first is dropped
ACK_WAIT_S = 15.0  # a job not acknowledged (nor marked in progress) within this is redelivered
MAX_DELIVER = 5  # deliveries before a line is given up and goes to the error file
UPDATE_ATTEMPTS = 20
FILE_CHUNK_TIMEOUT_S = 5.0  # a chunk not delivered within this: read again on a new consumer
FILE_READ_STALL_S = 30.0  # a file read that gains no byte for this long fails
KV_BUCKETS = (FILE_META_BUCKET, BATCHES_BUCKET, RESULTS_BUCKET)


class Conflict(RuntimeError):
    """A revision-checked update lost to other writers too many times."""


class BatchStore:
    """Typed access to the buckets and the jobs stream; `open` creates whatever is missing."""

    def __init__(self, js: JetStreamContext, replicas: int = 1) -> None:
        self.js = js
        self.replicas = replicas  # copies of every stream and bucket (NATS cluster nodes)
        self.files: ObjectStore
        self.file_meta: KeyValue
        self.batches: KeyValue
        self.results: KeyValue

    @classmethod
    async def open(cls, nc: NATS, replicas: int | None = None) -> BatchStore:
        """`replicas` defaults to $TIDAL_NATS_REPLICAS (1; 3 on a 3-node cluster)."""
        store = cls(
            nc.jetstream(timeout=10.0), envs.nats_replicas() if replicas is None else replicas
        )
        await store._ensure()
        return store

    async def _ensure(self) -> None:
        js, r = self.js, self.replicas
        file_storage = api.StorageType.FILE
        files_config = api.ObjectStoreConfig(bucket=FILES_BUCKET, storage=file_storage, replicas=r)
        try:
            self.files = await js.create_object_store(FILES_BUCKET, config=files_config)
        except nats.js.errors.BadRequestError:  # exists with other settings (replicas)
            self.files = await js.object_store(FILES_BUCKET)
        self.file_meta = await self._kv(FILE_META_BUCKET)
        self.batches = await self._kv(BATCHES_BUCKET)
        self.results = await self._kv(RESULTS_BUCKET)
        config = api.StreamConfig(
            name=JOBS_STREAM,
            subjects=[JOBS_SUBJECT + ".>"],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=file_storage,
            duplicate_window=DEDUP_WINDOW_S,
            num_replicas=r,
        )
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:  # exists with other settings: take ours
            existing = (await js.stream_info(JOBS_STREAM)).config.num_replicas or 1
            config.num_replicas = max(r, existing)  # never fewer copies (_set_replicas)
            await js.update_stream(config)
        # A store made before with fewer copies (say on one node, R=1) gets the ones asked for.
        for stream in (f"OBJ_{FILES_BUCKET}", *(f"KV_{b}" for b in KV_BUCKETS)):
            await self._set_replicas(stream)

    async def _kv(self, bucket: str) -> KeyValue:
        config = api.KeyValueConfig(
            bucket=bucket, storage=api.StorageType.FILE, history=1, replicas=self.replicas
        )
        try:
            return await self.js.create_key_value(config)
        except nats.js.errors.BadRequestError:  # exists with other settings (replicas)
            return await self.js.key_value(bucket)

    async def _set_replicas(self, stream: str) -> None:
        """Raise the stream's replicas to those asked for; never lower them (a service started
        by hand without $TIDAL_NATS_REPLICAS must not take a cluster's copies away)."""
        info = await self.js.stream_info(stream)
        current = info.config.num_replicas or 1
        if current < self.replicas:
            log.info("stream %s: %d -> %d replicas", stream, current, self.replicas)
            info.config.num_replicas = self.replicas
            await self.js.update_stream(info.config)

    # -- files --------------------------------------------------------------------------------

    async def put_file(self, meta: FileObject, data: io.BufferedIOBase | bytes) -> FileObject:
        """Store the content, then its file object with the size actually stored."""
        info = await self.files.put(meta.id, data)
        meta = msgspec.structs.replace(meta, bytes=info.size or 0)
        await self.file_meta.put(meta.id, msgspec.json.encode(meta))
        return meta

    async def file(self, file_id: str) -> FileObject | None:
        return await _get_json(self.file_meta, file_id, FileObject)

    async def file_content(self, file_id: str) -> bytes:
        result = await self.files.get(file_id)
        return result.data or b""

    async def file_chunks(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's content as the store's chunks, without holding it whole.

        A read cut short (the stream's leader lost or just back, a consumer that stops
        delivering) starts again on a fresh consumer past the bytes already given, so a caller
        gets every byte once; it fails only after `FILE_READ_STALL_S` without a new byte.
        """
        info = await self.files.get_info(file_id)
        size, sent = info.size or 0, 0
        stalled_since = time.monotonic()
        while sent < size:
            try:
                async for chunk in self._chunks_from(info.nuid, sent, size):
                    sent += len(chunk)
                    stalled_since = time.monotonic()
                    yield chunk
            except (TimeoutError, nats.errors.Error) as e:
                if time.monotonic() - stalled_since > FILE_READ_STALL_S:
                    raise
                log.warning("file %s: read cut at %d of %d bytes (%r); resuming", file_id,
                            sent, size, e)  # fmt: skip
                await asyncio.sleep(0.5)

    async def _chunks_from(self, nuid: str, start: int, size: int) -> AsyncIterator[bytes]:
        """The object's bytes from `start` to `size`, read on one ordered consumer."""
        sub = await self.js.subscribe(f"$O.{FILES_BUCKET}.C.{nuid}", ordered_consumer=True)
        try:
            pos = 0
            while pos < size:
                data = (await sub.next_msg(timeout=FILE_CHUNK_TIMEOUT_S)).data
                if pos + len(data) > start:
                    yield data[max(0, start - pos) :]
                pos += len(data)
        finally:
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                await sub.unsubscribe()

    async def list_files(self) -> list[FileObject]:
        return await _all_json(self.file_meta, ">", FileObject)

    async def delete_file(self, file_id: str) -> bool:
        if await self.file(file_id) is None:
            return False
        await self.file_meta.delete(file_id)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.files.delete(file_id)
        return True

    # -- batches ------------------------------------------------------------------------------

    async def create_batch(self, batch: Batch) -> None:
        await self.batches.create(batch.id, msgspec.json.encode(batch))

    async def batch(self, batch_id: str) -> Batch | None:
        return await _get_json(self.batches, batch_id, Batch)

    async def list_batches(self) -> list[Batch]:
        # batches are never deleted: every key the server holds is one to read
        expected = await self._num_keys(BATCHES_BUCKET, ">")
        return await _all_json(self.batches, ">", Batch, expected)

    async def update_batch(
        self, batch_id: str, change: Callable[[Batch], Batch | None]
    ) -> Batch | None:
        """Apply `change` to the stored batch with a revision check, retrying on a conflict.
        `change` returns None to leave it as it is; returns the stored batch (None if absent)."""
        for _ in range(UPDATE_ATTEMPTS):
            try:
                entry = await self.batches.get(batch_id)
            except nats.js.errors.KeyNotFoundError:
                return None
            current = decode_or_none(entry.value, Batch, f"batch {batch_id}")
            if current is None:
                return None
            new = change(current)
            if new is None:
                return current
            try:
                await self.batches.update(batch_id, msgspec.json.encode(new), last=entry.revision)
                return new
            except nats.js.errors.KeyWrongLastSequenceError:
                await asyncio.sleep(0.01)  # another writer won; read again
        raise Conflict(f"batch {batch_id}: {UPDATE_ATTEMPTS} conflicting updates in a row")

    # -- jobs and results ---------------------------------------------------------------------

    async def publish_job(self, batch_id: str, custom_id: str, payload: dict[str, Any]) -> None:
        await self.js.publish(
            f"{JOBS_SUBJECT}.{batch_id}",
            msgspec.json.encode(payload),
            headers={"Nats-Msg-Id": f"{batch_id}:{custom_id}"},
        )

    async def put_result(self, batch_id: str, custom_id: str, line: dict[str, Any]) -> bool:
        """Store a line's result unless one is there; True when this call stored it."""
        try:
            await self.results.create(result_key(batch_id, custom_id), msgspec.json.encode(line))
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            return False

    async def has_result(self, batch_id: str, custom_id: str) -> bool:
        try:
            await self.results.get(result_key(batch_id, custom_id))
            return True
        except nats.js.errors.KeyNotFoundError:
            return False

    async def results_of(self, batch_id: str) -> list[dict[str, Any]]:
        expected = await self.num_results(batch_id)
        return await _all_json(self.results, f"{batch_id}.*", dict, expected)

    async def num_results(self, batch_id: str) -> int:
        """How many lines of `batch_id` have a stored result, counted by the server."""
        return await self._num_keys(RESULTS_BUCKET, f"{batch_id}.*")

    async def _num_keys(self, bucket: str, keys: str) -> int:
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.{keys}")
        return len(info.state.subjects or {})


async def _get_json(kv: KeyValue, key: str, type_: type[Any]) -> Any:
    try:
        entry = await kv.get(key)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    except nats.js.errors.InvalidKeyError:
        return None
    return decode_or_none(entry.value, type_, f"key {key}")


def decode_or_none(data: bytes | None, type_: type[Any], what: str) -> Any:
    """A stored JSON value, or None (logged) when it is not one: anyone on the bus can write to a
    KV subject, and one bad value must not make a listing or a watcher fail for good."""
    try:
        return msgspec.json.decode(data or b"", type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("ignored a malformed stored value (%s): %s", what, exc)
        return None


LISTING_CONSUMER_TTL_S = 2.0  # how long a listing's consumer outlives it on the server


async def _all_json(kv: KeyValue, keys: str, type_: type[Any], expected: int = 0) -> list[Any]:
    """Every live value under `keys`, read with one watcher (no request per key). With
    `expected` (how many keys the server holds there, none deleted), at least that many.

    NOTE: nats-py's watcher can put its "nothing more stored" marker ahead of entries already on
    their way (it compares the consumer's pending count with what its callback has seen, before
    the callback ran). Trusted alone, it once made a finalizer read no results and write a batch
    with no output; with `expected`, an early marker is read past, and the listing ends once
    `expected` entries are in. (Waiting for a second marker, which never comes, stalled the
    batch keeper 10 s a step under load: windows of the live search with no offline tokens.)"""
    out = []
    seen = 0
    early = False  # the marker came before `expected` entries: it comes once, so count instead
    # NOTE: its consumer outlives the watcher (stopping only unsubscribes) by the inactive
    # threshold, 5 min by default: a keeper listing a few times a second reached the server's
    # 1,000 consumers a stream within minutes, and every later listing failed (BadRequest).
    watcher = await kv.watch(keys, ignore_deletes=True, inactive_threshold=LISTING_CONSUMER_TTL_S)
    try:
        while not (early and seen >= expected):
            entry = await watcher.updates(timeout=10.0)
            if entry is None:  # the end of what is stored now, unless it came early
                if seen >= expected:
                    break
                early = True
                continue
            seen += 1
            if entry.value and entry.operation is None:
                value = decode_or_none(entry.value, type_, f"key {entry.key}")
                if value is not None:
                    out.append(value)
    finally:
        await watcher.stop()
    return out
