"""An idle latency-strict instance pulls offline decodes (OOCO §3.4.3): the simulator gives an
idle instance's policy a `schedule` now and then, so a strict instance that never had work of
its own still reports the room that triggers the pull."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy import InstanceRole, PolicyContext, Slo, make_policy
from tidal.schemas.enums import RequestClass
from tidal.sim.core import InstanceSetup, Simulator
from tidal.workload.mix import SimRequest

SLO = Slo(1.0, 0.05)
MODEL = LinearStepModel(base_s=0.008, per_token_s=6e-5, per_ctx_token_s=3e-8, per_attn_pair_s=2e-10)
ROLES = (InstanceRole.RELAXED, InstanceRole.STRICT)


def test_an_idle_strict_instance_pulls_offline_decodes() -> None:
    ctx = PolicyContext(len(ROLES), ROLES, SLO, {}, seed=3)
    setups = [InstanceSetup(r, 512, 1500, MODEL, 1000.0, max_batch_reqs=64) for r in ROLES]
    sim = Simulator(setups, make_policy("ooco", ctx), link_bytes_per_s=10e9, horizon_s=300.0)
    # Offline work only: nothing is ever pushed to the strict instance, and OOCO dispatches
    # offline requests to relaxed instances alone, so the strict one starts (and stays) idle.
    reqs = [SimRequest(f"off{k}", RequestClass.OFFLINE, 0.1 * k, 400, 300) for k in range(16)]
    rec = sim.run(reqs)
    assert all(r.finish_s is not None for r in rec.requests)
    pulled = [r for r in rec.requests if r.instance_id == 1]
    assert pulled and all(r.num_migrations == 1 for r in pulled)
