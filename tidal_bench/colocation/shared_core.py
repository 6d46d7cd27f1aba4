"""What a torch engine's step costs while another engine steps on the same core (the torch
co-location bench runs both engines on core 0, one torch thread each).

Two worker processes each hold the real torch engine (the embedded SmolLM2-135M, dtype as the
live instance chooses it, `load_torch_engine`), one torch thread, pinned to one core as the
live instance pins itself (`services.common.affinity.apply`). The parent alternates, per step
kind: worker A alone (B idle), B alone (A idle), both together, ..., ending with A and B alone
again, so every
together window lies between two alone windows (a decode's context grows by one token a step:
the sandwich cancels that drift). A together step counts only where it lies wholly inside the
time the other worker was stepping. Per worker and window: the median step wall time (and the
stepping thread's CPU time). Per alternation the contention factor is

    c = (together / mean(alone before, alone after)) / 2

(1: the two steps share the core perfectly; above 1: each step does more work beside the other,
e.g. caches and memory bandwidth shared). A sanity phase times worker A alone on core 1 against
core 0.

    PYTHONPATH=. python -m tidal_bench.colocation.shared_core --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from services.common import affinity

# (name, decode rows, prefill tokens): the co-location run's step kinds (docs/colocation.md):
# decodes only, a strict step with a small offline prefill chunk beside its decodes, the
# relaxed instance's offline prefill chunk, and an online prompt's prefill
KINDS: tuple[tuple[str, int, int], ...] = (
    ("decode 20 rows", 20, 0),
    ("20 decodes + prefill 16", 20, 16),
    ("prefill 60", 0, 60),
    ("prefill 250", 0, 250),
)
CONTEXT = 256  # the decode rows' prompt: a few hundred tokens of context as they decode


@dataclass(frozen=True, slots=True)
class Window:
    """One worker's steps of one kind in one window: (start, end, thread CPU s) each."""

    steps: list[tuple[float, float, float]]

    def median_wall(self, lo: float = float("-inf"), hi: float = float("inf")) -> float:
        xs = [b - a for a, b, _ in self.steps if a >= lo and b <= hi]
        return statistics.median(xs) if xs else float("nan")

    def median_cpu(self, lo: float = float("-inf"), hi: float = float("inf")) -> float:
        xs = [c for a, b, c in self.steps if a >= lo and b <= hi]
        return statistics.median(xs) if xs else float("nan")

    @property
    def span(self) -> tuple[float, float]:
        return self.steps[0][0], self.steps[-1][1]


def _worker(conn: Connection, core: int, seed: int) -> None:
    """Holds an engine; runs the parent's ("steps", kind, n, start_at) and ("core", c)."""
    import random

    from tidal.engine.api import EngineRequest, SamplingParams
    from tidal.engine.torch.loader import load_torch_engine
    from tidal.plan.step import StepPlan

    affinity.apply((core,), threads=1)  # as the live instance pins itself (`--engine-cores`)
    eng = load_torch_engine(None, kv_cache_tokens=65536)
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    decoding = [f"d{i}" for i in range(max(k[1] for k in KINDS))]
    sp = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    for rid in decoding:  # prefilled once, untimed; they decode from here on
        eng.add(EngineRequest(rid, prompt(CONTEXT), sp))
        eng.step(StepPlan(prefill={rid: CONTEXT}))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    n_new = 0
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "core":
            affinity.pin((msg[1],))
            conn.send("ok")
            continue
        _, kind, n, start_at = msg
        _, rows, chunk = next(k for k in KINDS if k[0] == kind)
        out: list[tuple[float, float, float]] = []
        while time.monotonic() < start_at:
            time.sleep(0.001)
        for _ in range(n):
            prefill: dict[str, int] = {}
            if chunk:  # a new request's prompt, finished by its first token
                rid = f"p{n_new}"
                n_new += 1
                eng.add(EngineRequest(rid, prompt(chunk), one))
                prefill[rid] = chunk
            plan = StepPlan(prefill=prefill, decode=tuple(decoding[:rows]))
            t0, c0 = time.monotonic(), time.thread_time()
            eng.step(plan)
            out.append((t0, time.monotonic(), time.thread_time() - c0))
        conn.send(out)


class Pair:
    """The two workers, A and B."""

    def __init__(self, core: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for seed in (1, 2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, core, seed), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a worker failed to start")

    def run(self, who: tuple[int, ...], kind: str, n: int) -> list[Window]:
        start_at = time.monotonic() + 0.05
        for w in who:
            self.conns[w].send(("steps", kind, n, start_at))
        return [Window(self.conns[w].recv()) for w in who]

    def core(self, w: int, core: int) -> None:
        self.conns[w].send(("core", core))
        self.conns[w].recv()

    def close(self) -> None:
        for c in self.conns:
            c.send(("stop",))
        for p in self.procs:
            p.join(10)


def contention(alone: list[list[Window]], together: list[list[Window]]) -> dict[str, Any]:
    """Per worker and alternation i: together[i]'s median step (steps wholly inside the other
    worker's stepping) over the mean of alone[i]'s and alone[i + 1]'s medians, halved."""
    per: list[list[float]] = [[], []]
    cpu: list[list[float]] = [[], []]
    for i, both in enumerate(together):
        for w in (0, 1):
            lo, hi = both[1 - w].span
            a = (alone[i][w].median_wall() + alone[i + 1][w].median_wall()) / 2
            ac = (alone[i][w].median_cpu() + alone[i + 1][w].median_cpu()) / 2
            per[w].append(both[w].median_wall(lo, hi) / a / 2)
            cpu[w].append(both[w].median_cpu(lo, hi) / ac)
    flat = per[0] + per[1]
    return {
        "alone_ms_median": round(
            1e3 * statistics.median(w.median_wall() for a in alone for w in a), 1
        ),
        "together_ms_median": round(
            1e3 * statistics.median(w.median_wall() for t in together for w in t), 1
        ),
        "c_per_alternation_A": [round(x, 3) for x in per[0]],
        "c_per_alternation_B": [round(x, 3) for x in per[1]],
        "c_median": round(statistics.median(flat), 3),
        "c_min_max": [round(min(flat), 3), round(max(flat), 3)],
        "cpu_together_over_alone_median": round(statistics.median(cpu[0] + cpu[1]), 3),
    }


def pooled(kinds: dict[str, dict[str, Any]]) -> float:
    """c over every kind, worker and alternation: the median of them all (the one factor the
    simulator's `shared_device_slowdown` takes)."""
    xs = [x for v in kinds.values() for x in v["c_per_alternation_A"] + v["c_per_alternation_B"]]
    return round(statistics.median(xs), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--core", type=int, default=0, help="the core both workers share")
    ap.add_argument("--other-core", type=int, default=1, help="the sanity phase's other core")
    ap.add_argument("--alternations", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12, help="steps a worker runs per window")
    ap.add_argument("--json", default="", help="write the report here too")
    args = ap.parse_args(argv)
    if args.alternations < 1 or args.steps < 3:
        ap.error("--alternations >= 1 and --steps >= 3")
    load0 = os.getloadavg()
    t0 = time.time()
    pair = Pair(args.core)
    report: dict[str, Any] = {
        "what": "one torch engine's step beside another on the same core (real SmolLM2-135M, "
        "one torch thread each); c = together / alone / 2",
        "core": args.core,
        "alternations": args.alternations,
        "steps_per_window": args.steps,
        "decode_context_start": CONTEXT,
        "kinds": {},
    }
    try:
        for kind, _, _ in KINDS:
            pair.run((0, 1), kind, 2)  # warm both, untimed
            alone: list[list[Window]] = []
            together: list[list[Window]] = []
            for _ in range(args.alternations):
                alone.append(
                    [pair.run((0,), kind, args.steps)[0], pair.run((1,), kind, args.steps)[0]]
                )
                together.append(pair.run((0, 1), kind, args.steps))
            alone.append([pair.run((0,), kind, args.steps)[0], pair.run((1,), kind, args.steps)[0]])
            report["kinds"][kind] = contention(alone, together)
            print(kind, json.dumps(report["kinds"][kind]), flush=True)
        report["c_all_kinds_median"] = pooled(report["kinds"])
        sanity: dict[str, list[float]] = {}
        for kind, _, _ in KINDS:
            ratios = []
            for _ in range(3):
                pair.core(0, args.other_core)
                other = pair.run((0,), kind, args.steps)[0].median_wall()
                pair.core(0, args.core)
                own = pair.run((0,), kind, args.steps)[0].median_wall()
                ratios.append(round(other / own, 3))
            sanity[kind] = ratios
        report["other_core_over_core_alone"] = sanity
        print("core", args.other_core, "/ core", args.core, json.dumps(sanity), flush=True)
    finally:
        pair.close()
    report["loadavg_start"] = [round(x, 2) for x in load0]
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["wall_s"] = round(time.time() - t0, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
