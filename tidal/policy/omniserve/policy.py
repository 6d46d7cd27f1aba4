"""The `omniserve` policy (papers/omniserve.md §3.3): LS = online, BE = offline.

Arrival: LS requests pass the §3.3.3 admission inequality or are rejected early; BE requests wait
in the cluster queue and are dispatched a few at a time. Each step follows the §3.3.2 order —
① LS decode, ② LS chunk prefill (§3.3.4 binary search), ③ BE chunk prefill, ④ BE decode on the
GPU while the TPOT bound holds (§3.3.5) — then BE decodes that did not fit are offloaded to the
CPU-attention workers; offloaded decodes join a step only as far as the layer-wise piggyback
control admits their dense work (§3.3.6) and are recalled by delayed swap-in.
"""

from __future__ import annotations

from tidal.policy.base import ClusterActions, Policy, PolicyContext, Route, StepPlan, parse_params
from tidal.policy.batch_shape import decode_shape
from tidal.policy.omniserve.config import OmniConfig
from tidal.policy.omniserve.control import admit_ls, oldest_first, piggyback_admission
from tidal.policy.plan_builder import PlanBuilder, make_room_for_decodes, split_running
from tidal.policy.registry import register_policy
from tidal.policy.state import ClusterView, CpuPoolState, InstanceState, Phase, ReqState


def ls_admissible(inst: InstanceState, req: ReqState, ttft_s: float, cfg: OmniConfig) -> bool:
    """§3.3.3 on one instance: pending LS prefills + this one beside the LS decodes."""
    pending = [
        (r.prefill_target, r.num_computed_tokens)
        for r in (*inst.waiting, *inst.running)
        if r.is_online and not r.is_decoding and r.phase in (Phase.WAITING, Phase.RUNNING)
    ]
    dec = decode_shape([r.num_computed_tokens for r in inst.running if r.is_online])
    overhead = cfg.num_layers * cfg.comm_overhead_per_layer_s
    return admit_ls(
        inst.step_model, pending, dec, req.num_prompt_tokens, ttft_s, overhead, inst.chunk_size
    )


class OmniServePolicy(Policy):
    def __init__(self, ctx: PolicyContext, cfg: OmniConfig) -> None:
        self.cfg = cfg
        self.slo = ctx.online_slo
        self._slack_steps: dict[int, int] = {}
        self.be_buffer = 2

    def route(self, req: ReqState, cluster: ClusterView, now: float) -> Route:
        if not req.is_online:
            return Route.hold("BE: dispatched when an instance has room")
        # NOTE: LS prompts queue only behind LS prefill (§3.3.2 order: BE prefill comes after),
        # so balance on LS prefill left, not on all queued tokens (BE prompts are ~8k each).
        best = min(cluster.instances, key=lambda i: (_ls_prefill_left(i), i.num_requests))
        ttft = req.slo.ttft_s if req.slo is not None else self.slo.ttft_s
        admit = self.cfg.admission_control and req.slo_admission
        if admit and not ls_admissible(best, req, ttft, self.cfg):
            return Route.reject("omniserve: LS prefill would miss its TTFT SLO (§3.3.3)")
        return Route.to(best.instance_id)

    def tick(self, cluster: ClusterView, now: float) -> ClusterActions:
        return dispatch_be(cluster, self.be_buffer)

    def schedule(self, inst: InstanceState, now: float) -> StepPlan:
        return omni_step(inst, now, self.cfg, self.slo.tpot_s, self._slack_steps)


def _ls_prefill_left(inst: InstanceState) -> int:
    n = 0
    for r in inst.waiting:
        if r.is_online:
            n += r.num_prefill_left
    for r in inst.running:
        if r.is_online:
            n += r.num_prefill_left
    return n


def dispatch_be(cluster: ClusterView, buffer: int) -> ClusterActions:
    """Hand held BE requests to instances with fewer than `buffer` queued and KV room."""
    held = cluster.held
    if not held:
        return ClusterActions()
    out: dict[str, int] = {}
    k = 0
    for inst in cluster.instances:
        n_wait = sum(1 for r in inst.waiting if not r.is_online)
        free = inst.num_free_blocks
        while n_wait < buffer and k < len(held):
            need = inst.blocks_for(held[k].num_prompt_tokens + 1)
            if need > free:
                break
            out[held[k].req_id] = inst.instance_id
            free -= need
            k += 1
            n_wait += 1
    return ClusterActions(dispatch=out) if out else ClusterActions()


class _HostRoom:
    """Host memory left for offloaded KV while a plan is built (the simulator rejects a plan
    that parks more than `host_kv_capacity_tokens`; 0 means unlimited)."""

    __slots__ = ("left",)

    def __init__(self, cpu: CpuPoolState | None) -> None:
        if cpu is None:
            self.left = -1
        elif cpu.host_kv_capacity_tokens <= 0:
            self.left = 1 << 62
        else:
            # NOTE: the CPU decodes in flight are the pool's (`pending_tokens`), every
            # instance's, not one policy object's: live each instance has its own.
            self.left = cpu.host_kv_capacity_tokens - cpu.host_kv_tokens - cpu.pending_tokens

    def take(self, r: ReqState) -> bool:
        if r.num_computed_tokens > self.left:
            return False
        self.left -= r.num_computed_tokens
        return True


def omni_step(
    inst: InstanceState,
    now: float,
    cfg: OmniConfig,
    tpot_s: float,
    slack: dict[int, int],
) -> StepPlan:
    """One OmniServe step on `inst` (§3.3.2 order)."""
    iid = inst.instance_id
    d = cfg.num_layers
    bound = tpot_s - d * cfg.comm_overhead_per_layer_s
    cpu = inst.cpu if cfg.cpu_offload else None
    pig = bool(inst.offloaded) and cpu is not None
    be_bound = bound - d * cfg.piggyback_overhead_per_layer_s if pig else bound
    dec, pre = split_running(inst)
    dec = [r for r in dec if r.phase is Phase.RUNNING]
    victims = make_room_for_decodes(inst, dec, decoding_first=cpu is not None)
    if victims:
        # Out of KV: BE decodes go to the CPU workers (or are preempted without them).
        room = _HostRoom(cpu)
        to_cpu = [r.req_id for r in victims if r.is_decoding and not r.is_online and room.take(r)]
        # NOTE: in victim order; iterating a set of req_ids made runs depend on PYTHONHASHSEED.
        return StepPlan(
            offload=tuple(to_cpu),
            recompute=tuple(r.req_id for r in victims if r.req_id not in to_cpu),
        )
    b = PlanBuilder(inst)
    for r in dec:  # ① LS decode: always
        if r.is_online:
            b.add_decode(r)
    ls_pre = [r for r in pre if r.is_online] + [r for r in inst.waiting if r.is_online]
    for r in ls_pre:  # ② LS chunk prefill (§3.3.4)
        if b.add_prefill(r, bound_s=bound) == 0:
            break
    ls_blocked = any(r.req_id not in b.prefill for r in ls_pre[:1]) and b.budget.free == 0
    be_pre = [r for r in pre if not r.is_online] + [r for r in inst.waiting if not r.is_online]
    reserve = inst.num_blocks // 20  # keep room for decode growth before starting new BE work
    for r in be_pre:  # ③ BE chunk prefill, stricter bound while piggyback results wait
        if r.phase is Phase.WAITING and b.budget.free < reserve:
            break
        if b.add_prefill(r, bound_s=be_bound) == 0:
            break
    # NOTE: the §3.3.3 admission test times an LS prompt beside the LS decodes only, so a step
    # that carries LS prefill must not be lengthened by BE decodes, or admitted prompts miss
    # their TTFT (BE decodes are tens of long-context reads per step). They pause for that
    # step (offloaded ones still piggyback below); BE has no latency target.
    ls_prefilling = any(r.req_id in b.prefill for r in ls_pre)
    offload: list[str] = []
    room = _HostRoom(cpu)
    # The one-shot KV copy of an offload crosses PCIe inside this step (the simulator times it
    # there), so it spends the same TPOT budget as GPU work: §3.3.5 offloads only while the LS
    # decoding SLO holds; a BE decode that fits neither waits for a later step.
    copy_per_token_s = inst.kv_bytes_per_token / inst.pcie_bytes_per_s
    copy_s = 0.0
    for r in dec:  # ④ BE decode on the GPU while the bound holds (§3.3.5)
        if r.is_online or ls_prefilling:
            continue
        if len(b.decode) < inst.max_batch_reqs and b.add_decode(r, bound_s=be_bound - copy_s):
            continue
        c = r.num_computed_tokens * copy_per_token_s
        if b.step_s() + copy_s + c <= bound and room.take(r):
            offload.append(r.req_id)  # overflow: attention on the CPU workers
            copy_s += c
    if ls_blocked and cpu is not None:
        # LS prompt waits for KV: move BE decodes to the CPU to make room.
        more = [r for r in dec if not r.is_online and r.req_id not in b.decode]
        for r in more[:4]:
            c = r.num_computed_tokens * copy_per_token_s
            if r.req_id not in offload and b.step_s() + copy_s + c <= bound and room.take(r):
                offload.append(r.req_id)
                copy_s += c
    cpu_decode: list[str] = []
    if cpu is not None and inst.offloaded and cpu.busy_until_s <= now + 1e-12:
        ready = len(inst.offloaded)
        # §3.3.6: all offloaded requests are at the same layer in this step model; the greedy
        # layer-wise admission reduces to one count.
        got = piggyback_admission(inst.step_model, b.shape, [ready], bound - copy_s)
        # Each CPU decode adds one KV token in host memory, like a GPU decode needs its block.
        n = min(got[0], max(room.left, 0))
        cpu_decode = list(oldest_first(inst.offloaded, n))
    recall: list[str] = []
    has_slack = not offload and b.step_s() <= be_bound and not ls_pre
    slack[iid] = slack.get(iid, 0) + 1 if has_slack else 0
    patience = cfg.swap_in_patience_steps if cfg.delayed_swap_in else 0
    if has_slack and inst.offloaded and slack[iid] > patience:
        # Delayed swap-in (§3.2.4): only a request whose token is out (not in this step's CPU
        # batch) and only if its KV and the next token fit.
        # NOTE: a recall that leaves the GPU decodes no room to grow is undone by an offload a
        # few steps later (live, 1k-token requests ping-ponged hundreds of times in 3 minutes,
        # each a one-shot KV copy both ways): keep a block per GPU decode plus 5 % free after it.
        reserve = len(b.decode) + inst.num_blocks // 20
        for r in inst.offloaded:
            if r.req_id in cpu_decode:
                continue
            if b.budget.free - b.budget.cost(r, 1) >= reserve and b.budget.take(r, 1):
                recall.append(r.req_id)
            break
    if not (b.prefill or b.decode or offload or cpu_decode or recall):
        run = [r for r in inst.running if r.phase is Phase.RUNNING and not r.is_online]
        return StepPlan(recompute=(run[-1].req_id,)) if run and ls_pre else StepPlan()
    plain = not (b.prefill or offload or cpu_decode or recall or inst.waiting or inst.offloaded)
    return StepPlan(
        prefill=b.prefill,
        decode=tuple(b.decode),
        cpu_decode=tuple(cpu_decode),
        offload=tuple(offload),
        recall=tuple(recall),
        max_repeat=4 if plain else 1,
    )


@register_policy("omniserve")
def make_omniserve(ctx: PolicyContext) -> Policy:
    """Factory of `omniserve`; YAML keys are the fields of `OmniConfig`."""
    return OmniServePolicy(ctx, parse_params(OmniConfig, ctx.params, "policy omniserve"))
