"""A workload: an online stream and an offline stream, each request tagged with class and SLO."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tidal.policy.state import Slo
from tidal.schemas.enums import RequestClass
from tidal.workload.arrivals import gamma_arrivals, scale_trace, uniform_arrivals
from tidal.workload.traces import load_trace

ARRIVALS = ("trace", "poisson", "gamma", "uniform")


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload, before it reaches the cluster."""

    req_id: str
    req_class: RequestClass
    arrival_s: float  # seconds from the start of the run
    input_tokens: int
    output_tokens: int  # the request stops after exactly this many tokens
    slo: Slo | None = None  # online requests only
    class_name: str = ""  # its request class (`tidal.config.classes`) when the run has a table


@dataclass(frozen=True)
class StreamConfig:
    """One request stream (online or offline)."""

    source: str  # CSV file: a trace (arrival_s,...) or a length table; bare names: data dir
    arrival: str = "trace"  # trace | poisson | gamma | uniform
    rate: float | None = None  # req/s: the process rate, or for `trace` the target mean rate
    scale: float | None = None  # `trace` only: OOCO §5.1.3 rate factor (instead of `rate`)
    cv: float = 1.0  # `gamma`: coefficient of variation of the inter-arrival gaps
    start_s: float = 0.0  # `trace`: where in the trace the window starts, seconds
    max_input_tokens: int | None = None  # drop longer prompts (TaiChi §4.1 filters outliers)
    max_output_tokens: int | None = None  # clip outputs to this many tokens
    max_total_tokens: int | None = None  # drop requests whose input + output exceed this
    max_requests: int | None = None  # keep only the first N arrivals
    # multiply every prompt's length (before the filters): a long-context variant of a trace
    # with its own arrival times (e.g. the Azure conversation trace's prompts x6, capped by
    # `max_input_tokens`, for long-prompt traffic at a real arrival pattern)
    input_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival != "trace" and (self.rate is None or self.rate < 0):
            raise ValueError(f"arrival {self.arrival!r} needs rate >= 0 (req/s)")
        if self.rate is not None and self.scale is not None:
            raise ValueError("give rate or scale, not both")
        if self.scale is not None and self.scale <= 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if self.input_scale <= 0:
            raise ValueError(f"input_scale must be > 0, got {self.input_scale}")
        if self.cv <= 0:
            raise ValueError(f"cv must be > 0, got {self.cv}")
        if self.start_s < 0:
            raise ValueError(f"start_s must be >= 0, got {self.start_s}")
        for name in ("max_input_tokens", "max_output_tokens", "max_total_tokens", "max_requests"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")


def build_stream(
    cfg: StreamConfig,
    req_class: RequestClass,
    duration_s: float,
    rng: np.random.Generator,
    slo: Slo | None = None,
) -> list[SimRequest]:
    """The requests of one stream arriving in [0, duration_s)."""
    tr = load_trace(cfg.source)
    inp, out = tr.input_tokens, tr.output_tokens
    if cfg.input_scale != 1.0:
        inp = np.maximum(1, np.round(inp * cfg.input_scale)).astype(inp.dtype)
    ok = np.ones(len(tr), dtype=bool)
    if cfg.max_input_tokens is not None:
        ok &= inp <= cfg.max_input_tokens
    if cfg.max_total_tokens is not None:
        ok &= inp + out <= cfg.max_total_tokens
    if cfg.arrival == "trace":
        if tr.arrival_s is None:
            raise ValueError(f"{tr.name} has no timestamps; use arrival poisson|gamma|uniform")
        a = tr.arrival_s
        win = ok & (a >= cfg.start_s) & (a < cfg.start_s + duration_s)
        idx = np.nonzero(win)[0]
        t0 = a[idx] - cfg.start_s
        factor = cfg.scale
        if cfg.rate is not None:
            native = len(idx) / duration_s if duration_s > 0 else 0.0
            factor = cfg.rate / native if native > 0 else 1.0
        if factor is not None and factor != 1.0:
            t0, rows = scale_trace(t0, factor, rng)
            idx = idx[rows]
        times = t0
    else:
        rate = float(cfg.rate or 0.0)
        if cfg.arrival == "uniform":
            times = uniform_arrivals(rate, duration_s)
        else:
            cv = 1.0 if cfg.arrival == "poisson" else cfg.cv
            times = gamma_arrivals(rate, cv, duration_s, rng)
        pool = np.nonzero(ok)[0]
        if len(pool) == 0:
            raise ValueError(f"{tr.name}: no rows left after the length filters")
        idx = rng.choice(pool, size=len(times))
    if cfg.max_requests is not None:
        times, idx = times[: cfg.max_requests], idx[: cfg.max_requests]
    outs = out[idx]
    if cfg.max_output_tokens is not None:
        outs = np.minimum(outs, cfg.max_output_tokens)
    tag = "on" if req_class is RequestClass.ONLINE else "off"
    cols = zip(times.tolist(), inp[idx].tolist(), outs.tolist(), strict=True)
    return [
        SimRequest(f"{tag}-{k}", req_class, float(t), int(i), int(o), slo)
        for k, (t, i, o) in enumerate(cols)
    ]


def build_workload(
    online: StreamConfig | None,
    offline: StreamConfig | None,
    duration_s: float,
    seed: int,
    online_slo: Slo | None = None,
) -> list[SimRequest]:
    """Both streams merged by arrival time (online first on ties). Same seed, same workload."""
    rng_on = np.random.default_rng([seed, 1])  # independent streams: changing the offline
    rng_off = np.random.default_rng([seed, 2])  # load leaves the online requests unchanged
    reqs: list[SimRequest] = []
    if online is not None:
        reqs += build_stream(online, RequestClass.ONLINE, duration_s, rng_on, online_slo)
    if offline is not None:
        reqs += build_stream(offline, RequestClass.OFFLINE, duration_s, rng_off)
    reqs.sort(key=lambda r: (r.arrival_s, r.req_class is not RequestClass.ONLINE))
    return reqs
