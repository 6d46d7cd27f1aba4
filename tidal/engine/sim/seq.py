"""Per-request state of the `sim` engine, and its export/import byte format (migration).

`SimSeq` mirrors the torch engine's `Sequence`: ``token_ids`` is prompt + output, ``num_computed``
the tokens whose KV is written for every layer, ``num_pending = len(token_ids) - num_computed``;
a request preempted by recompute prefills prompt + output[:-1] again and then decodes on, so no
token is emitted twice.

An exported request's state is one MessagePack map (never pickled): its tokens, sampling,
progress and any layer-preempted partial chunk. Its emulated KV is ``num_kv_tokens *
kv_bytes_per_token`` bytes, moved in chunks (`tidal.engine.migrate`), so a transfer costs what the
real engine's would. The KV bytes derive from the request's tokens (a repeated blake2b digest)
and every chunk is checked on import: a corrupted transfer is a `ValueError`, not a silently
wrong request.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import dataclass

import msgspec

from tidal.engine.api import EngineRequest, RequestClass, SamplingParams
from tidal.engine.sim.tokens import prompt_key

__all__ = ["FORMAT", "SimSeq", "decode_state", "encode_state", "kv_digest", "kv_slice"]

FORMAT = "tidal-sim-request/2"
WAITING, RUNNING, SWAPPED = "waiting", "running", "swapped"  # SeqSnapshot.status values


@dataclass(eq=False)  # identity semantics, like the torch engine's Sequence
class SimSeq:
    req: EngineRequest
    token_ids: list[int]  # prompt + output
    key: bytes  # sim_tokens.prompt_key(prompt): picks every output token
    status: str = WAITING
    num_computed: int = 0  # tokens whose KV is written for every layer
    num_blocks: int = 0  # device KV blocks held (RUNNING only)
    partial_tokens: int = 0  # > 0: a layer-preempted chunk of this many tokens ...
    partial_layer: int = 0  # ... whose layers [0, partial_layer) have run
    num_host_tokens: int = 0  # KV tokens in host memory (SWAPPED only)
    text: str = ""  # output text emitted so far (stop strings are matched against it)
    num_ckpt_tokens: int = 0  # tokens checkpointed to host memory: whole blocks (`checkpoint`)
    is_released: bool = False  # SWAPPED by `release`: its checkpoint is its host KV

    @property
    def req_id(self) -> str:
        return self.req.req_id

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_output > 0 and self.num_pending == 1

    @property
    def num_device_blocks(self) -> int:
        return self.num_blocks

    @property
    def forced_tokens(self) -> int:
        return self.partial_tokens

    @property
    def num_kv_tokens(self) -> int:
        """Tokens with KV written for at least one layer (a partial chunk's included)."""
        return self.num_computed + self.partial_tokens


class _Payload(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    model: str
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    req_class: RequestClass
    arrival_s: float
    num_computed: int
    partial_tokens: int
    partial_layer: int
    text: str
    priority: int = 0  # its request class's priority


def kv_digest(token_ids: list[int], num_tokens: int) -> bytes:
    """64 bytes the emulated KV of the first `num_tokens` tokens repeats."""
    return hashlib.blake2b(array("q", token_ids[:num_tokens]).tobytes()).digest()


def kv_slice(digest: bytes, start: int, end: int) -> bytes:
    """Bytes [start, end) of the emulated KV: `digest` repeated, the size a real one has."""
    skip = start % len(digest)
    reps = math.ceil((skip + end - start) / len(digest))
    return (digest * reps)[skip : skip + end - start]


def encode_state(seq: SimSeq, model: str) -> bytes:
    return msgspec.msgpack.encode(
        _Payload(
            format=FORMAT,
            model=model,
            req_id=seq.req_id,
            prompt_token_ids=list(seq.req.prompt_token_ids),
            output_token_ids=seq.token_ids[seq.num_prompt :],
            sampling=seq.req.sampling,
            req_class=seq.req.req_class,
            arrival_s=seq.req.arrival_s,
            num_computed=seq.num_computed,
            partial_tokens=seq.partial_tokens,
            partial_layer=seq.partial_layer,
            text=seq.text,
            priority=seq.req.priority,
        )
    )


def decode_state(data: bytes, model: str, num_layers: int) -> SimSeq:
    """A `SimSeq` (WAITING, no blocks yet: the engine places its KV) from `encode_state` bytes.
    ValueError for a foreign, inconsistent or corrupted payload."""
    try:
        p = msgspec.msgpack.decode(data, type=_Payload)
    except (msgspec.MsgspecError, ValueError, TypeError) as e:
        raise ValueError(f"not a sim engine request export: {e}") from None
    if p.format != FORMAT:
        raise ValueError(f"unknown request export format {p.format!r} (expected {FORMAT!r})")
    if p.model != model:
        raise ValueError(f"request exported by model {p.model!r}, this engine serves {model!r}")
    token_ids = p.prompt_token_ids + p.output_token_ids
    num_kv = p.num_computed + p.partial_tokens
    if not p.prompt_token_ids or len(p.output_token_ids) >= p.sampling.max_tokens:
        raise ValueError(f"{p.req_id!r}: inconsistent prompt/output lengths in the export")
    if min(p.num_computed, p.partial_tokens) < 0 or num_kv > len(token_ids):
        raise ValueError(f"{p.req_id!r}: inconsistent computed/partial token counts")
    if p.partial_tokens and not 0 < p.partial_layer < num_layers:
        raise ValueError(f"{p.req_id!r}: partial chunk at layer {p.partial_layer} of {num_layers}")
    req = EngineRequest(
        p.req_id, p.prompt_token_ids, p.sampling, p.req_class, p.arrival_s, p.priority
    )
    return SimSeq(
        req=req,
        token_ids=token_ids,
        key=prompt_key(p.prompt_token_ids),
        num_computed=p.num_computed,
        partial_tokens=p.partial_tokens,
        partial_layer=p.partial_layer if p.partial_tokens else 0,
        text=p.text,
    )
