"""Per-key rate limits: the token bucket on explicit times, and the gateway's Guard answering 429
in OpenAI's error body with Retry-After on a small app."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.gateway.auth import Guard
from services.gateway.ratelimit import RateLimiter, TokenBucket, retry_after_header


def test_a_bucket_lets_a_burst_through_then_one_request_per_refill() -> None:
    b = TokenBucket(rate=2.0, burst=3.0, tokens=3.0, updated_s=100.0)
    assert [b.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(100.0) == pytest.approx(0.5)  # one token in 1/rate seconds
    assert b.take(100.25) == pytest.approx(0.25)  # a refused request is not counted
    assert b.take(100.5) == 0.0
    assert b.take(110.0) == 0.0  # refilled, but never past the burst
    assert b.tokens == pytest.approx(2.0)


def test_each_key_has_its_own_bucket_and_full_ones_are_forgotten_past_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.gateway import ratelimit

    monkeypatch.setattr(ratelimit, "MAX_BUCKETS", 2)
    lim = RateLimiter(rate=1.0, burst=1.0)
    assert lim.check("a", 0.0) == 0.0
    assert lim.check("a", 0.0) == pytest.approx(1.0)
    assert lim.check("b", 0.0) == 0.0
    assert lim.check("c", 5.0) == 0.0  # a and b refilled by now: forgotten
    assert set(lim.buckets) == {"c"}


def test_bad_rates_are_refused_and_the_burst_defaults_to_the_rate() -> None:
    for rate, burst in ((0.0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (1.0, 0.5)):
        with pytest.raises(ValueError):
            RateLimiter(rate, burst)
    assert RateLimiter(5.0).burst == 5.0
    assert RateLimiter(0.2).burst == 1.0


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert [retry_after_header(x) for x in (0.001, 1.0, 1.2, 7.9)] == ["1", "1", "2", "8"]


def _app(keys: list[str], limiter: RateLimiter) -> TestClient:
    a = FastAPI()

    @a.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @a.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    a.add_middleware(Guard, keys=keys, rate_limiter=limiter)
    return TestClient(a)


def test_past_its_burst_a_key_gets_429_in_openai_shape_with_retry_after() -> None:
    c = _app(["k1", "k2"], RateLimiter(rate=0.01, burst=2))
    k1 = {"Authorization": "Bearer k1"}
    assert [c.get("/v1/models", headers=k1).status_code for _ in range(2)] == [200, 200]
    r = c.get("/v1/models", headers=k1)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.json()["error"]["type"] == "requests"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert int(r.headers["retry-after"]) >= 99  # 1 / 0.01 s, less the time the test took
    assert c.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert c.get("/health").status_code == 200  # never limited
    # a wrong key is 401, not counted against anyone
    assert c.get("/v1/models", headers={"Authorization": "Bearer no"}).status_code == 401


def test_without_keys_the_limit_is_per_client_address() -> None:
    c = _app([], RateLimiter(rate=0.01, burst=1))
    assert c.get("/v1/models").status_code == 200
    assert c.get("/v1/models").status_code == 429
