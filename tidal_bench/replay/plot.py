"""A figure of `tidal bench replay`'s results: live against the simulator, error per metric.

    python -m tidal_bench.replay.plot docs/results/fidelity/ooco.json \
        docs/results/fidelity/ooco-long.json -o docs/results/fidelity/fidelity.png

One panel per config; per metric and policy, the simulator's error against the live stack (% of
live; attainment in points) with the serving path as the window had it (solid) and with the idle
probe's (hatched), and the +-10 % band (+-2 points for attainment). Both sides are emulation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tidal_bench.replay.table import KEYS


def errors(run: dict[str, Any], side: str) -> list[float]:
    """The simulator's error against live per metric of KEYS (points for attainment, else %)."""
    out = []
    for key, _, _ in KEYS:
        live, sim = run["live"][key], run[side][key]
        out.append(sim - live if key.endswith("pct") else 100.0 * (sim / live - 1) if live else 0.0)
    return out


def markdown(report: dict[str, Any]) -> str:
    """The fidelity table of one config: metric -> live, simulator, error; one column group per
    policy (in brackets the error with the idle probe's serving path, and as configured)."""
    policies = list(report["runs"])
    head = "| metric | " + " | ".join(f"{p}: live / sim / error" for p in policies) + " |"
    lines = [head, "|---" * (len(policies) + 1) + "|"]
    for (key, name, nd), *errs in zip(
        KEYS, *(errors(report["runs"][p], "simulator") for p in policies), strict=True
    ):
        cells = []
        for p, err in zip(policies, errs, strict=True):
            run = report["runs"][p]
            live, sim = run["live"][key], run["simulator"][key]
            k = [k for k, _, _ in KEYS].index(key)
            pro = errors(run, "simulator_probe")[k] if "simulator_probe" in run else float("nan")
            raw = errors(run, "simulator_uncalibrated")[k]
            unit = " pt" if key.endswith("pct") else " %"
            cells.append(
                f"{live:.{nd}f} / {sim:.{nd}f} / **{err:+.1f}{unit}** "
                f"({pro:+.1f}{unit}; {raw:+.1f}{unit})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(reports: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(reports), figsize=(7 * len(reports), 4.5), squeeze=False)
    names = [name for _, name, _ in KEYS]
    for ax, rep in zip(axes[0], reports, strict=True):
        policies = list(rep["runs"])
        width = 0.8 / len(policies)
        x = np.arange(len(KEYS))
        for i, policy in enumerate(policies):
            run = rep["runs"][policy]
            pos = x - 0.4 + width * (i + 0.5)
            bars = ax.bar(pos, errors(run, "simulator"), width, label=f"{policy}")
            ax.bar(
                pos,
                errors(run, "simulator_probe" if "simulator_probe" in run else "simulator"),
                width,
                fill=False,
                hatch="//",
                edgecolor=bars.patches[0].get_facecolor(),
            )
        ax.axhspan(-10, 10, color="green", alpha=0.08)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(x, names, rotation=20)
        ax.set_ylabel("simulator vs live: % (attainment: points)")
        ax.set_title(
            f"{rep['config']}, {rep['duration_s']:.0f} s window (emulated, both sides)\n"
            "solid: serving path as in the window; hatched: the idle probe's"
        )
        ax.set_ylim(-35, 35)  # the hatched probe-only bars of a loaded window reach ~-30 %
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("reports", nargs="+", help="JSON files written by `tidal bench replay`")
    p.add_argument("-o", "--out", required=True, help="PNG to write")
    p.add_argument("--markdown", action="store_true", help="also print each table as Markdown")
    args = p.parse_args(argv)
    reports = [json.loads(Path(r).read_text()) for r in args.reports]
    plot(reports, args.out)
    if args.markdown:
        for rep in reports:
            print(f"{rep['config']}, first {rep['duration_s']:.0f} s:\n{markdown(rep)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
