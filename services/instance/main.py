"""An instance worker: hosts one engine, runs the instance half of the cluster's policy before
every step, takes requests and migrations over NATS, streams tokens back.

python -m services.instance --id instance-0 --index 0 --engine sim [--config FILE --policy NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common import affinity, net, torch_threads
from services.common.bus import connect, subscribe
from services.common.heartbeat import heartbeat_loop
from services.common.lifecycle import run_service
from services.common.torch_threads import ComputeThread
from services.instance.args import build_parser
from services.instance.chunks import Coalescing
from services.instance.dataplane import DataPlaneServer
from services.instance.engines import build_engine
from services.instance.migration import Migrator
from services.instance.policy_adapter import PolicyAdapter
from services.instance.preempt import Preemptor
from services.instance.worker import Instance
from tidal import envs
from tidal.config.live import LiveConfig, load_live_config
from tidal.engine.api import CheckpointingEngine, ControllableEngine
from tidal.perf.spec import parse_step_model
from tidal.policy.registry import make_policy
from tidal.policy.state import InstanceRole, Slo
from tidal.schemas import codec, subjects
from tidal.schemas.control import CtlDrain, CtlPolicy, CtlRoles
from tidal.schemas.messages import (
    CancelRequest,
    GenerateRequest,
    Heartbeat,
    InstanceLoad,
    MigrateAbort,
    MigrateCommand,
    MigrateCommit,
    MigrateOffer,
)

if TYPE_CHECKING:
    from services.instance.cpu_attn_link import CpuAttnPool

log = logging.getLogger("tidal.instance")


def heartbeat(inst: Instance, status: str = "") -> Heartbeat:
    load = inst.engine.load()
    return Heartbeat(
        service_id=inst.id,
        kind="instance",
        pid=os.getpid(),
        started_unix_s=inst.started_unix_s,
        sent_unix_s=time.time(),
        status=status or ("draining" if inst.draining else "ok"),
        role=str(inst.adapter.inst.role),
        engine=inst.engine.name,
        model=inst.engine.model_name,
        is_emulated=inst.engine.is_emulated,
        load=InstanceLoad(
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_kv_blocks_used=load.num_kv_blocks_used,
            num_kv_blocks_total=load.num_kv_blocks_total,
            num_online=load.num_online,
            num_offline=load.num_offline,
            num_steps=inst.num_steps,
            last_step_ms=round(inst.last_step_ms, 3),
        ),
        info={
            "policy": inst.adapter.policy.name,
            "data_url": inst.data_url,
            **(engine_info() if (engine_info := getattr(inst.engine, "info", None)) else {}),
        },
    )


class Control:
    """Operator and scheduler control of one instance (JSON): policy, role, chunk, drain."""

    def __init__(self, inst: Instance, live: LiveConfig) -> None:
        self.inst = inst
        self.live = live

    async def on_policy(self, ctl: CtlPolicy, msg: Msg) -> None:
        """The scheduler switched policy (or params / SLO): run the same one here."""
        adapter = self.inst.adapter
        try:
            ctx = self.live.context()
            if ctl.params is not None:
                ctx = dataclasses.replace(ctx, params=ctl.params)
            if ctl.ttft_slo_s and ctl.tpot_slo_s:
                self.inst.default_slo = Slo(ctl.ttft_slo_s, ctl.tpot_slo_s)
            adapter.policy = make_policy(ctl.policy or adapter.policy.name, ctx)
            adapter.reqs.clear()  # fresh ReqStates: the new policy keeps no old bookkeeping
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("policy change refused: %s", exc)
            return
        log.info("instance %s now runs policy %s", self.inst.id, adapter.policy.name)
        self.inst.wake.set()

    async def on_control(self, msg: Msg) -> None:
        try:
            raw = msgspec.json.decode(msg.data or b"{}")
            if not isinstance(raw, dict):
                raise ValueError("expected a JSON object")
            if "instance_id" in raw:
                drain = msgspec.convert(raw, CtlDrain)
                self.inst.draining = not drain.undrain
                out: dict[str, object] = {"draining": self.inst.draining}
            else:
                roles = msgspec.convert(raw, CtlRoles)
                state = self.inst.adapter.inst
                if self.inst.id in roles.roles:
                    state.role = InstanceRole(roles.roles[self.inst.id])
                if self.inst.id in roles.chunk_sizes:
                    size = roles.chunk_sizes[self.inst.id]
                    if size < 1:
                        raise ValueError("chunk size must be >= 1")
                    state.chunk_size = size
                out = {"role": str(state.role), "chunk_size": state.chunk_size}
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            out = {"error": str(exc)}
        if msg.reply:
            await msg.respond(msgspec.json.encode(out))
        await self.inst.report(force=True)


def build_adapter(
    args: argparse.Namespace, live: LiveConfig, engine: ControllableEngine
) -> PolicyAdapter:
    slots = live.slots
    if not 0 <= args.index < len(slots):
        raise ValueError(f"--index {args.index}: the config has {len(slots)} instance slot(s)")
    group = slots[args.index]
    # A torch engine serving a local model directory plans with that model's shape.
    hf_dir = args.engine == "torch" and args.model and (Path(args.model) / "config.json").is_file()
    model = args.model if hf_dir else live.cfg.model
    spec = args.policy_step_model or (
        args.sim_step_model if engine.is_emulated else live.cfg.step_model_spec(model)
    )
    adapter = PolicyAdapter.build(
        policy=make_policy(live.policy, live.context()),
        index=args.index,
        instance_id=args.id,
        role=group.role,
        chunk_size=group.chunk_size,
        max_batch_reqs=group.max_batch_reqs,
        block_size=engine.block_size,
        num_blocks=engine.num_kv_blocks,
        step_model=parse_step_model(spec),
        step_model_spec=spec,
        kv_bytes_per_token=engine.kv_bytes_per_token,
    )
    if engine.capabilities.kv_checkpoint and isinstance(engine, CheckpointingEngine):
        ckpt_engine = engine
        adapter.checkpoint_capacity = lambda: ckpt_engine.checkpoint_capacity_bytes
    elif live.cfg.policy_params(live.policy).get("checkpoint_offline"):
        log.warning(
            "policy %s asks for offline KV checkpoints, but the %s engine keeps none (they "
            "need --engine torch with --checkpoint-host-gb > 0): its victims are recomputed",
            live.policy,
            engine.name,
        )
    return adapter


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    subjects.check_token(args.id, "instance id")
    live = load_live_config(args.config, args.policy, args.roles)
    if args.checkpoint_host_gb is None:  # the config's, where this engine can keep them
        cfg_gb = live.cfg.checkpoint_host_gb
        args.checkpoint_host_gb = cfg_gb if args.engine == "torch" else 0.0
    torch_threads.install(asyncio.get_running_loop())
    compute = ComputeThread("engine")
    # Loading weights can take seconds; the torch engine also times its matmuls (dtype_choice)
    # and packs weights there, on the one thread that will step it.
    engine = await compute.run(build_engine, args)
    torch_threads.single_torch_thread()  # this loop's thread, now that torch may be loaded
    if not isinstance(engine, ControllableEngine):
        raise ValueError(f"engine {engine.name!r} cannot be driven by a policy")
    try:
        adapter = build_adapter(args, live, engine)
        await _serve(args, stop, live, engine, adapter, compute)
    finally:
        if (close := getattr(engine, "close", None)) is not None:
            await compute.run(close)  # an SGLang child stops with its worker


async def _serve(
    args: argparse.Namespace,
    stop: asyncio.Event,
    live: LiveConfig,
    engine: ControllableEngine,
    adapter: PolicyAdapter,
    compute: ComputeThread,
) -> None:
    pool: CpuAttnPool | None = None
    if args.cpu_attn and callable(getattr(engine, "attach_cpu_attn", None)):
        # Imported here: the CPU-attention link moves torch tensors, and a `sim` instance of a
        # control-plane install (no torch) never uses it.
        from services.instance.cpu_attn_discovery import Discovery
        from services.instance.cpu_attn_link import CpuAttnPool

        pool = CpuAttnPool()
        engine.attach_cpu_attn(pool)  # type: ignore[attr-defined]
        adapter.cpu_capacity = pool.capacity
    nc: NATS = await connect(args.nats_url, f"instance-{args.id}", args.connect_timeout_s)
    inst = Instance(
        nc, args.id, engine, adapter, live.cfg.slo, compute, coalescing(args), args.overlap
    )
    migrator = Migrator(inst)
    control = Control(inst, live)
    plane = DataPlaneServer(migrator)
    bind = args.data_host or net.default_bind_host(args.nats_url)
    advertise = net.resolve_advertise_host(bind, args.advertise_host, args.nats_url)
    inst.data_url = await plane.start(bind, args.data_port, advertise)
    hb_s = envs.heartbeat_s()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(nc.drain)
        stack.push_async_callback(plane.close)
        sub = subscribe
        await sub(nc, subjects.instance_submit(args.id), GenerateRequest, inst.on_submit)
        await sub(nc, subjects.CANCEL, CancelRequest, inst.on_cancel)
        await sub(nc, subjects.instance_migrate(args.id), MigrateCommand, migrator.on_command)
        await sub(nc, subjects.migrate_offer(args.id), MigrateOffer, migrator.on_offer)
        await sub(nc, subjects.migrate_commit(args.id), MigrateCommit, migrator.on_commit)
        await sub(nc, subjects.migrate_abort(args.id), MigrateAbort, migrator.on_abort)
        await sub(nc, subjects.CTL_POLICY_CHANGED, CtlPolicy, control.on_policy, json=True)
        await nc.subscribe(subjects.instance_control(args.id), cb=control.on_control)
        await nc.subscribe(subjects.instance_preempt(args.id), cb=Preemptor(inst).on_preempt)
        reaper: asyncio.Task[None] | None = None
        if pool is not None:
            stack.callback(pool.close)
            discovery = Discovery(pool)
            await discovery.start(nc)
            reaper = asyncio.create_task(discovery.reap(stop))
        label = " (emulated timings)" if engine.is_emulated else ""
        log.info(
            "instance %s (slot %d, %s, %s engine%s, model %s, policy %s, data plane %s) ready",
            args.id,
            args.index,
            adapter.inst.role,
            engine.name,
            label,
            engine.model_name,
            adapter.policy.name,
            inst.data_url,
        )
        hb_stop = asyncio.Event()
        beats = asyncio.create_task(heartbeat_loop(nc, lambda: heartbeat(inst), hb_stop, hb_s))
        expiry = asyncio.create_task(migrator.expire_loop(hb_stop))
        await inst.run(stop)
        log.info("instance %s draining", args.id)
        await migrator.close()
        await inst.drain(args.drain_timeout_s)
        await migrator.close()
        hb_stop.set()
        await beats
        await expiry
        if reaper is not None:
            await reaper
        await nc.publish(
            subjects.heartbeat("instance", args.id),
            codec.encode(heartbeat(inst, status="stopped")),
        )
    log.info("instance %s stopped", args.id)


def coalescing(args: argparse.Namespace) -> Coalescing:
    return Coalescing(args.offline_chunk_tokens, args.offline_chunk_s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser(__doc__).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # before torch starts a thread, so every engine thread is born pinned
        affinity.apply_spec(args.cores, args.num_threads)
        coalescing(args)
    except ValueError as exc:
        print(f"instance: {exc}", file=sys.stderr)
        return 2
    return run_service("instance", lambda stop: serve(args, stop))
