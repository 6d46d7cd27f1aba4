"""`tidal bench replay`: the same trace window through the live stack and through the simulator.

For each policy, the config's workload (`tidal.sim.build.workload`, cut to `--duration-s`) is
replayed in real time against `tidal up --engine sim --config CONFIG --policy P`, whose sim
engine takes each step's time from the simulator's own latency model (`MODEL@HARDWARE` of the
config) and whose KV pool is the simulator's. Every request is a streamed `/v1/completions` call
of the official openai client with a prompt of exactly its trace length in the served tokenizer
(random words, no prompt a prefix of another: `kit.distinct_prompt_maker`) and `max_tokens` =
its trace output length. The simulator then runs the same requests with the same config and
policy. Printed side by side: online SLO attainment, TTFT and TPOT p50/p99, and
offline output tokens per second in the window. TTFT counts from the moment the client sent the
request (as guidellm's does); how late the client sent it against the trace is shown apart.
Both sides are emulation (the sim engine and the simulator); the point is their agreement.

`--client guidellm` sends the same window from an outside client instead, guidellm's trace
replay (`tidal_bench/replay/guidellm.py`; guidellm runs from its own environment,
`--guidellm PATH`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from services.cli import natsd
from tidal.config.cluster import ClusterConfig, load_config
from tidal.sim.build import instance_setups, simulate, workload
from tidal.sim.metrics import summarize
from tidal.workload.mix import SimRequest
from tidal_bench.kit import distinct_prompt_maker, gateway_metrics, pct, save_json, stack
from tidal_bench.replay import trace as trc
from tidal_bench.replay import window as wnd
from tidal_bench.replay.table import KEYS, SIDES, print_table
from tidal_bench.stream_timing import StreamTimes, read_stream


def _stats(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    return {
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
    }


async def _replay(
    base: str, model: str, reqs: list[SimRequest], cfg: ClusterConfig
) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=3600)
    # (request, sent, first token, last token, tokens, response id), times from t0
    rows: list[tuple[SimRequest, float, float | None, float | None, int, str]] = []
    off_tokens = 0  # offline output tokens streamed inside the window (as the simulator bins)
    # random words, no prompt a prefix of another (an engine with a prefix cache computes every
    # prompt token, as the simulator charges), drawn before the clock starts: no client lag
    prompt = distinct_prompt_maker(seed=0)
    texts = [prompt(r.input_tokens) for r in reqs]
    t0, unix0 = time.perf_counter(), time.time()

    async def one(r: SimRequest, text: str) -> None:
        nonlocal off_tokens
        await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
        got = StreamTimes()
        sent = time.perf_counter() - t0  # later than r.arrival_s by the client's own lag
        try:
            stream = await client.completions.create(
                model=model,
                prompt=text,
                max_tokens=r.output_tokens,
                stream=True,
                extra_body={"request_class": str(r.req_class)},
            )
            await read_stream(stream, got, lambda: time.perf_counter() - t0)
        except openai.APIError:
            pass  # rejected or failed: counts as not attained, no tokens
        if r.req_class == "offline":
            off_tokens += sum(t <= cfg.duration_s for t in got.times)
        first, last = (got.times[0], got.times[-1]) if got.times else (None, None)
        rows.append((r, sent, first, last, len(got.times), got.response_id))

    await asyncio.gather(*(one(r, text) for r, text in zip(reqs, texts, strict=True)))
    await client.close()
    slo = cfg.slo
    ttft, tpot, ok, num_online = [], [], 0, 0
    for r, sent, first, last, n, _ in rows:
        if r.req_class == "offline":
            continue
        num_online += 1
        if first is None or last is None:
            continue
        # NOTE: from the moment the request was sent, as guidellm measures it: a client late
        # to send (its event loop busy with the other streams) is not the server's latency.
        # The lateness is reported apart (dispatch lag).
        ttft.append(first - sent)
        tp = (last - first) / (n - 1) if n > 1 else 0.0
        if n == r.output_tokens:
            tpot.append(tp)
            ok += first - sent <= slo.ttft_s and tp <= slo.tpot_s
    out: dict[str, Any] = {
        "slo_attainment_pct": 100.0 * ok / max(1, num_online),
        "num_online": num_online,
    }
    out |= _stats(ttft, tpot)
    out["offline_tokens_per_s"] = off_tokens / cfg.duration_s
    lag = [sent - r.arrival_s for r, sent, *_ in rows]
    out["dispatch_lag_p50_s"] = pct(lag, 50)
    out["dispatch_lag_p99_s"] = pct(lag, 99)
    out["requests"] = [  # per request, for finding where the time went
        {
            "class": str(r.req_class),
            "arrival_s": r.arrival_s,
            "sent_s": sent,
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
            "first_token_s": first,
            "last_token_s": last,
            "num_chunks": n,
            "req_id": rid,
            "sent_unix_s": unix0 + sent,
            "first_token_unix_s": None if first is None else unix0 + first,
        }
        for r, sent, first, last, n, rid in rows
    ]
    return out


def _simulated(cfg: ClusterConfig, policy: str, reqs: list[SimRequest]) -> dict[str, Any]:
    s = summarize(simulate(cfg, policy, requests=reqs), cfg.duration_s, policy, "replay")
    on = s["online"]
    return {
        "slo_attainment_pct": on["slo_attainment_pct"],
        "num_online": on["num_requests"],
        "ttft_p50_s": on["ttft_s"]["p50"],
        "ttft_p99_s": on["ttft_s"]["p99"],
        "tpot_p50_s": on["tpot_s"]["p50"],
        "tpot_p99_s": on["tpot_s"]["p99"],
        "offline_tokens_per_s": s["offline"]["tokens_per_s"],
    }


def _resources(cfg: ClusterConfig, policy: str, kv_payload: int) -> dict[str, Any]:
    """What both sides get, said out loud: the same instances and KV pools, no CPU-attention
    worker (the sim engine has no CPU-attention path, so the simulator is given none either)."""
    setups = instance_setups(cfg, policy)
    return {
        "instances": [f"{s.role}, chunk {s.chunk_size}" for s in setups],
        "kv_tokens_per_instance": min(s.num_blocks for s in setups) * cfg.block_size,
        "cpu_attention_workers": 0,
        "kv_bytes_per_token_shipped": "emulated model's" if kv_payload < 0 else kv_payload,
    }


def _one(
    args: argparse.Namespace, cfg: ClusterConfig, policy: str, reqs: list[SimRequest], exe: str
) -> dict[str, Any]:
    """One policy, one repeat: a fresh stack, the calibration probe, the window; then the
    simulator on the same window: with the serving path as the window had it (dispatch and KV
    link rate read from its records, `window`), with the probe's, and as
    configured."""
    from tidal_bench.replay import probe

    spec = cfg.step_model_spec()
    res = _resources(cfg, policy, args.kv_payload_bytes_per_token)
    max_len = max(r.input_tokens + r.output_tokens for r in reqs) + 16
    up = ["--engine", "sim", "--config", args.config_path, "--policy", policy, "--cpu-attn", "0"]
    up += ["--sim-step-model", spec, "--kv-cache-tokens", str(res["kv_tokens_per_instance"])]
    up += ["--max-model-len", str(max_len)]
    with tempfile.TemporaryDirectory(prefix="tidal-replay-") as trace_dir:
        env = {
            "TIDAL_SIM_KV_PAYLOAD_BYTES_PER_TOKEN": str(args.kv_payload_bytes_per_token),
            "TIDAL_SIM_STEP_TRACE_DIR": trace_dir,
            "TIDAL_OFFLINE_CHUNK_TOKENS": "1",  # `_replay` counts a streamed chunk as a token
        }
        sim_reqs = reqs
        with stack(natsd.free_port(), *up, env=env) as base:
            bus = trc.find_bus(base)
            lone, probe_events = asyncio.run(_probe(base, bus, probe.probe_lengths(reqs)))
            delays = trc.handoff_delays(probe_events, probe.request_events(Path(trace_dir)))
            for path in Path(trace_dir).glob("*.jsonl"):
                path.write_text("")  # the window's steps only
            if exe:
                live = gl_replay(exe, base, reqs, cfg)
                sim_reqs = _gl().shifted(reqs, live["start_offset_s"])
                events: list[dict[str, Any]] = []
            else:
                live, events = asyncio.run(_window(base, bus, reqs, cfg))
            live["migrations"] = _migration_metrics(base)
        live["steps"] = probe.step_summary(Path(trace_dir))
        live["path"] = probe.serving_path(live["requests"], probe.request_events(Path(trace_dir)))
        trace = wnd.read_trace(Path(trace_dir))
        live["migration_kinds"] = trc.summarize_migrations(events)
        live["migration_events"] = events
        if args.trace_dir:
            name = f"{Path(args.config_path).stem}-{policy}"
            n = sum(1 for _ in Path(args.trace_dir).glob(f"{name}-*"))
            dest = Path(args.trace_dir) / f"{name}-{n}"
            trc.keep(Path(trace_dir), bus[1] if bus else None, dest, events)
    cal = probe.calibrate(cfg, policy, lone, delays)
    win = wnd.window_calibration(cal, live, trace, cfg.link_gb_per_s)
    return {
        "resources": res,
        "calibration": cal,
        "window_calibration": win,
        "live": live,
        "simulator": _simulated(probe.with_calibration(cfg, win), policy, sim_reqs),
        "simulator_probe": _simulated(probe.with_calibration(cfg, cal), policy, sim_reqs),
        "simulator_uncalibrated": _simulated(cfg, policy, sim_reqs),
    }


async def _probe(
    base: str, bus: tuple[str, Path] | None, lengths: list[int]
) -> tuple[list[Any], list[dict[str, Any]]]:
    """The calibration probe, with its migration events (none when the bus is not found)."""
    from tidal_bench.replay import probe

    if bus is None:
        return await probe.send_lone(base, "tidal-sim", lengths, 0.3), []
    async with trc.migration_log(bus[0]) as events:
        lone = await probe.send_lone(base, "tidal-sim", lengths, 0.3)
    return lone, events


async def _window(
    base: str, bus: tuple[str, Path] | None, reqs: list[SimRequest], cfg: ClusterConfig
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The window through the openai client, with the scheduler's migration events beside it
    (none when the stack's bus is not found)."""
    if bus is None:
        return await _replay(base, "tidal-sim", reqs, cfg), []
    async with trc.migration_log(bus[0]) as events:
        live = await _replay(base, "tidal-sim", reqs, cfg)
    return live, events


def _gl() -> Any:
    from tidal_bench.replay import guidellm as gl

    return gl


def gl_replay(exe: str, base: str, reqs: list[SimRequest], cfg: ClusterConfig) -> dict[str, Any]:
    out: dict[str, Any] = _gl().replay(exe, base, "tidal-sim", reqs, cfg)
    return out


def _migration_metrics(base: str) -> dict[str, float]:
    """The gateway's migration counters after the window (KV transfers, bytes, seconds)."""
    return {k: v for k, v in gateway_metrics(base).items() if "migrat" in k and "bucket" not in k}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each side's figures as the median over repeats (the first repeat's extras kept)."""
    out = dict(runs[0])
    for side in SIDES:
        out[side] = dict(runs[0][side])
        for key, _, _ in KEYS:
            out[side][key] = float(np.median([r[side][key] for r in runs]))
    out["repeats"] = [{side: {k: r[side][k] for k, _, _ in KEYS} for side in SIDES} for r in runs]
    out["calibrations"] = [
        {k: v for k, v in r["calibration"].items() if k != "probe"} for r in runs
    ]
    out["window_calibrations"] = [r.get("window_calibration", {}) for r in runs]
    return out


def run(args: argparse.Namespace) -> int:
    exe = ""
    if args.client == "guidellm":
        try:
            exe = _gl().find_guidellm(args.guidellm)
        except _gl().GuidellmError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.repeats < 1 or args.duration_s <= 0:
        print("error: --repeats must be >= 1 and --duration-s > 0", file=sys.stderr)
        return 2
    client = "guidellm trace replay" if exe else "the openai client"
    reports = {}
    for path in args.config:
        cfg = dataclasses.replace(load_config(path), duration_s=args.duration_s)
        # NOTE: the live sim engine has no CPU-attention path (it refuses offload), so the
        # simulator gets no CPU-attention worker either: equal resources on both sides.
        cfg = dataclasses.replace(cfg, cpu_workers=dataclasses.replace(cfg.cpu_workers, count=0))
        reqs = [r for r in workload(cfg) if r.arrival_s < args.duration_s]
        args.config_path = path
        report: dict[str, Any] = {
            "config": path,
            "duration_s": args.duration_s,
            "client": args.client,
            "repeats": args.repeats,
            "num_requests": len(reqs),
            "runs": {},
        }
        for policy in args.policies:
            runs = [_one(args, cfg, policy, reqs, exe) for _ in range(args.repeats)]
            report["runs"][policy] = median_run(runs)
        reports[path] = report
        spec = cfg.step_model_spec()
        print(
            f"Fidelity, live stack (sim engine, emulated {spec} step times; load from {client}) "
            f"vs simulator, {path}, first {args.duration_s:.0f} s ({len(reqs)} requests), "
            f"median of {args.repeats}; both sides emulated:"
        )
        print_table(report, "guidellm" if exe else "live")
        if args.json_dir:
            out = Path(args.json_dir) / f"{Path(path).stem}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            save_json(str(out), report)
    save_json(args.json, {"reports": reports})
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "replay",
        help="a trace window through the live stack (sim engine) and the simulator, compared",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        nargs="+",
        default=["configs/ooco.yaml", "configs/ooco-long.yaml"],
        help="experiment config YAML(s); one window each",
    )
    p.add_argument(
        "--policies", nargs="+", default=["tidal", "ooco", "online-priority"], help="policies"
    )
    p.add_argument("--duration-s", type=float, default=40.0, help="trace window, seconds")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per policy (fresh stack each); medians"
    )
    p.add_argument(
        "--kv-payload-bytes-per-token",
        type=int,
        default=-1,
        help="emulated KV bytes a live migration really ships per token (default -1: the "
        "emulated model's full size, 57,344 for Qwen2.5-7B; 0: none)",
    )
    p.add_argument(
        "--client",
        choices=["tidal", "guidellm"],
        default="tidal",
        help="who sends the load: Tidal's openai-client replay (default) or guidellm's trace "
        "replay (an outside client; see tidal_bench/replay/guidellm.py)",
    )
    p.add_argument(
        "--guidellm", default="", help="guidellm executable (default: `guidellm` on PATH)"
    )
    p.add_argument(
        "--trace-dir",
        default="",
        help="keep each window's sim-engine step traces, stack log and migration events under "
        "DIR/CONFIG-POLICY-N/ (for finding where live time went)",
    )
    p.add_argument("--json", default="", help="also write every config's figures here as JSON")
    p.add_argument(
        "--json-dir", default="", help="also write each config's figures as DIR/CONFIG.json"
    )
    p.set_defaults(func=run)
