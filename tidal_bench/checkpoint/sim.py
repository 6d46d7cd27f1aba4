"""The simulator half of `tidal bench checkpoint`: the same scenario on one simulated instance
of a catalogue model and GPU (the simulator's kernel, `tidal.sim.apply`: step times from the
roofline model, copies at `pcie_gb_per_s`). `checkpoint` copies beside each decode step (the
step takes the longer of the two); `checkpoint-sync` copies before it, in a span of its own,
counted in the step. Every figure is simulated."""

from __future__ import annotations

from dataclasses import dataclass

from tidal_bench.checkpoint.engine import MODES, Scenario


@dataclass
class SimFigures:
    mode: str
    decode_step_ms: float  # a decode step before the preemption (checkpoint copy beside it)
    first_step_ms: float  # the first decode step: its checkpoint is the whole prompt's KV
    mean_step_ms: float
    copy_ms: float  # checkpoint copies while decoding, at PCIe speed
    free_ms: float  # the preemption's copy time before its blocks are free
    resume_ms: float  # from resume to every request decoding again
    tokens_recomputed: int
    host_bytes: int


def measure(sc: Scenario, mode: str, model: str, hardware: str, pcie_gb_per_s: float) -> SimFigures:
    from tidal.perf import kv_bytes_per_token, make_step_model, model_spec
    from tidal.plan import StepPlan
    from tidal.policy.state import InstanceRole, InstanceState, Phase, ReqState
    from tidal.schemas.enums import RequestClass
    from tidal.sim.apply import start_span
    from tidal.sim.recorder import Recorder
    from tidal.sim.span import alloc_blocks, finish_span

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    kvb = kv_bytes_per_token(model_spec(model), 1)
    per_req = sc.context + sc.decode + sc.after + 2 * sc.block_size
    blocks = sc.num_requests * -(-per_req // sc.block_size)
    chunk = max(512, sc.context)
    inst = InstanceState(
        0, InstanceRole.AGGREGATED, chunk, 256, sc.block_size, blocks, blocks,
        make_step_model(model, hardware), kvb, pcie_gb_per_s * 1e9,
        ckpt_capacity_tokens=blocks * sc.block_size if mode.startswith("checkpoint") else 0,
    )  # fmt: skip
    rec = Recorder(1, 1.0)
    reqs: dict[str, ReqState] = {}
    for i in range(sc.num_requests):  # prefilled, first token out
        r = ReqState(f"off{i}", RequestClass.OFFLINE, 0.0, sc.context, sc.decode + sc.after + 1)
        r.phase, r.instance_id = Phase.RUNNING, 0
        r.num_computed_tokens, r.num_output_tokens = sc.context, 1
        alloc_blocks(inst, r, sc.context)
        inst.running.append(r)
        reqs[r.req_id] = r
    rids = tuple(reqs)
    now = 0.0

    def run(plan: StepPlan) -> float:
        nonlocal now
        span = start_span(inst, plan, reqs, now, rec)
        finish_span(inst, span, span.end_s, rec)
        took, now = span.end_s - now, span.end_s
        return took

    idle_s = run(StepPlan())  # an empty step: what a moves-only plan costs beyond its copies
    ckpt = rids if mode == "checkpoint" else ()
    sync = mode == "checkpoint-sync"
    steps = []
    for _ in range(sc.decode):  # a sync copy: a span of its own before the step, counted in it
        took = run(StepPlan(checkpoint=rids)) - idle_s if sync else 0.0
        steps.append(took + run(StepPlan(decode=rids, checkpoint=ckpt)))
    before = sum(r.num_computed_tokens for r in reqs.values())
    copy_ms = rec.num_checkpoint_tokens * kvb / (pcie_gb_per_s * 1e9) * 1e3
    preempt = {
        "recompute": StepPlan(recompute=rids),
        "swap": StepPlan(swap_out=rids),
        "checkpoint": StepPlan(release=rids),
        "checkpoint-sync": StepPlan(release=rids),
    }[mode]
    free_s = run(preempt) - idle_s
    assert inst.num_free_blocks == inst.num_blocks
    host = {
        "recompute": 0,
        "swap": before,
        "checkpoint": inst.ckpt_tokens,
        "checkpoint-sync": inst.ckpt_tokens,
    }[mode] * kvb
    restored = sum(r.num_computed_tokens for r in reqs.values())  # what survived, on host
    t0 = now
    swap_in = () if mode == "recompute" else rids
    while True:  # prefill chunks (swap_in first) until every request decodes again
        budget, pf = chunk, {}
        for r in reqs.values():
            if r.num_prefill_left and budget > 0:
                pf[r.req_id] = min(r.num_prefill_left, budget)
                budget -= pf[r.req_id]
        if not pf and not swap_in:
            break
        run(StepPlan(prefill=pf, swap_in=swap_in))
        swap_in = ()
    return SimFigures(
        mode=mode,
        decode_step_ms=sorted(steps)[len(steps) // 2] * 1e3,
        first_step_ms=steps[0] * 1e3,
        mean_step_ms=sum(steps) / len(steps) * 1e3,
        copy_ms=copy_ms,
        free_ms=free_s * 1e3,
        resume_ms=(now - t0) * 1e3,
        tokens_recomputed=before - restored,
        host_bytes=int(host),
    )
