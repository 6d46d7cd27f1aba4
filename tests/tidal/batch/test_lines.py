from __future__ import annotations

import json

import pytest

from tidal.batch.lines import (
    MAX_ERRORS,
    MAX_LINE_BYTES,
    check_lines,
    error_line,
    is_success,
    line_id,
    response_line,
    result_key,
    split_lines,
)

CHAT = "/v1/chat/completions"


def line(cid: str, model: str = "m", url: str = CHAT, **extra: object) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}).encode()


def codes(lines: list[bytes], models: set[str] | None = None) -> list[tuple[str, int | None]]:
    out = check_lines(lines, CHAT, {"m", "n"} if models is None else models)
    return [(e.code, e.line) for e in out.errors]


def test_a_good_file_gives_its_jobs_in_order_and_skips_blank_lines() -> None:
    out = check_lines([line("a"), b"", b"  ", line("b")], CHAT, {"m"})
    assert not out.errors and out.model == "m"
    assert [(j.index, j.custom_id) for j in out.jobs] == [(0, "a"), (1, "b")]


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (b"{not json", "invalid_json_line"),
        (b"[1, 2]", "invalid_json_line"),
        (json.dumps({"method": "POST", "url": CHAT, "body": {"model": "m"}}).encode(),
         "missing_required_parameter"),
        (json.dumps({"custom_id": "x", "method": "GET", "url": CHAT, "body": {}}).encode(),
         "invalid_method"),
        (line("x", url="/v1/completions"), "invalid_url"),
        (json.dumps({"custom_id": "x", "method": "POST", "url": CHAT}).encode(),
         "missing_required_parameter"),
        (line("x", stream=True), "invalid_value"),
        (line("a"), "duplicate_custom_id"),
        (line("x", model="n"), "mismatched_model"),
        (line("x", max_tokens=1, stop="y" * MAX_LINE_BYTES), "line_too_long"),  # > NATS payload
    ],
)  # fmt: skip
def test_each_kind_of_bad_line_is_named_with_its_line_number(bad: bytes, code: str) -> None:
    assert codes([line("a"), bad]) == [(code, 2)]


def test_an_empty_file_fails() -> None:
    assert codes([b"", b"\n"]) == [("empty_file", None)]


def test_errors_are_capped_but_counted() -> None:
    out = check_lines([b"junk"] * (MAX_ERRORS + 5), CHAT, {"m"})
    assert len(out.errors) == MAX_ERRORS and out.num_errors == MAX_ERRORS + 5


def test_no_model_list_checks_everything_but_the_model() -> None:
    assert codes([line("a", model="anything")], models=None) == [("model_not_found", 1)]
    assert not check_lines([line("a", model="anything")], CHAT, None).errors


def test_split_lines_joins_lines_cut_across_chunks() -> None:
    data = b"".join(line(f"c{i}") + b"\n" for i in range(50))
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    assert list(split_lines(chunks)) == data.split(b"\n")[:-1]
    assert list(split_lines([b"a\nb"])) == [b"a", b"b"]


def test_result_keys_are_valid_kv_keys_whatever_the_custom_id() -> None:
    k = result_key("batch_1", "weird id / with * and > and spaces")
    assert k.startswith("batch_1.") and all(c.isalnum() or c in "._" for c in k)
    assert result_key("batch_1", "a") != result_key("batch_1", "b")
    assert line_id("batch_1", "a") == line_id("batch_1", "a")


def test_output_and_error_lines_have_openai_shape() -> None:
    ok = response_line("batch_1", "a", 200, "req-1", {"x": 1})
    assert ok["response"] == {"status_code": 200, "request_id": "req-1", "body": {"x": 1}}
    assert ok["error"] is None and is_success(ok)
    bad = response_line("batch_1", "a", 400, "req-1", {"error": {}})
    assert not is_success(bad)
    gone = error_line("batch_1", "a", "batch_expired", "too late")
    assert gone["response"] is None and gone["error"]["code"] == "batch_expired"
    assert not is_success(gone)
