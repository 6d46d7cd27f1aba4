"""The gateway's OpenAPI schema, told the way the gateway answers.

FastAPI documents a 422 with its own validation body; the gateway answers bad input with a 400 in
OpenAI's error body instead (`main.py`'s exception handlers), and its other errors (404, 413,
429, 503, ...) in that body too. This rewrites every operation's error responses to say so, so a
fuzzer (`--checks response_schema_conformance`) and client generators see what really comes back.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "ErrorResponse",
    "description": "OpenAI's error body",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_DESCRIPTIONS = {
    "400": "Bad input: malformed JSON, a wrong type, a value out of range",
    "404": "Unknown model, file or batch",
    "413": "The request is too large to go on the bus",
    "429": "Too many requests in flight, or refused by admission control (with Retry-After)",
    "502": "Generation failed",
    "503": "No instance can take the request, or the scheduler or batch store is unreachable "
    "(with Retry-After)",
}
_GENERATE = ("400", "404", "413", "429", "502", "503")
_BATCH = ("400", "404", "503")


def _errors_of(path: str) -> tuple[str, ...]:
    if path in ("/v1/chat/completions", "/v1/completions"):
        return _GENERATE
    if path.startswith(("/v1/files", "/v1/batches")):
        return _BATCH
    if path == "/v1/models":
        return ("503",)
    return ()


def error_responses(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with FastAPI's 422 replaced by the error responses each operation gives."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in _errors_of(path):
                responses[status] = {
                    "description": _DESCRIPTIONS[status],
                    "content": {"application/json": {"schema": ref}},
                }
    return schema


def install(app: FastAPI) -> None:
    """Serve the corrected schema at /openapi.json."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = error_responses(
                get_openapi(title=app.title, version=app.version, routes=app.routes)
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
