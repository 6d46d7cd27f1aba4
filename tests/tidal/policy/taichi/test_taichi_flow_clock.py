"""TaiChi flowing decode's TPOT clock (papers/taichi.md §3.3): a degrading flow (②) keeps the
TPOT the request banked on the D-heavy instance; a back-flow (③) restarts TPOT and length."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy.base import PolicyContext
from tidal.policy.registry import make_policy
from tidal.policy.state import (
    ClusterView,
    InstanceRole,
    InstanceState,
    Phase,
    ReqState,
    RequestClass,
    Slo,
)
from tidal.policy.taichi.policy import TaichiPolicy

ROLES = (InstanceRole.P_HEAVY, InstanceRole.D_HEAVY)


def _cluster(free: tuple[int, int]) -> ClusterView:
    insts = [
        InstanceState(i, r, 256, 256, 16, 100, f, LinearStepModel(), 1, 1e9)
        for i, (r, f) in enumerate(zip(ROLES, free, strict=True))
    ]
    return ClusterView(insts, [], 1e9)


def _decode(out: int, last_s: float, inst: int) -> ReqState:
    r = ReqState("r", RequestClass.ONLINE, 0.0, 100, 1000)
    r.phase, r.instance_id, r.num_blocks = Phase.RUNNING, inst, 10
    r.num_output_tokens, r.num_computed_tokens = out, 100 + out - 1
    r.first_token_s, r.last_token_s = 0.0, last_s
    return r


def test_degrading_keeps_the_clock_and_back_flow_restarts_it() -> None:
    # TPOT SLO 0.2 s, α 0.96 -> back-flow bound 0.192 s. M = 0.5 of 100 blocks.
    ctx = PolicyContext(2, ROLES, Slo(3.0, 0.2), {"memory_watermark": 0.5}, seed=0)
    pol = make_policy("taichi", ctx)
    assert isinstance(pol, TaichiPolicy)
    c = _cluster((100, 30))  # D-heavy uses 70 blocks > 50
    pol.tick(c, 0.0)  # sets roles and chunk sizes
    r = _decode(51, 5.0, 1)  # 50 tokens in 5 s on D-heavy: TPOT 0.1 s
    c.instances[1].running = [r]
    moves = pol.tick(c, 1.0).migrate
    assert [(m.req_id, m.dst) for m in moves] == [("r", 0)]  # ② longest first
    # Lands on P-heavy (seen at t = 2 s), then one slow token: 61 tokens over 11.6 s. Its TPOT
    # over its life (the clock a degrading flow keeps) is 11.6 / 61 = 0.190 s <= 0.192 s: it
    # stays. A clock restarted on landing would read 9.6 s per token and send it straight back.
    c = _cluster((90, 100))
    r = _decode(61, 11.0, 0)
    c.instances[0].running = [r]
    assert pol.tick(c, 2.0).migrate == ()
    r.num_output_tokens, r.num_computed_tokens, r.last_token_s = 62, 161, 11.6
    assert pol.tick(c, 3.0).migrate == ()
    # Two more slow tokens: 13 / 63 = 0.206 s > 0.192 s -> ③ back-flow to the D-heavy one.
    r.num_output_tokens, r.num_computed_tokens, r.last_token_s = 64, 163, 13.0
    moves = pol.tick(c, 4.0).migrate
    assert [(m.req_id, m.dst) for m in moves] == [("r", 1)]
    # Landed on D-heavy: "treated as a new request, with its output length reset".
    c.instances[0].running, c.instances[1].running = [], [r]
    r.instance_id = 1
    pol.tick(c, 5.0)
    flow = pol._flow_req(r, 5.0)
    assert (flow.output_tokens, flow.tpot_s) == (0, 0.0)


def test_infeasible_request_is_never_sent_where_decodes_use_up_the_chunk() -> None:
    # A 3,000-token prompt cannot meet a 10 ms TTFT anywhere (Alg. 2 returns ∅), so the paper's
    # experiments pick a random instance -- but not the D-heavy one whose chunk of 256 is all
    # decodes (300 of them): it would never prefill the prompt.
    pol = make_policy("taichi", PolicyContext(2, ROLES, Slo(0.01, 0.2), {}, seed=0))
    c = _cluster((100, 100))
    busy = []
    for k in range(300):
        r = _decode(5, 1.0, 1)
        r.req_id = f"d{k}"
        busy.append(r)
    c.instances[1].running = busy
    req = ReqState("new", RequestClass.ONLINE, 0.0, 3000, 10, slo=Slo(0.01, 0.2))
    assert {pol.route(req, c, 0.0).instance_id for _ in range(20)} == {0}
    c.instances[1].running = busy[:10]  # room again: the draw covers both instances
    assert {pol.route(req, c, 0.0).instance_id for _ in range(40)} == {0, 1}


def test_a_refused_flow_may_be_chosen_again_after_the_timeout() -> None:
    # The flow to P-heavy is asked at t = 1 s but the request is still on D-heavy afterwards (the
    # cluster refused the move): it is not asked twice while in flight, and again once the
    # request has stayed put for longer than ASK_TIMEOUT_S.
    from tidal.policy.taichi.policy import ASK_TIMEOUT_S

    ctx = PolicyContext(2, ROLES, Slo(3.0, 0.2), {"memory_watermark": 0.5}, seed=0)
    pol = make_policy("taichi", ctx)
    c = _cluster((100, 30))
    pol.tick(c, 0.0)
    c.instances[1].running = [_decode(51, 5.0, 1)]
    assert [m.dst for m in pol.tick(c, 1.0).migrate] == [0]
    assert pol.tick(c, 1.0 + ASK_TIMEOUT_S / 2).migrate == ()  # still in flight
    assert [m.dst for m in pol.tick(c, 2.0 + ASK_TIMEOUT_S).migrate] == [0]
