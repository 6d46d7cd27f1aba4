"""A hung SGLang server does not hang the request: a `/generate` stream silent for
`STREAM_IDLE_TIMEOUT_S` ends with an error message (then handled as an SGLang abort)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from services.instance.sglang import client as client_mod
from services.instance.sglang.client import SglangClient


def hung_server() -> tuple[str, socket.socket]:
    """Answers /v1/loads, and /generate with headers and then nothing, for ever."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            request = conn.recv(65536)
            if b"/generate" in request:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
                time.sleep(30)  # hung
            else:
                body = b'{"loads": []}'
                head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                conn.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body)

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", srv


def test_a_silent_generate_stream_ends_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_mod, "STREAM_IDLE_TIMEOUT_S", 0.5)
    url, srv = hung_server()
    client = SglangClient(url, timeout_s=2.0)
    try:
        client.submit("r", "rid-1", {"input_ids": [1, 2, 3], "stream": True})
        got = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not got or got[-1].obj is not None):
            client.arrived.wait(0.2)
            while not client.inbox.empty():
                got.append(client.inbox.get())
        assert got, "the stream never ended"
        assert got[-1].obj is None  # the end marker
        errors = [m.obj for m in got if m.obj and "error" in m.obj]
        assert errors and "Timeout" in errors[0]["error"]["message"]
    finally:
        client.close()
        srv.close()
