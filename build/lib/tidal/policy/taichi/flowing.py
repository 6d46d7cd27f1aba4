"""TaiChi flowing decode (papers/taichi.md §3.3, Alg. 1): longest-first degradation from D-heavy
instances above the memory watermark, TPOT-aware back-flow from P-heavy instances."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FlowReq:
    req_id: str
    output_tokens: int  # tokens generated since it (re)started on this instance type
    tpot_s: float  # its TPOT so far, seconds (reset on back-flow, §3.3 ③)
    blocks: int  # GPU KV blocks it holds


def select_backflow(reqs: Sequence[FlowReq], tpot_slo_s: float, alpha: float) -> list[str]:
    """Alg. 1 lines 1-3 (P-heavy): decodes whose TPOT passed α·SLO flow back to D-heavy."""
    bound = tpot_slo_s * alpha
    return [r.req_id for r in reqs if r.tpot_s > bound]


def select_degrading(
    reqs: Sequence[FlowReq], used_blocks: int, total_blocks: int, watermark: float
) -> list[str]:
    """Alg. 1 lines 4-12 (D-heavy): while memory use exceeds M, move the decode with the longest
    current output to a P-heavy instance (it has already enjoyed the most low-interference steps
    and absorbs degradation best)."""
    limit = watermark * total_blocks
    if used_blocks <= limit:
        return []
    out: list[str] = []
    released = 0
    for r in sorted(reqs, key=lambda r: r.output_tokens, reverse=True):  # line 8: argmax
        if used_blocks - released <= limit:
            break
        out.append(r.req_id)
        released += r.blocks
    return out


@dataclass(frozen=True, slots=True)
class DecodeHost:
    instance_id: int
    used_fraction: float  # HBM (KV) use, 0..1 — the decode load of §3.3 ①
    free_blocks: int


def choose_decode_host(
    prefill_instance: int,
    prefilled_on_d_heavy: bool,
    d_heavy: Sequence[DecodeHost],
    blocks_needed: int,
) -> int | None:
    """§3.3 ① low-interference decode init: in place after a D-heavy prefill (no transfer);
    after a P-heavy prefill the D-heavy instance with the lowest HBM use that has room.
    None means no D-heavy instance has room: decode stays where it was prefilled."""
    if prefilled_on_d_heavy:
        return prefill_instance
    fits = [h for h in d_heavy if h.free_blocks >= blocks_needed]
    if not fits:
        return None
    return min(fits, key=lambda h: (h.used_fraction, h.instance_id)).instance_id


def least_loaded(hosts: Sequence[DecodeHost], blocks_needed: int) -> int | None:
    """Where a flowed request goes: the target-type instance with the lowest HBM use and room
    ("distributed ... through the proxy in a load-balanced manner", §3.3)."""
    fits = [h for h in hosts if h.free_blocks >= blocks_needed]
    return min(fits, key=lambda h: (h.used_fraction, h.instance_id)).instance_id if fits else None
