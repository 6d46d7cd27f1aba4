"""The burst schedule against a live stack: online streams at the schedule's arrival times
(from the official openai client, or from guidellm's trace replay: `guidellm_online`), Batch API
jobs submitted at the start through the openai client and polled to the end."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Callable
from typing import Any

from tidal.config.cluster import ClusterConfig
from tidal_bench.burst.guidellm_online import run_online
from tidal_bench.burst.schedule import BurstSchedule, OnlineResult, outcome_of
from tidal_bench.kit import distinct_prompt_maker
from tidal_bench.stream_timing import StreamTimes, read_stream

TERMINAL = ("completed", "failed", "expired", "cancelled")


async def _submit(
    client: Any, model: str, ids: list[str], sched: BurstSchedule, prompts: list[str]
) -> str:
    rows = [
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": model,
                "prompt": text,
                "max_tokens": sched.line_output_tokens,
            },
        }
        for cid, text in zip(ids, prompts, strict=True)
    ]
    data = "\n".join(map(json.dumps, rows)).encode()
    f = await client.files.create(file=("burst.jsonl", io.BytesIO(data)), purpose="batch")
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    return str(b.id)


async def _online(
    client: Any, model: str, sched: BurstSchedule, prompts: list[tuple[float, str]], t0: float
) -> Any:
    """Each (arrival time, prompt) of `prompts` as a streamed request at its time from t0."""
    import openai

    results: list[OnlineResult] = []

    async def one(at: float, text: str) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        sent = time.perf_counter() - t0
        got = StreamTimes()
        try:
            stream = await client.completions.create(
                model=model,
                prompt=text,
                max_tokens=sched.output_tokens,
                stream=True,
                extra_body={"request_class": "online"},
            )
            await read_stream(stream, got, lambda: time.perf_counter() - t0)
        except openai.APIStatusError as e:
            results.append(OnlineResult(sent, outcome_of(e.status_code)))
            return
        except openai.APIError:
            results.append(OnlineResult(sent, outcome_of(None)))
            return
        first, last = (got.times[0], got.times[-1]) if got.times else (None, None)
        n = len(got.times)
        ttft = None if first is None else first - sent
        itl = None if first is None or last is None or n < 2 else (last - first) / (n - 1)
        results.append(OnlineResult(sent, "ok", ttft, itl))

    await asyncio.gather(*(one(t, text) for t, text in prompts))
    return results


async def _job_results(client: Any, batch: Any) -> tuple[int, int]:
    """(lines with a 200 response, lines in the error file) of a finished batch, each
    custom_id counted once."""
    ok: set[str] = set()
    if batch.output_file_id:
        text = (await client.files.content(batch.output_file_id)).text
        for line in text.splitlines():
            row = json.loads(line)
            if (row.get("response") or {}).get("status_code") == 200:
                ok.add(row["custom_id"])
    failed: set[str] = set()
    if batch.error_file_id:
        text = (await client.files.content(batch.error_file_id)).text
        failed = {json.loads(line)["custom_id"] for line in text.splitlines() if line.strip()}
    return len(ok), len(failed - ok)


async def run_live(
    base: str,
    sched: BurstSchedule,
    seed: int,
    job_timeout_s: float,
    poll_s: float = 1.0,
    tick: Callable[[float], None] | None = None,
    guidellm: tuple[str, ClusterConfig] | None = None,
) -> dict[str, Any]:
    """Run the schedule against the stack at `base`; `tick(seconds)` is told the run's time as
    it goes (a progress bar); `guidellm` (its executable and the config, for its trace's last
    row) has guidellm send the online load. Returns the online results, each job's timeline and
    `online_offset_s`, how long after the jobs' submission the online schedule started (0 for
    the openai client, guidellm's start-up for guidellm)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    # Prompts of random words (no prompt a prefix of another, so an engine with a prefix cache
    # computes every prompt token, as the simulator charges), all drawn before the clock starts:
    # drawing them costs the client no time inside the run.
    prompt = distinct_prompt_maker(seed)
    ids = sched.line_ids()
    line_prompts = [[prompt(sched.line_prompt_tokens) for _ in job] for job in ids]
    online_prompts = (
        [] if guidellm else [(t, prompt(sched.prompt_tokens)) for t in sched.arrivals(seed)]
    )
    t0, t0_unix = time.perf_counter(), time.time()
    batch_ids = await asyncio.gather(
        *(_submit(client, model, i, sched, p) for i, p in zip(ids, line_prompts, strict=True))
    )
    created = time.perf_counter() - t0
    if guidellm is None:
        online: asyncio.Task[Any] = asyncio.create_task(
            _online(client, model, sched, online_prompts, t0)
        )
    else:
        exe, cfg = guidellm
        online = asyncio.create_task(
            asyncio.to_thread(run_online, exe, base, model, sched, seed, cfg)
        )
    # per job: (t, lines done) at each poll where the count moved
    curves: list[list[tuple[float, int]]] = [[(created, 0)] for _ in batch_ids]
    finished: list[float | None] = [None] * len(batch_ids)
    last: list[Any] = [None] * len(batch_ids)
    deadline = sched.duration_s + job_timeout_s
    while True:
        now = time.perf_counter() - t0
        for j, bid in enumerate(batch_ids):
            if finished[j] is not None:
                continue
            b = await client.batches.retrieve(bid)
            last[j] = b
            rc = b.request_counts
            done = 0 if rc is None else rc.completed + rc.failed
            if done != curves[j][-1][1]:
                curves[j].append((time.perf_counter() - t0, done))
            if b.status in TERMINAL:
                finished[j] = time.perf_counter() - t0
        if tick is not None:
            tick(now)
        if online.done() and all(f is not None for f in finished):
            break
        if now > deadline:
            for j, bid in enumerate(batch_ids):
                if finished[j] is None:
                    last[j] = await client.batches.cancel(bid)
            break
        await asyncio.sleep(poll_s)
    offset, command = 0.0, ""
    if guidellm is None:
        results = await online
    else:
        results, zero_unix, command = await online
        offset = zero_unix - t0_unix
    jobs = []
    for j, b in enumerate(last):
        if b is None:  # no jobs at all
            continue
        if b.status not in TERMINAL:
            b = await client.batches.retrieve(batch_ids[j])
        num_ok, num_failed = await _job_results(client, b)
        jobs.append(
            {
                "job": j,
                "batch_id": batch_ids[j],
                "status": b.status,
                "lines": sched.lines,
                "created_s": created,
                "completed_s": finished[j] if b.status == "completed" else None,
                "num_results": num_ok,
                "num_failed": num_failed,
                "curve": curves[j],
            }
        )
    await client.close()
    out = {"online": results, "jobs": jobs, "online_offset_s": offset}
    return out | ({"guidellm_command": command} if command else {})
