"""A batch line's body becomes a request, or a 400 naming the field a batch cannot honour."""

from __future__ import annotations

from typing import Any

import pytest

from services.batch.runner import build_request
from services.common.protocol import ApiError

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
        (CHAT, {"n": 2}, "n"),
        (CHAT, {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"logprobs": 0}, "logprobs"),
    ],
)
def test_a_field_a_batch_cannot_honour_is_refused(
    endpoint: str, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": "m", **extra}
    body |= {"messages": MESSAGES} if endpoint == CHAT else {"prompt": "hi"}
    with pytest.raises(ApiError) as err:
        build_request(endpoint, body, "tidal.gw.g.tokens")
    assert err.value.status == 400 and err.value.param == param


def test_penalties_reach_the_request() -> None:
    body = {"model": "m", "messages": MESSAGES, "presence_penalty": 1.5, "logit_bias": {"5": -3}}
    req = build_request(CHAT, body, "tidal.gw.g.tokens")
    assert req.sampling.presence_penalty == 1.5 and req.sampling.logit_bias == [(5, -3.0)]


async def test_collect_counts_tokens_as_each_chunk_arrives() -> None:
    from services.batch.runner import collect
    from tidal.schemas.messages import TokenChunk

    counts: list[int] = []

    class Handle:  # a running line's stream, as a RequestHandle yields it
        async def __aiter__(self):  # type: ignore[no-untyped-def]
            for seq, n, finish in ((0, 1, None), (1, 4, None), (2, 0, "stop")):
                yield TokenChunk("r", seq, "x" * n, n, 3, 0, "i0", finish_reason=finish)
                assert sum(counts) == [1, 5, 5][seq]  # counted before the next chunk comes

    chunks = await collect(Handle(), counts.append)  # type: ignore[arg-type]
    assert [c.seq for c in chunks] == [0, 1, 2] and counts == [1, 4]
