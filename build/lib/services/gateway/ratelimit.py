"""Per-key request rate limits: a token bucket per API key (per client address when the gateway
has no keys), `--rate-limit` requests a second with bursts of up to `--rate-burst`.

A request past its key's limit is answered 429 at once, in OpenAI's error body (`type:
"requests"`, `code: "rate_limit_exceeded"`) with `Retry-After`: the whole seconds until the
bucket holds a request again, so a client library that honours it (the openai client does)
retries when it will get in.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

MAX_BUCKETS = 10_000  # past this, buckets refilled to full are forgotten (they equal a new one)


@dataclass
class TokenBucket:
    """`burst` requests at once, refilled at `rate` a second; `now` is always an argument."""

    rate: float
    burst: float
    tokens: float
    updated_s: float

    def take(self, now_s: float) -> float:
        """0 if a request may go now (and count it); else the seconds until one may."""
        self.tokens = min(self.burst, self.tokens + (now_s - self.updated_s) * self.rate)
        self.updated_s = now_s
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def is_full(self, now_s: float) -> bool:
        return self.tokens + (now_s - self.updated_s) * self.rate >= self.burst


class RateLimiter:
    def __init__(self, rate: float, burst: float = 0.0) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"--rate-limit {rate} must be a positive number of requests/s")
        burst = burst or max(1.0, rate)
        if not (burst >= 1 and math.isfinite(burst)):
            raise ValueError(f"--rate-burst {burst} must be at least 1")
        self.rate = rate
        self.burst = burst
        self.buckets: dict[str, TokenBucket] = {}

    def check(self, who: str, now_s: float) -> float:
        """0 if `who` may make a request now; else the seconds to wait (nothing counted)."""
        bucket = self.buckets.get(who)
        if bucket is None:
            if len(self.buckets) >= MAX_BUCKETS:
                self._forget_full(now_s)
            bucket = self.buckets[who] = TokenBucket(self.rate, self.burst, self.burst, now_s)
        return bucket.take(now_s)

    def _forget_full(self, now_s: float) -> None:
        for who in [w for w, b in self.buckets.items() if b.is_full(now_s)]:
            del self.buckets[who]


def retry_after_header(wait_s: float) -> str:
    """Whole seconds, rounded up, at least 1 (RFC 9110's delay-seconds)."""
    return str(max(1, math.ceil(wait_s)))


def add_rate_args(p: argparse.ArgumentParser) -> None:
    """`--rate-limit` and `--rate-burst` (the gateway's, and `tidal up`'s to pass on)."""
    p.add_argument(
        "--rate-limit",
        type=float,
        default=0.0,
        help="requests/s per API key (per client address without keys), token bucket; 0: none",
    )
    p.add_argument(
        "--rate-burst",
        type=float,
        default=0.0,
        help="requests a key may make at once under --rate-limit (default: max(1, the rate))",
    )
