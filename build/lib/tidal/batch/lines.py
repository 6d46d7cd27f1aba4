"""A batch's input lines checked as OpenAI checks them, and its output and error lines.

Input line: `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {...}}`.
Output line: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`;
a line whose request failed goes to the error file with the same shape (OpenAI puts non-2xx
responses there), a line that never ran has `response: null` and `error: {code, message}`.
Validation reads the file line by line and stops collecting after `MAX_ERRORS`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tidal.batch.objects import BatchError

MAX_LINES = 50_000  # OpenAI's limit of requests per batch
MAX_ERRORS = 100  # errors reported per failed batch; validation goes on counting lines
MAX_CUSTOM_ID_CHARS = 512
# A line becomes one JetStream job message, under NATS's 1 MiB max_payload with room to spare.
MAX_LINE_BYTES = 900 * 1024


@dataclass(frozen=True)
class Job:
    """One line to run: where it sits in the file (0-based) and what to send."""

    index: int
    custom_id: str
    body: dict[str, Any]


@dataclass
class Checked:
    """The outcome of validation: the jobs in file order, or the errors that fail the batch."""

    jobs: list[Job] = field(default_factory=list)
    errors: list[BatchError] = field(default_factory=list)
    model: str | None = None
    num_errors: int = 0  # all errors found (only the first MAX_ERRORS are kept)

    def fail(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(BatchError(code=code, message=message, line=line, param=param))


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Lines of a file that arrives in chunks, without holding the whole file."""
    tail = b""
    for chunk in chunks:
        parts = (tail + chunk).split(b"\n")
        tail = parts.pop()
        yield from parts
    if tail:
        yield tail


def check_lines(lines: Iterable[bytes], endpoint: str, models: set[str] | None) -> Checked:
    """Validate every line of an input file for `endpoint`, serving `models` (None: any)."""
    out = Checked()
    seen: set[str] = set()
    num = 0
    for num, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if len(out.jobs) >= MAX_LINES:
            out.fail("too_many_requests", f"a batch holds at most {MAX_LINES} requests", num)
            break
        if len(raw) > MAX_LINE_BYTES:
            out.fail("line_too_long", f"line {num} is over {MAX_LINE_BYTES} bytes", num)
            continue
        try:
            line = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            out.fail("invalid_json_line", f"line {num} is not valid JSON: {exc}", num)
            continue
        if not isinstance(line, dict):
            out.fail("invalid_json_line", f"line {num} is not a JSON object", num)
            continue
        job = _check_line(line, num, endpoint, out)
        if job is None:
            continue
        if job.custom_id in seen:
            out.fail(
                "duplicate_custom_id",
                f"custom_id {job.custom_id!r} appears more than once",
                num,
                "custom_id",
            )
            continue
        seen.add(job.custom_id)
        model = job.body.get("model")
        if out.model is None:
            out.model = model
        elif model != out.model:
            out.fail(
                "mismatched_model",
                f"every line of a batch must use the same model ({out.model!r}, not {model!r})",
                num,
                "body.model",
            )
            continue
        if models is not None and model not in models:
            out.fail(
                "model_not_found",
                f"the model {model!r} does not exist (served: {', '.join(sorted(models))})",
                num,
                "body.model",
            )
            continue
        out.jobs.append(Job(index=len(out.jobs), custom_id=job.custom_id, body=job.body))
    if not out.jobs and not out.num_errors:
        out.fail("empty_file", "the input file has no requests", None)
    return out


def _check_line(line: dict[str, Any], num: int, endpoint: str, out: Checked) -> Job | None:
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        message = "custom_id must be a non-empty string"
        out.fail("missing_required_parameter", message, num, "custom_id")
        return None
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        message = f"custom_id is over {MAX_CUSTOM_ID_CHARS} characters"
        out.fail("invalid_value", message, num, "custom_id")
        return None
    if line.get("method") != "POST":
        out.fail("invalid_method", "method must be POST", num, "method")
        return None
    if line.get("url") != endpoint:
        out.fail(
            "invalid_url",
            f"url {line.get('url')!r} does not match the batch's endpoint {endpoint!r}",
            num,
            "url",
        )
        return None
    body = line.get("body")
    if not isinstance(body, dict):
        out.fail("missing_required_parameter", "body must be a JSON object", num, "body")
        return None
    if not isinstance(body.get("model"), str):
        out.fail("missing_required_parameter", "body.model must be a string", num, "body.model")
        return None
    if body.get("stream"):
        out.fail("invalid_value", "streaming is not available in a batch", num, "body.stream")
        return None
    return Job(index=0, custom_id=custom_id, body=body)


def result_key(batch_id: str, custom_id: str) -> str:
    """A KV key for one line's result (custom ids may hold any character; keys may not)."""
    return f"{batch_id}.{hashlib.blake2b(custom_id.encode(), digest_size=16).hexdigest()}"


def line_id(batch_id: str, custom_id: str) -> str:
    return "batch_req_" + result_key(batch_id, custom_id).split(".", 1)[1]


def response_line(
    batch_id: str, custom_id: str, status_code: int, request_id: str, body: dict[str, Any]
) -> dict[str, Any]:
    """A line whose request ran (the output file for 2xx, the error file otherwise)."""
    return {
        "id": line_id(batch_id, custom_id),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(batch_id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line that never got a response (expired, cancelled, failed past its retries)."""
    return {
        "id": line_id(batch_id, custom_id),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def is_success(line: dict[str, Any]) -> bool:
    resp = line.get("response")
    return isinstance(resp, dict) and 200 <= int(resp.get("status_code", 0)) < 300
