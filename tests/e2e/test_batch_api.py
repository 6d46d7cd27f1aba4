"""The OpenAI Batch API end to end: the official `openai` client against `tidal up --engine sim`
(real nats-server with JetStream, real gateway, scheduler, batch service and instances)."""

from __future__ import annotations

import io
import json
import time
import urllib.request
from typing import Any

import openai
import pytest
from openai.types import Batch

from tests.e2e.conftest import Stack, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.nats]
MODEL = "tidal-sim"
CHAT = "/v1/chat/completions"
DONE = ("completed", "failed", "expired", "cancelled")


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def chat_line(cid: str, max_tokens: int = 6, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"say something about {cid}"}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def upload(c: openai.OpenAI, lines: list[dict[str, Any]] | bytes) -> str:
    data = lines if isinstance(lines, bytes) else "\n".join(map(json.dumps, lines)).encode()
    f = c.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.status == "processed" and f.bytes == len(data)
    return f.id


def submit(c: openai.OpenAI, lines: list[dict[str, Any]] | bytes, window: str = "24h") -> Batch:
    return c.batches.create(
        input_file_id=upload(c, lines),
        endpoint=CHAT,
        completion_window=window,  # type: ignore[arg-type]
    )


def wait(c: openai.OpenAI, batch_id: str, until: tuple[str, ...] = DONE, timeout_s: float = 120):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b = c.batches.retrieve(batch_id)
        if b.status in until:
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {b.status} after {timeout_s} s: {b}")


def lines_of(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_round_trip_with_the_openai_client(stack: Stack) -> None:
    c = client(stack)
    lines = [chat_line(f"req-{i}") for i in range(24)]
    batch = c.batches.create(
        input_file_id=upload(c, lines),
        endpoint=CHAT,
        completion_window="24h",
        metadata={"job": "e2e"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "e2e"}
    done = wait(c, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (24, 24)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.error_file_id is None and done.usage is not None and done.usage.output_tokens > 0
    out = lines_of(c, done.output_file_id)
    # every custom_id exactly once, in input order, with a real completion in its body
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(24)]
    for x in out:
        assert x["error"] is None and x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 6
        assert body["tidal"]["request_class"] == "offline"
    # lists page as OpenAI's do
    assert batch.id in [b.id for b in c.batches.list(limit=100)]
    first = c.batches.list(limit=1)
    assert len(first.data) == 1 and first.data[0].id == batch.id
    assert {done.input_file_id, done.output_file_id} <= {f.id for f in c.files.list()}
    deleted = c.files.delete(done.input_file_id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(done.input_file_id)


def test_a_line_whose_body_is_invalid_fails_alone(stack: Stack) -> None:
    c = client(stack)
    lines = [chat_line("good-1"), chat_line("bad", temperature=-3), chat_line("good-2")]
    done = wait(c, submit(c, lines).id)
    assert done.status == "completed"
    assert done.request_counts is not None and done.request_counts.failed == 1
    assert [x["custom_id"] for x in lines_of(c, done.output_file_id)] == ["good-1", "good-2"]
    (err,) = lines_of(c, done.error_file_id)
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert "temperature" in err["response"]["body"]["error"]["message"]


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (b'{"custom_id": "x", "method": "POST", oops', "invalid_json_line"),
        (json.dumps(chat_line("a")).encode(), "duplicate_custom_id"),
        (json.dumps({**chat_line("x"), "url": "/v1/embeddings"}).encode(), "invalid_url"),
        (json.dumps(chat_line("x", model="no-such-model")).encode(), "mismatched_model"),
    ],
)
def test_an_invalid_file_fails_the_batch_naming_the_line(
    stack: Stack, bad: bytes, code: str
) -> None:
    c = client(stack)
    data = json.dumps(chat_line("a")).encode() + b"\n" + bad + b"\n"
    done = wait(c, submit(c, data).id)
    assert done.status == "failed" and done.failed_at
    assert done.errors is not None and done.errors.data
    assert [(e.code, e.line) for e in done.errors.data] == [(code, 2)]
    assert done.output_file_id is None


def test_an_unknown_model_fails_the_batch(stack: Stack) -> None:
    c = client(stack)
    done = wait(c, submit(c, [chat_line("a", model="no-such-model")]).id)
    assert done.status == "failed" and done.errors is not None
    assert [(e.code, e.line, e.param) for e in done.errors.data] == [
        ("model_not_found", 1, "body.model")
    ]


def test_bad_create_requests_get_openai_style_errors(stack: Stack) -> None:
    c = client(stack)
    fid = upload(c, [chat_line("a")])
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        c.batches.create(input_file_id=fid, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        c.batches.create(input_file_id=fid, endpoint=CHAT, completion_window="forever")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        c.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_doesnotexist")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")


def test_ten_thousand_lines_validate_then_cancel_keeps_what_is_done(stack: Stack) -> None:
    c = client(stack)
    lines = [chat_line(f"n{i}", max_tokens=4) for i in range(10_000)]
    batch = submit(c, lines)
    running = wait(c, batch.id, until=("in_progress", *DONE), timeout_s=120)
    assert running.status == "in_progress"
    assert running.request_counts is not None and running.request_counts.total == 10_000
    deadline = time.monotonic() + 60
    while c.batches.retrieve(batch.id).request_counts.completed < 20:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "no line finished in 60 s"
        time.sleep(0.2)
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait(c, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    out, err = lines_of(c, done.output_file_id), lines_of(c, done.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(f"n{i}" for i in range(10_000))  # each line once
    assert done.request_counts is not None and done.request_counts.completed == len(out) >= 20
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
    with pytest.raises(openai.BadRequestError, match="cannot cancel"):
        c.batches.cancel(wait(c, submit(c, [chat_line("z")]).id).id)


def test_a_batch_past_its_window_expires_with_partial_results(stack: Stack) -> None:
    c = client(stack)
    lines = [chat_line(f"e{i}", max_tokens=200, ignore_eos=True) for i in range(300)]
    done = wait(c, submit(c, lines, window="3s").id, timeout_s=60)
    assert done.status == "expired" and done.expired_at
    out, err = lines_of(c, done.output_file_id), lines_of(c, done.error_file_id)
    assert sorted(x["custom_id"] for x in out + err) == sorted(f"e{i}" for i in range(300))
    assert err and {x["error"]["code"] for x in err} == {"batch_expired"}


def test_batch_metrics_on_metrics(stack: Stack) -> None:
    with urllib.request.urlopen(stack.base_url.removesuffix("/v1") + "/metrics") as r:
        text = r.read().decode()
    for name in (
        'tidal_batches{status="completed"}',
        "tidal_batch_lines_queued",
        "tidal_batch_lines_in_flight",
        'tidal_batch_lines_total{outcome="completed"}',
        "tidal_batch_output_tokens_total",
        "tidal_batch_generated_tokens_total",
        "tidal_batch_oldest_job_age_seconds",
    ):
        assert name in text, name
    samples = [line.split() for line in text.splitlines() if line.startswith("tidal_batch_")]
    names = [s[0] for s in samples]
    assert len(names) == len(set(names)), "a series is on /metrics twice"
    value = {name: float(v) for name, v in samples}
    # every stored line's tokens were counted as they came, and cancelled lines' tokens too
    stored = value["tidal_batch_output_tokens_total"]
    assert value["tidal_batch_generated_tokens_total"] >= stored > 0


def _online_attainment(stack: Stack, n: int, ttft_s: float, tpot_s: float) -> float:
    """Stream `n` online requests, 0.1 s apart; the share that met both SLOs."""
    import asyncio

    async def run() -> float:
        c = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)

        async def one(i: int) -> bool:
            await asyncio.sleep(0.1 * i)
            t0 = time.perf_counter()
            first = last = None
            n_tok = 0
            stream = await c.completions.create(
                model=MODEL, prompt=f"online {i}", max_tokens=16, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    last = time.perf_counter()
                    first = first or last
                    n_tok += 1
            assert first is not None and last is not None
            tpot = (last - first) / max(1, n_tok - 1)
            return first - t0 <= ttft_s and tpot <= tpot_s

        ok = await asyncio.gather(*(one(i) for i in range(n)))
        await c.close()
        return sum(ok) / n

    return asyncio.run(run())


def test_online_requests_keep_their_slo_while_a_batch_runs(stack: Stack) -> None:
    # SLOs a few times the emulated step (3 ms): what a batch must not take from online work.
    alone = _online_attainment(stack, 40, ttft_s=0.5, tpot_s=0.05)
    c = client(stack)
    # 400 x 256 tokens: several times the measurement's length, so the batch is still running
    # when it is cancelled (at 64 tokens it once finished between the check and the cancel)
    batch = submit(c, [chat_line(f"bg{i}", max_tokens=256, ignore_eos=True) for i in range(400)])
    wait(c, batch.id, until=("in_progress", *DONE))
    deadline = time.monotonic() + 60
    while c.batches.retrieve(batch.id).request_counts.completed == 0:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the batch never started running"
        time.sleep(0.2)
    busy = _online_attainment(stack, 40, ttft_s=0.5, tpot_s=0.05)
    running = c.batches.retrieve(batch.id)
    assert running.status == "in_progress", "the batch must still run while online is measured"
    c.batches.cancel(batch.id)
    assert busy >= alone - 0.01, (alone, busy)


def test_a_batch_past_the_offline_backlog_bound_fails_and_a_later_one_runs() -> None:
    # 10 ms steps: the first batch's 300-token lines keep 4 lines queued for about 3 s
    with start_stack("--max-offline-backlog", "4", "--sim-step-model", "linear:0.01,0,0,0") as st:
        c = client(st)
        a = submit(c, [chat_line(f"a{i}", max_tokens=300) for i in range(4)])
        assert wait(c, a.id, until=("in_progress", *DONE)).status == "in_progress"
        b = wait(c, submit(c, [chat_line("b0")]).id)
        assert b.status == "failed" and b.errors is not None and b.errors.data
        err = b.errors.data[0]
        assert err.code == "backlog_limit_exceeded" and "bound of 4 lines" in (err.message or "")
        assert wait(c, a.id).status == "completed"
        later = wait(c, submit(c, [chat_line("c0"), chat_line("c1")]).id)
        assert later.status == "completed"
