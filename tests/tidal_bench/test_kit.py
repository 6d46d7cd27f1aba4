"""What the bench commands share: percentiles and the JSON report."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tidal_bench import kit
from tidal_bench.kit import pct, save_json


def test_a_report_is_written_with_its_options_and_without_the_command(tmp_path: Path) -> None:
    args = argparse.Namespace(rate=25.0, json="x.json", func=print)
    out = tmp_path / "r.json"
    save_json(str(out), {"args": args, "p50": 1.5, "when": Path("/a")})
    assert json.loads(out.read_text()) == {
        "args": {"rate": 25.0, "json": "x.json"},
        "p50": 1.5,
        "when": "/a",
    }
    save_json("", {"nothing": 1})  # no path: nothing written, no error


def test_percentiles_are_numpys_and_nan_without_values() -> None:
    assert pct([3.0, 1.0, 2.0], 50) == 2.0
    assert pct([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)  # linear between ranks
    assert math.isnan(pct([], 50))


def test_a_stack_that_exits_at_once_is_reported_with_its_log_not_waited_for() -> None:
    from services.cli import natsd
    from tidal_bench.kit import stack

    with (
        pytest.raises(RuntimeError, match=r"(?s)exited .* before serving.*nonsense"),
        stack(natsd.free_port(), "--engine", "nonsense", start_timeout_s=600),
    ):
        pass


def test_cpu_clock_and_children_of_read_proc() -> None:
    kid = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; time.sleep(30)", "--id", "kid-0"]
    )
    try:
        pids = kit.children_of(os.getpid())
        assert pids["kid-0"] == kid.pid
        clock = kit.CpuClock({"me": os.getpid(), "kid-0": kid.pid})
        sum(i * i for i in range(200_000))  # some CPU time of this process's own
        got = clock.read()
        assert set(got["cpu_s"]) == {"me", "kid-0"} and got["cpu_s"]["me"] >= 0
        assert set(got["core_busy"]) >= os.sched_getaffinity(0)
        assert all(0.0 <= b <= 1.0 for b in got["core_busy"].values())
    finally:
        kid.kill()
        kid.wait()


def _fixed_prompt(n: int) -> str:
    """The benches' prompts before `kit.distinct_prompt_maker`: n tokens of "tide tide ...",
    each a prefix of the longer ones (the control case below)."""
    return "tide" + " tide" * max(0, n - 1 - kit.bos_tokens())


def test_distinct_prompts_have_the_asked_length_and_no_shared_first_block() -> None:
    from tidal.engine.sim.tokens import load_sim_tokenizer

    tok = load_sim_tokenizer()
    bos = len(tok.encode("tide")) - 1
    assert all(len(tok.encode("tide" + w)) == bos + 2 for w in kit.PROMPT_WORDS)
    prompt = kit.distinct_prompt_maker(seed=1)
    lengths = [1, 2, 17, 33, 100, 256] * 20
    ids = [tok.encode(prompt(n)) for n in lengths]
    assert [len(x) for x in ids] == [max(n, bos + 1) for n in lengths]
    first_blocks = [tuple(x[:16]) for x in ids if len(x) > 16]  # the torch engine's block
    assert len(set(first_blocks)) == len(first_blocks)
    assert kit.distinct_prompt_maker(seed=1)(50) == kit.distinct_prompt_maker(seed=1)(50)
    # the fixed prompts are each other's prefixes: what a prefix cache serves
    assert tok.encode(_fixed_prompt(100))[:16] == tok.encode(_fixed_prompt(200))[:16]


@pytest.mark.slow
def test_the_torch_engine_computes_every_token_of_distinct_prompts() -> None:
    """The offline limit and the simulator charge every prompt token: so must the live run."""
    from tidal.engine.api import EngineRequest, SamplingParams
    from tidal.engine.sim.tokens import load_sim_tokenizer
    from tidal.engine.torch.loader import load_torch_engine

    tok = load_sim_tokenizer()
    lengths = [40, 120, 33, 200, 64, 150]

    def computed(prompt: Any) -> tuple[int, int]:
        eng = load_torch_engine(None, kv_cache_tokens=4096)
        total = done = 0
        for i, n in enumerate(lengths):
            ids = tok.encode(prompt(n))
            total += len(ids)
            eng.add(EngineRequest(f"r{i}", ids, SamplingParams(max_tokens=1, ignore_eos=True)))
            while eng.has_work():
                done += eng.step().telemetry.num_prefill_tokens
        return total, done

    total, done = computed(kit.distinct_prompt_maker(seed=3))
    assert done == total == sum(lengths)
    total, done = computed(_fixed_prompt)  # each other's prefixes: the cache serves them
    assert total == sum(lengths) and done < total / 2
