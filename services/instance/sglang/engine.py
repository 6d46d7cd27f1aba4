"""`--engine sglang`: a `ControllableEngine` whose steps run in a real SGLang server.

SGLang runs its own continuous-batching loop; this engine cannot plan its steps. What the
policy's `StepPlan` controls here (docs/sglang.md):

- **admission**: a request enters SGLang only once a plan names it (`prefill` or `decode`), so
  the policy's per-step budget becomes how many requests (offline ones above all) the worker
  lets into SGLang at a time; FCFS (`plan=None`) admits everything waiting;
- **class -> priority**: online requests go in with a higher SGLang priority, so SGLang's
  scheduler lets them retract offline work (`services.instance.sglang.api.PRIORITY`);
- **preempt / swap_out** (recompute): abort in SGLang, keep the tokens generated, wait again;
  re-admission sends prompt + generated ids as input and asks only for the rest;
- **migration** (push and pull) is recompute too (as NVIDIA Dynamo's request migration):
  `export_request` aborts at the source and carries token ids and text position, not KV;
  `import_request` resubmits at the target at once, plan or not (the torch engine's
  imported request arrives running, and the policy treats it so); `swap_in` likewise. Over a
  prefill/decode pair (`pd.PdPairClient`) every submission is also pushed from the prefill
  server to the decode server by SGLang's own KV transfer.

A step hands out whatever tokens the streams brought since the last one, waiting up to
`poll_s` for the first. Text is detokenised here with Tidal's tokenizer and stop strings are
cut here (`tidal.engine.torch.sampling.Detokenizer`), so the text is what the torch engine would
stream for the same tokens, and a recompute never repeats text. The requests' submissions and
their streams are kept in `streams.SglangStreams`, this engine's base.
"""

from __future__ import annotations

import threading
import time

from services.instance.sglang.api import RecomputePayload
from services.instance.sglang.client import SglangClient
from services.instance.sglang.streams import SglangReq, SglangStreams
from tidal.engine.api import (
    EngineLoad,
    EngineRequest,
    RequestClass,
    SeqSnapshot,
    StepPlan,
    StepResult,
    StepTelemetry,
    Tokenizer,
    check_fits,
)
from tidal.engine.detokenizer import Detokenizer
from tidal.plan import EngineCapabilities, MigrationMode, PlanRefused, RefusalReason


class SglangEngine(SglangStreams):
    """`ControllableEngine` over `SglangClient`; calls come from one thread at a time."""

    name = "sglang"
    is_emulated = False
    block_size = 1  # SGLang's token-granular KV pool
    last_step_preempted = False  # SGLang's priority preemption happens inside SGLang
    last_preempt_latency_s: float | None = None
    self_driven = True  # streams run by themselves: step even when the plan is empty
    migration_mode = "recompute"

    def __init__(
        self,
        client: SglangClient,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        num_kv_tokens: int,
        kv_bytes_per_token: float = 0.0,
        poll_s: float = 0.02,
    ) -> None:
        super().__init__(client)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.poll_s = poll_s
        self._wake = threading.Event()

    # ---- Engine ----

    def add(self, request: EngineRequest) -> None:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        check_fits(n, request.sampling.max_tokens, self.max_model_len)
        if request.req_id in self.reqs:
            raise ValueError(f"duplicate request {request.req_id}")
        self.reqs[request.req_id] = SglangReq(
            request, Detokenizer(self.tokenizer, request.sampling.stop)
        )

    def abort(self, req_id: str) -> bool:
        r = self.reqs.pop(req_id, None)
        if r is None:
            return False
        self._stop_submission(r)
        return True

    def has_work(self) -> bool:
        return bool(self.reqs)

    def load(self) -> EngineLoad:
        running = sum(1 for r in self.reqs.values() if r.rid)
        online = sum(1 for r in self.reqs.values() if r.req.req_class is RequestClass.ONLINE)
        sl = self.client.load
        total = sl.max_total_tokens or self.num_kv_blocks
        return EngineLoad(
            num_running=max(running, sl.num_running),
            num_waiting=(len(self.reqs) - running) + sl.num_waiting,
            num_kv_blocks_used=sl.num_used_tokens if sl.max_total_tokens else self._used(),
            num_kv_blocks_total=total,
            num_online=online,
            num_offline=len(self.reqs) - online,
        )

    def info(self) -> dict[str, str]:
        """SGLang's own load, for the heartbeat. `migration_mode` is that of Tidal's migrate
        and pull commands; `sglang_retractions_total` counts SGLang's own priority
        preemptions; a PD pair adds its prefill -> decode handoffs (`PdPairClient`)."""
        sl = self.client.load
        return {
            "sglang_url": self.client.base_url,
            "sglang_token_usage": f"{sl.token_usage:.4f}",
            "sglang_gen_throughput": f"{sl.gen_throughput:.1f}",
            "sglang_running": str(sl.num_running),
            "sglang_waiting": str(sl.num_waiting),
            "migration_mode": self.migration_mode,
            "sglang_retractions_total": str(self.num_sglang_retractions),
            **self.client.info(),
        }

    # ---- stepping ----

    def step(self, plan: StepPlan | None = None) -> StepResult:
        t0 = time.perf_counter()
        admit = (
            [rid for rid, r in self.reqs.items() if not r.rid]
            if plan is None
            else [rid for rid in (*plan.prefill, *plan.decode) if rid in self.reqs]
        )
        num_prefill = 0
        for req_id in admit:
            r = self.reqs[req_id]
            if not r.rid:
                num_prefill += self._submit(r)
        if not self.client.arrived.is_set():
            self._wait_for_tokens()
        self._wake.clear()  # a wake after this ends the next step's wait at once
        self.client.arrived.clear()
        events = self._drain()
        num_decode = sum(len(e.token_ids) for e in events)
        tel = StepTelemetry(
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_context_tokens=self._used(),
            num_requests=sum(1 for r in self.reqs.values() if r.rid) + len(events),
            step_s=time.perf_counter() - t0,
        )
        return StepResult(events, tel)

    def _wait_for_tokens(self) -> None:
        deadline = time.monotonic() + self.poll_s
        while not self.client.arrived.is_set() and not self._wake.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.client.arrived.wait(min(left, 0.005))

    def wake_step(self) -> None:
        """Thread-safe: end the running step's wait for tokens (new work is waiting)."""
        self._wake.set()

    def request_layer_cut(self) -> bool:
        """An online request arrived: end the step's wait so it is admitted now. SGLang's
        priority scheduling then retracts offline work itself; nothing is cut here."""
        self._wake.set()
        return any(r.rid and r.req.req_class is RequestClass.OFFLINE for r in self.reqs.values())

    # ---- ControllableEngine: recompute in place of KV moves ----

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            migration=MigrationMode.RECOMPUTE,
            swap_is_recompute=True,  # SGLang's KV cannot leave it: a swap is an abort
            priority=True,  # SGLang's priority scheduling retracts offline work itself
            self_driven=True,
        )

    def offload(self, req_id: str) -> None:
        raise PlanRefused(RefusalReason.NO_CPU_ATTENTION, "SGLang has no CPU-attention path")

    def recall(self, req_id: str) -> None:
        raise PlanRefused(RefusalReason.NO_CPU_ATTENTION, "SGLang has no CPU-attention path")

    def recompute(self, req_id: str) -> None:
        r = self._get(req_id)
        if r.rid:
            self._stop_submission(r)
            self.num_recomputes += 1

    def swap_out(self, req_id: str) -> None:
        """SGLang's KV cannot be moved out over its API: a swap is a recompute here."""
        self.recompute(req_id)

    def swap_in(self, req_id: str) -> None:
        """Back into SGLang now (a recompute of prompt + generated ids): the plan that swaps a
        request in counts it as running from then on, as the torch engine's does."""
        r = self._get(req_id)
        if not r.rid:
            self._submit(r)

    def export_request(self, req_id: str, remove: bool = True) -> bytes:
        r = self._get(req_id)
        data = RecomputePayload(
            self.model_name, r.req, r.output_ids, r.logprobs, r.detok.emitted
        ).encode()
        if remove:
            self.reqs.pop(req_id, None)
            self._stop_submission(r)
            self.num_recomputes += 1
        return data

    def import_request(self, data: bytes) -> None:
        p = RecomputePayload.decode(data)
        if p.model != self.model_name:
            raise ValueError(f"payload is for model {p.model!r}, not {self.model_name!r}")
        if p.req.req_id in self.reqs:
            raise ValueError(f"duplicate request {p.req.req_id}")
        r = SglangReq(
            p.req, Detokenizer(self.tokenizer, p.req.sampling.stop), p.output_ids, p.logprobs
        )
        r.detok.emitted = p.emitted  # the text the client already has
        self.reqs[p.req.req_id] = r
        # the scheduler placed it here running: into SGLang now, not when a plan names it (a
        # strict instance's OOCO plan admits no online prefill, so waiting for one would leave
        # a pushed request waiting for ever)
        self._submit(r)

    def snapshot(self) -> list[SeqSnapshot]:
        """Waiting here: no KV. In SGLang: running, and SGLang owns its prefill. Once a token
        came, its whole context counts as computed (the policy sees it decoding); before, all
        but one token (the policy sees a prefill one token from done, which it can plan but
        not stall on: a prefill with nothing left would be a request the policy can neither
        prefill nor decode, and OOCO's relaxed step preempts such a "stuck" one, which
        here resubmitted and aborted it every step)."""
        out = []
        for rid, r in self.reqs.items():
            n = len(r.req.prompt_token_ids) + len(r.output_ids)
            running = bool(r.rid)
            computed = (n if r.output_ids else n - 1) if running else 0
            out.append(
                SeqSnapshot(
                    req_id=rid,
                    req_class=r.req.req_class,
                    arrival_s=r.req.arrival_s,
                    num_prompt_tokens=len(r.req.prompt_token_ids),
                    max_output_tokens=r.req.sampling.max_tokens,
                    num_computed_tokens=computed,
                    num_output_tokens=len(r.output_ids),
                    num_blocks=n if running else 0,
                    status="running" if running else "waiting",
                )
            )
        return out

    def num_free_blocks(self) -> int:
        return max(0, self.num_kv_blocks - self._used())

    def close(self) -> None:
        for r in list(self.reqs.values()):
            self._stop_submission(r)
        self.client.close()
