"""The gateway's Prometheus samples, read the way the end-to-end tests assert on them."""

from __future__ import annotations

from tidal_bench.kit import metric_samples


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on `base`/metrics whose labels include `labels`."""
    return sum(
        value
        for sample, have, value in metric_samples(base)
        if sample == name and all(have.get(k) == v for k, v in labels.items())
    )
