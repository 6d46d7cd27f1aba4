"""`tidal bench replay`'s calibration probe: what the live serving path costs that the simulator's
engine model does not, measured on the stack before its window.

Lone online requests (one at a time, so nothing queues) of the window's own prompt lengths go
through the live stack; the simulator runs the same requests at the same moments. What the live
side spends beyond the simulator is then the serving path itself, two figures:

- **dispatch** (TTFT, live - simulated = a + b x prompt tokens): HTTP, the gateway, the bus hops
  to the scheduler and the instance, tokenising the prompt, the first token back to the client.
  The simulator routes each request that much after its arrival (`ClusterConfig.dispatch_ms`,
  `dispatch_us_per_token`).
- **hand-off** (first token -> second token, live - simulated = c + d x prompt tokens): a push
  migration after prefill (report, scheduler, migrate command, offer, KV on the data plane,
  commit) against the simulator's link. The simulator's link gets the fitted fixed cost and
  bandwidth (`link_latency_ms`, `link_gb_per_s`), so its transfers take what live ones took.

Fits are least squares (numpy), clipped to what is physical (no negative cost, a bandwidth no
higher than the configured link's). Both are emulation on both sides; the point is agreement.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tidal.config.cluster import ClusterConfig
from tidal.schemas.enums import RequestClass
from tidal.sim.build import instance_setups, simulate
from tidal.workload.mix import SimRequest
from tidal_bench.stream_timing import read_stream

PROBE_OUTPUT_TOKENS = 8  # enough for a first gap and a steady decode step after it
PROBE_PERCENTILES = (5, 50, 90, 99)  # of the window's online prompt lengths
PROBE_REPEATS = 3  # lone requests per length (their median is fitted)


def probe_lengths(reqs: list[SimRequest]) -> list[int]:
    """Prompt lengths to probe: percentiles of the window's online prompts, each twice."""
    online = [r.input_tokens for r in reqs if r.req_class == RequestClass.ONLINE]
    if not online:
        raise ValueError("the window has no online request to calibrate on")
    lengths = sorted({int(np.percentile(online, q)) for q in PROBE_PERCENTILES})
    return [n for n in lengths for _ in range(PROBE_REPEATS)]


@dataclasses.dataclass(frozen=True)
class Lone:
    """One probe request as the client saw it (seconds from the probe's start)."""

    input_tokens: int
    sent_s: float
    ttft_s: float
    decode_s: float  # first token -> last token (the hand-off and the decode steps)
    first_gap_s: float = 0.0  # first token -> second token (live only; the simulator keeps
    # no per-token times)


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line, both clipped at 0; the mean with slope 0
    when all x are equal."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if len(xs) < 2 or np.ptp(xs) == 0:
        return max(0.0, float(np.mean(ys)) if len(ys) else 0.0), 0.0
    slope, intercept = np.polyfit(xs, ys, 1)
    if slope < 0:  # no cost falls as prompts grow: a constant fits better
        return max(0.0, float(np.mean(ys))), 0.0
    if intercept < 0:  # through the origin
        return 0.0, max(0.0, float(np.dot(xs, ys) / np.dot(xs, xs)))
    return float(intercept), float(slope)


def by_length(lengths: list[int], values: list[float]) -> tuple[list[float], list[float]]:
    """(each distinct length, the median of its values): one noisy request moves no fit."""
    keys = sorted(set(lengths))
    meds = [
        float(np.median([v for n, v in zip(lengths, values, strict=True) if n == k])) for k in keys
    ]
    return [float(k) for k in keys], meds


async def send_lone(base: str, model: str, lengths: list[int], gap_s: float) -> list[Lone]:
    """The probe requests, one at a time, `gap_s` apart after each ends."""
    import openai

    from tidal_bench.kit import distinct_prompt_maker

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    prompt = distinct_prompt_maker(seed=0)  # random words: no probe a prefix of another
    texts = [prompt(n) for n in lengths]
    out: list[Lone] = []
    t0 = time.perf_counter()
    try:
        for n, text in zip(lengths, texts, strict=True):
            sent = time.perf_counter() - t0
            stream = await client.completions.create(
                model=model,
                prompt=text,
                max_tokens=PROBE_OUTPUT_TOKENS,
                stream=True,
                extra_body={"request_class": "online"},
            )
            times = (await read_stream(stream, clock=lambda: time.perf_counter() - t0)).times
            if len(times) == PROBE_OUTPUT_TOKENS:
                ttft, decode, gap = times[0] - sent, times[-1] - times[0], times[1] - times[0]
                out.append(Lone(n, sent, ttft, decode, gap))
            await asyncio.sleep(gap_s)
    finally:
        await client.close()
    return out


def simulated_lone(cfg: ClusterConfig, policy: str, lone: list[Lone]) -> list[Lone]:
    """The same probe requests through the simulator, at the moments the client sent them."""
    reqs = [
        SimRequest(f"probe-{i}", RequestClass.ONLINE, p.sent_s, p.input_tokens, PROBE_OUTPUT_TOKENS)
        for i, p in enumerate(lone)
    ]
    run = dataclasses.replace(cfg, duration_s=max(p.sent_s for p in lone) + 1.0)
    done = {r.req_id: r for r in simulate(run, policy, requests=reqs).requests}
    out = []
    for i, p in enumerate(lone):
        r = done[f"probe-{i}"]
        if r.first_token_s is None or r.last_token_s is None:
            raise RuntimeError(f"the simulator did not finish probe request {i}")
        ttft, decode = r.first_token_s - r.arrival_s, r.last_token_s - r.first_token_s
        out.append(Lone(p.input_tokens, p.sent_s, ttft, decode))
    return out


def calibrate(
    cfg: ClusterConfig, policy: str, lone: list[Lone], handoff_delays_s: Sequence[float] = ()
) -> dict[str, Any]:
    """The serving-path figures from the live probe against the simulator's twin of it;
    `handoff_delays_s`, the probe's pushes' first token -> migrate command (seconds), gives the
    part of the hand-off's fixed cost spent before the source exports (median)."""
    if not lone:
        raise ValueError("no probe request completed: the live stack did not serve")
    sim = simulated_lone(cfg, policy, lone)
    lengths = [p.input_tokens for p in lone]
    n, ttft_extra = by_length(
        lengths, [a.ttft_s - b.ttft_s for a, b in zip(lone, sim, strict=True)]
    )
    dispatch_s, per_token_s = fit_line(n, ttft_extra)
    # Decode span (the hand-off, then the decode steps) live against simulated: what is left is
    # the hand-off the simulator's link did not charge (plus any per-step overrun, ~0.2 ms).
    _, extra = by_length(lengths, [a.decode_s - b.decode_s for a, b in zip(lone, sim, strict=True)])
    kvb = instance_setups(cfg, policy)[0].kv_bytes_per_token
    fixed_s, s_per_token = fit_line(n, extra)
    link_bps = cfg.link_gb_per_s * 1e9
    s_per_byte = 1 / link_bps + s_per_token / kvb
    latency_ms = cfg.link_latency_ms + 1e3 * fixed_s
    delay_ms = 1e3 * float(np.median(handoff_delays_s)) if len(handoff_delays_s) else 0.0
    return {
        "dispatch_ms": 1e3 * dispatch_s,
        "dispatch_us_per_token": 1e6 * per_token_s,
        "link_latency_ms": latency_ms,
        "handoff_delay_ms": min(delay_ms, latency_ms),
        "link_gb_per_s": 1 / s_per_byte / 1e9,
        "probe": [
            {
                "input_tokens": a.input_tokens,
                "ttft_live_s": a.ttft_s,
                "ttft_sim_s": b.ttft_s,
                "decode_live_s": a.decode_s,
                "decode_sim_s": b.decode_s,
                "first_gap_live_s": a.first_gap_s,
            }
            for a, b in zip(lone, sim, strict=True)
        ],
    }


def with_calibration(cfg: ClusterConfig, cal: dict[str, Any]) -> ClusterConfig:
    """`cfg` with the probe's serving path: dispatch delay, and the link the hand-offs had."""
    return dataclasses.replace(
        cfg,
        dispatch_ms=float(cal["dispatch_ms"]),
        dispatch_us_per_token=float(cal["dispatch_us_per_token"]),
        link_latency_ms=float(cal["link_latency_ms"]),
        link_gb_per_s=float(cal["link_gb_per_s"]),
        handoff_delay_ms=float(cal.get("handoff_delay_ms", 0.0)),
    )


def step_summary(trace_dir: Path) -> dict[str, Any]:
    """Per instance, from the sim engine's step trace (`TIDAL_SIM_STEP_TRACE_DIR`): how far live
    steps ran past their emulated time, and the host work before each (ms, p50/p90/p99)."""
    out: dict[str, Any] = {}
    for path in sorted(trace_dir.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in lines if "emulated_s" in r]  # steps (the rest: request events)
        if not rows:
            continue
        over = np.array([r["wall_s"] - r["emulated_s"] for r in rows]) * 1e3
        host = np.array([r["host_s"] for r in rows]) * 1e3
        late = np.array([r["late_s"] for r in rows]) * 1e3
        emul = np.array([r["emulated_s"] for r in rows])
        q = [50, 90, 99]
        out[path.stem] = {
            "num_steps": len(rows),
            "emulated_s_total": float(emul.sum()),
            "overrun_ms_p50_p90_p99": np.percentile(over, q).round(3).tolist(),
            "overrun_total_pct": float(100 * (over.sum() / 1e3) / max(emul.sum(), 1e-9)),
            "host_ms_p50_p90_p99": np.percentile(host, q).round(3).tolist(),
            "late_ms_p50_p90_p99": np.percentile(late, q).round(3).tolist(),
        }
    return out


def request_events(trace_dir: Path) -> dict[str, dict[str, float]]:
    """req_id -> {event: unix_s} from every instance's trace (`add`: joined an engine, `first`:
    its first token made; the earliest of each)."""
    out: dict[str, dict[str, float]] = {}
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "event" in rec:
                ev = out.setdefault(rec["req_id"], {})
                ev[rec["event"]] = min(ev.get(rec["event"], rec["unix_s"]), rec["unix_s"])
    return out


def serving_path(requests: list[dict[str, Any]], events: dict[str, dict[str, float]]) -> dict:
    """Where the window's online TTFT went outside the engine, per request from the client's and
    the engine's clocks (one host): `in` client sent -> the request joined an engine (HTTP,
    gateway, scheduler, instance, tokenising, the step boundary), `out` first token made -> the
    client had it. ms, p50/p90/p99, and how many requests were matched."""
    path_in, path_out = [], []
    for r in requests:
        rid = r.get("req_id") or ""
        # the API's id is the engine's request id behind the object's prefix ("cmpl-")
        ev = events.get(rid) or events.get(rid.split("-", 1)[-1], {})
        if r["class"] != "online" or "sent_unix_s" not in r:
            continue
        if "add" in ev:
            path_in.append(ev["add"] - r["sent_unix_s"])
        if "first" in ev and r.get("first_token_unix_s") is not None:
            path_out.append(r["first_token_unix_s"] - ev["first"])
    q = [50, 90, 99]

    def ms(v: list[float]) -> list[float]:
        return (np.percentile(v, q) * 1e3).round(2).tolist() if v else []

    return {
        "in_ms_p50_p90_p99": ms(path_in),
        "out_ms_p50_p90_p99": ms(path_out),
        "num_matched": len(path_in),
    }
