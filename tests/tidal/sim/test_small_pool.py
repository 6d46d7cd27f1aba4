"""`tidal` on KV pools of 2,048-3,072 tokens per instance (OOCO's two instances, the ooco.yaml
workload): every request ends. Before `tidal.policy.tidal.liveness` the run stopped with
requests stranded: offline requests the gate held for ever (prompt + expected output longer
than the pool), a strict instance whose online decodes all needed a block with none free (and
the pushes waiting for it), prompts longer than the pool prefilled up to a full pool; once
those were ended, online decodes pushed as soon as their context fitted filled the strict pool
with requests none of which could finish."""

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
    # Everything that fits the pool finishes: offline work is evicted and resumed, online
    # decodes wait for a strict instance where they can finish. Only what fits no pool ends
    # (out of KV memory) instead of holding it for ever.
    assert [r.req_id for r in fits if r.phase is not Phase.FINISHED] == []
    assert sum(1 for r in fits if r.is_online) > 10
    too_long = [r for r in reqs if r.num_prompt_tokens + 1 > kv_tokens]
    assert too_long and all(r.phase is Phase.REJECTED for r in too_long)
    assert all(
        r.num_output_tokens == r.max_output_tokens for r in reqs if r.phase is Phase.FINISHED
    )


def test_online_requests_end_on_a_small_overloaded_pool() -> None:
    """16 offline req/s on 3,072 tokens: far more offline work than the pool serves, so some
    of it is still queued when the run stops; every online request ends all the same, and
    offline work keeps finishing to the end (no pool is stuck)."""
    cfg = load_config("configs/ooco.yaml", ("kv_capacity_tokens=3072", "offline.rate=16"))
    cfg = override_streams(cfg, None, None, None, 20.0)
    rec = simulate(cfg, "tidal", check=True)
    online = [r for r in rec.requests if r.is_online]
    assert online and {r.phase for r in online} <= {Phase.FINISHED, Phase.REJECTED}
    assert sum(1 for r in online if r.phase is Phase.FINISHED) > 10
    done = [
        r.finish_s or 0.0 for r in rec.requests if not r.is_online and r.phase is Phase.FINISHED
    ]
    assert max(done) > rec.end_s - 30.0  # still finishing offline work near the end
