"""The `sglang` engine over a prefill/decode pair (`PdPairClient`) against two fake SGLang
servers in PD mode sharing a fake transfer (`fake_sglang`, written from SGLang 0.5.23's source).
These test the adapter alone: no SGLang, no KV transfer backend ran here."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from services.cli import natsd
from services.gateway.metrics import GatewayMetrics
from services.instance.sglang.api import MAX_ROOM
from services.instance.sglang.engine import SglangEngine
from services.instance.sglang.launcher import pd_client
from services.instance.sglang.pd import PdPairClient
from tests.services.instance.sglang.fake_sglang import NO_ROOM, FakeSglang, FakeTransfer
from tests.services.instance.sglang.test_sglang_engine import (
    PROMPT,
    WordTokenizer,
    greedy,
    make_engine,
    req,
    run,
    tokens_of,
    wait_for,
)
from tidal.engine.api import FinishReason, RequestClass, TokenEvent
from tidal.schemas.messages import PD_MIGRATION_MODE, Heartbeat


class Pair:
    """A fake prefill server and a fake decode server sharing one fake transfer."""

    def __init__(self, decode_total_tokens: int = 30000) -> None:
        transfer = FakeTransfer()
        self.prefill = FakeSglang(mode="prefill", transfer=transfer, total_tokens=5000)
        self.decode = FakeSglang(mode="decode", transfer=transfer, total_tokens=decode_total_tokens)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    with p.prefill.serve(), p.decode.serve():
        yield p


def pd_engine(prefill_url: str, decode_url: str, handoff_timeout_s: float = 30.0) -> SglangEngine:
    client = PdPairClient(prefill_url, decode_url, 8998, handoff_timeout_s=handoff_timeout_s)
    return SglangEngine(client, WordTokenizer(), "fake-model", 4096, 30000, 0.0, 0.02)


@pytest.fixture
def engine(pair: Pair) -> Iterator[SglangEngine]:
    eng = pd_engine(pair.prefill.url, pair.decode.url)
    yield eng
    eng.close()


def client_of(eng: SglangEngine) -> PdPairClient:
    assert isinstance(eng.client, PdPairClient)
    return eng.client


def test_a_pd_pair_serves_a_request_with_the_tokens_of_one_server(
    engine: SglangEngine, pair: Pair
) -> None:
    engine.add(req("a", 12, RequestClass.ONLINE))
    events = run(engine)
    assert tokens_of(events, "a") == greedy(PROMPT, 12)  # what the non-PD fake streams
    assert "".join(e.text for e in events) == WordTokenizer().decode(greedy(PROMPT, 12))
    assert events[-1].finish_reason is FinishReason.LENGTH
    # as SGLang's routers send it: the same body and rid to both, one room, the prefill's host
    (p,), (d,) = pair.prefill.bodies, pair.decode.bodies
    assert p["rid"] == d["rid"] and p["input_ids"] == d["input_ids"] == PROMPT
    assert p["bootstrap_room"] == d["bootstrap_room"] and 0 <= d["bootstrap_room"] <= MAX_ROOM
    assert (d["bootstrap_host"], d["bootstrap_port"]) == ("127.0.0.1", 8998)
    assert d["stream"] is True and p["stream"] is False
    wait_for(lambda: client_of(engine).num_handoffs == 1, "the handoff to be counted")
    info = engine.info()
    assert info["pd_transfers_total"] == "1" and info["pd_transfer_failures_total"] == "0"
    assert info["migration_mode_pd"] == PD_MIGRATION_MODE
    assert info["migration_mode"] == "recompute"  # Tidal's own migrate / pull commands


def test_an_abort_reaches_both_servers(engine: SglangEngine, pair: Pair) -> None:
    engine.add(req("x", 400))
    events: list[TokenEvent] = []
    while len(tokens_of(events, "x")) < 3:
        events += engine.step(None).events
    rid = pair.decode.bodies[0]["rid"]
    assert engine.abort("x")
    wait_for(lambda: pair.decode.aborts == [rid], "the abort at the decode server")
    wait_for(lambda: pair.prefill.aborts == [rid], "the abort at the prefill server")
    assert not engine.has_work()


def test_a_prefill_server_that_is_down_fails_the_request_instead_of_hanging(
    pair: Pair,
) -> None:
    down = f"http://127.0.0.1:{natsd.free_port()}"  # nothing listens there
    eng = pd_engine(down, pair.decode.url)
    try:
        eng.add(req("d", 8))
        t0 = time.monotonic()
        events = run(eng, timeout_s=30)
        assert time.monotonic() - t0 < 20
        (last,) = [e for e in events if e.finish_reason is not None]
        assert last.finish_reason is FinishReason.ERROR
        assert "prefill server" in last.error and "ConnectError" in last.error
        # requeued as SGLang's own aborts are (3 times), then failed; each decode submission
        # aborted (some never reach the decode server: the refusal is quicker)
        assert client_of(eng).num_handoff_failures == 4
        wait_for(lambda: len(pair.decode.aborts) == 4, "the decode server's aborts")
        assert len(pair.decode.bodies) <= 4
        wait_for(lambda: not pair.decode.waiting, "no room waited for at the decode server")
    finally:
        eng.close()


def test_a_room_that_never_reaches_the_decode_server_times_out() -> None:
    """The prefill answers, but its KV goes to another transfer: the decode server would wait
    SGLang's 300 s; the handoff bound ends it and the request is requeued, then failed."""
    p = Pair()
    p.prefill.transfer = FakeTransfer()  # not the decode server's
    with p.prefill.serve(), p.decode.serve():
        eng = pd_engine(p.prefill.url, p.decode.url, handoff_timeout_s=0.3)
        try:
            eng.add(req("t", 8))
            events = run(eng, timeout_s=30)
            (last,) = [e for e in events if e.finish_reason is not None]
            assert last.finish_reason is FinishReason.ERROR
            assert "no token 0.3 s after the prefill server sent the KV" in last.error
            assert client_of(eng).num_handoffs == 0
        finally:
            eng.close()


def test_a_pd_server_refuses_a_request_without_a_room(pair: Pair) -> None:
    """What SGLang answers, so a pair that is not sent rooms fails loudly (fake's check)."""
    import httpx

    body = {"rid": "tidal-x", "input_ids": PROMPT, "stream": False}
    r = httpx.post(pair.prefill.url + "/generate", json=body, timeout=10)
    assert r.status_code == 400 and NO_ROOM in r.json()["error"]["message"]


def test_migration_out_of_a_pd_instance_is_a_recompute_with_the_same_output(
    engine: SglangEngine, pair: Pair
) -> None:
    other = FakeSglang()
    with other.serve():
        dst = make_engine(other.url)
        try:
            engine.add(req("m", 30, RequestClass.ONLINE))
            events: list[TokenEvent] = []
            while len(tokens_of(events, "m")) < 6:
                events += engine.step(None).events
            data = engine.export_request("m")
            rid = pair.decode.bodies[0]["rid"]
            wait_for(lambda: pair.decode.aborts == [rid], "the abort at the decode server")
            wait_for(lambda: pair.prefill.aborts == [rid], "the abort at the prefill server")
            dst.import_request(data)
            events += run(dst)
            assert tokens_of(events, "m") == greedy(PROMPT, 30)
            assert "".join(e.text for e in events) == WordTokenizer().decode(greedy(PROMPT, 30))
            n_before = len(other.bodies[0]["input_ids"]) - len(PROMPT)
            assert n_before >= 6 and engine.migration_mode == "recompute"
        finally:
            dst.close()


def test_load_is_the_decode_servers_with_the_prefills_queue(
    engine: SglangEngine, pair: Pair
) -> None:
    client = client_of(engine)
    wait_for(lambda: client.prefill_load.max_total_tokens == 5000, "the prefill's /v1/loads")
    wait_for(lambda: client.decode_load.max_total_tokens == 30000, "the decode's /v1/loads")
    assert engine.load().num_kv_blocks_total == 30000  # the decode server's KV bounds decoding
    info = engine.info()
    assert info["sglang_prefill_url"] == pair.prefill.url
    assert info["sglang_url"] == pair.decode.url and info["sglang_bootstrap"] == "127.0.0.1:8998"
    pair.decode.transfer = FakeTransfer()  # its KV never lands: it waits at the decode server
    engine.add(req("w", 8))
    engine.step(None)
    wait_for(lambda: client.load.num_waiting >= 1, "the waiting request in the load")
    assert engine.load().num_waiting >= 1


def test_the_pair_is_checked_and_its_bootstrap_port_read_from_server_info(pair: Pair) -> None:
    args = argparse.Namespace(sglang_bootstrap_port=8998, sglang_handoff_timeout_s=5.0)
    pair.prefill.bootstrap_port = 9123
    client = pd_client(args, pair.prefill.url, pair.decode.url, 10.0)
    try:
        assert client.bootstrap_port == 9123 and client.handoff_timeout_s == 5.0
    finally:
        client.close()
    with pytest.raises(ValueError, match="mode decode; a PD pair needs it prefill"):
        pd_client(args, pair.decode.url, pair.prefill.url, 10.0)


def test_the_gateway_counts_pd_handoffs_as_push_migrations() -> None:
    m = GatewayMetrics()

    def beat(ok: int, failed: int, started: float = 1.0) -> Heartbeat:
        info = {"pd_transfers_total": str(ok), "pd_transfer_failures_total": str(failed)}
        return Heartbeat("inst-0", "instance", 1, started, 2.0, info=info)

    def count(outcome: str) -> str:
        text = generate_latest(m.registry).decode()
        want = f'tidal_migrations_total{{kind="push",mode="pd_transfer",outcome="{outcome}"}}'
        return next((ln.split()[-1] for ln in text.splitlines() if ln.startswith(want)), "0")

    m.on_instance_beat(beat(3, 1))
    m.on_instance_beat(beat(5, 1))
    assert (count("ok"), count("failed")) == ("5.0", "1.0")
    m.on_instance_beat(beat(2, 0, started=9.0))  # restarted: counts from 0 again
    assert count("ok") == "7.0"
    m.on_instance_beat(Heartbeat("inst-1", "instance", 1, 1.0, 2.0))  # not a PD pair
    assert count("ok") == "7.0"


def test_the_gateway_counts_sglang_retractions_per_instance() -> None:
    m = GatewayMetrics()

    def beat(n: str, started: float = 1.0) -> Heartbeat:
        info = {"sglang_retractions_total": n, "migration_mode": "recompute"}
        return Heartbeat("inst-0", "instance", 1, started, 2.0, info=info)

    def count() -> str:
        text = generate_latest(m.registry).decode()
        want = 'tidal_sglang_retractions_total{instance="inst-0"}'
        return next((ln.split()[-1] for ln in text.splitlines() if ln.startswith(want)), "0")

    m.on_instance_beat(beat("2"))
    m.on_instance_beat(beat("3"))
    assert count() == "3.0"
    m.on_instance_beat(beat("garbage"))  # logged and dropped
    m.on_instance_beat(beat("5"))  # grew by 2 since the last readable beat
    assert count() == "5.0"
    m.on_instance_beat(beat("1", started=9.0))  # restarted
    assert count() == "6.0"
