"""Time the torch engine's detokeniser over one long output, fed token by token as the engine
feeds it: `python scripts/bench_detok.py [--tokens 4096] [--stop STR]`. Uses the embedded SmolLM2
tokenizer (no model is loaded); prints total and per-token time, and checks the streamed text
equals one full decode."""

from __future__ import annotations

import argparse
import inspect
import time

from tidal.engine.detokenizer import Detokenizer
from tidal.engine.tokenizer import embedded_model_path, load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    args = p.parse_args()
    tok = load_tokenizer(embedded_model_path())
    base = "The tide comes in over the reef; gulls cry, naïve café 海 🌊.\n"
    ids = tok.encode(base * (args.tokens // len(tok.encode(base)) + 1))[: args.tokens]
    detok = Detokenizer(tok, args.stop)
    # The engine's call: the whole sequence with the output's bounds (no copy), where the
    # detokeniser has them; before, a fresh `seq.output_ids` list each step.
    bounded = "end" in inspect.signature(detok.update).parameters
    out: list[str] = []
    t0 = time.perf_counter()
    for n in range(1, len(ids) + 1):
        final = n == len(ids)
        if bounded:
            delta, _ = detok.update(ids, final, end=n)  # type: ignore[call-arg]
        else:
            delta, _ = detok.update(ids[:n], final)
        out.append(delta)
    dt = time.perf_counter() - t0
    assert "".join(out) == tok.decode(ids), "the streamed text differs from a full decode"
    print(f"{len(ids)} tokens: {dt * 1e3:.1f} ms total, {dt / len(ids) * 1e6:.1f} us/token")


if __name__ == "__main__":
    main()
