"""Arrival processes and OOCO's trace scaling. All take a seeded `numpy.random.Generator`."""

from __future__ import annotations

import numpy as np


def poisson_arrivals(rate: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of a Poisson process of `rate` req/s on [0, duration_s)."""
    return gamma_arrivals(rate, 1.0, duration_s, rng)


def gamma_arrivals(
    rate: float, cv: float, duration_s: float, rng: np.random.Generator
) -> np.ndarray:
    """Arrivals with Gamma inter-arrival gaps of mean 1/rate and coefficient of variation `cv`
    (cv=1 is Poisson; cv>1 is burstier)."""
    if rate <= 0 or duration_s <= 0:
        return np.zeros(0)
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    shape = 1.0 / (cv * cv)
    n = int(rate * duration_s * 1.5 + 20 * np.sqrt(rate * duration_s + 1) + 10)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    t = np.cumsum(gaps)
    while t[-1] < duration_s:  # rare: draw more
        more = np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=n)) + t[-1]
        t = np.concatenate([t, more])
    return t[t < duration_s]


def uniform_arrivals(rate: float, duration_s: float) -> np.ndarray:
    """Evenly spaced arrivals at `rate` req/s on [0, duration_s) (OOCO §5.2 offline load)."""
    if rate <= 0 or duration_s <= 0:
        return np.zeros(0)
    n = int(np.ceil(rate * duration_s - 1e-9))
    return np.arange(n) / rate


def scale_trace(
    arrival_s: np.ndarray, factor: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """OOCO §5.1.3 trace scaling by `factor` (new rate / old rate), keeping the burst shape.

    Returns (arrival times, source row per arrival). factor < 1 drops each request with
    probability 1 - factor; factor > 1 keeps every request and adds, after each, copies whose
    timestamps are interpolated towards the next arrival and whose lengths are taken from
    random rows, so a 5-minute spike stays a 5-minute spike and the peak/trough ratio holds.
    """
    if factor <= 0:
        raise ValueError(f"scale factor must be > 0, got {factor}")
    n = len(arrival_s)
    if n == 0:
        return arrival_s.copy(), np.zeros(0, dtype=np.int64)
    if factor <= 1:
        keep = rng.random(n) < factor
        return arrival_s[keep], np.nonzero(keep)[0]
    base = int(np.floor(factor))
    copies = np.full(n, base, dtype=np.int64)  # arrivals per original request, itself included
    copies += rng.random(n) < (factor - base)
    nxt = np.empty(n)
    nxt[:-1] = arrival_s[1:]
    # The last request has no successor: interpolate over the mean gap.
    nxt[-1] = arrival_s[-1] + (arrival_s[-1] - arrival_s[0]) / max(n - 1, 1)
    owner = np.repeat(np.arange(n), copies)
    offset = np.arange(len(owner)) - np.repeat(np.cumsum(copies) - copies, copies)
    frac = offset / np.repeat(copies, copies)
    times = arrival_s[owner] + frac * (nxt[owner] - arrival_s[owner])
    rows = np.where(offset == 0, owner, rng.integers(0, n, size=len(owner)))
    return times, rows
