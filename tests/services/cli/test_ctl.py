"""`tidal ctl preempt` against a live sim instance over a real nats-server: it sends the JSON a
person would send with the NATS CLI and prints the instance's answer; exit 1 on a refusal;
`--below-priority` preempts an online request of a lower class."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.cli.main import build_parser
from tests.services.instance.migration_kit import sim_kind
from tests.services.instance.test_preempt import ONE_BY_ONE, decoding, running, start

pytestmark = pytest.mark.nats


async def ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object]]:
    """(exit status, the JSON printed, or {"stderr": ...} when none was)."""
    args = build_parser().parse_args(["ctl", *argv])
    rc = await asyncio.to_thread(args.func, args)  # `tidal ctl` runs its own event loop
    out, err = capsys.readouterr()
    return rc, json.loads(out) if out.strip() else {"stderr": err}


async def test_ctl_preempt_frees_offline_work_and_reports_refusals(
    nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running(nats_url, sim_kind(), *ONE_BY_ONE) as nc:
        off = await start(nc, "a", 60)
        on = await start(nc, "on", 60, req_class="online")  # priority 0
        await decoding(off, on)
        url = ("--nats-url", nats_url)
        rc, reply = await ctl(capsys, *url, "preempt", "inst-p", "--req", "a", "--swap")
        assert rc == 0 and reply["error"] == ""
        assert reply["preempted"] == [{"req_id": "a", "how": "swap", "tokens_lost": 0}]
        rc, reply = await ctl(capsys, *url, "preempt", "inst-p", "--blocks", "100000")
        assert rc == 1 and "fewer than the 100000 asked for" in str(reply["error"])
        rc, reply = await ctl(capsys, *url, "preempt", "inst.p", "--blocks", "1")
        assert rc == 2 and "instance id" in str(reply["stderr"])
        rc, reply = await ctl(
            capsys, *url, "preempt", "inst-p", "--req", "on", "--below-priority", "0"
        )
        assert rc == 1 and "priority 0, not below 0" in str(reply["error"])
        rc, reply = await ctl(
            capsys, *url, "preempt", "inst-p", "--req", "on", "--below-priority", "1"
        )
        assert rc == 0 and reply["preempted"][0]["how"] == "recompute", reply  # type: ignore[index]
        async with asyncio.timeout(30):
            await asyncio.gather(off.done.wait(), on.done.wait())
        off.assert_complete(60)
        on.assert_complete(60)
