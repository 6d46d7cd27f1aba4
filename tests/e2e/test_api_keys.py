"""`tidal up --api-key` end to end with the openai client: keys are required, and files and
batches are visible only to the key that made them (another key gets 404)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.cli import natsd

pytestmark = [pytest.mark.e2e, pytest.mark.nats]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = natsd.free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tidal-keys-"))
    env = {**os.environ, "TIDAL_STATE_FILE": str(tmp / "up.json"), "TIDAL_API_KEYS": "key-b"}
    env.pop("TIDAL_NATS_URL", None)
    tidal = str(Path(sys.executable).parent / "tidal")
    argv = [tidal, "up", "--engine", "sim", "--port", str(port), "--cpu-attn", "0"]
    argv += ["--api-key", "key-a", "--store-dir", str(tmp / "js"), "--log-level", "WARNING"]
    log = (tmp / "up.log").open("w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (tmp / "up.json").exists():  # written once /v1/models answers (with a key)
            assert time.monotonic() < deadline and proc.poll() is None, (tmp / "up.log").read_text()
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


def test_a_key_is_required_and_both_configured_keys_work(base_url: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(base_url, "wrong").models.list()
    for key in ("key-a", "key-b"):  # --api-key and $TIDAL_API_KEYS
        assert [m.id for m in client(base_url, key).models.list()] == ["tidal-sim"]
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health") as r:
        assert r.status == 200


def test_files_and_batches_belong_to_their_key(base_url: str) -> None:
    a, b = client(base_url, "key-a"), client(base_url, "key-b")
    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tidal-sim", "prompt": "hi", "max_tokens": 2}}  # fmt: skip
    f = a.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")  # fmt: skip
    assert a.files.retrieve(f.id).id == f.id and a.batches.retrieve(batch.id).id == batch.id
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(f.id)
    with pytest.raises(openai.NotFoundError):
        b.files.delete(f.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.cancel(batch.id)
    with pytest.raises(openai.BadRequestError):  # another key's file is no input file of yours
        b.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert f.id not in {x.id for x in b.files.list()}
    assert batch.id not in {x.id for x in b.batches.list()}
    deadline = time.monotonic() + 60
    while (done := a.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, done
        time.sleep(0.2)
    assert done.output_file_id is not None
    assert a.files.content(done.output_file_id).text  # the output belongs to key a too
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)
