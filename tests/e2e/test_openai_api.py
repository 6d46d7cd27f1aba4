"""End to end through `tidal up --engine sim` with the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import Stack, wait_until
from tidal.engine.sim.tokens import load_sim_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.nats]
MODEL = "tidal-sim"
CHAT = [{"role": "user", "content": "Tell me about tides."}]


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def test_streamed_online_chat(stack: Stack) -> None:
    stream = client(stack).chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].system_fingerprint == "tidal-sim-emulated"  # labelled as emulation


def test_non_streamed_completion(stack: Stack) -> None:
    resp = client(stack).completions.create(model=MODEL, prompt="The sea", max_tokens=7)
    assert resp.object == "text_completion"
    assert len(resp.choices[0].text.split()) == 7
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    # The sim engine counts tokens with the served model's tokenizer (SmolLM2's), as vLLM would.
    assert resp.usage.prompt_tokens == len(load_sim_tokenizer().encode("The sea"))
    assert resp.usage.completion_tokens == 7
    assert resp.model_extra is not None and resp.model_extra["tidal"]["emulated"] is True


def test_offline_class_by_body_field_and_by_header(stack: Stack) -> None:
    c = client(stack)
    by_body = c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, extra_body={"request_class": "offline"}
    )
    by_header = c.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=3,
        extra_headers={"X-Tidal-Class": "offline", "X-Tidal-TTFT-Ms": "5000"},
    )
    assert by_body.model_extra is not None
    assert by_body.model_extra["tidal"]["request_class"] == "offline"
    assert json.loads(by_header.content)["tidal"]["request_class"] == "offline"
    assert by_header.headers["x-tidal-emulated"] == "true"


def test_32_concurrent_streams(stack: Stack) -> None:
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=20,
            stream=True,
        )
        return "".join([ch.choices[0].delta.content or "" async for ch in stream])

    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(32)))
        finally:
            await c.close()

    texts = asyncio.run(run())
    assert len(texts) == 32 and all(len(t.split()) == 20 for t in texts)


def test_client_disconnect_cancels_the_request_everywhere(stack: Stack) -> None:
    def cancelled_total() -> float:
        body = httpx.get(stack.base_url.removesuffix("/v1") + "/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in body.splitlines()
            if line.startswith("tidal_gateway_cancelled_requests_total")
        )

    before = cancelled_total()
    stream = client(stack).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4000, stream=True
    )  # ~12 s of 3 ms steps
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()

    def all_idle() -> bool:
        instances = [s for s in stack.status()["services"] if s["kind"] == "instance"]
        return bool(instances) and all(s["load"]["num_running"] == 0 for s in instances)

    wait_until(all_idle, 5, "the instances to drop the cancelled request")
    wait_until(lambda: cancelled_total() == before + 1, 5, "the cancel metric")


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[]", 400, ""),
        (json.dumps({"model": MODEL}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
        (
            json.dumps({"model": MODEL, "messages": CHAT, "temperature": 5}).encode(),
            400,
            "temperature",
        ),
        (json.dumps({"model": MODEL, "messages": CHAT, "n": 17}).encode(), 400, "16"),
        (
            json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 0}).encode(),
            400,
            "max_tokens",
        ),
        (
            json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 10**6}).encode(),
            400,
            "context length",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
            400,
            "role",
        ),
        (
            json.dumps({"model": MODEL, "messages": CHAT, "request_class": "batch"}).encode(),
            400,
            "request_class",
        ),
        (json.dumps({"model": "no-such-model", "messages": CHAT}).encode(), 404, "no-such-model"),
    ],
)
def test_malformed_chat_requests_get_openai_style_4xx(
    stack: Stack, body: bytes, status: int, fragment: str
) -> None:
    r = httpx.post(
        stack.base_url + "/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and fragment in err["message"] + str(err.get("param"))
    assert err["type"] in ("invalid_request_error",)


def test_bad_header_and_bad_completion_prompt_get_400(stack: Stack) -> None:
    r = httpx.post(
        stack.base_url + "/chat/completions",
        json={"model": MODEL, "messages": CHAT},
        headers={"X-Tidal-Class": "vip"},
    )
    assert r.status_code == 400 and "X-Tidal-Class" in r.json()["error"]["message"]
    metrics = httpx.get(stack.base_url.removesuffix("/v1") + "/metrics").text
    assert 'req_class="vip"' not in metrics  # client values never become metric labels
    assert 'req_class="invalid"' in metrics
    r = httpx.post(stack.base_url + "/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client(stack).completions.create(model=MODEL, prompt="x", max_tokens=-1)


def test_health_metrics_and_models(stack: Stack) -> None:
    root = stack.base_url.removesuffix("/v1")
    assert httpx.get(root + "/health").json()["status"] == "ok"
    metrics = httpx.get(root + "/metrics").text
    assert 'tidal_gateway_ttft_seconds_count{emulated="true",req_class="online"}' in metrics
    assert [m.id for m in client(stack).models.list()] == [MODEL]


def test_ctl_status_lists_every_service_and_pause_resume(stack: Stack) -> None:
    kinds = sorted(s["kind"] for s in stack.status()["services"])
    assert kinds == ["batch", "cpu_attn", "gateway", "instance", "instance", "scheduler"]
    table = stack.ctl("status")
    assert table.returncode == 0 and "instance-1" in table.stdout
    assert stack.ctl("offline", "pause").returncode == 0
    r = httpx.post(
        stack.base_url + "/chat/completions",
        json={"model": MODEL, "messages": CHAT, "request_class": "offline"},
    )
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
    online = httpx.post(
        stack.base_url + "/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 2},
    )
    assert online.status_code == 200
    assert stack.ctl("offline", "resume").returncode == 0
    r = httpx.post(
        stack.base_url + "/chat/completions",
        json={"model": MODEL, "messages": CHAT, "request_class": "offline", "max_tokens": 2},
    )
    assert r.status_code == 200


def test_killed_instance_is_reported_restarted_and_routed_around(stack: Stack) -> None:
    victim = next(s for s in stack.status()["services"] if s["id"] == "instance-0")
    os.kill(victim["pid"], signal.SIGKILL)
    # Requests keep being served while instance-0 is down and coming back.
    c = client(stack)
    t_end = time.monotonic() + 3
    served = 0
    while time.monotonic() < t_end:
        resp = c.completions.create(model=MODEL, prompt="still there?", max_tokens=2)
        served += resp.choices[0].finish_reason == "length"
    assert served > 0
    wait_until(
        lambda: f"instance-0 (pid {victim['pid']}) killed by SIGKILL" in stack.log(),
        10,
        "the supervisor to report the death by name",
    )

    def back() -> bool:
        s = next((s for s in stack.status()["services"] if s["id"] == "instance-0"), None)
        return s is not None and s["pid"] != victim["pid"] and s["status"] == "ok"

    wait_until(back, 20, "instance-0 to come back")
    assert "instance-0 restarted" in stack.log()


def test_streamed_offline_chat_gets_all_its_text_in_fewer_chunks(stack: Stack) -> None:
    """An offline request's tokens leave the instance in chunks of up to 32 (or every 0.25 s,
    `services.instance.chunks`): a streaming client still gets every token's text."""
    c = client(stack)
    prompt = [{"role": "user", "content": "Summarise the tide tables."}]
    common = {"model": MODEL, "messages": prompt, "max_tokens": 100, "temperature": 0.0}
    stream = c.chat.completions.create(
        **common,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"request_class": "offline", "ignore_eos": True},
    )
    chunks = list(stream)
    deltas = [ch.choices[0].delta.content for ch in chunks if ch.choices]
    text = "".join(d or "" for d in deltas)
    online = c.chat.completions.create(**common, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert text == online.choices[0].message.content
    assert len(text.split()) == 100
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 100
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert 1 <= len([d for d in deltas if d]) < 100  # several tokens a chunk
