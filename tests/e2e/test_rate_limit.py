"""`tidal up --rate-limit` end to end with the openai client: past its burst a key gets 429 with
Retry-After in OpenAI's error body, another key is not affected, and the openai client's own
retries (which honour Retry-After) get the request through."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tidal_bench.faults.kit import MODEL, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.nats]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # a request per 5 s per key, bursts of 3; an emulated step takes no time. `tidal up` polls
    # with the first key until the stack is ready, this test with the first key: the tests use
    # the others.
    s = Stack("--api-key", "key-a", "--api-key", "key-b", "--api-key", "key-c", "--rate-limit",
              "0.2", "--rate-burst", "3", step_model="zero", api_key="key-a")  # fmt: skip
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_past_its_burst_a_key_gets_429_with_retry_after_and_others_do_not(stack: Stack) -> None:
    b = openai.OpenAI(base_url=stack.base, api_key="key-b", max_retries=0)
    statuses: list[int] = []
    while 429 not in statuses and len(statuses) < 20:  # 20 requests take far less than 5 s each
        try:
            b.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            statuses.append(200)
        except openai.RateLimitError as exc:
            statuses.append(429)
            err = exc.response
            assert exc.code == "rate_limit_exceeded"
            assert int(err.headers["retry-after"]) >= 1
            assert err.json()["error"]["type"] == "requests"
    assert statuses[:3] == [200, 200, 200] and statuses[-1] == 429, statuses
    c = openai.OpenAI(base_url=stack.base, api_key="key-c", max_retries=0)
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def test_the_openai_client_retries_after_the_wait_and_gets_in(stack: Stack) -> None:
    c = openai.OpenAI(base_url=stack.base, api_key="key-c", max_retries=0)
    with pytest.raises(openai.RateLimitError):  # drain key-c's bucket
        for _ in range(20):
            c.models.list()
    patient = openai.OpenAI(base_url=stack.base, api_key="key-c", max_retries=5)
    assert [m.id for m in patient.models.list()] == [MODEL]
