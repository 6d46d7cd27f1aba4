"""NATS messages and CPU an offline batch costs, one chunk per token vs coalesced chunks.

`python scripts/bench_offline_chunks.py [--chunk-tokens 1,32] [--lines 600] [--json PATH]`

For each `--chunk-tokens` value (`TIDAL_OFFLINE_CHUNK_TOKENS` of every instance; 1 = one
`TokenChunk` per token, as before issue 29) it starts a nats-server with monitoring and
`tidal up --engine sim` on it (the `--config`'s instances, `--sim-step-model` timings:
EMULATED), runs one Batch API batch of `--lines` chat lines to its end, and reports, over the
batch's run: NATS messages in per second (the server's /varz), CPU seconds per second of the
instances and of the whole stack (every process it started, nats-server included, from
/proc), and the batch's output tokens per second (emulated).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.cli import natsd
from tidal_bench.kit import stack

TICK_S = os.sysconf("SC_CLK_TCK")
WORDS = ("tide", "wave", "shore", "moon", "current", "reef", "harbor", "sail", "drift", "foam")


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process under `root`."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        todo += children.get(pid, [])
    return out


def cpu_s(pids: dict[int, str]) -> dict[int, float]:
    """pid -> user + system CPU seconds so far."""
    out = {}
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[pid] = (int(f[11]) + int(f[12])) / TICK_S  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return out


def varz(monitor: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def run_batch(base: str, args: argparse.Namespace) -> tuple[float, int, int]:
    """The batch's wall seconds, output tokens and completed lines."""
    import openai

    rng = random.Random(args.seed)
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    lines = []
    for i in range(args.lines):
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        body = {
            "model": "tidal-sim",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
        }
        line = {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions"}
        lines.append(json.dumps(line | {"body": body}))
    f = client.files.create(
        file=("b.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch"
    )
    t0 = time.monotonic()
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    wall_s = time.monotonic() - t0
    assert batch.output_file_id, f"batch {batch.status}: {batch.errors}"
    out = client.files.content(batch.output_file_id).text.splitlines()
    tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in out)
    return wall_s, tokens, len(out)


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="tidal-chunks-")
    port, monitor, api = natsd.free_port(), natsd.free_port(), natsd.free_port()
    argv = natsd.nats_server_argv(port, tmp, extra=["-m", str(monitor)])
    nats = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    up = ["--engine", "sim", "--nats-url", f"nats://127.0.0.1:{port}", "--config", args.config]
    up += ["--policy", args.policy, "--sim-step-model", args.sim_step_model, "--cpu-attn", "0"]
    try:
        natsd.wait_for_port("127.0.0.1", port, 10.0)
        with stack(api, *up, env={"TIDAL_OFFLINE_CHUNK_TOKENS": str(n)}) as base:
            procs = descendants(os.getpid())
            v0, c0 = varz(monitor), cpu_s(procs)
            wall_s, tokens, num_lines = run_batch(base, args)
            v1, c1 = varz(monitor), cpu_s(procs)
    finally:
        nats.terminate()
        nats.wait(timeout=30)

    def rate(kind: str) -> float:
        used = sum(c1[p] - c0[p] for p, cmd in procs.items() if kind in cmd and p in c1)
        return round(used / wall_s, 3)

    return {
        "offline_chunk_tokens": n,
        "lines": num_lines,
        "output_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "offline_tokens_per_s": round(tokens / wall_s, 1),  # emulated
        "nats_msgs_in_per_s": round((v1["in_msgs"] - v0["in_msgs"]) / wall_s, 1),
        "nats_msgs_out_per_s": round((v1["out_msgs"] - v0["out_msgs"]) / wall_s, 1),
        "instance_cpu_s_per_s": rate("services.instance"),
        "gateway_cpu_s_per_s": rate("services.gateway"),
        "batch_cpu_s_per_s": rate("services.batch"),
        "stack_cpu_s_per_s": rate(""),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chunk-tokens", default="1,32", help="TIDAL_OFFLINE_CHUNK_TOKENS values")
    p.add_argument("--lines", type=int, default=600, help="batch lines")
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per line")
    p.add_argument("--config", default="configs/ooco.yaml")
    p.add_argument("--policy", default="tidal")
    p.add_argument("--sim-step-model", default="qwen2.5-7b@a100-80gb", help="EMULATED timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the figures here")
    args = p.parse_args()
    runs = []
    for n in (int(x) for x in args.chunk_tokens.split(",")):
        runs.append(measure(n, args))
        print(json.dumps(runs[-1]), flush=True)
    report = {"emulated": True, "engine": "sim", "settings": vars(args), "runs": runs}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
