"""The latency budget of a latency-strict step that carries offline work (HyGen §4.1 inside
OOCO's strict pool), held to what each online request on the instance still has of its TPOT.

HyGen bounds every hybrid batch by one latency budget L (Alg. 1/2), which its SLO-aware profiler
(§4.2, Fig. 7) tunes offline until the *observed* mean TBT meets the SLO: the batch latency the
predictor sees is not the TBT a client sees. Here the gap is closed per request and at run time.
The TPOT SLO is on a request's mean over its tokens, (t_last - t_first) / (N - 1), so every
moment spent before this instance's steps (the KV hand-off from the prefill instance after the
first token, OOCO §3.4.3 push; a wait for a step boundary) comes out of what its remaining steps
may take. With k of N tokens out, the first at t_first, the remaining N - k steps keep the mean
within `target` when each takes at most

    (t_first + target * (N - 1) - now) / (N - k)

and the step's budget is the least of that over the online requests it decodes, capped by
`strict_prefill_budget` x TPOT (HyGen's L). The budget is wall time; the step model that fills it
predicts a step as on an engine alone on its cores, so it is divided by the instance's measured
step time over the predicted one (`InstanceState.step_time_scale`, `tidal.perf.step_scale`):
live with two engines on one core each step takes about twice its prediction, and a budget in
the model's seconds overran the TPOT SLO (docs/colocation.md, `tidal` live at 4 lines/s).
OmniServe's bound S_d/d - gamma (§3.3.4) subtracts the same kind of cost (what the latency model
does not see) from the SLO before the model fills it.
The requests' token times are the ones the instance publishes, in the simulator and live alike
(live, a pushed request carries its first token's time to the decode instance), so the
simulator and the live stack run this one rule on their own clocks.
"""

from __future__ import annotations

from tidal.policy.state import InstanceState, ReqState


def tpot_room_s(r: ReqState, now: float, target_s: float) -> float | None:
    """Longest mean step that still lets online request `r` end with a mean TPOT within
    `target_s`; None when that does not constrain it (no first token yet, or no token left to
    make, or one token in all)."""
    first = r.first_token_s
    n = r.max_output_tokens
    k = r.num_output_tokens
    if first is None or n < 2 or k >= n:
        return None
    return (first + target_s * (n - 1) - now) / (n - k)


def strict_step_budget(
    inst: InstanceState, now: float, tpot_slo_s: float, fraction: float, target: float
) -> float:
    """Seconds of the step model a strict step of `inst` may take once it carries offline
    work: `fraction` x the TPOT SLO, lowered to the TPOT room (`tpot_room_s` at `target` x each
    request's own TPOT SLO) of the most pressed online request decoding on it, over the
    instance's `step_time_scale` (wall seconds to the model's). Below the step of its decodes
    alone it adds no offline work (the decodes themselves are OOCO Alg. 2's, never cut here)."""
    bound = fraction * tpot_slo_s
    for r in inst.running:
        if not r.is_online or not r.is_decoding:
            continue
        slo = r.slo.tpot_s if r.slo is not None else tpot_slo_s
        room = tpot_room_s(r, now, target * slo)
        if room is not None and room < bound:
            bound = room
    return bound / inst.step_time_scale
