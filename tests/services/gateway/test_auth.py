"""The gateway's API keys and body limits (`services/gateway/auth.py`) on a small app."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from services.gateway import auth
from services.gateway.auth import Guard, keys_from, owner_of


def app(keys: list[str], metrics_need_key: bool = False) -> TestClient:
    a = FastAPI()

    @a.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @a.get("/metrics")
    async def metrics() -> str:
        return "m"

    @a.post("/v1/echo")
    async def echo(request: Request) -> dict:
        return {"owner": request.state.owner, "n": len(await request.body())}

    a.add_middleware(Guard, keys=keys, metrics_need_key=metrics_need_key)
    return TestClient(a)


def test_keys_come_from_flags_and_the_environment_without_blanks_or_repeats() -> None:
    assert keys_from(["a", " b "], env="b, c,,") == ["a", "b", "c"]
    assert keys_from([], env="") == []


def test_an_owner_id_is_stable_and_does_not_show_the_key() -> None:
    assert owner_of("sk-secret") == owner_of("sk-secret") != owner_of("sk-other")
    assert "secret" not in owner_of("sk-secret")


def test_no_keys_configured_leaves_the_api_open() -> None:
    r = app([]).post("/v1/echo", content=b"x")
    assert r.status_code == 200 and r.json() == {"owner": "", "n": 1}


def test_a_missing_or_wrong_key_is_401_in_openai_shape() -> None:
    c = app(["k1", "k2"])
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"}):
        r = c.post("/v1/echo", content=b"x", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    r1 = c.post("/v1/echo", content=b"x", headers={"Authorization": "Bearer k1"})
    r2 = c.post("/v1/echo", content=b"x", headers={"Authorization": "Bearer k2"})
    assert r1.status_code == r2.status_code == 200
    assert r1.json()["owner"] == owner_of("k1") != r2.json()["owner"]


def test_health_is_open_and_metrics_asks_for_a_key_only_when_told() -> None:
    assert app(["k"]).get("/health").status_code == 200
    assert app(["k"]).get("/metrics").status_code == 200
    assert app(["k"], metrics_need_key=True).get("/metrics").status_code == 401


def test_a_body_over_the_limit_is_413_by_length_and_when_streamed(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(auth, "MAX_JSON_BODY_BYTES", 100)
    c = app([])
    assert c.post("/v1/echo", content=b"x" * 100).status_code == 200
    r = c.post("/v1/echo", content=b"x" * 101)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(10):
            yield b"x" * 50

    r = c.post("/v1/echo", content=chunks())  # no Content-Length: counted as it streams in
    assert r.status_code == 413


def test_class_key_rules_are_keyed_by_the_owner_id_a_request_carries() -> None:
    from tidal.config.classes import parse_classes

    table = parse_classes(
        None, keys={"sk-etl": {"pin": "offline"}, owner_of("sk-b"): {"cap": "offline"}}
    )
    keyed = auth.keyed_by_owner(table)
    assert set(keyed.keys) == {owner_of("sk-etl"), owner_of("sk-b")}  # no key is kept
    assert keyed.resolve(None, owner_of("sk-etl")).name == "offline"
    assert keyed.resolve(None, owner_of("sk-b")).name == "offline"  # capped
    assert keyed.resolve(None, owner_of("sk-other")).name == "online"
