"""Per-request state of the torch engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tidal.engine.api import EngineRequest
from tidal.engine.detokenizer import Detokenizer
from tidal.engine.torch.ckpt_copier import CopyJob


class SeqStatus(enum.StrEnum):
    WAITING = "waiting"  # no KV (new, or preempted by recompute)
    RUNNING = "running"  # holds KV blocks
    SWAPPED = "swapped"  # KV in host memory (swap_out); not schedulable until swap_in
    OFFLOADED = "offloaded"  # KV on a CPU-attention worker; decodes by piggybacking


@dataclass
class PartialChunk:
    """A chunk a layer-boundary preemption interrupted (OOCO §3.4.1): layers [0, layer) have run
    and written their KV; it resumes at `layer` from `hidden` without recompute."""

    num_tokens: int
    layer: int
    hidden: torch.Tensor  # (num_tokens, hidden) residual stream entering `layer`


@dataclass
class CpuProgress:
    """Where an offloaded request's current token is (OmniServe's residual store entry); its
    worker is the link's to know."""

    stage: str = "idle"  # "idle": at a token boundary | "pre": enters QKV at `layer`
    # | "wait": attention at `layer` is on the worker
    layer: int = 0
    x: torch.Tensor | None = None  # (1, hidden) residual stream entering `layer`

    @property
    def at_boundary(self) -> bool:
        return self.stage == "idle"


@dataclass(eq=False)  # identity semantics: requests are compared with `is`
class Sequence:
    req: EngineRequest
    token_ids: list[int]  # prompt + output
    num_prompt: int
    detok: Detokenizer
    generator: torch.Generator | None
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is written for every layer
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hash per full computed block
    num_registered: int = 0  # leading blocks registered in the prefix cache
    partial: PartialChunk | None = None
    swapped_kv: torch.Tensor | None = None  # (L, 2, T, Hk, D) on the host while SWAPPED
    # (None for a request released to its checkpoint: `ckpt` is its KV then)
    ckpt: list[torch.Tensor] = field(default_factory=list)  # host copies of its first
    # `num_ckpt_tokens` tokens' KV, (L, 2, T_i, Hk, D) each, in order (`torch.checkpoint`)
    num_ckpt_tokens: int = 0  # tokens checkpointed: whole blocks, <= num_computed
    num_ckpt_queued: int = 0  # tokens checkpointed or queued for the copier (budget reserved)
    ckpt_jobs: list[CopyJob] = field(default_factory=list)  # its copies not yet in `ckpt`,
    # in order (`torch.ckpt_copier`): done ones wait for the engine's thread to take them
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    cpu: CpuProgress | None = None  # while OFFLOADED: its worker and its token's progress

    @property
    def req_id(self) -> str:
        return self.req.req_id

    @property
    def num_device_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def forced_tokens(self) -> int:
        return self.partial.num_tokens if self.partial else 0

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_output > 0 and self.num_pending == 1
