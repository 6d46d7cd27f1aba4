"""One live window of `tidal bench colocation --search-offline`, measured on a running stack.

The config's online trace is replayed with the official openai client, streamed, while the offline
lines go in through the Batch API (`/v1/files` + `/v1/batches`, one batch a second holding the
lines that arrived in it); online SLO attainment and TTFT/TPOT are counted from the warm-up's end,
offline tokens/s and lines/s from the batch service's `/metrics` counters over the measured part.
At the end the window's batches are left to finish or cancelled, so the next window starts on an
empty stack. Every prompt is of random words (`kit.distinct_prompt_maker`): no prompt is a prefix
of another, so the torch engine's prefix cache computes what the simulator and the offline limit
charge, every prompt token.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import time
from typing import Any

from tidal.config.cluster import ClusterConfig
from tidal.workload.mix import SimRequest
from tidal_bench.colocation.max_offline import Measurement
from tidal_bench.kit import CpuClock, distinct_prompt_maker, metric_samples, pct
from tidal_bench.stream_timing import StreamTimes, read_stream


async def _submit(client: Any, model: str, lines: list[tuple[int, int]]) -> str:
    """One batch of (prompt tokens, output tokens) lines through /v1/files + /v1/batches."""
    prompt = distinct_prompt_maker()
    body = "\n".join(
        json.dumps(
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": model,
                    "prompt": prompt(n_in),
                    "max_tokens": n_out,
                    "ignore_eos": True,
                },
            }
        )
        for i, (n_in, n_out) in enumerate(lines)
    ).encode()
    f = await client.files.create(file=("w.jsonl", io.BytesIO(body)), purpose="batch")
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    return str(b.id)


FINAL = ("completed", "failed", "cancelled", "expired")


async def _settle(client: Any, model: str, batch_ids: list[str], settle_s: float) -> None:
    """Leave the stack empty for the next window: the window's batches get `settle_s` to finish,
    the rest are cancelled. NOTE: the batch service takes seconds to minutes to finalize
    cancelled batches and validates no new batch meanwhile (later windows measured no offline
    tokens at all), so batches are left to finish where they can; after a cancel, a one-line
    batch run to completion shows the service is ready again."""
    import openai

    deadline = time.monotonic() + settle_s
    left = list(batch_ids)
    while left and time.monotonic() < deadline:
        states = await asyncio.gather(*(client.batches.retrieve(b) for b in left))
        left = [b.id for b in states if b.status not in FINAL]
        if left:
            await asyncio.sleep(0.5)
    if not left:
        return
    for bid in left:
        with contextlib.suppress(openai.APIError):  # it ended meanwhile
            await client.batches.cancel(bid)
    probe = await _submit(client, model, [(8, 1)])
    for _ in range(600):
        if (await client.batches.retrieve(probe)).status in FINAL:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("the batch service did not run a one-line batch within 300 s")


def _batch_counters(base: str) -> dict[str, float]:
    out = {"tokens": 0.0, "lines": 0.0, "busy": 0.0}
    for name, labels, value in metric_samples(base):
        if name == "tidal_batch_generated_tokens_total":  # as generated, not per stored line
            out["tokens"] += value
        elif name == "tidal_batch_lines_total" and labels.get("outcome") == "completed":
            out["lines"] += value
        elif name in ("tidal_batch_lines_in_flight", "tidal_batch_lines_queued"):
            out["busy"] += value
    return out


async def measure_window(
    base: str,
    model: str,
    cfg: ClusterConfig,
    online: list[SimRequest],
    offline: list[SimRequest],
    warmup_s: float,
    settle_s: float = 90.0,
    procs: dict[str, int] | None = None,
) -> Measurement:
    """One window: the online trace streamed and the offline lines submitted as batches at their
    arrival times; counted from `warmup_s` on; every batch cancelled and drained at the end.
    `procs` (name -> pid: the stack's processes and the load generator): their CPU over the
    measured part goes into the measurement."""
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    prompt = distinct_prompt_maker()
    slo, end_s = cfg.slo, cfg.duration_s
    rows: list[tuple[float, float | None, float | None, int, int]] = []  # sent, 1st, last, n, want
    batch_ids: list[str] = []
    t0 = time.perf_counter()

    async def at(t: float) -> None:
        await asyncio.sleep(max(0.0, t - (time.perf_counter() - t0)))

    async def one(r: SimRequest) -> None:
        await at(r.arrival_s)
        sent = time.perf_counter() - t0
        got = StreamTimes()
        try:
            stream = await client.completions.create(
                model=model,
                prompt=prompt(r.input_tokens),
                max_tokens=r.output_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"request_class": "online", "ignore_eos": True},
            )
            await read_stream(stream, got, lambda: time.perf_counter() - t0)
        except openai.APIError:
            pass  # rejected or failed: not attained
        first, last = (got.times[0], got.times[-1]) if got.times else (None, None)
        # NOTE: tokens, not text chunks: a real tokenizer's detokenizer may hold a token back
        # or send two in one chunk
        n = got.num_tokens or 0
        if sent >= warmup_s:
            rows.append((sent, first, last, n, r.output_tokens))

    async def submit(second: int, lines: list[SimRequest]) -> None:
        await at(float(second))
        batch_ids.append(
            await _submit(client, model, [(r.input_tokens, r.output_tokens) for r in lines])
        )

    async def snapshot(t: float) -> dict[str, float]:
        await at(t)
        return await asyncio.to_thread(_batch_counters, base)

    groups: dict[int, list[SimRequest]] = {}
    for r in offline:
        groups.setdefault(int(r.arrival_s), []).append(r)
    tasks = [asyncio.create_task(one(r)) for r in online]
    tasks += [asyncio.create_task(submit(s, g)) for s, g in groups.items()]
    c0 = await snapshot(warmup_s)
    clock = CpuClock(procs) if procs else None
    c1 = await snapshot(end_s)
    cpu = cpu_row(clock.read()) | {"loadavg_1m": os.getloadavg()[0]} if clock else None
    measured_s = end_s - warmup_s
    try:
        await asyncio.gather(*tasks)
        await _settle(client, model, batch_ids, settle_s)
    finally:
        await client.close()
    ok = 0
    ttft, tpot = [], []
    for sent, first, last, n, want in rows:
        if first is None or last is None:
            continue
        ttft.append(first - sent)
        tp = (last - first) / (n - 1) if n > 1 else 0.0
        tpot.append(tp)
        ok += n >= want and first - sent <= slo.ttft_s and tp <= slo.tpot_s
    return Measurement(
        attainment_pct=100.0 * ok / max(1, len(rows)),
        offline_tokens_per_s=(c1["tokens"] - c0["tokens"]) / measured_s,
        offline_lines_per_s=(c1["lines"] - c0["lines"]) / measured_s,
        num_online=len(rows),
        ttft_p99_s=pct(ttft, 99),
        tpot_p99_s=pct(tpot, 99),
        cpu=cpu,
    )


def cpu_row(read: dict[str, Any]) -> dict[str, Any]:
    """A `CpuClock.read()` as CPU seconds a second per process, their sum, and each core's busy
    share (everything on the core, this machine's other work included)."""
    span = max(read["window_s"], 1e-9)
    per = {n: round(s / span, 3) for n, s in sorted(read["cpu_s"].items())}
    return {
        "window_s": read["window_s"],
        "cpu_s_per_s": per,
        "stack_and_loadgen_cpu_s_per_s": round(sum(per.values()), 3),
        "core_busy": {str(c): b for c, b in sorted(read["core_busy"].items())},
    }
