"""The simulator's `online-priority` at one offline rate for several hand-out times
(`ClusterConfig.handout_ms`): offline tok/s and the relaxed instance's busy fraction over the
measured part of the window `tidal bench colocation --search-offline` uses (configs/ooco.yaml,
trace seconds 0-14, the first 4 s warm-up, 256 output tokens a line). Emulated figures.

    python docs/results/colocation/oprio_handout_sweep.py [--qps 16.5] [--lines 1692]
        [--handout-ms 0 7.4 10.6 31]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

from tidal.sim.build import simulate, with_offline_rate
from tidal_bench.colocation.search import write_config

WARMUP_S, MEASURE_S = 4, 10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--qps", type=float, default=16.5)
    p.add_argument("--lines", type=int, default=1692, help="batch lines in flight")
    p.add_argument("--handout-ms", type=float, nargs="+", default=[0, 7.4, 10.6, 31])
    args = p.parse_args()
    for ms in args.handout_ms:
        ns = argparse.Namespace(
            config="configs/ooco.yaml",
            set=["offline.max_output_tokens=256", f"handout_ms={ms}"],
            warmup_s=WARMUP_S,
            measure_s=MEASURE_S,
        )
        cfg, _ = write_config(ns, tempfile.mkdtemp())
        cfg = with_offline_rate(cfg, args.qps)
        cfg = dataclasses.replace(cfg, batch_max_inflight=args.lines, bin_s=1.0)
        rec = simulate(cfg, "online-priority")
        end = WARMUP_S + MEASURE_S
        busy = sum(rec.busy_s[0][WARMUP_S:end]) / MEASURE_S
        tok = sum(rec.offline_tokens[WARMUP_S:end]) / MEASURE_S
        print(f"handout {ms:5.1f} ms: {tok:7.1f} offline tok/s, relaxed instance busy {busy:.3f}")


if __name__ == "__main__":
    main()
