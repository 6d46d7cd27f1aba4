"""What a run leaves behind: per-request states, counters and time series (no analysis here)."""

from __future__ import annotations

from collections import Counter

from tidal.policy.state import ReqState


class Recorder:
    """Counters and per-bin series filled in by the simulator as it runs."""

    def __init__(self, num_instances: int, bin_s: float) -> None:
        self.bin_s = bin_s
        self.num_instances = num_instances
        self.requests: list[ReqState] = []
        self.end_s = 0.0
        self.num_steps = 0
        self.num_spans = 0
        self.num_preemptions = 0
        self.num_layer_preemptions = 0  # steps cut at a layer boundary (OOCO §3.4.1)
        self.num_layer_cut_tokens = 0  # prefill tokens in those steps (resumed later, kept)
        self.num_swaps = 0
        self.num_recompute_lost_tokens = 0  # KV tokens recompute preemptions dropped
        self.num_releases = 0  # checkpointed offline requests whose GPU blocks were freed
        self.num_checkpoint_tokens = 0  # KV tokens copied to host by checkpoints
        self.num_checkpoint_lost_tokens = 0  # tokens past a checkpoint released (recomputed)
        self.num_restored_tokens = 0  # tokens copied back from checkpoints
        self.num_preempt_signals = 0  # preempt signals taken in (`preempt_for_online`)
        self.num_preempt_signal_victims = 0  # requests they preempted
        self.num_class_evictions = 0  # online requests a higher class evicted on its instance
        self.num_offloads = 0
        self.num_migrations = 0
        self.num_migrations_refused = 0
        self.num_kv_transfers = 0
        self.rejections: Counter[str] = Counter()
        self.num_batch_queued = 0  # offline lines still waiting for a batch place at the end
        self.tbt_s: list[float] = []  # step times of steps that carried online decodes
        self.tbt_weight: list[int] = []  # online decodes in that step (samples it stands for)
        self.online_tokens: list[int] = []  # per bin: online tokens generated
        self.offline_tokens: list[int] = []  # per bin: offline tokens generated
        self.busy_s: list[list[float]] = [[] for _ in range(num_instances)]  # per instance, bin

    def _grow(self, b: int) -> None:
        while len(self.online_tokens) <= b:
            self.online_tokens.append(0)
            self.offline_tokens.append(0)
            for s in self.busy_s:
                s.append(0.0)

    def record_span(
        self,
        inst_id: int,
        start_s: float,
        bounds: list[float],
        k: int,
        num_online_decodes: int,
        online_tokens: int,
        offline_tokens: int,
    ) -> None:
        self.num_spans += 1
        self.num_steps += k
        end = bounds[k - 1]
        b = int(end / self.bin_s)
        self._grow(b)
        self.online_tokens[b] += online_tokens
        self.offline_tokens[b] += offline_tokens
        # Busy time, split over the bins the span covers.
        busy = self.busy_s[inst_id]
        t = start_s
        while t < end:
            bb = int(t / self.bin_s)
            nxt = min(end, (bb + 1) * self.bin_s)
            self._grow(bb)
            busy[bb] += nxt - t
            t = nxt
        if num_online_decodes:
            prev = start_s
            for j in range(k):
                self.tbt_s.append(bounds[j] - prev)
                self.tbt_weight.append(num_online_decodes)
                prev = bounds[j]
