"""The engines the instance tests run on: the sim engine, and (slow) the torch engine on the
tiny random Llama the engine tests use, in fp32 so that greedy output is batch-invariant; and
one instance service on the sim engine (`instance`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from tests.services.instance.instance_kit import serve_instance
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
    # A lone instance: a policy that prefills and decodes where the request landed.
    async for nc in serve_instance(nats_url, monkeypatch, "aggregated", "aggregated"):
        yield nc
