"""Run metrics from a `Recorder`: per-request latencies, SLO attainment, goodput, throughput.

Definitions (all over requests that *arrived* in the workload window [0, duration_s)):
* TTFT = first token - arrival; TPOT = (last token - first token) / (tokens - 1), the mean over
  a request's tokens after the first (0 for one-token outputs); queueing = first computed step -
  arrival. TBT samples are the step times of steps that carried online decodes, weighted by how
  many online decodes each carried.
* An online request *attains* its SLO when it finished, TTFT <= slo.ttft_s and TPOT <=
  slo.tpot_s. A rejected or unfinished request attains nothing: it violates TTFT if it never got
  a first token in time, and TPOT if it did not finish within the SLO pace.
* Goodput = attaining online requests / duration_s. Offline throughput counts tokens generated
  inside the window (so an ever-growing backlog does not inflate it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tidal.policy.state import Phase, ReqState
from tidal.sim.recorder import Recorder

SIMULATED = "simulated"  # every summary and plot says what produced it


def _pct(a: np.ndarray, w: np.ndarray | None = None) -> dict[str, float]:
    if len(a) == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    if w is None:
        q = np.percentile(a, [50, 90, 99])
        return {"mean": float(a.mean()), "p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2])}
    order = np.argsort(a)
    a, w = a[order], w[order]
    cw = np.cumsum(w) / w.sum()
    idx = np.minimum(np.searchsorted(cw, [0.5, 0.9, 0.99]), len(a) - 1)
    pick = [float(a[int(i)]) for i in idx]
    return {"mean": float((a * w).sum() / w.sum()), "p50": pick[0], "p90": pick[1], "p99": pick[2]}


def tpot_s(r: ReqState) -> float:
    if r.first_token_s is None or r.last_token_s is None or r.num_output_tokens <= 1:
        return 0.0
    return (r.last_token_s - r.first_token_s) / (r.num_output_tokens - 1)


def slo_flags(r: ReqState) -> tuple[bool, bool]:
    """(TTFT met, TPOT met) for an online request."""
    assert r.slo is not None
    ttft_ok = r.first_token_s is not None and r.first_token_s - r.arrival_s <= r.slo.ttft_s
    tpot_ok = r.phase is Phase.FINISHED and tpot_s(r) <= r.slo.tpot_s
    return ttft_ok, tpot_ok


def online_arrays(reqs: list[ReqState]) -> dict[str, np.ndarray]:
    """Per online request: arrival, TTFT (nan if none), TPOT (nan if unfinished), attained."""
    on = [r for r in reqs if r.is_online]
    arr = np.array([r.arrival_s for r in on])
    ttft = np.array(
        [np.nan if r.first_token_s is None else r.first_token_s - r.arrival_s for r in on]
    )
    tp = np.array([tpot_s(r) if r.phase is Phase.FINISHED else np.nan for r in on])
    flags = [slo_flags(r) if r.slo is not None else (True, True) for r in on]
    ok = np.array([a and b for a, b in flags], dtype=bool)
    ttft_ok = np.array([a for a, _ in flags], dtype=bool)
    tpot_ok = np.array([b for _, b in flags], dtype=bool)
    return {
        "arrival": arr,
        "ttft": ttft,
        "tpot": tp,
        "ok": ok,
        "ttft_ok": ttft_ok,
        "tpot_ok": tpot_ok,
    }


def summarize(rec: Recorder, duration_s: float, policy: str, config: str) -> dict[str, Any]:
    """The `summary.json` of one run."""
    reqs = rec.requests
    on = online_arrays(reqs)
    n_on = len(on["arrival"])
    fin_on = [r for r in reqs if r.is_online and r.phase is Phase.FINISHED]
    queue = np.array(
        [r.start_s - r.arrival_s for r in reqs if r.is_online and r.start_s is not None]
    )
    nb = int(np.ceil(duration_s / rec.bin_s))
    off_tok = np.array(rec.offline_tokens[:nb], dtype=float)
    on_tok = np.array(rec.online_tokens[:nb], dtype=float)
    off = [r for r in reqs if not r.is_online]
    off_fin = [r for r in off if r.phase is Phase.FINISHED and (r.finish_s or 0) <= duration_s]
    window_busy = [sum(b[:nb]) / duration_s for b in rec.busy_s]

    def pct(x: float, n: int) -> float:
        return 100.0 * x / n if n else 0.0

    return {
        "label": SIMULATED,
        "config": config,
        "policy": policy,
        "duration_s": duration_s,
        "sim_end_s": rec.end_s,
        "online": {
            "num_requests": n_on,
            "num_finished": len(fin_on),
            "num_rejected": sum(1 for r in reqs if r.is_online and r.phase is Phase.REJECTED),
            "ttft_s": _pct(on["ttft"][~np.isnan(on["ttft"])]),
            "tpot_s": _pct(on["tpot"][~np.isnan(on["tpot"])]),
            "tbt_s": _pct(np.array(rec.tbt_s), np.array(rec.tbt_weight, dtype=float)),
            "max_tbt_s": _pct(np.array([r.max_tbt_s for r in fin_on])),
            "queueing_s": _pct(queue),
            "slo_attainment_pct": pct(int(on["ok"].sum()), n_on),
            "violation_pct": pct(n_on - int(on["ok"].sum()), n_on),
            "ttft_violation_pct": pct(n_on - int(on["ttft_ok"].sum()), n_on),
            "tpot_violation_pct": pct(n_on - int(on["tpot_ok"].sum()), n_on),
            "goodput_rps": float(on["ok"].sum()) / duration_s,
            "tokens_per_s": float(on_tok.sum()) / duration_s,
            "total_tokens_per_s": sum(
                r.num_prompt_tokens + r.num_output_tokens
                for r in fin_on
                if (r.finish_s or 0) <= duration_s
            )
            / duration_s,
        },
        "offline": {
            "num_requests": len(off) + rec.num_batch_queued,
            "num_batch_queued": rec.num_batch_queued,  # never reached the cluster
            "num_finished": len(off_fin),
            "tokens_per_s": float(off_tok.sum()) / duration_s,
            "requests_per_s": len(off_fin) / duration_s,
            "total_tokens_per_s": sum(r.num_prompt_tokens + r.num_output_tokens for r in off_fin)
            / duration_s,
        },
        "counters": {
            "steps": rec.num_steps,
            "spans": rec.num_spans,
            "preemptions": rec.num_preemptions,
            "layer_preemptions": rec.num_layer_preemptions,
            "layer_cut_prefill_tokens": rec.num_layer_cut_tokens,  # resumed, not recomputed
            "swaps": rec.num_swaps,
            "offloads": rec.num_offloads,
            "recompute_lost_tokens": rec.num_recompute_lost_tokens,  # KV tokens to compute again
            "releases": rec.num_releases,  # checkpointed requests freed (`StepPlan.release`)
            "checkpoint_tokens": rec.num_checkpoint_tokens,  # KV tokens copied to host
            "checkpoint_lost_tokens": rec.num_checkpoint_lost_tokens,  # past a checkpoint
            "restored_tokens": rec.num_restored_tokens,  # copied back from checkpoints
            "preempt_signals": rec.num_preempt_signals,  # `preempt_for_online`, taken in
            "preempt_signal_victims": rec.num_preempt_signal_victims,
            "migrations": rec.num_migrations,
            "migrations_refused": rec.num_migrations_refused,
            "kv_transfers": rec.num_kv_transfers,
            "rejections": dict(rec.rejections),
        },
        "utilisation": window_busy,  # per instance: busy fraction of the window
    }


REQUEST_COLUMNS = (
    "req_id,class,instance,arrival_s,input_tokens,output_tokens,phase,ttft_s,tpot_s,"
    "max_tbt_s,queueing_s,finish_s,preemptions,migrations"
)


def request_rows(reqs: list[ReqState]) -> list[str]:
    """One CSV line per request (`REQUEST_COLUMNS`); empty cells where a time never came."""

    def f(x: float | None) -> str:
        return "" if x is None else f"{x:.6f}"

    rows = []
    for r in reqs:
        ttft = None if r.first_token_s is None else r.first_token_s - r.arrival_s
        queue = None if r.start_s is None else r.start_s - r.arrival_s
        tp = tpot_s(r) if r.phase is Phase.FINISHED else None
        rows.append(
            f"{r.req_id},{r.req_class.value},{'' if r.instance_id is None else r.instance_id},"
            f"{r.arrival_s:.6f},{r.num_prompt_tokens},{r.num_output_tokens},{r.phase.value},"
            f"{f(ttft)},{f(tp)},{r.max_tbt_s:.6f},{f(queue)},{f(r.finish_s)},"
            f"{r.num_preemptions},{r.num_migrations}"
        )
    return rows
