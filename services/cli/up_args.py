"""The command line of `tidal up` / `tidal serve`, and how it maps to each instance's options."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.cli.model_args import add_model_args
from services.common import affinity
from services.common.args import add_advertise_host, add_listen_host
from services.gateway.ratelimit import add_rate_args


def add_up_args(p: argparse.ArgumentParser, model_required: bool) -> None:
    """The options of `tidal up` and `tidal serve`."""
    add_model_args(p, required=model_required)
    p.add_argument("--nats-url", default="", help="join this NATS server instead of starting one")
    p.add_argument(
        "--engine",
        default="torch",
        choices=("sim", "torch", "sglang"),
        help="instance engine: torch (real model), sim (emulated timings) or sglang (a real "
        "SGLang server per instance; docs/sglang.md)",
    )
    p.add_argument(
        "--sglang-urls",
        default="",
        help="sglang: comma-separated SGLang server per instance, in slot order (default: each "
        "instance starts its own)",
    )
    p.add_argument(
        "--sglang-decode-urls",
        default="",
        help="sglang PD: comma-separated decode server per instance, in slot order (empty: that "
        "instance is not a pair); --sglang-urls then names the prefill servers",
    )
    p.add_argument("--sglang-args", default="", help="sglang: extra launch_server arguments")
    p.add_argument("--sglang-python", default="", help="sglang: the Python that has sglang")
    p.add_argument("--max-model-len", type=int, default=0, help="context length (0: model's)")
    p.add_argument(
        "--kv-cache-tokens", type=int, default=0, help="KV pool of each instance (0: default)"
    )
    p.add_argument(
        "--config",
        default="",
        help="cluster config YAML: instance roles, chunk sizes, SLO, policy params, request "
        "classes (default: configs/embedded.yaml)",
    )
    p.add_argument(
        "--policy",
        default="tidal",
        help="scheduling policy the scheduler and every instance run (tidal policies lists them)",
    )
    p.add_argument(
        "--instances",
        default="",
        help="comma-separated instance roles, one instance each (default: the config's)",
    )
    p.add_argument(
        "--cpu-attn",
        type=int,
        default=None,
        help="number of CPU-attention workers (default: 1, or 0 where PyTorch is not installed)",
    )
    p.add_argument(
        "--max-offline-backlog",
        type=int,
        default=0,
        help="Batch API lines queued over all batches past which a new batch fails (0: none)",
    )
    p.add_argument(
        "--batch-max-inflight",
        type=int,
        default=32,
        help="Batch API lines running at once (the offline load a batch can put on the cluster)",
    )
    p.add_argument(
        "--cpu-attn-gib",
        type=float,
        default=4.0,
        help="host memory each CPU-attention worker holds offloaded KV in, GiB",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="the gateway accepts only this key (repeatable; also $TIDAL_API_KEYS); none: open",
    )
    add_rate_args(p)
    p.add_argument(
        "--store-dir",
        default="",
        help="JetStream store (batches, files, queued lines), kept across restarts "
        "(default: $TIDAL_CACHE_DIR/jetstream-PORT)",
    )
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=0,
        metavar="N",
        help="run N nats-server nodes clustered with routes (3: streams and buckets R=3, "
        "any one node can be lost) instead of one",
    )
    p.add_argument(
        "--sync-always",
        action="store_true",
        help="fsync every JetStream write (batches survive a machine crash too; slower)",
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway address")
    add_listen_host(p, "the instances' KV data planes and the CPU-attention workers listen")
    add_advertise_host(p)
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument(
        "--sim-step-model",
        default="linear",
        help="sim engine latency: zero | linear[:B,P,D,C] | "
        "MODEL@HARDWARE[,tp=N][,kind=K][,profile=PATH]",
    )
    p.add_argument("--log-level", default="INFO", help="log level of every service")
    p.add_argument(
        "--engine-cores",
        default=None,
        help="pin the instances (torch engines) to these cores, e.g. 0 or 0-3,6; threads follow "
        "(default: unpinned, every core)",
    )
    p.add_argument(
        "--cpu-attn-cores",
        default=None,
        help="pin the CPU-attention workers to these cores, disjoint from --engine-cores; each "
        "worker gets its own slice when there are at least as many cores as workers",
    )
    p.add_argument(
        "--service-cores",
        default=None,
        help="pin the control plane (nats-server, scheduler, batch service, gateway) to these "
        "cores; may overlap the others (default: unpinned)",
    )
    p.add_argument(
        "--fixed-threads",
        action="store_true",
        help="torch instances keep cores ÷ instances threads, busy or not (default: each step "
        "runs on cores ÷ instances busy now)",
    )


def sglang_args(a: argparse.Namespace, index: int, num_instances: int) -> list[str]:
    """One instance's `--sglang-*` options: its server from `--sglang-urls` (with its decode
    server from `--sglang-decode-urls`, a PD pair), or its own child."""
    urls = [u for u in a.sglang_urls.split(",") if u] if a.sglang_urls else []
    if urls and len(urls) != num_instances:
        raise ValueError(f"--sglang-urls names {len(urls)} server(s) for {num_instances} instances")
    out = ["--sglang-url", urls[index]] if urls else []
    if decode_urls := getattr(a, "sglang_decode_urls", ""):
        decodes = decode_urls.split(",")
        if not urls or len(decodes) != num_instances:
            raise ValueError(
                f"--sglang-decode-urls names {len(decodes)} server(s) for {num_instances} "
                "instances, each paired with its prefill server in --sglang-urls"
            )
        out += ["--sglang-decode-url", decodes[index]] if decodes[index] else []
    if a.sglang_args:
        out += ["--sglang-args", a.sglang_args]
    if a.sglang_python:
        out += ["--sglang-python", a.sglang_python]
    return out


@dataclass(frozen=True)
class Pinning:
    """Where `tidal up` pins each kind of service; () is unpinned."""

    engine: tuple[int, ...] = ()  # the instances' cores
    cpu_attn: tuple[int, ...] = ()  # the CPU-attention workers' cores, shared out among them
    service: tuple[int, ...] = ()  # nats-server, scheduler, batch service, gateway

    def cpu_attn_slices(self, num_workers: int) -> list[tuple[tuple[int, ...], int]]:
        """(cores, threads) of each worker: its own slice, or all of them at one thread each
        (fewer threads than cores never oversubscribe) when workers outnumber cores."""
        if not self.cpu_attn:
            return [((), 0)] * num_workers
        shared = len(self.cpu_attn) < num_workers
        return [
            (cores, max(1, len(self.cpu_attn) // num_workers) if shared else len(cores))
            for cores in affinity.split_cores(self.cpu_attn, num_workers)
        ]


def parse_pinning(a: argparse.Namespace) -> Pinning:
    """The `--*-cores` options, checked: each a core list of cores this process may use, and the
    engines' disjoint from the workers' (ValueError saying which)."""

    def cores(spec: str | None, flag: str) -> tuple[int, ...]:
        return () if spec is None else affinity.parse_cores(spec, flag)

    pin = Pinning(
        engine=cores(getattr(a, "engine_cores", None), "--engine-cores"),
        cpu_attn=cores(getattr(a, "cpu_attn_cores", None), "--cpu-attn-cores"),
        service=cores(getattr(a, "service_cores", None), "--service-cores"),
    )
    affinity.check_disjoint(**{"--engine-cores": pin.engine, "--cpu-attn-cores": pin.cpu_attn})
    return pin
