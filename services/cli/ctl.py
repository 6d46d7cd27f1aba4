"""`tidal ctl`: the control plane from a shell. Sends the same JSON as `nats req tidal.ctl.* '{}'`.

tidal ctl status [--json]          cluster picture (every service, its load)
tidal ctl offline pause|resume     stop / restart admitting offline requests
tidal ctl preempt INSTANCE --blocks N | --req ID [--req ID ...] [--swap] [--below-priority P]
                                   free KV there by preempting offline work (and, with
                                   --below-priority, online work of a class below P)
tidal ctl req SUBJECT [JSON]       any control subject, raw JSON reply
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

import nats.errors

from services.cli import state
from services.common.bus import BusUnavailable, connect
from tidal.schemas import subjects


async def request(nats_url: str, subject: str, payload: str, timeout_s: float) -> Any:
    nc = await connect(nats_url, "tidal-ctl", timeout_s)
    try:
        msg = await nc.request(subject, payload.encode(), timeout=timeout_s)
    finally:
        await nc.close()
    return json.loads(msg.data)


def _print_status(status: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Tidal cluster (offline admission "
        f"{'PAUSED' if status.get('offline_paused') else 'open'})"
    )
    for col in (
        "kind",
        "id",
        "status",
        "role",
        "engine",
        "model",
        "running",
        "waiting",
        "kv",
        "attn ms/layer",
        "up s",
    ):
        table.add_column(col)
    for s in status.get("services", []):
        load = s.get("load") or {}
        engine = s.get("engine", "")
        if s.get("emulated"):
            engine += " (emulated)"
        kv = f"{load['num_kv_blocks_used']}/{load['num_kv_blocks_total']}" if load else ""
        running, attn = str(load.get("num_running", "")), ""
        if s["kind"] == "cpu_attn":  # a worker: offloaded requests, KV tokens held
            info = s.get("info") or {}
            running = info.get("offloaded_requests", "")
            kv = f"{info.get('kv_tokens', '?')} tok" if info else ""
            attn = info.get("attn_ms_per_layer", "")
        table.add_row(
            s["kind"],
            s["id"],
            s["status"],
            s.get("role", ""),
            engine,
            s.get("model", ""),
            running,
            str(load.get("num_waiting", "")),
            kv,
            attn,
            str(s.get("uptime_s", "")),
        )
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("services.common.bus").setLevel(logging.ERROR)  # no reconnect chatter
    url = args.nats_url or state.default_nats_url()
    if args.ctl_cmd == "status":
        subject, payload = subjects.CTL_STATUS, "{}"
    elif args.ctl_cmd == "offline":
        subject = (
            subjects.CTL_OFFLINE_PAUSE if args.action == "pause" else subjects.CTL_OFFLINE_RESUME
        )
        payload = "{}"
    elif args.ctl_cmd == "preempt":
        try:
            subject = subjects.instance_preempt(args.instance)
        except ValueError as exc:
            print(f"tidal ctl: {exc}", file=sys.stderr)
            return 2
        body = {"req_ids": args.req or [], "num_blocks": args.blocks, "swap": args.swap}
        if args.below_priority is not None:
            body["below_priority"] = args.below_priority
        payload = json.dumps(body)
    else:
        subject, payload = args.subject, args.payload
        try:
            json.loads(payload)
        except ValueError as exc:
            print(f"tidal ctl: payload is not JSON: {exc}", file=sys.stderr)
            return 2
    try:
        reply = asyncio.run(request(url, subject, payload, args.timeout_s))
    except BusUnavailable as exc:
        print(f"tidal ctl: {exc} (is `tidal up` running? pass --nats-url)", file=sys.stderr)
        return 1
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        print(f"tidal ctl: nobody answered on {subject} (is the scheduler up?)", file=sys.stderr)
        return 1
    if args.ctl_cmd == "status" and not args.json:
        _print_status(reply)
    else:
        print(json.dumps(reply, indent=2))
    return 1 if args.ctl_cmd == "preempt" and reply.get("error") else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ctl",
        help="control plane: status, offline pause/resume, raw requests",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nats-url",
        default="",
        help="bus to use (default: $TIDAL_NATS_URL, else the running `tidal up`)",
    )
    p.add_argument("--timeout-s", type=float, default=3.0, help="reply timeout")
    ctl = p.add_subparsers(dest="ctl_cmd", required=True)
    st = ctl.add_parser("status", help="every service and its load")
    st.add_argument("--json", action="store_true", help="raw JSON, as `nats req` prints it")
    off = ctl.add_parser("offline", help="pause or resume offline admission")
    off.add_argument("action", choices=("pause", "resume"))
    pre = ctl.add_parser(
        "preempt", help="free KV on an instance by preempting offline work (tidal.inst.ID.preempt)"
    )
    pre.add_argument("instance", help="instance id, e.g. instance-0")
    pre.add_argument("--blocks", type=int, default=0, help="free at least this many KV blocks")
    pre.add_argument("--req", action="append", help="preempt this offline request (repeatable)")
    pre.add_argument(
        "--swap",
        action="store_true",
        help="swap victims without a checkpoint to host memory instead of recomputing them",
    )
    pre.add_argument(
        "--below-priority",
        type=int,
        default=None,
        metavar="P",
        help="online requests of a class priority below P may be preempted too (by "
        "recompute, after the offline work); default: offline work only",
    )
    raw = ctl.add_parser("req", help="send JSON to any control subject")
    raw.add_argument("subject", help="e.g. tidal.ctl.status")
    raw.add_argument("payload", nargs="?", default="{}", help="JSON body (default {})")
    p.set_defaults(func=run)
