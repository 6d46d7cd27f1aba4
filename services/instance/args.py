"""`python -m services.instance`'s command line: the bus, the slot and the policy, the engine
and its model, the KV data plane, CPU attention and the offline chunking."""

from __future__ import annotations

import argparse

from services.common.args import add_advertise_host, add_bus_args, add_listen_host
from services.instance.engines import ENGINES
from services.instance.sglang.api import DEFAULT_BOOTSTRAP_PORT, DEFAULT_HANDOFF_TIMEOUT_S
from tidal import envs
from tidal.policy.state import InstanceRole

ROLES = tuple(r.value for r in InstanceRole)


def build_parser(description: str | None) -> argparse.ArgumentParser:
    """`python -m services.instance`'s flags."""
    p = argparse.ArgumentParser(prog="python -m services.instance", description=description)
    add_bus_args(p)
    p.add_argument("--id", default="instance-0", help="instance id (letters, digits, _ -)")
    p.add_argument("--index", type=int, default=0, help="this instance's slot in the config")
    p.add_argument("--config", default="", help="cluster config YAML (default: embedded)")
    p.add_argument("--policy", default="", help="policy name (default: the config's)")
    p.add_argument(
        "--roles",
        default="",
        help="comma-separated role per slot, instead of the config's (the scheduler must be "
        f"given the same): {', '.join(ROLES)}",
    )
    p.add_argument("--engine", default="sim", choices=ENGINES, help="engine to host")
    p.add_argument("--model", default="", help="model path (torch, sglang) or served name (sim)")
    p.add_argument("--tokenizer", default="", help="sim engine: tokenizer (default SmolLM2's)")
    p.add_argument("--device", default="cpu", help="torch device (torch engine): cpu, cuda[:N]")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="torch engine dtype (auto: measured fastest here, or $TIDAL_DTYPE)",
    )
    p.add_argument(
        "--served-model-name", default="", help="the model name clients send (default: MODEL's)"
    )
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    p.add_argument(
        "--cores",
        default="",
        help="pin this instance to these cores (0 or 0-3,6) with one torch thread each, or "
        "--num-threads (default: unpinned)",
    )
    p.add_argument(
        "--core-share",
        default="",
        help="torch: file of the engines sharing this machine's cores; each step then runs on "
        "cores ÷ engines busy (slot = --index)",
    )
    p.add_argument("--max-model-len", type=int, default=0, help="context length (0: model's)")
    p.add_argument(
        "--sglang-url",
        default="",
        help="sglang: attach to this running SGLang server (else start one as a child)",
    )
    p.add_argument(
        "--sglang-decode-url",
        default="",
        help="sglang: with --sglang-url, SGLang PD disaggregation: --sglang-url is a server run "
        "with --disaggregation-mode prefill, this one with --disaggregation-mode decode; every "
        "request goes to both (same bootstrap room) and SGLang pushes its KV prefill -> decode",
    )
    p.add_argument(
        "--sglang-bootstrap-port",
        type=int,
        default=DEFAULT_BOOTSTRAP_PORT,
        help="sglang PD: the prefill server's --disaggregation-bootstrap-port, used when its "
        "/server_info does not report it",
    )
    p.add_argument(
        "--sglang-handoff-timeout-s",
        type=float,
        default=DEFAULT_HANDOFF_TIMEOUT_S,
        help="sglang PD: a prefill server that has not answered, or a decode server that has "
        "brought no token after the prefill answered, within this long fails the handoff "
        "(the request is requeued; SGLang's own wait is 300 s)",
    )
    p.add_argument(
        "--sglang-args",
        default="",
        help='sglang: extra `sglang.launch_server` arguments for the child, e.g. "--tp 2"',
    )
    p.add_argument(
        "--sglang-python",
        default="",
        help="sglang: the Python that has sglang installed (default: this one)",
    )
    p.add_argument(
        "--sglang-start-timeout-s",
        type=float,
        default=900.0,
        help="sglang: how long to wait for the server to answer /health",
    )
    p.add_argument("--kv-cache-tokens", type=int, default=0, help="KV pool size (0: default)")
    p.add_argument(
        "--checkpoint-host-gb",
        type=float,
        default=None,
        help="torch: host memory for offline KV checkpoints (ConServe), GB; a policy such as "
        "aggregated with checkpoint_offline then checkpoints offline decodes and a preemption "
        "frees their blocks at once (default: the config's checkpoint_host_gb; 0: none)",
    )
    p.add_argument(
        "--sim-step-model",
        default="linear",
        help="sim engine latency: zero | linear[:B,P,D,C] | "
        "MODEL@HARDWARE[,tp=N][,kind=K][,profile=PATH]",
    )
    p.add_argument(
        "--policy-step-model",
        default="",
        help="latency model the policy plans with (default: the sim engine's, or the "
        "config's MODEL@HARDWARE roofline for torch)",
    )
    p.add_argument(
        "--cpu-attn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch: offload decode attention to the CPU-attention workers heartbeating on the "
        "bus when the policy says so (OmniServe)",
    )
    add_listen_host(p, "the KV data plane listens")
    add_advertise_host(p)
    p.add_argument("--data-port", type=int, default=0, help="KV data plane port (0: any free)")
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=5.0,
        help="on SIGTERM, let running requests finish this long before aborting",
    )
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        default=envs.OVERLAP.get() not in ("0", "false", "no", "off"),
        help="plan, publish and report only between engine steps, never while one computes "
        f"(services/instance/overlap.py; ${envs.OVERLAP.name}=0 too)",
    )
    for env, flag, kind in (
        (envs.OFFLINE_CHUNK_TOKENS, "--offline-chunk-tokens", int),
        (envs.OFFLINE_CHUNK_S, "--offline-chunk-s", float),
    ):  # an offline request's tokens go out together (`chunks.Coalescing`)
        p.add_argument(flag, type=kind, default=env.get(), help=f"{env.help} (${env.name})")
    return p
