"""`tidal` on KV pools of 2,048-3,072 tokens per instance (OOCO's two instances, the ooco.yaml
workload): every request ends. Before `tidal.policy.tidal.liveness` the run stopped with
requests stranded: offline requests the gate held for ever (prompt + expected output longer
than the pool), a strict instance whose online decodes all needed a block with none free (and
the pushes waiting for it), prompts longer than the pool prefilled up to a full pool."""

from __future__ import annotations

import pytest

from tidal.config.cluster import load_config, override_streams
from tidal.policy.state import Phase
from tidal.sim.build import simulate


@pytest.mark.parametrize(("kv_tokens", "duration_s"), [(2048, 10.0), (3072, 30.0)])
def test_every_request_ends_on_a_small_pool(kv_tokens: int, duration_s: float) -> None:
    cfg = load_config("configs/ooco.yaml", (f"kv_capacity_tokens={kv_tokens}", "offline.rate=4"))
    cfg = override_streams(cfg, None, None, None, duration_s)
    rec = simulate(cfg, "tidal", check=True)  # check: block accounting after every event
    reqs = rec.requests
    assert len(reqs) > 50
    assert {r.phase for r in reqs} <= {Phase.FINISHED, Phase.REJECTED}
    assert rec.end_s < cfg.duration_s + cfg.drain_s  # ended by finishing, not the horizon
    assert set(rec.rejections) <= {"out_of_kv", "tidal: online prefill would miss its TTFT SLO"}
    fits = [r for r in reqs if r.num_prompt_tokens + r.max_output_tokens <= kv_tokens]
    for r in fits:
        if not r.is_online:  # offline work that fits the pool is evicted and resumed, never ended
            assert r.phase is Phase.FINISHED, r.req_id
    # A request too long for the pool ends (out of KV memory) instead of holding it for ever.
    too_long = [r for r in reqs if r.num_prompt_tokens + 1 > kv_tokens]
    assert too_long and all(r.phase is Phase.REJECTED for r in too_long)
    finished = [r for r in reqs if r.phase is Phase.FINISHED]
    assert all(r.num_output_tokens == r.max_output_tokens for r in finished)
    assert sum(1 for r in finished if r.is_online) >= 0.7 * sum(1 for r in reqs if r.is_online)
