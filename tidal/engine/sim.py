"""The `sim` engine: an emulated instance engine for tests, demos and cluster experiments.

It batches like a real engine (continuous batching, chunked prefill, online before offline, a KV
pool in blocks) but runs no model: output tokens are deterministic words chosen from the prompt's
hash, and each step's duration comes from a latency model (`tidal.perf.api.StepModel`). Its
timings are *emulated*: `is_emulated` is True, and the instance service labels every response and
metric accordingly.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

from tidal.engine.api import (
    EngineLoad,
    EngineRequest,
    FinishReason,
    RequestClass,
    StepResult,
    StepTelemetry,
    TokenEvent,
    Tokenizer,
)
from tidal.perf.api import BatchShape, StepModel

_WORDS = [
    "tide",
    "ebb",
    "flow",
    "wave",
    "shore",
    "moon",
    "current",
    "surf",
    "swell",
    "reef",
    "harbor",
    "sail",
    "drift",
    "foam",
    "coral",
    "kelp",
    "gull",
    "buoy",
    "anchor",
    "beacon",
]
_WORD_BASE = 256  # ids 0..255 are bytes; 256.. are whole words


class SimTokenizer:
    """Byte-level tokenizer with a few whole-word tokens for the emulated output."""

    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        out: list[str] = []
        raw = bytearray()
        for tid in token_ids:
            if tid < _WORD_BASE:
                raw.append(tid)
                continue
            if raw:
                out.append(raw.decode("utf-8", errors="replace"))
                raw.clear()
            out.append(" " + _WORDS[(tid - _WORD_BASE) % len(_WORDS)])
        if raw:
            out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        turns = [f"<|{m['role']}|>{m['content']}\n" for m in messages]
        return "".join(turns) + "<|assistant|>"


@dataclass(frozen=True)
class LinearStepModel:
    """step_s = base_s + prefill_token_s*P + decode_req_s*D + context_token_s*C (emulation)."""

    base_s: float = 0.008  # fixed cost of a step (kernel launches, sampling)
    prefill_token_s: float = 0.00008  # per new prompt token
    decode_req_s: float = 0.0002  # per decoding request
    context_token_s: float = 0.0000005  # per KV token read by decode attention

    def __post_init__(self) -> None:
        for name in ("base_s", "prefill_token_s", "decode_req_s", "context_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"LinearStepModel.{name} must be >= 0")

    def step_s(self, batch: BatchShape) -> float:
        if batch.num_tokens == 0:
            return 0.0
        return (
            self.base_s
            + self.prefill_token_s * batch.num_prefill_tokens
            + self.decode_req_s * batch.num_decode_reqs
            + self.context_token_s * batch.decode_context_tokens
        )


ZERO_STEP_MODEL = LinearStepModel(0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class SimEngineConfig:
    model_name: str = "tidal-sim"  # the model id clients ask for
    max_model_len: int = 8192  # prompt + output tokens per request
    max_num_seqs: int = 256  # requests stepped together
    max_batch_tokens: int = 2048  # prefill + decode tokens per step (chunked-prefill budget)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 8192  # KV pool size, in blocks

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_num_seqs < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_num_seqs and max_batch_tokens must be >= 1")
        if self.block_size < 1 or self.num_kv_blocks < 1:
            raise ValueError("block_size and num_kv_blocks must be >= 1")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError("the KV pool cannot hold even one max_model_len request")


@dataclass
class _SimSeq:
    req: EngineRequest
    num_computed: int = 0  # prompt tokens whose KV exists
    output_ids: list[int] = field(default_factory=list)
    num_blocks: int = 0

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prompt

    @property
    def num_tokens(self) -> int:
        return self.num_computed + len(self.output_ids)


@dataclass(frozen=True)
class SimPlan:
    """What one emulated step runs."""

    prefill: dict[str, int]  # req_id -> prompt tokens to prefill this step
    decode: list[str]  # req_ids decoding one token this step
    batch: BatchShape


class SimScheduler:
    """Continuous batching with chunked prefill: decodes, then prefill chunks, online first."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        self.waiting: deque[_SimSeq] = deque()
        self.running: dict[str, _SimSeq] = {}
        self.num_free_blocks = config.num_kv_blocks

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def free(self, seq: _SimSeq) -> None:
        self.num_free_blocks += seq.num_blocks
        seq.num_blocks = 0

    def schedule(self) -> SimPlan:
        budget = self.config.max_batch_tokens
        decode: list[str] = []
        prefill: dict[str, int] = {}
        ctx = 0
        for seq in self.running.values():
            if seq.is_prefilling or budget == 0:
                continue
            decode.append(seq.req.req_id)
            ctx += seq.num_tokens
            budget -= 1
        pairs = 0
        for seq in self.running.values():
            if budget and seq.is_prefilling:
                pairs += self._plan_chunk(seq, budget, prefill)
                budget -= prefill[seq.req.req_id]
        # Admit waiting requests, online first (the deque is kept online-first by `add`).
        # NOTE: admission reserves KV for prompt + max_tokens, so a running request never
        # stalls for memory; the emulator trades some capacity for never needing recompute.
        while budget and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            need = self._blocks_for(seq.num_prompt + seq.req.sampling.max_tokens)
            if need > self.num_free_blocks:
                break
            self.num_free_blocks -= need
            seq.num_blocks = need
            self.waiting.popleft()
            self.running[seq.req.req_id] = seq
            pairs += self._plan_chunk(seq, budget, prefill)
            budget -= prefill[seq.req.req_id]
        batch = BatchShape(
            num_prefill_tokens=sum(prefill.values()),
            num_prefill_reqs=len(prefill),
            prefill_attn_pairs=pairs,
            num_decode_reqs=len(decode),
            decode_context_tokens=ctx,
        )
        return SimPlan(prefill=prefill, decode=decode, batch=batch)

    @staticmethod
    def _plan_chunk(seq: _SimSeq, budget: int, prefill: dict[str, int]) -> int:
        chunk = min(seq.num_prompt - seq.num_computed, budget)
        prefill[seq.req.req_id] = chunk
        return chunk * (seq.num_computed + chunk)


def sim_token(prompt_ids: list[int], index: int) -> int:
    """Emulated output token `index` of a prompt: the same prompt always gives the same text."""
    digest = hashlib.blake2b(bytes(str(len(prompt_ids)), "ascii"), digest_size=8)
    digest.update(bytes(t % 256 for t in prompt_ids[:64]))
    digest.update(index.to_bytes(4, "little"))
    return _WORD_BASE + int.from_bytes(digest.digest()[:4], "little") % len(_WORDS)


class SimEngine:
    """Implements `tidal.engine.api.Engine` with emulated step times."""

    name = "sim"
    is_emulated = True

    def __init__(self, config: SimEngineConfig, step_model: StepModel | None = None) -> None:
        self.config = config
        self.model_name = config.model_name
        self.max_model_len = config.max_model_len
        self.tokenizer: Tokenizer = SimTokenizer()
        self.step_model: StepModel = step_model or LinearStepModel()
        self.scheduler = SimScheduler(config)
        self.num_steps = 0

    def add(self, request: EngineRequest) -> None:
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                f"({request.sampling.max_tokens}) exceeds this model's context of "
                f"{self.max_model_len} tokens"
            )
        if request.req_id in self.scheduler.running or any(
            s.req.req_id == request.req_id for s in self.scheduler.waiting
        ):
            raise ValueError(f"request id {request.req_id!r} is already in this engine")
        seq = _SimSeq(request)
        if request.req_class == RequestClass.ONLINE:
            # Online requests jump ahead of every waiting offline request.
            idx = next(
                (
                    i
                    for i, s in enumerate(self.scheduler.waiting)
                    if s.req.req_class == RequestClass.OFFLINE
                ),
                len(self.scheduler.waiting),
            )
            self.scheduler.waiting.insert(idx, seq)
        else:
            self.scheduler.waiting.append(seq)

    def abort(self, req_id: str) -> bool:
        seq = self.scheduler.running.pop(req_id, None)
        if seq is not None:
            self.scheduler.free(seq)
            return True
        for s in self.scheduler.waiting:
            if s.req.req_id == req_id:
                self.scheduler.waiting.remove(s)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self) -> StepResult:
        plan = self.scheduler.schedule()
        step_s = self.step_model.step_s(plan.batch)  # execute: emulated
        events = self._update(plan)
        self.num_steps += 1
        telemetry = StepTelemetry(
            num_prefill_tokens=plan.batch.num_prefill_tokens,
            num_decode_tokens=plan.batch.num_decode_reqs,
            num_context_tokens=plan.batch.decode_context_tokens,
            num_requests=len(plan.prefill) + len(plan.decode),
            step_s=step_s,
        )
        return StepResult(events=events, telemetry=telemetry)

    def _update(self, plan: SimPlan) -> list[TokenEvent]:
        running = self.scheduler.running
        emit: list[str] = list(plan.decode)
        for req_id, chunk in plan.prefill.items():
            seq = running[req_id]
            seq.num_computed += chunk
            if not seq.is_prefilling:
                emit.append(req_id)  # the step that finishes a prefill samples the first token
        events = []
        for req_id in emit:
            seq = running[req_id]
            tid = sim_token(seq.req.prompt_token_ids, len(seq.output_ids))
            seq.output_ids.append(tid)
            finish = None
            if len(seq.output_ids) >= seq.req.sampling.max_tokens:
                finish = FinishReason.LENGTH
                del running[req_id]
                self.scheduler.free(seq)
            events.append(
                TokenEvent(
                    req_id=req_id,
                    token_ids=(tid,),
                    text=self.tokenizer.decode([tid]),
                    finish_reason=finish,
                    num_prompt_tokens=seq.num_prompt,
                    num_output_tokens=len(seq.output_ids),
                )
            )
        return events

    def load(self) -> EngineLoad:
        sched = self.scheduler
        seqs = [*sched.running.values(), *sched.waiting]
        num_online = sum(1 for s in seqs if s.req.req_class == RequestClass.ONLINE)
        return EngineLoad(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_kv_blocks_used=self.config.num_kv_blocks - sched.num_free_blocks,
            num_kv_blocks_total=self.config.num_kv_blocks,
            num_online=num_online,
            num_offline=len(seqs) - num_online,
        )
