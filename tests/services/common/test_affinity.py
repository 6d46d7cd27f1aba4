"""Core lists (`0`, `0-3,6`), their checks, and pinning a process with its torch threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.common import affinity

ALL = range(8)


@pytest.mark.parametrize(
    ("spec", "cores"),
    [("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)), (" 5 , 1-2 ", (1, 2, 5)), ("2,2,1-2", (1, 2))],
)
def test_parse_cores_reads_lists_and_ranges(spec: str, cores: tuple[int, ...]) -> None:
    assert affinity.parse_cores(spec, allowed=ALL) == cores
    assert affinity.parse_cores(affinity.format_cores(cores), allowed=ALL) == cores


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("", "--engine-cores is empty"),
        ("  ", "--engine-cores is empty"),
        ("0,", "'' is not a core or a range"),
        ("one", "'one' is not a core or a range"),
        ("3-1", "'3-1' is not a range of cores"),
        ("-1", "'-1' is not a core or a range"),
        ("0-9", "core(s) 8-9 not available here (this process may run on 0-7)"),
        ("12,14", "core(s) 12,14 not available here"),
    ],
)
def test_parse_cores_says_what_is_wrong(spec: str, why: str) -> None:
    with pytest.raises(ValueError, match="--engine-cores") as err:
        affinity.parse_cores(spec, "--engine-cores", allowed=ALL)
    assert why in str(err.value)


def test_parse_cores_checks_against_this_process_by_default() -> None:
    mine = sorted(os.sched_getaffinity(0))
    assert affinity.parse_cores(affinity.format_cores(mine)) == tuple(mine)
    with pytest.raises(ValueError, match="not available here"):
        affinity.parse_cores(str(max(mine) + 1))


def test_format_cores_folds_runs() -> None:
    assert affinity.format_cores([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert affinity.format_cores([]) == ""


def test_check_disjoint_names_the_flags_that_overlap() -> None:
    affinity.check_disjoint(a=(0,), b=(1, 2), c=())
    with pytest.raises(ValueError, match="--engine-cores and --cpu-attn-cores share core"):
        affinity.check_disjoint(**{"--engine-cores": (0, 1), "--cpu-attn-cores": (1, 2)})


def test_split_cores_gives_slices_or_shares() -> None:
    assert affinity.split_cores([0, 1, 2, 3, 4], 2) == [(0, 1, 2), (3, 4)]
    assert affinity.split_cores([1], 2) == [(1,), (1,)]  # more workers than cores: they share
    assert affinity.split_cores([1, 2], 0) == []


def test_apply_pins_this_process_to_its_allowed_set_and_sizes_torch() -> None:
    import torch

    mine = affinity.allowed_cores()
    before, env = torch.get_num_threads(), dict(os.environ)
    try:
        assert affinity.apply(mine) == len(mine)
        assert os.sched_getaffinity(0) == mine
        assert torch.get_num_threads() == len(mine)
        assert os.environ["OMP_NUM_THREADS"] == str(len(mine))
    finally:
        torch.set_num_threads(before)
        os.environ.clear()
        os.environ.update(env)


# Pins a fresh interpreter to one core while a thread is already running, then starts another.
PIN_ONE = """
import json, os, sys, threading
from services.common import affinity
ready, done = threading.Event(), threading.Event()
seen = {}
def old():
    ready.set(); done.wait(); seen["old"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=old); t.start(); ready.wait()
n = affinity.apply_spec(sys.argv[1])
done.set(); t.join()
import torch
def new():
    seen["new"] = sorted(os.sched_getaffinity(0)); seen["new_threads"] = torch.get_num_threads()
t2 = threading.Thread(target=new); t2.start(); t2.join()
seen.update(main=sorted(os.sched_getaffinity(0)), threads=torch.get_num_threads(),
            omp=os.environ["OMP_NUM_THREADS"], cores=list(n))
print(json.dumps(seen))
"""


def test_apply_spec_pins_running_and_new_threads_of_a_process() -> None:
    core = max(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", PIN_ONE, str(core)], capture_output=True, text=True, check=True
    )
    seen = json.loads(out.stdout)
    assert seen["main"] == seen["old"] == seen["new"] == seen["cores"] == [core]
    assert seen["threads"] == seen["new_threads"] == 1
    assert seen["omp"] == "1"


def test_apply_spec_of_nothing_leaves_the_process_alone() -> None:
    mine = os.sched_getaffinity(0)
    assert affinity.apply_spec("") == ()
    assert os.sched_getaffinity(0) == mine
