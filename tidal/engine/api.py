"""The one interface every instance engine implements (`sim` now, `torch` next, `sglang` later).

The instance service owns an engine and drives it with one call per step; inside, each engine runs
the loop STYLE.md asks for: ``plan = scheduler.schedule(now)`` -> ``out = runner.execute(plan)`` ->
``scheduler.update(plan, out)``. The service feeds requests in (`add`, `abort`) and carries the
step's token events out to the gateway. Nothing here does I/O.

An engine is *emulated* when its step times come from a latency model rather than from running a
model (`sim`). It still takes that time (the sim engine waits it out, interruptibly, when
`realtime`), and every response and metric it produces is labelled as emulation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tidal.plan import EngineCapabilities, StepPlan
from tidal.schemas.enums import RequestClass

# The error of a request ended because it cannot get KV memory and no offline work is left to
# evict for it (online work is never evicted): `finish_reason` "error", never a silent "length".
OUT_OF_KV_ERROR = "out of KV memory: no offline work left to evict for it (never evicted)"


class OffloadRefused(Exception):
    """No CPU-attention worker took the request (the message says why); it stays on the
    instance."""


__all__ = [
    "OUT_OF_KV_ERROR",
    "CheckpointingEngine",
    "ControllableEngine",
    "Engine",
    "EngineCapabilities",
    "EngineLoad",
    "EngineRequest",
    "FinishReason",
    "RequestClass",
    "SamplingParams",
    "SeqSnapshot",
    "StepPlan",
    "StepResult",
    "StepTelemetry",
    "TokenEvent",
    "Tokenizer",
]


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens reached or the context window is full
    ABORT = "abort"  # cancelled by the client or the operator
    ERROR = "error"  # the engine failed this request (message in TokenEvent.error)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, mirroring the OpenAI fields the gateway accepts."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probs to return per token; None = none
    # OpenAI's penalties: logit -= frequency_penalty * count + presence_penalty * (count > 0),
    # count = times the token is in the output so far
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs

    @property
    def is_penalised(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for tid, bias in self.logit_bias:
            if tid < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias needs ids >= 0 and biases in [-100, 100]: {tid}")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the first `logit_bias` token outside the vocabulary."""
        for tid, _ in self.logit_bias:
            if tid >= vocab_size:
                raise ValueError(
                    f"logit_bias token {tid} is not in the vocabulary [0, {vocab_size})"
                )


def check_fits(num_prompt: int, max_tokens: int, max_model_len: int) -> None:
    """ValueError (naming the context, which the gateway maps to `context_length_exceeded`)
    when prompt + max_tokens does not fit the model's context."""
    if num_prompt + max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context length of {max_model_len} tokens"
        )


@dataclass
class EngineRequest:
    """A tokenised request as it enters an engine."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    req_class: RequestClass = RequestClass.ONLINE
    arrival_s: float = 0.0  # caller's clock, for queueing metrics only
    priority: int = 0  # its request class's priority (higher is served first; the policy's
    # eviction of a lower class is checked against it, `tidal.plan.interpreter`)


@dataclass(frozen=True)
class TokenEvent:
    """One request's progress in one step: the tokens it produced, and whether it ended."""

    req_id: str
    token_ids: tuple[int, ...]  # tokens produced this step (usually 0 or 1)
    text: str  # detokenised text delta for token_ids (stop strings already cut)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including this step's
    logprobs: tuple[float, ...] = ()  # log-prob of each token in token_ids, when asked
    # per token in token_ids: its `logprobs` most likely (token id, log-prob), most likely first
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    error: str = ""


@dataclass(frozen=True)
class StepTelemetry:
    """What one engine step did; the performance models are calibrated from a log of these."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_context_tokens: int  # KV tokens attended to, summed over requests
    num_requests: int
    step_s: float  # wall time, or emulated time for an emulated engine
    module_s: dict[str, float] = field(default_factory=dict)  # module name -> seconds (optional)


@dataclass(frozen=True)
class StepResult:
    events: list[TokenEvent]
    telemetry: StepTelemetry


@dataclass(frozen=True)
class EngineLoad:
    """The load an instance reports to the scheduler."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_online: int
    num_offline: int


class Tokenizer(Protocol):
    eos_token_id: int | None

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render OpenAI-style chat messages into a prompt string ending at the assistant turn."""
        ...


class Engine(Protocol):
    """The instance engine interface. Calls come from one thread at a time."""

    name: str  # "sim", "torch", ...
    model_name: str  # the model id clients ask for
    is_emulated: bool  # True when step_s is emulated, not measured
    max_model_len: int  # prompt + output tokens one request may hold
    tokenizer: Tokenizer

    def add(self, request: EngineRequest) -> None:
        """Queue a request; ValueError (with a message for the client) if it can never run."""
        ...

    def abort(self, req_id: str) -> bool:
        """Drop a request wherever it is and free its KV; False if it is unknown."""
        ...

    def has_work(self) -> bool: ...

    def step(self) -> StepResult:
        """Run one schedule -> execute -> update iteration."""
        ...

    def load(self) -> EngineLoad: ...


@dataclass(frozen=True)
class SeqSnapshot:
    """One request inside an engine, as the instance's policy adapter mirrors it into a
    `tidal.policy.ReqState` before every step."""

    req_id: str
    req_class: RequestClass
    arrival_s: float  # the EngineRequest's arrival_s (caller's clock)
    num_prompt_tokens: int
    max_output_tokens: int  # sampling.max_tokens
    num_computed_tokens: int  # tokens whose KV is written for every layer
    num_output_tokens: int  # generated so far
    num_blocks: int  # KV blocks held on the device
    status: str  # "waiting" (no KV) | "running" (KV on device) | "swapped" (KV in host memory)
    forced_tokens: int = 0  # > 0: a layer-preempted chunk that must resume with exactly this many
    num_checkpointed_tokens: int = 0  # tokens whose KV is checkpointed in host memory (whole
    # blocks; `CheckpointingEngine.checkpoint`)
    is_released: bool = False  # swapped by `CheckpointingEngine.release`: its checkpoint is its KV
    priority: int = 0  # the EngineRequest's priority (its request class's)

    @classmethod
    def of(cls, seq: SnapshotSource) -> SeqSnapshot:
        """The snapshot of one engine's request record (the torch and sim engines share it)."""
        return cls(
            req_id=seq.req.req_id,
            req_class=seq.req.req_class,
            arrival_s=seq.req.arrival_s,
            num_prompt_tokens=seq.num_prompt,
            max_output_tokens=seq.req.sampling.max_tokens,
            num_computed_tokens=seq.num_computed,
            num_output_tokens=seq.num_output,
            num_blocks=seq.num_device_blocks,
            status=str(seq.status),
            forced_tokens=seq.forced_tokens,
            priority=seq.req.priority,
        )


class SnapshotSource(Protocol):
    """What an engine's record of a request shows its snapshot and its planner's view
    (`scheduler.SeqView.of`) (`torch.sequence.Sequence`,
    `sim.seq.SimSeq`: two records, since one holds tensors, a generator and block ids and the
    other emulated counters, but one view of them)."""

    req: EngineRequest
    num_computed: int

    @property
    def num_prompt(self) -> int: ...

    @property
    def num_output(self) -> int: ...

    @property
    def status(self) -> str: ...

    @property
    def num_device_blocks(self) -> int: ...

    @property
    def forced_tokens(self) -> int: ...

    @property
    def num_pending(self) -> int: ...

    @property
    def is_decode(self) -> bool: ...


@runtime_checkable
class ControllableEngine(Engine, Protocol):
    """An engine a policy can drive step by step: explicit plans, a layer cut, recompute,
    swapping, CPU attention and export/import for migration, as far as its `capabilities`
    declare. `torch`, `sim` and `sglang` implement it; the instance's executor
    (`tidal.engine.executor`, through `tidal.plan.carry_out`) is its only planner-side caller.
    Each method either does all its work or raises and changes nothing.
    """

    block_size: int  # tokens per KV block
    num_kv_blocks: int  # KV blocks in total
    kv_bytes_per_token: float  # bytes of KV one token holds (all layers)
    last_step_preempted: bool  # the last step was cut at a layer boundary
    last_preempt_latency_s: float | None  # signal -> free time of the last cut

    @property
    def capabilities(self) -> EngineCapabilities:
        """What of a `StepPlan` this engine can carry out (read each plan: CPU-attention
        workers come and go)."""
        ...

    def step(self, plan: StepPlan | None = None) -> StepResult:
        """Run `plan`'s prefill chunks, decodes and CPU decodes (its other fields are the
        interpreter's stages, already run), or the engine's own planner when None."""
        ...

    def request_layer_cut(self) -> bool:
        """Thread-safe: end the running step after its current layer (False: none running).
        The cut work is kept and resumes without recompute (`SeqSnapshot.forced_tokens`)."""
        ...

    def wake_step(self) -> None:
        """Thread-safe: new work is waiting; a step that waits for tokens (a self-driven
        engine's) ends its wait now. A no-op for engines whose steps do not wait."""
        ...

    def recompute(self, req_id: str) -> None:
        """Drop the request's KV; it waits again and recomputes prompt + output later."""
        ...

    def swap_out(self, req_id: str) -> None: ...

    def swap_in(self, req_id: str) -> None:
        """MemoryError if the KV does not fit now."""
        ...

    def offload(self, req_id: str) -> None:
        """KV to a CPU-attention worker; it decodes on with attention there."""
        ...

    def recall(self, req_id: str) -> None:
        """An offloaded request's KV back on the device; MemoryError if it does not fit."""
        ...

    def export_request(self, req_id: str, remove: bool = True) -> bytes:
        """Tokens, sampling state and KV of all layers; another engine of the same model
        continues it with identical output."""
        ...

    def import_request(self, data: bytes) -> None:
        """MemoryError if its KV does not fit; ValueError for a foreign or corrupt payload."""
        ...

    def snapshot(self) -> list[SeqSnapshot]:
        """Every request in the engine, in arrival order."""
        ...

    def num_free_blocks(self) -> int: ...


@runtime_checkable
class CheckpointingEngine(ControllableEngine, Protocol):
    """An engine that saves offline KV to host memory block by block while it decodes, so a
    preemption frees its GPU blocks at once (ConServe; `EngineCapabilities.kv_checkpoint`).
    `torch` implements it (`sim` emulates it, with `SimEngineConfig.checkpoint_host_bytes`);
    without a budget, or on the others, such plans are refused (`NO_KV_CHECKPOINT`)."""

    def checkpoint(self, req_id: str) -> None:
        """Copy the full KV blocks of a running request not yet saved to host memory;
        `PlanRefused(HOST_MEMORY_FULL)` past the checkpoint budget, changing nothing."""
        ...

    def release(self, req_id: str) -> None:
        """Free a checkpointed running request's GPU blocks at once; it waits swapped with its
        checkpoint as its KV (`swap_in` copies it back; the tail past it is prefilled)."""
        ...

    @property
    def checkpoint_capacity_bytes(self) -> int:
        """Host memory for checkpoints in all, bytes (0: none)."""
        ...

    @property
    def checkpoint_room_bytes(self) -> int:
        """Host bytes the checkpoint budget still has."""
        ...
