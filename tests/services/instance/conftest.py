"""The engines the instance tests run on: the sim engine, and (slow) the torch engine on the
tiny random Llama the engine tests use, in fp32 so that greedy output is batch-invariant; and
one instance service on the sim engine (`instance`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from services.common.bus import connect
from services.instance import main as instance_main
from tests.services.instance.instance_kit import heartbeat_load
from tests.services.instance.migration_kit import EngineKind, sim_kind, torch_kind
from tests.tidal.engine.conftest import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "llama", "llama")


@pytest.fixture(params=["sim", pytest.param("torch", marks=pytest.mark.slow)])
def engine_kind(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[EngineKind]:
    if request.param == "sim":
        yield sim_kind()
        return
    import torch

    monkeypatch.setenv("TIDAL_DTYPE", "float32")
    threads = torch.get_num_threads()
    try:
        yield torch_kind(str(request.getfixturevalue("tiny_llama_dir")))
    finally:
        torch.set_num_threads(threads)  # the instances set one thread for this process


@pytest.fixture
async def instance(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[NATS]:
    monkeypatch.setenv("TIDAL_HEARTBEAT_S", "0.1")
    # 20 ms per step so a cancel lands mid-request.
    args = instance_main.parse_args(
        [
            "--nats-url",
            nats_url,
            "--id",
            "inst-t",
            "--sim-step-model",
            "linear:0.02,0,0,0",
            "--max-model-len",
            "256",
            # A lone instance: a policy that prefills and decodes where the request landed.
            "--policy",
            "aggregated",
            "--roles",
            "aggregated",
            "--tokenizer",
            "bytes",
        ]
    )
    stop = asyncio.Event()
    task = asyncio.create_task(instance_main.serve(args, stop))
    nc = await connect(nats_url, "test")
    await heartbeat_load(nc)  # the first heartbeat comes after the subscriptions
    try:
        yield nc
    finally:
        stop.set()
        await task
        await nc.drain()
