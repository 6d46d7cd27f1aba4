"""`tidal up --engine-cores/--cpu-attn-cores/--service-cores`: what each service is started with,
the errors for bad core lists, and a worker started with `--cores` running there; also the batch
service's `--batch-max-inflight`, planned the same way."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys

import nats
import pytest

from services.cli import up
from services.cli.main import build_parser, main
from services.cli.up_procs import Child
from services.common import affinity
from tidal.schemas import codec, subjects
from tidal.schemas.messages import Heartbeat


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    # The plan is argv only: pretend this process may use 8 cores, whatever the machine has.
    monkeypatch.setattr(affinity, "allowed_cores", lambda: frozenset(range(8)))


def plan(*argv: str) -> dict[str, Child]:
    args = build_parser().parse_args(["up", "--engine", "sim", *argv])
    assert isinstance(args, argparse.Namespace)
    return {c.name: c for c in up.Supervisor(args).plan()}


def flag(child: Child, name: str) -> str:
    return child.argv[child.argv.index(name) + 1]


def test_pinning_flags_reach_every_service(eight_cores: None) -> None:
    children = plan(
        "--cpu-attn", "3", "--engine-cores", "0-1", "--cpu-attn-cores", "2-6",
        "--service-cores", "7",
    )  # fmt: skip
    instances = [c for n, c in children.items() if n.startswith("instance-")]
    assert len(instances) == 2  # the embedded config: one relaxed, one strict
    for inst in instances:
        assert inst.cores == (0, 1) and flag(inst, "--cores") == "0-1"
        assert flag(inst, "--num-threads") == "1"  # 2 cores / 2 engines
        assert inst.env["OMP_NUM_THREADS"] == "1"
    workers = [children[f"cpu-attn-{i}"] for i in range(3)]
    assert [w.cores for w in workers] == [(2, 3), (4, 5), (6,)]
    assert [flag(w, "--cores") for w in workers] == ["2-3", "4-5", "6"]
    assert [flag(w, "--num-threads") for w in workers] == ["2", "2", "1"]
    for name in ("scheduler-0", "batch-0", "gateway-0"):
        assert children[name].cores == (7,) and "--cores" not in children[name].argv


def test_more_workers_than_cores_share_them_at_one_thread_each(eight_cores: None) -> None:
    children = plan("--cpu-attn", "2", "--engine-cores", "0", "--cpu-attn-cores", "1")
    for i in range(2):
        w = children[f"cpu-attn-{i}"]
        assert w.cores == (1,) and flag(w, "--num-threads") == "1"
    assert flag(children["instance-0"], "--cores") == "0"


def test_without_pinning_flags_nothing_is_pinned() -> None:
    children = plan("--cpu-attn", "1")
    assert all(c.cores == () and "--cores" not in c.argv for c in children.values())


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--engine-cores", "0", "--cpu-attn-cores", "0"], "share core(s) 0"),
        (["--engine-cores", "0-3", "--cpu-attn-cores", "3-5"], "share core(s) 3"),
        (["--engine-cores", "4096"], "--engine-cores '4096': core(s) 4096 not available here"),
        (["--cpu-attn-cores", ""], "--cpu-attn-cores is empty"),
        (["--service-cores", "2-1"], "'2-1' is not a range of cores"),
    ],
)
def test_bad_core_lists_fail_before_anything_starts(
    eight_cores: None, capsys: pytest.CaptureFixture[str], argv: list[str], why: str
) -> None:
    assert main(["up", "--engine", "sim", "--cpu-attn", "0", *argv]) == 2
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("module", ["services.instance", "services.cpu_attn"])
def test_services_refuse_a_core_they_may_not_use(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--cores", "4096"], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "--cores '4096': core(s) 4096 not available here" in out.stderr


def test_a_worker_started_with_cores_runs_there(nats_url: str) -> None:
    core = max(os.sched_getaffinity(0))
    argv = [sys.executable, "-m", "services.cpu_attn", "--nats-url", nats_url, "--id", "w-pin"]
    proc = subprocess.Popen([*argv, "--cores", str(core)], stderr=subprocess.DEVNULL)

    async def first_beat() -> Heartbeat:
        nc = await nats.connect(nats_url)
        try:
            sub = await nc.subscribe(subjects.heartbeat("cpu_attn", "w-pin"))
            msg = await sub.next_msg(timeout=60)
            return codec.decode(msg.data, Heartbeat)
        finally:
            await nc.close()

    try:
        beat = asyncio.run(first_beat())
        assert beat.info["cores"] == str(core)
        assert beat.info["num_threads"] == "1"
        assert os.sched_getaffinity(proc.pid) == {core}
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_batch_max_inflight_reaches_the_batch_service_and_a_bad_one_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert flag(plan("--cpu-attn", "0")["batch-0"], "--max-inflight") == "32"
    assert (
        flag(plan("--cpu-attn", "0", "--batch-max-inflight", "128")["batch-0"], "--max-inflight")
        == "128"
    )
    assert main(["up", "--engine", "sim", "--cpu-attn", "0", "--batch-max-inflight", "0"]) == 2
    assert "--batch-max-inflight must be >= 1" in capsys.readouterr().err
