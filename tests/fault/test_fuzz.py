"""Abuse of the gateway's HTTP API and of every NATS subject the services listen on: bad input is a
4xx in OpenAI's error body (never a 5xx), garbage on the bus is logged and dropped, and every
service is still up and serving afterwards. One `tidal up --engine sim` for the module.

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

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest

from services.cli import natsd
from tidal.schemas import subjects

pytestmark = [pytest.mark.fault, pytest.mark.nats]
MODEL = "tidal-sim"
REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "hi"}]
MB = 1024 * 1024


@dataclass
class Up:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    nats_url: str
    env: dict[str, str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli.main", "ctl", "status", "--json"],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        status: dict[str, Any] = json.loads(out.stdout)
        return status

    def pids(self) -> dict[str, int]:
        return {s["id"]: int(s["pid"]) for s in self.status()["services"]}


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            data: bytes = resp.read()
            return data
    except OSError:
        return None


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    port = natsd.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tidal-fuzz-"))
    env = {**os.environ, "TIDAL_STATE_FILE": str(tmp / "up.json"), "TIDAL_HEARTBEAT_S": "0.2"}
    env.pop("TIDAL_NATS_URL", None)
    argv = [
        sys.executable,
        "-m",
        "services.cli.main",
        "up",
        "--engine",
        "sim",
        "--port",
        str(port),
        "--cpu-attn",
        "0",
        "--sim-step-model",
        "zero",
        "--store-dir",
        str(tmp / "js"),
        "--log-level",
        "INFO",
    ]
    log_path = tmp / "up.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while b'"tidal-sim"' not in (_get(base + "/v1/models") or b""):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        while not (tmp / "up.json").exists():
            time.sleep(0.1)
        nats_url = json.loads((tmp / "up.json").read_text())["nats_url"]
        yield Up(proc, base, nats_url, env, log_path)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


@pytest.fixture(scope="module")
def http(up: Up) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=up.base, timeout=60) as client:
        yield client


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **extra}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def assert_serving(up: Up, http: httpx.Client, pids: dict[str, int] | None = None) -> None:
    """Every service up (the same processes, when `pids` is given) and a request served."""
    assert up.proc.poll() is None
    assert http.get("/health").json()["status"] == "ok"
    r = http.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    if pids is not None:
        assert up.pids() == pids, "a service died or restarted:\n" + up.log()[-4000:]


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


def _upload(http: httpx.Client, data: bytes) -> str:
    r = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    file_id: str = r.json()["id"]
    return file_id


def _wait_batch(http: httpx.Client, batch_id: str, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b: dict[str, Any] = http.get(f"/v1/batches/{batch_id}").json()
        if b["status"] in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {b['status']} after {timeout_s} s")


def test_a_jsonl_line_over_the_bus_limit_fails_its_batch_and_the_next_batch_runs(
    up: Up, http: httpx.Client
) -> None:
    def line(cid: str, content: str) -> bytes:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        obj = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
        return json.dumps(obj).encode() + b"\n"

    long_file = _upload(http, line("ok", "hi") + line("long", "y" * 2 * MB))
    create = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = http.post("/v1/batches", json={**create, "input_file_id": long_file})
    failed = _wait_batch(http, r.json()["id"])
    assert failed["status"] == "failed"
    assert [e["code"] for e in failed["errors"]["data"]] == ["line_too_long"]
    r = http.post("/v1/batches", json={**create, "input_file_id": _upload(http, line("a", "hi"))})
    assert _wait_batch(http, r.json()["id"])["status"] == "completed"


def test_garbage_in_the_batch_kv_buckets_is_skipped(up: Up, http: httpx.Client) -> None:
    async def write() -> None:
        nc = await nats.connect(up.nats_url)
        js = nc.jetstream()
        await js.publish("$KV.tidal-batches.batch_garbage", b"\xff\x00 not json")
        await js.publish("$KV.tidal-batch-results.batch_garbage.x", b"[1, 2")
        await nc.drain()

    asyncio.run(write())
    r = http.get("/v1/batches")
    assert r.status_code == 200, r.text
    assert "batch_garbage" not in {b["id"] for b in r.json()["data"]}
    assert_openai_error(http.get("/v1/batches/batch_garbage"), 404)
    assert_openai_error(http.post("/v1/batches/batch_garbage/cancel"), 404)


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


def test_abuse_payloads_get_no_5xx_and_every_service_stays_up(up: Up, http: httpx.Client) -> None:
    pids = up.pids()
    server_errors = []
    for method, path, kwargs in _abuse():
        r = http.request(method, path, **kwargs)
        if r.status_code >= 500:
            server_errors.append((method, path, r.status_code, r.text[:200]))
        elif r.status_code >= 400 and r.headers.get("content-type") == "application/json":
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert not server_errors
    assert_serving(up, http, pids)


# -- garbage on the bus --------------------------------------------------------------------------


def _garbage(rng: random.Random) -> list[bytes]:
    """Random bytes, MessagePack and JSON of the wrong shape or types."""
    enc = msgspec.msgpack.encode
    return [
        b"",
        rng.randbytes(1),
        rng.randbytes(64),
        rng.randbytes(4096),
        b"\xc1",  # never used in MessagePack
        b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 G items
        enc(None),
        enc(7),
        enc("req"),
        enc([1, 2, 3]),
        enc({"req_id": 5, "model": [], "sampling": "x", "reply_subject": None}),
        enc({"instance_id": {"a": 1}, "req_id": 1.5, "seq": "x"}),
        enc({"service_id": "x", "kind": "instance", "pid": -1, "started_unix_s": "now"}),
        enc(
            {
                "req_id": "r",
                "model": "tidal-sim",
                "req_class": "online",
                "max_tokens": -5,
                "num_prompt_chars": -1,
                "ttft_slo_ms": -1.0,
                "tpot_slo_ms": 0.0,
            }
        ),
        b'{"policy": 5}',
        b'{"roles": "x", "chunk_sizes": [1]}',
        b'{"instance_id": 7}',
        b"[1, 2",
        b"\xff\xfe",
        b"null",
        b"[]",
    ]


def _subjects(pids: dict[str, int]) -> list[str]:
    instances = [i for i in pids if i.startswith("instance-")]
    out = [
        subjects.ROUTE,
        subjects.MODELS,
        subjects.CANCEL,
        subjects.INSTANCE_DOWN,
        subjects.MIGRATION_EVENTS,
        subjects.BATCH_STATS,
        subjects.CTL_POLICY_CHANGED,
        subjects.CTL_STATUS,
        subjects.CTL_POLICY,
        subjects.CTL_POLICY_SET,
        subjects.CTL_ROLES,
        subjects.CTL_DRAIN,
        subjects.CTL_OFFLINE_RESUME,
        subjects.gateway_tokens("gateway-0"),
        subjects.BATCH_JOBS + ".batch_garbage",
    ]
    for kind, sid in (
        ("scheduler", "scheduler-0"),
        ("instance", "instance-0"),
        ("gateway", "gateway-0"),
        ("batch", "batch-0"),
    ):
        out.append(subjects.heartbeat(kind, sid))
    for iid in instances:
        out += [
            subjects.instance_submit(iid),
            subjects.instance_state(iid),
            subjects.instance_preempt(iid),
            subjects.instance_migrate(iid),
            subjects.instance_control(iid),
            subjects.migrate_offer(iid),
            subjects.migrate_commit(iid),
            subjects.migrate_abort(iid),
        ]
    return out


def test_garbage_on_every_subject_is_dropped_and_every_service_stays_up(
    up: Up, http: httpx.Client
) -> None:
    pids = up.pids()
    assert {"scheduler-0", "gateway-0", "batch-0", "instance-0", "instance-1"} <= set(pids)
    rng = random.Random(15)
    subs = _subjects(pids)

    async def feed() -> int:
        nc = await nats.connect(up.nats_url)
        sent = 0
        try:
            for subject in subs:
                for payload in _garbage(rng):
                    # A request too, so request/reply handlers see it with a reply subject;
                    # a handler may answer an error or drop it: both are fine.
                    await nc.publish(subject, payload)
                    with contextlib.suppress(nats.errors.TimeoutError):
                        await nc.request(subject, payload, timeout=0.05)
                    sent += 2
            await nc.flush()
        finally:
            await nc.drain()
        return sent

    sent = asyncio.run(feed())
    assert sent >= len(subs) * 20
    time.sleep(1.0)  # heartbeats go on; a crashed child would be gone from status by now
    assert_serving(up, http, pids)
    log = up.log()
    assert "dropped malformed message" in log
    assert "Traceback" not in log, log[-6000:]
    # a batch still runs end to end (the dispatcher dropped the garbage job)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    file_id = _upload(http, json.dumps(line).encode())
    r = http.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert _wait_batch(http, r.json()["id"])["status"] == "completed"
