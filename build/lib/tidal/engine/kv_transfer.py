"""Moving one request's KV out of and into the paged cache: swap to host memory, and the byte
format of export/import (push and pull migration, OOCO §3.3, are built on it)."""

from __future__ import annotations

import io
from dataclasses import asdict
from typing import Any

import torch

from tidal.engine.api import EngineRequest, RequestClass, SamplingParams, Tokenizer
from tidal.engine.sampling import Detokenizer, make_generator
from tidal.engine.sequence import PartialChunk, Sequence

FORMAT_VERSION = 1


def token_slots(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """KV slot of every position in [start, end) under a block table; (end - start,) int64."""
    table = torch.tensor(block_ids, dtype=torch.int64)
    pos = torch.arange(start, end, dtype=torch.int64)
    return table[pos // block_size] * block_size + pos % block_size


def gather_kv(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """kv (L, 2, S, Hk, D) -> (L, 2, T, Hk, D) copy on the host."""
    return kv.index_select(2, slots.to(kv.device)).to("cpu")


def scatter_kv(kv: torch.Tensor, slots: torch.Tensor, data: torch.Tensor) -> None:
    kv.index_copy_(2, slots.to(kv.device), data.to(device=kv.device, dtype=kv.dtype))


def pack(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save({"version": FORMAT_VERSION, **state}, buf)
    return buf.getvalue()


def unpack(data: bytes) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    if state.get("version") != FORMAT_VERSION:
        raise ValueError(f"unknown request export format {state.get('version')!r}")
    return state


def request_to_dict(req: EngineRequest) -> dict[str, Any]:
    sp = asdict(req.sampling)
    sp["stop"] = list(sp["stop"])
    sp["stop_token_ids"] = list(sp["stop_token_ids"])
    return {
        "req_id": req.req_id,
        "prompt_token_ids": list(req.prompt_token_ids),
        "sampling": sp,
        "req_class": str(req.req_class),
        "arrival_s": req.arrival_s,
    }


def request_from_dict(d: dict[str, Any]) -> EngineRequest:
    sp = dict(d["sampling"])
    sp["stop"] = tuple(sp["stop"])
    sp["stop_token_ids"] = tuple(sp["stop_token_ids"])
    return EngineRequest(
        req_id=d["req_id"],
        prompt_token_ids=list(d["prompt_token_ids"]),
        sampling=SamplingParams(**sp),
        req_class=RequestClass(d["req_class"]),
        arrival_s=float(d["arrival_s"]),
    )


def export_seq(seq: Sequence, kv: torch.Tensor | None, model_name: str, shape: list[int]) -> bytes:
    p = seq.partial
    return pack(
        {
            "model": model_name,
            "shape": shape,
            "request": request_to_dict(seq.req),
            "token_ids": seq.token_ids,
            "num_computed": seq.num_computed,
            "emitted": seq.detok.emitted,
            "kv": kv,  # (L, 2, T, Hk, D) on the host, or None before any prefill
            "partial": None if p is None else [p.num_tokens, p.layer, p.hidden.to("cpu")],
            "rng": None if seq.generator is None else seq.generator.get_state(),
        }
    )


def import_seq(
    data: bytes, tokenizer: Tokenizer, shape: list[int], device: torch.device
) -> tuple[Sequence, torch.Tensor | None]:
    """A `Sequence` (no KV blocks yet) and its host KV, from `export_seq` bytes."""
    st = unpack(data)
    if st["shape"] != shape:
        raise ValueError(f"exported KV shape {st['shape']} does not match this model {shape}")
    req = request_from_dict(st["request"])
    seq = Sequence(
        req=req,
        token_ids=list(st["token_ids"]),
        num_prompt=len(req.prompt_token_ids),
        detok=Detokenizer(tokenizer, req.sampling.stop),
        generator=make_generator(req.sampling),
    )
    seq.detok.emitted = st["emitted"]
    if seq.generator is not None and st["rng"] is not None:
        seq.generator.set_state(st["rng"])
    seq.num_computed = int(st["num_computed"])
    if st["partial"] is not None:
        n, layer, hidden = st["partial"]
        seq.partial = PartialChunk(int(n), int(layer), hidden.to(device))
    return seq, st["kv"]
