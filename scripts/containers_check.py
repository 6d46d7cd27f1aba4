"""Drive a running `compose up` of docker-compose.yml (make test-containers): wait for the gateway,
one streamed chat, a 20-line batch during which one instance container is killed, then check
every line's result is there exactly once. Prints each step's seconds; exit 1 on any failure.

    python scripts/containers_check.py --kill "podman kill tidal_instance-relaxed_1"
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
import subprocess
import sys
import time
from collections import Counter

import openai

MODEL = "tidal-sim"
DONE = ("completed", "failed", "expired", "cancelled")


def step(name: str, t0: float) -> float:
    now = time.monotonic()
    print(f"containers: {name} in {now - t0:.1f} s", flush=True)
    return now


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--kill", default="", help="command that kills one instance container")
    p.add_argument("--lines", type=int, default=20)
    p.add_argument("--timeout-s", type=float, default=600)
    a = p.parse_args()
    c = openai.OpenAI(base_url=a.base_url, api_key="unused", max_retries=0, timeout=60)
    t0 = time.monotonic()
    deadline = t0 + a.timeout_s
    while True:
        try:
            if [m.id for m in c.models.list()] == [MODEL]:
                break
        except openai.APIError:
            pass
        if time.monotonic() > deadline:
            print("containers: the gateway never listed the model", file=sys.stderr)
            return 1
        time.sleep(1)
    t = step("gateway ready (model listed)", t0)
    chunks = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello from a container"}],
        max_tokens=16,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    if len(text.split()) != 16:
        print(f"containers: the streamed chat gave {text!r}", file=sys.stderr)
        return 1
    t = step("streamed chat (16 tokens)", t)
    rows = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": 64, "ignore_eos": True}}
        for i in range(a.lines)
    ]  # fmt: skip
    f = c.files.create(
        file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())), purpose="batch"
    )
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    if a.kill:
        while b.request_counts is None or b.request_counts.completed < 1:
            b = c.batches.retrieve(b.id)
            if b.status in DONE:
                break
            time.sleep(0.1)
        done = b.request_counts.completed if b.request_counts else 0
        out = subprocess.run(shlex.split(a.kill), capture_output=True, text=True)
        print(f"containers: killed ({a.kill}: rc {out.returncode}) at {done}/{a.lines} lines")
    while b.status not in DONE:
        if time.monotonic() > deadline:
            print(f"containers: batch {b.id} stuck in {b.status}", file=sys.stderr)
            return 1
        time.sleep(0.5)
        try:
            b = c.batches.retrieve(b.id)
        except openai.APIError:
            continue
    t = step(f"batch of {a.lines} lines {b.status}", t)
    ids = []
    if b.output_file_id:
        content = c.files.content(b.output_file_id).text
        ids = [json.loads(x)["custom_id"] for x in content.splitlines()]
    counts = Counter(ids)
    lost = [r["custom_id"] for r in rows if r["custom_id"] not in counts]
    dup = [k for k, n in counts.items() if n > 1]
    print(f"containers: {len(counts)} lines once, lost {len(lost)}, duplicated {len(dup)}")
    step("total", t0)
    return 0 if b.status == "completed" and not lost and not dup else 1


if __name__ == "__main__":
    sys.exit(main())
