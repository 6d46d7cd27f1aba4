"""Moving one request's KV out of and into the paged cache by slot (swap to host memory,
migration chunks), and a request's fields as plain data for its exported state."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from tidal.engine.api import EngineRequest, RequestClass, SamplingParams


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
        "priority": req.priority,
    }


def request_from_dict(d: dict[str, Any]) -> EngineRequest:
    sp = dict(d["sampling"])
    sp["stop"] = tuple(sp["stop"])
    sp["stop_token_ids"] = tuple(sp["stop_token_ids"])
    sp["logit_bias"] = tuple((int(t), float(b)) for t, b in sp.get("logit_bias", ()))
    return EngineRequest(
        req_id=d["req_id"],
        prompt_token_ids=list(d["prompt_token_ids"]),
        sampling=SamplingParams(**sp),
        req_class=RequestClass(d["req_class"]),
        arrival_s=float(d["arrival_s"]),
        priority=int(d.get("priority", 0)),
    )
