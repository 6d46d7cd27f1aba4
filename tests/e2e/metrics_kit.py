"""The gateway's Prometheus samples, read the way the end-to-end tests assert on them."""

from __future__ import annotations

import urllib.request


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on `base`/metrics whose labels include `labels`."""
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
