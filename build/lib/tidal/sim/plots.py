"""PNG plots of simulated runs and searches (matplotlib, Agg backend). Every title says
"simulated"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tidal.sim.metrics import online_arrays
from tidal.sim.recorder import Recorder

TAG = "(simulated)"


def _cdf(ax: Any, x: np.ndarray, label: str, slo: float | None) -> None:
    x = np.sort(x[~np.isnan(x)])
    if len(x):
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)
    if slo is not None:
        ax.axvline(slo, color="red", ls="--", lw=1, label=f"SLO {slo:g} s")
    ax.set_ylabel("fraction of online requests")
    ax.grid(alpha=0.3)
    ax.legend()


def run_plots(
    rec: Recorder, out: Path, title: str, duration_s: float, slo: tuple[float, float]
) -> list[str]:
    """Latency CDFs and time series of one run; returns the file names written."""
    on = online_arrays(rec.requests)
    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _cdf(axes[0], on["ttft"], "TTFT", slo[0])
    axes[0].set_xlabel("TTFT (s)")
    _cdf(axes[1], on["tpot"], "TPOT", slo[1])
    axes[1].set_xlabel("TPOT (s)")
    fig.suptitle(f"{title}: online latency CDFs {TAG}")
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)
    plt.close(fig)
    files.append("latency_cdf.png")

    nb = max(1, int(np.ceil(duration_s / rec.bin_s)))
    t = (np.arange(nb) + 0.5) * rec.bin_s
    pad = lambda xs: np.array((list(xs) + [0] * nb)[:nb], dtype=float)  # noqa: E731
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    axes[0].plot(t, pad(rec.online_tokens) / rec.bin_s, label="online")
    axes[0].plot(t, pad(rec.offline_tokens) / rec.bin_s, label="offline")
    axes[0].set_ylabel("generated tokens/s")
    axes[0].legend()
    if len(on["arrival"]):
        b = np.minimum((on["arrival"] / rec.bin_s).astype(int), nb - 1)
        n = np.bincount(b, minlength=nb)
        ok = np.bincount(b, weights=on["ok"].astype(float), minlength=nb)
        att = np.where(n > 0, 100 * ok / np.maximum(n, 1), np.nan)
        axes[1].plot(t, att, label="SLO attainment (by arrival)")
        axes[1].plot(t, n / rec.bin_s, label="online arrivals/s", alpha=0.6)
        axes[1].legend()
    axes[1].set_ylabel("% / req/s")
    for i, busy in enumerate(rec.busy_s):
        axes[2].plot(t, 100 * pad(busy) / rec.bin_s, label=f"instance {i}")
    axes[2].set_ylabel("busy %")
    axes[2].set_xlabel("time (s)")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: throughput, SLO attainment, utilisation over time {TAG}")
    fig.tight_layout()
    fig.savefig(out / "timeseries.png", dpi=110)
    plt.close(fig)
    files.append("timeseries.png")
    return files


def search_plot(
    results: dict[str, list[tuple[float, float, float]]],
    out: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    threshold: float,
    best: dict[str, float],
    fname: str,
    ylabel2: str = "",
) -> str:
    """Left: one line per policy through its probes (load, metric), the threshold and each
    policy's answer (dotted). Right: the probes' throughput (load, third value). For
    max-offline this is OOCO Fig. 6: online violation % against offline load."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for pol, pts in results.items():
        pts = sorted(pts)
        xs = [p[0] for p in pts]
        line = ax.plot(xs, [p[1] for p in pts], marker="o", label=pol)[0]
        ax.axvline(best[pol], color=line.get_color(), ls=":", lw=1)
        ax2.plot(xs, [p[2] for p in pts], marker="o", label=pol, color=line.get_color())
    ax.axhline(threshold, color="red", ls="--", lw=1, label=f"threshold {threshold:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax2.set_xlabel(xlabel)
    ax2.set_ylabel(ylabel2)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"{title} {TAG}")
    fig.tight_layout()
    fig.savefig(out / fname, dpi=110)
    plt.close(fig)
    return fname
