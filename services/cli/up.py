"""`tidal up`: the embedded stack in one command — nats-server, scheduler, CPU-attention workers,
instances and the gateway, each its own process, supervised.

A child that dies unexpectedly is reported by name with its exit reason and restarted with
exponential back-off; the scheduler routes around it meanwhile. Ctrl-C (or SIGTERM) stops the
services first (each drains), then the bus.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path

from services.cli import natsd, state
from services.cli.model_args import check_model_args, instance_model_argv
from services.cli.up_args import add_up_args, parse_pinning, sglang_args
from services.cli.up_procs import Child, http_ok, say, terminate, watch
from services.common import affinity
from services.gateway.auth import API_KEYS_ENV, keys_from
from services.gateway.ratelimit import RateLimiter
from tidal import envs
from tidal.config import live as live_config
from tidal.config.live import load_live_config
from tidal.engine.torch import core_share


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stopping = asyncio.Event()
        self.services: list[Child] = []
        self.nats: list[Child] = []  # one nats-server, or the nodes of --nats-cluster
        self.store_dir = ""
        self.core_share_path: Path | None = None
        self.nats_url_shown = args.nats_url.split("@")[-1]
        self.nats_url = args.nats_url
        self.api_keys = keys_from(args.api_key)
        self.pin = parse_pinning(args)

    def _service(
        self, name: str, module: str, *extra: str, cores: tuple[int, ...] = (), threads: int = 0
    ) -> Child:
        # NOTE: the bus URL (with its token) travels in the environment, not in argv, which any
        # user of the machine can read with `ps`.
        argv = [sys.executable, "-m", module, "--id", name, *extra]
        env = {"TIDAL_LOG_LEVEL": self.args.log_level, "TIDAL_NATS_URL": self.nats_url}
        if self.nats:  # the bus is ours: streams get a copy on each node, up to 3
            env[envs.NATS_REPLICAS.name] = str(min(len(self.nats), 3))
        if name.startswith("gateway") and self.api_keys:
            env[API_KEYS_ENV] = ",".join(self.api_keys)
        if cores:  # torch's OpenMP pool is sized from the environment when torch loads
            argv += ["--cores", affinity.format_cores(cores)]
            env.update(affinity.thread_env(threads or len(cores)))
        return Child(name, argv, env=env, cores=cores)

    def plan(self) -> list[Child]:
        a = self.args
        pin = self.pin
        policy_args = ["--policy", a.policy] + (["--config", a.config] if a.config else [])
        if a.instances:  # the same roles for the scheduler's policy and every instance's
            policy_args += ["--roles", ",".join(parse_roles(a.instances))]
        children = [self._service("scheduler-0", "services.scheduler", *policy_args)]
        children[0].cores = pin.service
        addr = ["--advertise-host", a.advertise_host] if a.advertise_host else []
        gib = ["--capacity-gib", str(a.cpu_attn_gib), *addr]
        gib += ["--host", a.data_host] if a.data_host else []
        num_workers = num_cpu_attn(a.cpu_attn)
        children += [
            self._service(
                f"cpu-attn-{i}",
                "services.cpu_attn",
                *gib,
                *(["--num-threads", str(threads)] if cores else []),
                cores=cores,
                threads=threads,
            )
            for i, (cores, threads) in enumerate(pin.cpu_attn_slices(num_workers))
        ]
        num_instances = len(load_live_config(a.config, a.policy, a.instances).slots)
        # NOTE: instances share this machine's cores; without a split, each torch engine would
        # start one thread per core and they would fight over them. This split is where they
        # start; with a core share each step then runs on cores ÷ instances busy at the time
        # (tidal.engine.torch.core_share), so a lone stream gets every core.
        threads = max(1, len(pin.engine or affinity.allowed_cores()) // num_instances)
        share: list[str] = []
        if a.engine == "torch" and num_instances > 1 and not a.fixed_threads:
            path = Path(tempfile.gettempdir()) / f"tidal-cores-{os.getpid()}.bin"
            core_share.create(path, num_instances)
            self.core_share_path = path
            share = ["--core-share", str(path)]
        for i in range(num_instances):
            extra = [
                *policy_args,
                "--index",
                str(i),
                "--engine",
                a.engine,
                "--sim-step-model",
                a.sim_step_model,
                "--num-threads",
                str(threads),
                *share,
                *addr,
            ]
            if a.data_host:
                extra += ["--data-host", a.data_host]
            extra += instance_model_argv(a)
            if a.max_model_len:
                extra += ["--max-model-len", str(a.max_model_len)]
            if a.kv_cache_tokens:
                extra += ["--kv-cache-tokens", str(a.kv_cache_tokens)]
            if a.engine == "sglang":
                extra += sglang_args(a, i, num_instances)
            children.append(
                self._service(
                    f"instance-{i}", "services.instance", *extra, cores=pin.engine, threads=threads
                )
            )
        backlog = ["--max-backlog", str(a.max_offline_backlog)] if a.max_offline_backlog else []
        inflight = ["--max-inflight", str(a.batch_max_inflight)]
        lane = ["--config", a.config] if a.config else []  # its lowest class takes the lines
        children.append(self._service("batch-0", "services.batch", *backlog, *inflight, *lane))
        gateway = ["--host", a.host, "--port", str(a.port)]
        gateway += ["--config", a.config] if a.config else []  # its request classes
        if a.rate_limit:
            gateway += ["--rate-limit", str(a.rate_limit), "--rate-burst", str(a.rate_burst)]
        children.append(self._service("gateway-0", "services.gateway", *gateway))
        children[-2].cores = children[-1].cores = pin.service
        return children

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        if not natsd.port_is_free(self.args.host, self.args.port):
            say(f"port {self.args.port} on {self.args.host} is in use; pick another with --port")
            return 1
        natsd.reserve(self.args.port)  # the gateway binds it last: no NATS node may take it
        try:
            if not self.nats_url and not await self._start_nats():
                return 1
            self.services = self.plan()
            for child in self.services:
                await child.start()
            watchers = [
                asyncio.create_task(watch(c, self.stopping)) for c in self.services + self.nats
            ]
            api = f"http://{self.args.host}:{self.args.port}/v1"
            ready = asyncio.create_task(self._announce_when_ready(api))
            await self.stopping.wait()
            ready.cancel()
            say("stopping (services drain first, then the bus)")
            await self._stop_all(watchers)
            return 0
        finally:
            state.clear_state()
            if self.core_share_path is not None:
                self.core_share_path.unlink(missing_ok=True)

    async def _start_nats(self) -> bool:
        port = natsd.free_port()
        # NOTE: the store outlives `tidal up`: batches, their files and queued lines are still
        # there after a restart (one store per gateway port, so two stacks never share one).
        self.store_dir = self.args.store_dir or str(
            Path(envs.CACHE_DIR.get()) / f"jetstream-{self.args.port}"
        )
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        # A token of this run's own: nothing on the machine joins the bus anonymously. `tidal
        # ctl` reads it from the state file (mode 0600).
        token = secrets.token_urlsafe(24)
        if self.args.nats_cluster > 1:
            return await self._start_nats_cluster(token)
        argv = natsd.nats_server_argv(
            port, self.store_dir, sync_always=self.args.sync_always, auth_token=token
        )
        self.nats = [Child("nats-server", argv, cores=self.pin.service)]
        self.nats_url = f"nats://{token}@127.0.0.1:{port}"
        self.nats_url_shown = f"nats://127.0.0.1:{port}"
        await self.nats[0].start()
        ok = await asyncio.to_thread(natsd.wait_for_port, "127.0.0.1", port, 10.0)
        if not ok:
            say(f"nats-server did not start on port {port}")
            return False
        say(f"nats-server (JetStream) on {self.nats_url_shown}, store {self.store_dir}")
        return True

    async def _start_nats_cluster(self, token: str) -> bool:
        nodes = natsd.cluster_nodes(
            self.args.nats_cluster, self.store_dir, self.args.sync_always, token
        )
        self.nats = [Child(n.name, n.argv, cores=self.pin.service) for n in nodes]
        self.nats_url = ",".join(f"nats://{token}@127.0.0.1:{n.port}" for n in nodes)
        self.nats_url_shown = ",".join(f"nats://127.0.0.1:{n.port}" for n in nodes)
        for child in self.nats:
            await child.start()
        for n in nodes:
            if not await asyncio.to_thread(natsd.wait_for_port, "127.0.0.1", n.port, 10.0):
                say(f"{n.name} did not start on port {n.port}")
                return False
        say(
            f"NATS cluster of {len(nodes)} nodes (JetStream, streams R={min(len(nodes), 3)}) on "
            f"{self.nats_url_shown}, stores under {self.store_dir}"
        )
        return True

    async def _announce_when_ready(self, api: str) -> None:
        t0 = time.monotonic()
        health = api.removesuffix("/v1") + "/health"
        while not self.stopping.is_set():
            key = self.api_keys[0] if self.api_keys else ""
            if await asyncio.to_thread(http_ok, health) and await asyncio.to_thread(
                http_ok, api + "/models", require_data=True, api_key=key
            ):
                state.write_state(self.nats_url, api)
                say(f"ready in {time.monotonic() - t0:.1f}s")
                print(
                    f"\n  API:   {api}   (OpenAI-compatible; GET {api}/models)\n"
                    f"  NATS:  {self.nats_url_shown}   (token in {state.state_path()};"
                    " tidal ctl status)\n"
                    f"  Stop:  Ctrl-C\n",
                    flush=True,
                )
                return
            await asyncio.sleep(0.2)

    async def _stop_all(self, watchers: list[asyncio.Task[None]]) -> None:
        await terminate([c for c in self.services if c.proc is not None])
        await terminate(self.nats)
        for w in watchers:
            w.cancel()


def parse_roles(spec: str) -> tuple[str, ...]:
    roles = live_config.parse_roles(spec)
    if not roles:
        raise ValueError("--instances names no instance role")
    return roles


def has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def num_cpu_attn(requested: int | None) -> int:
    """CPU-attention workers to start: as asked, else one where torch is installed (they hold KV
    as tensors) and none in a control-plane install."""
    return (1 if has_torch() else 0) if requested is None else requested


def _run(args: argparse.Namespace) -> int:
    try:
        check_model_args(args)
        if not has_torch() and (args.engine == "torch" or (args.cpu_attn or 0) > 0):
            what = "the torch engine" if args.engine == "torch" else "--cpu-attn workers"
            raise ValueError(
                f"{what} need PyTorch, which this install lacks: pip install "
                "'tidal-serve[engine]' (or run the control plane alone with --engine sim)"
            )
        if args.instances:
            parse_roles(args.instances)
        # A bad config, policy or role fails here, not in every child.
        slots = load_live_config(args.config, args.policy, args.instances).slots
        if args.engine == "sglang":
            sglang_args(args, 0, len(slots))  # --sglang-urls names one server per instance
        if args.port < 1 or args.port > 65535:
            raise ValueError(f"--port {args.port} is not a TCP port")
        if args.cpu_attn is not None and args.cpu_attn < 0:
            raise ValueError("--cpu-attn must be >= 0")
        if args.cpu_attn_gib <= 0:
            raise ValueError("--cpu-attn-gib must be > 0")
        if args.nats_cluster not in (0, 1) and not 3 <= args.nats_cluster <= 7:
            raise ValueError("--nats-cluster takes 3 to 7 nodes (a JetStream cluster needs 3)")
        parse_pinning(args)  # a bad or overlapping core list
        if args.max_offline_backlog < 0:
            raise ValueError("--max-offline-backlog must be >= 0")
        if args.batch_max_inflight < 1:
            raise ValueError("--batch-max-inflight must be >= 1")
        if args.rate_limit:
            RateLimiter(args.rate_limit, args.rate_burst)  # a bad rate fails here
    except ValueError as exc:
        say(str(exc))
        return 2
    return asyncio.run(Supervisor(args).run())


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up",
        help="start the embedded stack (nats + all services)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_up_args(up, model_required=False)
    up.set_defaults(func=_run)
    serve = sub.add_parser(
        "serve",
        help="serve MODEL (a local HF directory or GGUF file) with the whole stack, as "
        "`vllm serve MODEL`: `tidal up MODEL`",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_up_args(serve, model_required=True)
    serve.set_defaults(func=_run)
