"""What the multi-host tests record and check: every stream and batch line exactly once, the
migrations between hosts (from the bus), and which instance runs which request."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
from dataclasses import dataclass, field

import nats
import openai

from tidal.engine.sim.tokens import load_sim_tokenizer, output_word_ids, prompt_key, sim_token
from tidal.schemas import codec, subjects
from tidal.schemas.messages import InstanceReport, MigrationEvent

MODEL = "tidal-sim"
RESULTS: list[dict[str, object]] = []  # one row per case, printed at the end of the session
ON_GPU = ("running", "waiting", "swapped", "offloaded")  # phases that hold the request


def expected_text(prompt: str, num_tokens: int) -> str:
    """What the sim engine answers `prompt` with wherever it runs (an unmoved run's output)."""
    tok = load_sim_tokenizer("")
    key, words = prompt_key(tok.encode(prompt)), output_word_ids(tok)
    return tok.decode([sim_token(key, i, words) for i in range(num_tokens)])


@dataclass
class Stream:
    prompt: str
    text: str = ""
    finish_reason: str | None = None
    error: str = ""


async def stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> Stream:
    out = Stream(prompt)
    try:
        resp = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in resp:
            for choice in chunk.choices:
                out.text += choice.text or ""
                out.finish_reason = choice.finish_reason or out.finish_reason
    except openai.APIError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def submit_batch(client: openai.AsyncOpenAI, n: int, max_tokens: int) -> str:
    lines = [
        {"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"batch line {i}", "max_tokens": max_tokens,
                  "ignore_eos": True}}
        for i in range(n)
    ]  # fmt: skip
    data = "\n".join(map(json.dumps, lines)).encode()
    f = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    return b.id


async def batch_output(client: openai.AsyncOpenAI, batch_id: str, timeout_s: float) -> list[dict]:
    """The output lines of a batch once it is completed (retrying while the gateway is cut)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            b = await client.batches.retrieve(batch_id)
            if b.status in ("completed", "failed", "expired", "cancelled"):
                break
        except (openai.APIConnectionError, openai.InternalServerError):
            pass
        assert time.monotonic() < deadline, f"batch not done in {timeout_s:.0f} s"
        await asyncio.sleep(0.5)
    assert b.status == "completed", b
    assert b.output_file_id is not None, b
    text = await file_text(client, b.output_file_id, deadline)
    if b.error_file_id:  # failed lines: say why, so a lost line shows its cause
        errors = await file_text(client, b.error_file_id, deadline)
        print(f"batch {batch_id} failed lines:\n{errors[:4000]}")
    return [json.loads(x) for x in text.splitlines()]


async def file_text(client: openai.AsyncOpenAI, file_id: str, deadline: float) -> str:
    """A file's content, retried as a client would on a 503 (the store not yet readable again
    after a node came back)."""
    while True:
        try:
            return (await client.files.content(file_id)).text
        except (openai.APIConnectionError, openai.InternalServerError) as e:
            assert time.monotonic() < deadline, f"file {file_id} not readable: {e!r}"
            await asyncio.sleep(0.5)


def once_each(lines: list[dict], n: int) -> tuple[int, int]:
    """(lost, duplicated) custom_ids of a batch of `n` lines."""
    ids = [x["custom_id"] for x in lines]
    want = {f"b{i}" for i in range(n)}
    return len(want - set(ids)), len(ids) - len(set(ids))


def client_id(req_id: str) -> str:
    """The request a copy re-run by the gateway stands for (`<id>.r<n>` -> `<id>`): two copies
    of one request on two instances are the same request run twice."""
    return re.sub(r"\.r\d+$", "", req_id)


def describe(rid: str, *reports: InstanceReport) -> str:
    """Where `rid` (any copy of it) was in each report, for an assertion message."""
    out = []
    for rep in reports:
        for r in rep.requests:
            if client_id(r.req_id) == rid:
                out.append(f"{rep.instance_id}@{rep.sent_unix_s:.2f}: {r.req_id} {r.phase} "
                           f"{r.num_computed_tokens}/{r.num_output_tokens}")  # fmt: skip
    return "; ".join(out)


@dataclass
class BusLog:
    """Migration events and each instance's latest report, heard on the bus from the root ns."""

    migrations: list[MigrationEvent] = field(default_factory=list)
    latest: dict[str, InstanceReport] = field(default_factory=dict)  # instance -> last report
    overlaps: list[tuple[float, str]] = field(default_factory=list)  # (when, req on two)
    # Reports sent before this (unix s) are not checked for overlaps: after a partition heals,
    # reports the cut host published during the cut arrive late and show its state then.
    since_unix_s: float = 0.0
    moved_at: dict[str, list[float]] = field(default_factory=dict)  # req -> ok migrations
    seen_on_two: dict[str, str] = field(default_factory=dict)  # req -> the first two reports
    nc: nats.NATS | None = None

    def on_two(self, handoff_s: float = 1.5) -> list[str]:
        """Requests seen on two instances at once, less a migration's own handoff: an overlap
        within `handoff_s` of an ok migration of that request (the source's last report, up
        to 1 s old, beside the destination's first) is the move, not duplicate work."""
        return sorted(
            {
                rid
                for when, rid in self.overlaps
                if not any(abs(when - m) < handoff_s for m in self.moved_at.get(rid, []))
            }
        )

    async def start(self, url: str) -> BusLog:
        self.nc = await nats.connect(
            url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )

        async def on_mig(msg) -> None:  # type: ignore[no-untyped-def]
            event = codec.decode(msg.data, MigrationEvent)
            self.migrations.append(event)
            if event.outcome == "ok":
                self.moved_at.setdefault(client_id(event.req_id), []).append(time.monotonic())

        async def on_rep(msg) -> None:  # type: ignore[no-untyped-def]
            rep = codec.decode(msg.data, InstanceReport)
            seen = self.latest.get(rep.instance_id)
            if seen is not None and seen.sent_unix_s > rep.sent_unix_s:
                return  # an older report delivered late
            self.latest[rep.instance_id] = rep
            if rep.sent_unix_s < self.since_unix_s:
                return
            mine = {client_id(r.req_id) for r in rep.requests if r.phase in ON_GPU}
            for other in self.latest.values():
                fresh = abs(rep.sent_unix_s - other.sent_unix_s) < 1.0
                stale = other.sent_unix_s < self.since_unix_s
                if other.instance_id == rep.instance_id or not fresh or stale:
                    continue
                theirs = {client_id(r.req_id) for r in other.requests if r.phase in ON_GPU}
                for rid in mine & theirs:
                    self.overlaps.append((time.monotonic(), rid))
                    self.seen_on_two.setdefault(rid, describe(rid, rep, other))

        await self.nc.subscribe(subjects.MIGRATION_EVENTS, cb=on_mig)
        await self.nc.subscribe(subjects.INSTANCE_STATE_ALL, cb=on_rep)
        return self

    async def status(self) -> dict:
        assert self.nc is not None
        return json.loads((await self.nc.request(subjects.CTL_STATUS, b"{}", timeout=3)).data)

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


def client_for(api: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api + "/v1", api_key="none", max_retries=0, timeout=60)


async def until_served(client: openai.AsyncOpenAI, timeout_s: float) -> float:
    """Seconds until a new online request is answered in full."""
    t0 = time.monotonic()
    while True:
        try:
            r = await client.completions.create(
                model=MODEL, prompt="are you there?", max_tokens=8, timeout=10
            )
            if r.choices and r.choices[0].finish_reason == "length":
                return time.monotonic() - t0
        except openai.APIError:
            pass
        assert time.monotonic() - t0 < timeout_s, f"no online request served in {timeout_s} s"
        await asyncio.sleep(0.25)
