"""`tidal bench classes`: request classes under overload, live (sim engine) beside the simulator.

Starts `tidal up --config classes.yaml --engine sim --sim-step-model STEP` (three classes:
interactive, standard, batch; emulated step times), submits a `--batch-lines`-line batch through
the Batch API, then sends each class's requests at its Poisson `--rate CLASS=R` for
`--duration-s` with the official openai client (`X-Tidal-Class`, non-streamed,
`--prompt-tokens` of random words, `kit.distinct_prompt_maker`, / `--max-tokens` each, EOS
ignored). Per class it counts what was asked, where it ran (`X-Tidal-Class`,
`X-Tidal-Demoted-From`), the 429s, the gateway's SLO attainment (`tidal_slo_requests_total`) and
evictions (`tidal_class_preemptions_total`), and waits for the batch. Then the simulator runs the
same arrivals, class table, step model and policy (`tidal.sim.classes`) and the two tables are
printed side by side. Live figures are the sim engine's (emulated step times, real serving
path); the simulator's are simulated.

`--sim-only` runs the simulator alone (no stack), and only then may `--kv-capacity-tokens` shrink
each instance's KV pool: a small pool shows a higher class evicting a lower one (the `evicted`
column; docs/classes.md).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from services.cli import natsd
from tidal.config.cluster import ClusterConfig, load_config
from tidal.perf.spec import parse_step_model
from tidal.policy.state import Phase
from tidal.schemas.enums import RequestClass
from tidal.sim.build import simulate
from tidal.sim.classes import ClassGate, class_rows
from tidal.workload.mix import SimRequest
from tidal_bench.kit import distinct_prompt_maker, metric_samples, save_json, stack

MODEL = "tidal-sim"
DEFAULT_STEP = "linear:0.01,0.0001,0.0005,0"  # 10 ms a step + 0.1 ms a token + 0.5 ms a decode
DEFAULT_RATES = ("interactive=1", "standard=8")
BATCH_MAX_INFLIGHT = 32  # `tidal up`'s default: the simulator's batch gate is given the same


@dataclass(frozen=True)
class Arrival:
    req_id: str
    at_s: float  # seconds from the start of the load
    class_name: str


def arrivals(rates: dict[str, float], duration_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals of each class at its rate over [0, duration_s), in time order."""
    rng = random.Random(seed)
    out: list[Arrival] = []
    for name, rate in sorted(rates.items()):
        t = rng.expovariate(rate)
        while t < duration_s:
            out.append(Arrival(f"{name}-{len(out)}", t, name))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda a: a.at_s)


@dataclass
class LiveCounts:
    asked: Counter[str]
    served_in: Counter[str]  # class a request ran in -> requests
    demoted: Counter[str]  # class asked -> requests that ran looser
    rejected: Counter[str]  # class asked -> 429s
    errors: Counter[str]  # class asked -> any other failure
    error_samples: list[str]  # "class: status message" of the first few of them


async def _drive(base: str, load: list[Arrival], prompts: list[str], max_tokens: int) -> LiveCounts:
    """Each arrival of `load` with its prompt (`prompts`, one each) at its time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    counts = LiveCounts(Counter(), Counter(), Counter(), Counter(), Counter(), [])
    t0 = time.monotonic()

    async def one(a: Arrival, prompt: str) -> None:
        await asyncio.sleep(max(0.0, a.at_s - (time.monotonic() - t0)))
        counts.asked[a.class_name] += 1
        try:
            raw = await client.completions.with_raw_response.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                extra_headers={"X-Tidal-Class": a.class_name},
                extra_body={"ignore_eos": True},
            )
        except openai.RateLimitError:
            counts.rejected[a.class_name] += 1
            return
        except openai.APIError as exc:
            counts.errors[a.class_name] += 1
            if len(counts.error_samples) < 5:
                status = getattr(exc, "status_code", "no status")
                counts.error_samples.append(f"{a.class_name}: {status} {exc.message}")
            return
        counts.served_in[raw.headers["x-tidal-class"]] += 1
        if raw.headers.get("x-tidal-demoted-from"):
            counts.demoted[a.class_name] += 1

    try:
        await asyncio.gather(*(one(a, p) for a, p in zip(load, prompts, strict=True)))
    finally:
        await client.close()
    return counts


def _batch(client: Any, prompts: list[str], max_tokens: int) -> Any:
    rows = [
        {
            "custom_id": f"b{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                     "ignore_eos": True},
        }
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip
    data = "\n".join(map(json.dumps, rows)).encode()
    f = client.files.create(file=("classes.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )


def _attainment(base: str) -> dict[str, tuple[int, int]]:
    """class -> (requests that met their SLO, that did not), from the gateway's /metrics."""
    out: dict[str, list[int]] = {}
    for name, labels, value in metric_samples(base):
        if name == "tidal_slo_requests_total" and labels["attained"] in ("true", "false"):
            pair = out.setdefault(labels["req_class"], [0, 0])
            pair[labels["attained"] == "false"] += int(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def run_live(args: argparse.Namespace, load: list[Arrival]) -> dict[str, Any]:
    import openai

    # a prompt of random words each, none a prefix of another (an engine with a prefix cache
    # computes every prompt token, as the simulator charges), drawn before the load starts
    prompt = distinct_prompt_maker(seed=args.seed)
    lines = [prompt(args.prompt_tokens) for _ in range(args.batch_lines)]
    online = [prompt(args.prompt_tokens) for _ in load]
    up = ["--config", args.config, "--engine", "sim", "--sim-step-model", args.sim_step_model]
    with stack(natsd.free_port(), *up) as base:
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
        batch = _batch(client, lines, args.max_tokens)
        counts = asyncio.run(_drive(base, load, online, args.max_tokens))
        deadline = time.monotonic() + args.batch_timeout_s
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        attained = _attainment(base)
        evicted = {
            labels["req_class"]: int(value)
            for name, labels, value in metric_samples(base)
            if name == "tidal_class_preemptions_total"
        }
    rc = batch.request_counts
    return {
        "counts": {k: dict(v) for k, v in vars(counts).items() if isinstance(v, Counter)},
        "error_samples": counts.error_samples,
        "attained": attained,
        "preemptions": evicted,
        "batch": {"status": batch.status, "completed": rc.completed if rc else 0,
                  "failed": rc.failed if rc else 0, "lines": args.batch_lines},
    }  # fmt: skip


def run_sim(args: argparse.Namespace, cfg: ClusterConfig, load: list[Arrival]) -> dict[str, Any]:
    reqs = [
        SimRequest(a.req_id, RequestClass.ONLINE, a.at_s, args.prompt_tokens, args.max_tokens,
                   class_name=a.class_name)
        for a in load
    ]  # fmt: skip
    lines = [
        SimRequest(f"b{i}", RequestClass.OFFLINE, 0.0, args.prompt_tokens, args.max_tokens)
        for i in range(args.batch_lines)
    ]
    gate = ClassGate(cfg.classes, cfg.slo)
    run_cfg = replace(
        cfg, duration_s=args.duration_s, drain_s=args.batch_timeout_s,
        batch_max_inflight=BATCH_MAX_INFLIGHT,
        kv_capacity_tokens=getattr(args, "kv_capacity_tokens", 0) or cfg.kv_capacity_tokens,
    )  # fmt: skip
    model = parse_step_model(args.sim_step_model)
    everything = sorted(lines + reqs, key=lambda r: r.arrival_s)
    rec = simulate(run_cfg, cfg.policy, step_model=model, requests=everything, classes=gate)
    done = sum(1 for r in rec.requests if r.req_id.startswith("b") and r.phase is Phase.FINISHED)
    rows = class_rows(gate, rec.requests)
    return {
        "rows": [vars(r) | {"attainment": r.attainment} for r in rows],
        "batch": {"completed": done, "lines": args.batch_lines},
        "num_class_evictions": rec.num_class_evictions,
    }


def _fmt_att(met: int, missed: int) -> str:
    n = met + missed
    return f"{100 * met / n:.1f}% of {n}" if n else "–"


def report(cfg: ClusterConfig, live: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    c = live["counts"]
    rows = {r["name"]: r for r in sim["rows"]}
    out = [
        f"{'class':12s} | {'asked':>13s} | {'served in it':>13s} | {'attained':>27s} | "
        f"{'demoted':>9s} | {'rejected (429)':>14s} | {'preempted':>9s}",
        "-" * 12 + "-|-" + "-" * 13 + "-|-" + "-" * 13 + "-|-" + "-" * 27 + "-|-" + "-" * 9
        + "-|-" + "-" * 14 + "-|-" + "-" * 9,
    ]  # fmt: skip
    for spec in cfg.classes.classes:
        n = spec.name
        s = rows[n]
        met, missed = live["attained"].get(n, (0, 0))
        sim_met = s["num_attained"] if s["has_slo"] else 0
        sim_missed = s["num_served"] - sim_met if s["has_slo"] else 0
        cells = [
            f"{c['asked'].get(n, 0)} / {s['num_asked']}",
            f"{c['served_in'].get(n, 0)} / {s['num_served']}",
            f"{_fmt_att(met, missed)} / {_fmt_att(sim_met, sim_missed)}",
            f"{c['demoted'].get(n, 0)} / {s['num_demoted']}",
            f"{c['rejected'].get(n, 0)} / {s['num_rejected']}",
            f"{live.get('preemptions', {}).get(n, 0)} / {s['num_preemptions']}",
        ]
        out.append(
            f"{n:12s} | {cells[0]:>13s} | {cells[1]:>13s} | {cells[2]:>27s} | {cells[3]:>9s} | "
            f"{cells[4]:>14s} | {cells[5]:>9s}"
        )
    errors = sum(c.get("errors", {}).values())
    if errors:
        out.append(f"other errors (live): {errors}: " + "; ".join(live.get("error_samples", [])))
    lb, sb = live["batch"], sim["batch"]
    out.append(
        f"Batch API lines ({cfg.classes.lowest.name}): live {lb['completed']} of {lb['lines']} "
        f"completed ({lb['status']}, {lb['failed']} failed); simulated {sb['completed']} of "
        f"{sb['lines']}"
    )
    return out


def _rates(specs: list[str], cfg: ClusterConfig) -> dict[str, float]:
    rates: dict[str, float] = {}
    for spec in specs:
        name, _, value = spec.partition("=")
        if name not in cfg.classes.names:
            raise SystemExit(f"--rate {spec}: no class {name!r}; classes: {cfg.classes.names}")
        try:
            rates[name] = float(value)
        except ValueError:
            raise SystemExit(f"--rate {spec}: expected CLASS=REQ_PER_S") from None
        if rates[name] <= 0:
            raise SystemExit(f"--rate {spec}: the rate must be > 0")
    return rates


def report_sim(cfg: ClusterConfig, sim: dict[str, Any]) -> list[str]:
    """The simulator's table alone (`--sim-only`)."""
    out = [f"{'class':12s} | {'asked':>6s} | {'served':>6s} | {'attained':>14s} | "
           f"{'demoted':>7s} | {'rejected':>8s} | {'evicted':>7s}"]  # fmt: skip
    for r in sim["rows"]:
        met = r["num_attained"] if r["has_slo"] else 0
        att = _fmt_att(met, r["num_served"] - met) if r["has_slo"] else "–"
        out.append(
            f"{r['name']:12s} | {r['num_asked']:6d} | {r['num_served']:6d} | {att:>14s} | "
            f"{r['num_demoted']:7d} | {r['num_rejected']:8d} | {r['num_preemptions']:7d}"
        )
    sb = sim["batch"]
    out.append(f"Batch lines ({cfg.classes.lowest.name}): {sb['completed']} of {sb['lines']}")
    out.append(f"evictions of an SLO class by a higher one: {sim['num_class_evictions']}")
    return out


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.kv_capacity_tokens and not args.sim_only:
        raise SystemExit("--kv-capacity-tokens applies to the simulator alone: add --sim-only")
    load = arrivals(_rates(args.rate or list(DEFAULT_RATES), cfg), args.duration_s, args.seed)
    if args.sim_only:
        sim = run_sim(args, cfg, load)
        kv = args.kv_capacity_tokens or cfg.kv_capacity_tokens
        print(
            f"Request classes, SIMULATED only ({args.config}, policy {cfg.policy}; {len(load)} "
            f"requests over {args.duration_s:g} s, {args.prompt_tokens} prompt + "
            f"{args.max_tokens} output tokens each; step model {args.sim_step_model}; KV pool "
            f"{kv} tokens per instance)."
        )
        print("\n".join(report_sim(cfg, sim)))
        save_json(args.json, {"args": args, "simulated": sim})
        return 0
    live = run_live(args, load)
    sim = run_sim(args, cfg, load)
    print(
        f"Request classes under overload ({args.config}, policy {cfg.policy}; {len(load)} "
        f"requests over {args.duration_s:g} s, {args.prompt_tokens} prompt + {args.max_tokens} "
        f"output tokens each; step model {args.sim_step_model}). Live: sim engine, emulated "
        "step times; sim: the simulator. Each cell live / simulated."
    )
    print("\n".join(report(cfg, live, sim)))
    save_json(args.json, {"args": args, "live": live, "simulated": sim,
                          "arrivals": [vars(a) for a in load]})  # fmt: skip
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "classes",
        help="request classes under overload: attainment, demotions, rejections (live + sim)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default="classes.yaml", help="cluster config with `classes:`")
    p.add_argument(
        "--rate",
        action="append",
        default=[],
        metavar="CLASS=R",
        help=f"Poisson rate of a class, req/s (repeatable; default {' '.join(DEFAULT_RATES)})",
    )
    p.add_argument("--duration-s", type=float, default=20.0, help="seconds of arrivals")
    p.add_argument("--prompt-tokens", type=int, default=200, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--batch-lines", type=int, default=40, help="Batch API lines submitted first")
    p.add_argument("--batch-timeout-s", type=float, default=120.0, help="wait for the batch")
    p.add_argument("--sim-step-model", default=DEFAULT_STEP, help="emulated step time, both")
    p.add_argument("--seed", type=int, default=0, help="arrival times and prompt words")
    p.add_argument("--json", default="", help="also write the figures here as JSON")
    p.add_argument("--sim-only", action="store_true", help="the simulator alone (no stack)")
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=0,
        help="with --sim-only: KV pool per instance, tokens (default: the config's)",
    )
    p.set_defaults(func=run)
