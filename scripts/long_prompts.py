"""Long-prompt load for a running Tidal gateway: N concurrent streamed chats whose prompts are
STEP, 2*STEP, ... N*STEP tokens (one word per token in SmolLM2's tokenizer), `max_tokens` 100,
`ignore_eos`, a 30 s TTFT SLO; prints per-request outcome and a summary.

    python scripts/long_prompts.py http://127.0.0.1:8000/v1 --n 10 --step 3300
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import time

import openai

WORDS = [" tide", " moon", " sea", " salt", " wave", " shore", " foam", " reef"]


def one(base: str, model: str, num_tokens: int, max_tokens: int, seed: int) -> dict[str, object]:
    client = openai.OpenAI(base_url=base, api_key="none", timeout=600, max_retries=0)
    prompt = "".join(WORDS[(seed + i) % len(WORDS)] for i in range(num_tokens))
    t0 = time.perf_counter()
    ttft, n, error = None, 0, ""
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "slo_ttft_ms": 30_000},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
    except openai.OpenAIError as exc:
        error = str(exc)[:160]
    return {
        "tokens": num_tokens,
        "ttft_s": ttft,
        "output": n,
        "s": time.perf_counter() - t0,
        "error": error,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("base_url")
    p.add_argument("--model", default="tidal-sim")
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--step", type=int, default=3300)
    p.add_argument("--max-tokens", type=int, default=100)
    args = p.parse_args()
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.n) as pool:
        sizes = [args.step * (i + 1) for i in range(args.n)]
        rows = list(
            pool.map(
                lambda a: one(args.base_url, args.model, a[1], args.max_tokens, a[0]),
                enumerate(sizes),
            )
        )
    wall = time.perf_counter() - t0
    for r in rows:
        print(r)
    done = sum(r["output"] == args.max_tokens and not r["error"] for r in rows)
    print(f"{done}/{args.n} finished with all {args.max_tokens} tokens in {wall:.1f} s")


if __name__ == "__main__":
    main()
