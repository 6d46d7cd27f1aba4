"""The simulator's invariants: every GPU KV block accounted for, every request in one place,
every waiting list highest priority first.

`Simulator(check=True)` (the tests) asserts them after every event; a failure is a bug in the
simulator (`tidal.sim.core`, `tidal.sim.apply`, `tidal.sim.transfers`), not in a policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tidal.policy.state import InstanceState, Phase, ReqState


def check_invariants(
    instances: Sequence[InstanceState],
    queue: Sequence[ReqState],  # the cluster queue (`ClusterView.held`)
    reqs: Mapping[str, ReqState],  # every request that arrived, by id
    reserved: Sequence[int],  # per instance: blocks reserved for KV in flight to it
    cuts: Mapping[str, tuple[int, int]] | None = None,  # chunks cut at a layer boundary
) -> None:
    """Assert the invariants: every block accounted for, every request in one place, every
    cut chunk on a request that still holds it (running: its blocks too) and has it to run."""
    where: dict[str, str] = {}

    def put(r: ReqState, place: str) -> None:
        assert r.req_id not in where, f"{r.req_id} in {where.get(r.req_id)} and {place}"
        where[r.req_id] = place

    for inst in instances:
        i = inst.instance_id
        held = 0
        for name, lst in (
            ("waiting", inst.waiting),
            ("running", inst.running),
            ("swapped", inst.swapped),
            ("offloaded", inst.offloaded),
        ):
            for r in lst:
                put(r, f"{name}@{i}")
                assert r.instance_id == i, f"{r.req_id} listed on {i}, says {r.instance_id}"
                held += r.num_blocks
                if name != "running":
                    assert r.num_blocks == 0, f"{r.req_id} {name} but holds GPU blocks"
                else:
                    need = inst.blocks_for(r.num_computed_tokens)
                    assert r.num_blocks >= need, f"{r.req_id} holds too few blocks"
        assert inst.num_free_blocks >= 0, f"instance {i}: free blocks < 0"
        assert held + inst.num_free_blocks + reserved[i] == inst.num_blocks, (
            f"instance {i}: {held} held + {inst.num_free_blocks} free + "
            f"{reserved[i]} reserved != {inst.num_blocks}"
        )
        assert inst.num_waiting_tokens == sum(r.num_prefill_left for r in inst.waiting)
        w = inst.waiting
        assert all(w[k].priority >= w[k + 1].priority for k in range(len(w) - 1)), (
            f"instance {i}: waiting list not highest priority first"
        )
        ckpt = sum(r.num_checkpointed_tokens for lst in (inst.running, inst.swapped) for r in lst)
        assert ckpt == inst.ckpt_tokens <= max(inst.ckpt_capacity_tokens, 0), (
            f"instance {i}: {ckpt} checkpointed tokens, {inst.ckpt_tokens} counted, "
            f"capacity {inst.ckpt_capacity_tokens}"
        )
    for r in queue:
        put(r, "held")
    for r in reqs.values():
        if r.phase in (Phase.FINISHED, Phase.REJECTED, Phase.MIGRATING):
            put(r, str(r.phase))
        assert r.num_output_tokens <= r.max_output_tokens, f"{r.req_id} overran"
    assert len(where) == len(reqs), "a request is lost"
    for rid, (n, layer) in (cuts or {}).items():
        r = reqs[rid]
        assert r.phase in (Phase.RUNNING, Phase.SWAPPED), f"{rid}: cut chunk but {r.phase}"
        assert r.instance_id is not None
        inst = instances[r.instance_id]
        assert 0 < layer < inst.num_layers, f"{rid}: cut after layer {layer}"
        assert 0 < n <= max(r.num_prefill_left, 1 if r.is_decoding else 0), f"{rid}: cut {n}"
        if r.phase is Phase.RUNNING:
            need = inst.blocks_for(r.num_computed_tokens + n)
            assert r.num_blocks >= need, f"{rid} holds too few blocks for its cut chunk"
