"""`tidal batch`: the OpenAI Batch API from the shell.

    tidal batch submit requests.jsonl [--endpoint /v1/chat/completions] [--wait] [--out out.jsonl]
    tidal batch list | status BATCH_ID | cancel BATCH_ID | results BATCH_ID [--out FILE]

It talks to the gateway's HTTP API (`--base-url`, default: the running `tidal up`'s, else
http://127.0.0.1:8000/v1), exactly as the `openai` client does. `--wait` shows a progress bar
(lines done, output tokens/s, ETA) until the batch ends, then writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from services.cli import state

TERMINAL = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0


def default_base_url() -> str:
    try:
        st = json.loads(state.state_path().read_text())
        os.kill(int(st["pid"]), 0)
        return str(st["api_url"])
    except (OSError, ValueError, KeyError, TypeError):
        return "http://127.0.0.1:8000/v1"


class Api:
    def __init__(self, base_url: str, api_key: str) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=60.0)

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise SystemExit(f"tidal batch: cannot reach {self.http.base_url}: {exc}") from None
        if resp.status_code >= 400:
            try:
                msg = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = resp.text[:300]
            raise SystemExit(f"tidal batch: {method} {path}: HTTP {resp.status_code}: {msg}")
        return resp

    def json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        out: dict[str, Any] = self.call(method, path, **kw).json()
        return out


def _summary(b: dict[str, Any]) -> str:
    c = b.get("request_counts") or {}
    return (
        f"{b['id']}  {b['status']:<11} {c.get('completed', 0)}/{c.get('total', 0)} done, "
        f"{c.get('failed', 0)} failed  (input {b['input_file_id']}, {b['endpoint']})"
    )


def _wait(api: Api, batch: dict[str, Any]) -> dict[str, Any]:
    columns = (
        TextColumn("[bold]{task.fields[status]}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} lines"),
        TextColumn("{task.fields[tok_s]} tok/s"),
        TimeRemainingColumn(),
    )
    t0, tokens0 = time.monotonic(), None
    with Progress(*columns, transient=False, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("batch", total=None, status=batch["status"], tok_s="-")
        while batch["status"] not in TERMINAL:
            time.sleep(POLL_S)
            batch = api.json("GET", f"/batches/{batch['id']}")
            c = batch.get("request_counts") or {}
            tokens = _output_tokens(api)
            if tokens0 is None:
                tokens0 = tokens
            elapsed = max(time.monotonic() - t0, 1e-9)
            rate = "-"
            if tokens is not None and tokens0 is not None:
                rate = f"{(tokens - tokens0) / elapsed:.0f}"
            bar.update(
                task,
                total=c.get("total") or None,
                completed=c.get("completed", 0) + c.get("failed", 0),
                status=batch["status"],
                tok_s=rate,
            )
    return batch


def _output_tokens(api: Api) -> float | None:
    """`tidal_batch_output_tokens_total` from the gateway's /metrics, if it answers."""
    try:
        text = api.http.get(str(api.http.base_url).removesuffix("/v1") + "/metrics").text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("tidal_batch_output_tokens_total "):
            return float(line.split()[1])
    return None


def _results(api: Api, batch: dict[str, Any], out: str) -> None:
    parts = []
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            parts.append(api.call("GET", f"/files/{batch[key]}/content").content)
    data = b"".join(parts)
    if out == "-":
        sys.stdout.buffer.write(data)
    else:
        Path(out).write_bytes(data)
        n = data.count(b"\n")
        print(f"{n} result lines written to {out}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    api = Api(args.base_url or default_base_url(), args.api_key)
    if args.batch_cmd == "submit":
        path = Path(args.file)
        if not path.is_file():
            raise SystemExit(f"tidal batch: {path} is not a file")
        with path.open("rb") as f:
            files = {"file": (path.name, f)}
            up = api.json("POST", "/files", files=files, data={"purpose": "batch"})
        batch = api.json(
            "POST",
            "/batches",
            json={
                "input_file_id": up["id"],
                "endpoint": args.endpoint,
                "completion_window": args.window,
            },
        )
        print(f"submitted {batch['id']} ({up['bytes']} bytes in {up['id']})", file=sys.stderr)
        if not args.wait:
            print(batch["id"])
            return 0
        batch = _wait(api, batch)
        print(_summary(batch), file=sys.stderr)
        for err in (batch.get("errors") or {}).get("data") or []:
            print(f"  line {err.get('line')}: {err.get('code')}: {err.get('message')}")
        if args.out:
            _results(api, batch, args.out)
        return 0 if batch["status"] == "completed" else 1
    if args.batch_cmd == "list":
        page = api.json("GET", "/batches", params={"limit": args.limit})
        for b in page["data"]:
            print(_summary(b))
        return 0
    if args.batch_cmd == "status":
        b = api.json("GET", f"/batches/{args.batch_id}")
        print(json.dumps(b, indent=2) if args.json else _summary(b))
        return 0
    if args.batch_cmd == "cancel":
        print(_summary(api.json("POST", f"/batches/{args.batch_id}/cancel")))
        return 0
    b = api.json("GET", f"/batches/{args.batch_id}")
    if b["status"] not in TERMINAL:
        raise SystemExit(f"tidal batch: {b['id']} is {b['status']}; results come at its end")
    _results(api, b, args.out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="OpenAI Batch API: submit a JSONL file, follow it, get its results",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="", help="API base (default: the running tidal up's)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="bearer key")
    cmd = p.add_subparsers(dest="batch_cmd", required=True)
    s = cmd.add_parser("submit", help="upload FILE and create a batch")
    s.add_argument("file", help="JSONL, one {custom_id, method, url, body} per line")
    s.add_argument(
        "--endpoint",
        default="/v1/chat/completions",
        choices=("/v1/chat/completions", "/v1/completions"),
    )
    s.add_argument("--window", default="24h", help="completion window (24h; Tidal: <N>s|m|h)")
    s.add_argument("--wait", action="store_true", help="follow it to the end with a progress bar")
    s.add_argument("--out", default="", help="with --wait: write the result lines here")
    ls = cmd.add_parser("list", help="recent batches")
    ls.add_argument("--limit", type=int, default=20)
    st = cmd.add_parser("status", help="one batch")
    st.add_argument("batch_id")
    st.add_argument("--json", action="store_true", help="the whole Batch object")
    c = cmd.add_parser("cancel", help="cancel a batch (lines done so far are kept)")
    c.add_argument("batch_id")
    r = cmd.add_parser("results", help="output and error lines of an ended batch")
    r.add_argument("batch_id")
    r.add_argument("--out", default="-", help="file to write (default: stdout)")
    p.set_defaults(func=_run)
