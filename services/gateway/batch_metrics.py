"""Prometheus metrics of the Batch API, from the batch service's `BatchStats` (once a second while
batches run or lines are queued or in flight, else every `IDLE_STATS_S`: services/batch/main.py).

Counters in `BatchStats` count since that process started; a restart (a new `started_unix_s`)
is added on, so `tidal_batch_lines_total`, `tidal_batch_output_tokens_total` and
`tidal_batch_generated_tokens_total` only grow.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from tidal.batch.objects import ALL_STATUSES
from tidal.schemas.messages import BatchStats


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Gauge("tidal_batches", "Batches by status", ["status"], registry=registry)
        self.lines_queued = Gauge(
            "tidal_batch_lines_queued",
            "Batch lines waiting on the work queue, not taken yet",
            registry=registry,
        )
        self.lines_in_flight = Gauge(
            "tidal_batch_lines_in_flight", "Batch lines running in the cluster", registry=registry
        )
        self.lines = Counter(
            "tidal_batch_lines",
            "Batch lines finished with a stored result, by outcome (completed or failed)",
            ["outcome"],
            registry=registry,
        )
        self.output_tokens = Counter(
            "tidal_batch_output_tokens",
            "Output tokens generated for batch lines (rate() gives the batch path's tokens/s)",
            registry=registry,
        )
        self.generated_tokens = Counter(
            "tidal_batch_generated_tokens",
            "Output tokens of batch lines as they are generated, retried and cancelled lines "
            "included (rate() over a short window: the batch path's decode rate)",
            registry=registry,
        )
        self.oldest_job_age = Gauge(
            "tidal_batch_oldest_job_age_seconds",
            "Age of the oldest batch line still on the work queue (0 when none)",
            registry=registry,
        )
        self._last: dict[str, BatchStats] = {}  # service id -> its previous stats

    def on_stats(self, st: BatchStats) -> None:
        prev = self._last.get(st.service_id)
        if prev is None or prev.started_unix_s != st.started_unix_s:
            prev = None  # first stats from this process: all of its counts are new
        done = st.lines_done_total - (prev.lines_done_total if prev else 0)
        failed = st.lines_failed_total - (prev.lines_failed_total if prev else 0)
        tokens = st.output_tokens_total - (prev.output_tokens_total if prev else 0)
        self.lines.labels("completed").inc(max(0, done - failed))
        self.lines.labels("failed").inc(max(0, failed))
        self.output_tokens.inc(max(0, tokens))
        gen = st.generated_tokens_total - (prev.generated_tokens_total if prev else 0)
        self.generated_tokens.inc(max(0, gen))
        self._last[st.service_id] = st
        for status in ALL_STATUSES:
            self.batches.labels(status).set(st.batches_by_status.get(status, 0))
        self.lines_queued.set(st.lines_queued)
        self.lines_in_flight.set(st.lines_in_flight)
        self.oldest_job_age.set(st.oldest_job_age_s)
