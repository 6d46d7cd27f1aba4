"""Schemathesis hooks for fuzzing the gateway (loaded with SCHEMATHESIS_HOOKS=this file).

Generated bodies name the served model (`TIDAL_FUZZ_MODEL`, default `tidal-sim`) so requests get
past the 404 and reach the bus; file and batch ids are, half the time, ones that exist (a file
uploaded here, a batch created from it), so the fuzzer reaches the Batch API beyond its 404s.
The command is in tests/fault/test_http_abuse.py's docstring. Not imported by the test suite.
"""

from __future__ import annotations

import itertools
import json
import os
import urllib.request
from typing import Any

import schemathesis  # type: ignore[import-not-found]

MODEL = os.environ.get("TIDAL_FUZZ_MODEL", "tidal-sim")
BASE = os.environ.get("TIDAL_FUZZ_URL", "http://127.0.0.1:8000").rstrip("/")
_ids: dict[str, str] = {}
_turn = itertools.count()  # not `random`: Hypothesis warns of it inside strategies


def _post(path: str, data: bytes, content_type: str) -> dict[str, Any]:
    req = urllib.request.Request(
        BASE + path, data=data, headers={"Content-Type": content_type}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _real_ids() -> dict[str, str]:
    """A real file and batch, created once."""
    if not _ids:
        line = {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        }
        boundary = "fuzzboundary"
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n{json.dumps(line)}\n\r\n--{boundary}--\r\n"
        ).encode()
        file = _post("/v1/files", body, f"multipart/form-data; boundary={boundary}")
        _ids["file_id"] = file["id"]
        batch = _post(
            "/v1/batches",
            json.dumps(
                {
                    "input_file_id": file["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                }
            ).encode(),
            "application/json",
        )
        _ids["batch_id"] = batch["id"]
    return _ids


@schemathesis.hook
def map_body(ctx: Any, body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    path = ctx.operation.path
    if path in ("/v1/chat/completions", "/v1/completions") and next(_turn) % 10:
        body["model"] = MODEL
    if path == "/v1/batches" and "input_file_id" in body and next(_turn) % 2:
        body["input_file_id"] = _real_ids()["file_id"]
    return body


@schemathesis.hook
def map_path_parameters(ctx: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
    if params and next(_turn) % 2:
        for key in ("file_id", "batch_id"):
            if key in params:
                params[key] = _real_ids()[key]
    return params
