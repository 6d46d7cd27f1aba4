"""Abuse of the gateway's HTTP API: bad input is a 4xx in OpenAI's error body (never a 5xx), and
every service is still up and serving afterwards. One `tidal up --engine sim` for the module
(`tests/fault/fuzzkit.py`); garbage on the bus is `test_bus_garbage.py`.

Found by fuzzing (issue 15, item 4) and kept here as regressions: out-of-range integers were a
500 (msgpack overflow on the bus); an SLO of 5e-324 ms a 30 s wait then 503 (it underflowed to
0 s and the scheduler's route handler raised); a lone UTF-16 surrogate or a > 1 MiB string a
500; a JSONL line over NATS's max_payload left its batch `validating` for ever; a garbage value in
the batch KV bucket a 500 on every GET /v1/batches.

schemathesis is not a dev dependency (it runs for minutes over the live stack); run it by hand in
a venv of its own against a running `tidal up --engine sim --sim-step-model zero --port 8000`:

    python3.11 -m venv /tmp/stvenv && /tmp/stvenv/bin/pip install schemathesis
    SCHEMATHESIS_HOOKS=tests/fault/schemathesis_hooks.py TIDAL_FUZZ_URL=http://127.0.0.1:8000 \\
      /tmp/stvenv/bin/schemathesis run http://127.0.0.1:8000/openapi.json \\
      --checks not_a_server_error,response_schema_conformance --max-examples 100 --seed 1 \\
      --request-timeout 40 --workers 2 --continue-on-failure

(schemathesis 4.32.5, 14 operations: 2265 cases, 0 failures, 46 s after the fixes.)
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.fault.fuzzkit import (
    CHAT,
    MB,
    MODEL,
    FuzzUp,
    assert_openai_error,
    assert_serving,
    chat,
    upload,
    wait_batch,
)

pytestmark = [pytest.mark.fault, pytest.mark.nats]


# -- regressions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "max_tokens", 10**23),
        ("/v1/chat/completions", "max_completion_tokens", 2**64),
        ("/v1/chat/completions", "seed", 10**23),
        ("/v1/chat/completions", "seed", -(10**23)),
        ("/v1/chat/completions", "seed", 2**63),
        ("/v1/chat/completions", "top_k", 10**23),
        ("/v1/chat/completions", "top_logprobs", 10**23),
        ("/v1/completions", "max_tokens", 10**23),
        ("/v1/completions", "logprobs", 10**23),
        ("/v1/completions", "seed", -(2**63) - 1),
    ],
)
def test_out_of_range_integers_are_a_400_not_a_500(
    http: httpx.Client, path: str, field: str, value: int
) -> None:
    base = chat() if path.endswith("chat/completions") else {"model": MODEL, "prompt": "hi"}
    r = http.post(
        path,
        content=json.dumps({**base, field: value}),
        headers={"content-type": "application/json"},
    )
    assert_openai_error(r, 400, field)


def test_int64_seed_bounds_are_accepted(http: httpx.Client) -> None:
    for seed in (2**63 - 1, -(2**63)):
        assert http.post("/v1/chat/completions", json=chat(seed=seed)).status_code == 200


@pytest.mark.parametrize("field", ["slo_ttft_ms", "slo_tpot_ms"])
def test_an_slo_that_underflows_is_a_400_at_once(http: httpx.Client, field: str) -> None:
    t0 = time.monotonic()
    r = http.post("/v1/chat/completions", json=chat(**{field: 5e-324}))
    assert_openai_error(r, 400, field)
    header = "X-Tidal-TTFT-Ms" if field == "slo_ttft_ms" else "X-Tidal-TPOT-Ms"
    r = http.post("/v1/chat/completions", json=chat(), headers={header: "5e-324"})
    assert_openai_error(r, 400, field)
    assert time.monotonic() - t0 < 5


def test_lone_surrogate_and_oversized_strings(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        content=b'{"model": "tidal-sim", "messages": [{"role": "user", "content": "\\ud800"}]}',
        headers={"content-type": "application/json"},
    )
    assert_openai_error(r, 400)
    big = "x" * (3 * MB // 2)  # over NATS's 1 MiB max_payload
    bodies = (chat(messages=[{"role": "user", "content": big}]), chat(model=big), chat(stop=big))
    for body in bodies:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code in (404, 413), r.text  # an unknown model may be named first
        assert_openai_error(r, r.status_code)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": big})
    assert_openai_error(r, 413)


def test_a_jsonl_line_over_the_bus_limit_fails_its_batch_and_the_next_batch_runs(
    fuzz_up: FuzzUp, http: httpx.Client
) -> None:
    def line(cid: str, content: str) -> bytes:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        obj = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
        return json.dumps(obj).encode() + b"\n"

    long_file = upload(http, line("ok", "hi") + line("long", "y" * 2 * MB))
    create = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = http.post("/v1/batches", json={**create, "input_file_id": long_file})
    failed = wait_batch(http, r.json()["id"])
    assert failed["status"] == "failed"
    assert [e["code"] for e in failed["errors"]["data"]] == ["line_too_long"]
    r = http.post("/v1/batches", json={**create, "input_file_id": upload(http, line("a", "hi"))})
    assert wait_batch(http, r.json()["id"])["status"] == "completed"


# -- abuse payloads ------------------------------------------------------------------------------


def _abuse() -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, httpx keyword arguments) of hostile requests."""
    j = {"content-type": "application/json"}
    big = "x" * (10 * MB)
    nested = b'{"model": "tidal-sim", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested_obj = b'{"model": "tidal-sim", "messages": [], "x": ' + b'{"a": ' * 50_000
    nested_obj += b"1" + b"}" * 50_000 + b"}"
    out: list[tuple[str, str, dict[str, Any]]] = []
    for path in ("/v1/chat/completions", "/v1/completions"):
        raw = [
            b'{"model": "tidal-sim", "messages": [], "prompt": "x", "max_tokens": '
            + b"9" * 5000
            + b"}",
            b'{"model": "tidal-sim", "messages": [{"role": "user", "content": "x"}], '
            b'"prompt": "x", "temperature": NaN}',
            b'{"model": "tidal-sim", "messages": [{"role": "user", "content": "x"}], '
            b'"prompt": "x", "slo_ttft_ms": Infinity}',
            b'{"model": "tidal-sim", "messages": [{"role": "user", "content": "x"}], '
            b'"prompt": "x", "top_p": -Infinity}',
            b'{"model": "tidal-sim", "messages": [{"role": "user", "content": "\xff\xfe"}], '
            b'"prompt": "\xc3\x28"}',
            b'{"model": "tidal-sim", "prompt": "x", "max_tokens": 1e400}',
            nested,
            nested_obj,
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": big}], "prompt": big}
            ).encode(),
            b"",
            b"null",
            b"[1, 2, 3]",
            b'"a string"',
            b"\x00" * 1000,
        ]
        out += [("POST", path, {"content": body, "headers": j}) for body in raw]
        for field in ("max_tokens", "seed", "top_k", "n", "logprobs", "top_logprobs"):
            for value in (-(2**70), -1, 0, 2**64, 10**30, 1.5, "1", True, None, [], {}):
                body = {"model": MODEL, "messages": CHAT, "prompt": "x", field: value}
                out.append(("POST", path, {"content": json.dumps(body), "headers": j}))
        ok = json.dumps(chat(prompt="x"))
        for ct in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/xml",
            "multipart/form-data; boundary=zz",
            "application/json; charset=latin-1",
        ):
            out.append(("POST", path, {"content": ok, "headers": {"content-type": ct}}))
    out += [
        ("POST", "/v1/files", {"content": b'{"purpose": "batch"}', "headers": j}),
        ("POST", "/v1/files", {"files": {"file": ("a.jsonl", b"{}")}, "data": {"purpose": "x"}}),
        (
            "POST",
            "/v1/files",
            {"files": {"file": ("\xff.jsonl", b"\xff\xfe\n")}, "data": {"purpose": "batch"}},
        ),
        (
            "POST",
            "/v1/files",
            {
                "content": b"--zz\r\ngarbage",
                "headers": {"content-type": "multipart/form-data; boundary=zz"},
            },
        ),
        ("GET", "/v1/files", {"params": {"limit": 2**70}}),
        ("GET", "/v1/files", {"params": {"limit": -1, "order": "sideways"}}),
        ("GET", "/v1/batches", {"params": {"limit": "NaN", "after": "\x00" * 10}}),
        ("GET", "/v1/files/..%2F..%2Fetc%2Fpasswd", {}),
        ("GET", "/v1/files/file-" + "a" * 5000 + "/content", {}),
        ("DELETE", "/v1/files/file-%00", {}),
        ("GET", "/v1/batches/batch_%ff", {}),
        ("POST", "/v1/batches/" + "b" * 10_000 + "/cancel", {}),
    ]
    for body in (
        {"input_file_id": "file-x", "endpoint": "/v1/embeddings", "completion_window": "24h"},
        {"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "9" * 400},
        {"input_file_id": "x" * 10_000, "endpoint": "/v1/completions", "completion_window": "1s"},
        {
            "input_file_id": "file-x",
            "endpoint": "/v1/completions",
            "completion_window": "24h",
            "metadata": {str(i): "v" for i in range(1000)},
        },
        {"input_file_id": 2**70, "endpoint": None, "completion_window": 1e400},
    ):
        out.append(("POST", "/v1/batches", {"content": json.dumps(body), "headers": j}))
    return out


def test_abuse_payloads_get_no_5xx_and_every_service_stays_up(
    fuzz_up: FuzzUp, http: httpx.Client
) -> None:
    pids = fuzz_up.pids()
    server_errors = []
    for method, path, kwargs in _abuse():
        r = http.request(method, path, **kwargs)
        if r.status_code >= 500:
            server_errors.append((method, path, r.status_code, r.text[:200]))
        elif r.status_code >= 400 and r.headers.get("content-type") == "application/json":
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert not server_errors
    assert_serving(fuzz_up, http, pids)
