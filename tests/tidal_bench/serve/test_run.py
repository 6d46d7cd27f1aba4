"""`tidal bench serve --compare URL`: lone streams taking turns between two OpenAI-compatible
servers (here two tiny fake ones on threads; the real run pairs `make up` with llama.cpp)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tidal_bench.serve.run import TIDAL_EXTRA, single_streams


def _server(model: str, seen: list[dict[str, Any]]) -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            return None

        def _send(self, body: bytes, ctype: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            data = [{"id": model, "object": "model", "created": 0, "owned_by": "t"}]
            self._send(json.dumps({"object": "list", "data": data}).encode(), "application/json")

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(req)
            lines = []
            for k in range(req["max_tokens"]):
                ch = {"index": 0, "text": f"t{k} ", "finish_reason": None, "logprobs": None}
                ev = {"id": "c", "object": "text_completion", "created": 0, "model": model}
                lines.append(f"data: {json.dumps(ev | {'choices': [ch]})}\n\n")
            lines.append("data: [DONE]\n\n")
            self._send("".join(lines).encode(), "text/event-stream")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def two_servers() -> Iterator[tuple[str, str, list[dict], list[dict]]]:
    seen_a: list[dict] = []
    seen_b: list[dict] = []
    a, b = _server("model-a", seen_a), _server("model-b", seen_b)
    yield (
        f"http://127.0.0.1:{a.server_address[1]}/v1",
        f"http://127.0.0.1:{b.server_address[1]}/v1",
        seen_a,
        seen_b,
    )
    a.shutdown()
    b.shutdown()


def test_single_streams_take_turns_and_count_every_gap(
    two_servers: tuple[str, str, list[dict], list[dict]],
) -> None:
    url_a, url_b, seen_a, seen_b = two_servers
    bias = {"logit_bias": {"2": -100}}
    res = single_streams({"tidal": (url_a, TIDAL_EXTRA), "other": (url_b, bias)}, 3, 5, 10)
    # one warm-up each, then 3 counted requests of 5 texts: 4 gaps each
    assert len(seen_a) == len(seen_b) == 4
    assert res["tidal"]["itl_samples"] == res["other"]["itl_samples"] == 12
    assert res["tidal"]["model"] == "model-a" and res["other"]["model"] == "model-b"
    # Tidal's own fields go to Tidal only; the outside server gets plain OpenAI ones
    assert all(r["ignore_eos"] is True for r in seen_a)
    assert all("ignore_eos" not in r and r["logit_bias"] == {"2": -100} for r in seen_b)
    # the same prompts on both, a new one per request (no prefix-cache hit)
    assert [r["prompt"] for r in seen_a] == [r["prompt"] for r in seen_b]
    assert len({r["prompt"] for r in seen_a}) == 4
    for r in res.values():
        assert r["itl_ms_p50"] > 0 and r["itl_ms_p90"] >= r["itl_ms_p50"]


def test_compare_overlap_runs_the_stack_with_overlap_on_and_off() -> None:
    import argparse

    from tidal_bench.serve.run import _variants

    args = argparse.Namespace(compare_fixed_threads=False, compare_overlap=True)
    variants = _variants(args)
    assert {name: env["TIDAL_OVERLAP"] for name, (_, env) in variants.items()} == {
        "overlap": "1",
        "no overlap": "0",
    }
