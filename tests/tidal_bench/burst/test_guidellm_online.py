"""guidellm's replay of the burst schedule, read back: each request on the schedule's clock,
errored ones by their HTTP status, the sentinel row left out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tidal_bench.burst.guidellm_online import error_outcome, results_of

ORIGIN = 1_000_000.0  # guidellm's scheduler_start_time: the trace's first row, Unix seconds


def ok_request(rel: float, start: float, first: float, last: float, n: int) -> dict[str, Any]:
    """A successful request as guidellm 0.8.1 writes it (only the fields read)."""
    return {
        "request_args": json.dumps({"body": {"max_tokens": n}}),
        "info": {
            "scheduler_start_time": ORIGIN,
            "settings": {"relative_timestamp": rel},
            "timings": {
                "targeted_start": ORIGIN + rel,
                "request_start": start,
                "first_token_iteration": first,
                "last_token_iteration": last,
            },
        },
        "output_metrics": {"text_tokens": n},
    }


def errored_request(rel: float, error: str) -> dict[str, Any]:
    """An errored request as guidellm 0.8.1 writes it: httpx's error text in info.error."""
    return {"info": {"settings": {"relative_timestamp": rel}, "error": error}}


REFUSED = (
    "HTTPStatusError(\"Client error '429 Too Many Requests' for url "
    "'http://127.0.0.1:40861/v1/completions'\\nFor more information check: "
    'https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/429")'
)


def test_requests_land_on_the_schedules_clock_with_their_outcome() -> None:
    first_arrival = 0.4  # the schedule's first arrival: guidellm's trace time 0
    doc = {
        "benchmarks": [
            {
                "requests": {
                    "successful": [
                        # 5 tokens, first at +50 ms, then 4 gaps of 10 ms
                        ok_request(0.0, ORIGIN + 0.001, ORIGIN + 0.051, ORIGIN + 0.091, 5),
                        ok_request(7.0, ORIGIN + 7.0, ORIGIN + 7.2, ORIGIN + 7.2, 1),
                        ok_request(30.0, ORIGIN + 30, ORIGIN + 30.1, ORIGIN + 30.1, 1),  # sentinel
                    ],
                    "errored": [
                        errored_request(2.0, REFUSED),
                        errored_request(3.0, "HTTPStatusError(\"Server error '503 Unavailable'\")"),
                        errored_request(4.0, "ConnectError('All connection attempts failed')"),
                    ],
                    "incomplete": [],
                }
            }
        ]
    }
    results, zero_unix = results_of(doc, first_arrival, sentinel_trace_s=30.0)
    assert zero_unix == pytest.approx(ORIGIN - 0.4)
    assert [(r.sent_s, r.outcome) for r in results] == [
        (pytest.approx(0.4), "ok"),
        (pytest.approx(2.4), "429"),
        (pytest.approx(3.4), "5xx"),
        (pytest.approx(4.4), "error"),
        (pytest.approx(7.4), "ok"),
    ]
    assert results[0].ttft_s == pytest.approx(0.050)
    assert results[0].itl_s == pytest.approx(0.010)
    assert results[-1].itl_s is None  # one token: no gap


def test_error_texts_without_a_status_are_plain_errors() -> None:
    assert error_outcome(REFUSED) == "429"
    assert error_outcome("ReadTimeout('')") == "error"
    assert error_outcome("") == "error"
