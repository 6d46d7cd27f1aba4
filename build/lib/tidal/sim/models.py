"""The CPU-attention workers' latency model (the linear step model is `tidal.perf.linear`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CpuAttnRoofline:
    """Decode attention on CPU workers is memory bound (OmniServe §3.2): it streams each
    request's KV once per step. time = overhead + KV bytes / (workers * bytes/s per worker).

    Plausibility of the defaults (OmniServe §4, §5.1.1: one Xeon Gold 6342 per CPU server, 8
    channels of DDR4-3200 = 204.8 GB/s peak, AVX-512 attention): 100 GB/s sustained per worker
    is about half of peak; 2 ms per step covers the queue and residual-store work (§5.3,
    Fig. 19(a): <= 75 us, 0.5 ms residual loads at 400 requests) plus the q/k/v and result
    round trips. Yi-34B (GQA, 8 KV heads x 128, 60 layers, BF16) streams 245,760 B per context
    token, so 4 workers read about 1.6 M context tokens/s: ~550 decode tokens/s at 3k context.
    Simplifications: the workers are one pool shared by the node's instances (§4 gives each GPU
    worker its own share); one CPU batch rides one GPU step (§3.2.3 runs them asynchronously,
    layer by layer); the one-shot KV copy to the host is timed at PCIe speed inside the step
    that offloads (§3.2.4 overlaps it; remote workers would receive it over 100 Gbps RoCE)."""

    kv_bytes_per_token: float  # all layers, K and V
    bytes_per_s_per_worker: float = 100e9  # sustained host memory bandwidth of one worker
    overhead_s: float = 0.002  # per step: queueing, the residual store, PCIe round trip

    def attn_s(self, num_reqs: int, context_tokens: int, num_workers: int) -> float:
        if num_reqs == 0:
            return 0.0
        bw = max(num_workers, 1) * self.bytes_per_s_per_worker
        return self.overhead_s + context_tokens * self.kv_bytes_per_token / bw
