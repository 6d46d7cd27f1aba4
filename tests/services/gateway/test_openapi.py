"""The OpenAPI schema states what the endpoints accept and how they answer errors."""

from __future__ import annotations

from typing import Any

from services.gateway.main import create_app


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = create_app(None, "gw-test").openapi()  # type: ignore[arg-type]
    return schema


def _field(schema: dict[str, Any], model: str, name: str) -> dict[str, Any]:
    prop: dict[str, Any] = schema["components"]["schemas"][model]["properties"][name]
    return prop.get("anyOf", [prop])[0]


def test_every_integer_of_a_request_body_is_bounded_to_what_msgpack_carries() -> None:
    schema = _schema()
    for model in ("ChatCompletionRequest", "CompletionRequest"):
        props = schema["components"]["schemas"][model]["properties"]
        for name in props:
            f = _field(schema, model, name)
            if f.get("type") == "integer":
                assert f["minimum"] >= -(2**63) and f["maximum"] <= 2**64 - 1, (model, name)
    seed = _field(schema, "ChatCompletionRequest", "seed")
    # NOTE: FastAPI writes the bounds as floats: int64's maximum reads as 2**63 there.
    assert float(seed["minimum"]) == -(2**63) and float(seed["maximum"]) == 2**63
    assert _field(schema, "ChatCompletionRequest", "n")["maximum"] == 16  # MAX_CHOICES
    assert _field(schema, "ChatCompletionRequest", "slo_ttft_ms")["minimum"] > 0
    assert _field(schema, "CompletionRequest", "echo")["enum"] == [False]
    assert _field(schema, "CreateBatch", "endpoint")["enum"] == [
        "/v1/chat/completions",
        "/v1/completions",
    ]


def test_errors_are_documented_in_openai_body_not_fastapi_422() -> None:
    schema = _schema()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, ops in schema["paths"].items():
        for op in ops.values():
            assert "422" not in op["responses"], path
            if path.startswith("/v1/") and path != "/v1/models":
                assert op["responses"]["400"]["content"]["application/json"]["schema"] == ref
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "404", "413", "429", "503"} <= set(chat)
