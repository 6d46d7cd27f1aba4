from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tidal.policy.state import Slo
from tidal.schemas.enums import RequestClass
from tidal.workload.mix import StreamConfig, build_stream, build_workload
from tidal.workload.traces import data_dir, load_trace


@pytest.fixture
def trace_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "t.csv").write_text(
        "arrival_s,input_tokens,output_tokens\n2.0,30,3\n0.5,10,1\n1.0,20,2\n4.0,40,0\n"
    )
    (tmp_path / "lens.csv").write_text(
        "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n100,10,110,10\n"
        "5000,50,5050,100\n"
    )
    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path))
    return tmp_path


def test_data_dir_from_env(trace_dir: Path) -> None:
    assert data_dir() == trace_dir


def test_trace_sorted_and_rebased(trace_dir: Path) -> None:
    tr = load_trace("t.csv")
    assert tr.arrival_s is not None
    assert tr.arrival_s.tolist() == [0.0, 0.5, 1.5, 3.5]
    assert tr.input_tokens.tolist() == [10, 20, 30, 40]
    assert tr.output_tokens.tolist() == [1, 2, 3, 1]  # 0 outputs clamped to one token


def test_length_table_has_no_arrivals(trace_dir: Path) -> None:
    tr = load_trace("lens.csv")
    assert tr.arrival_s is None and tr.input_tokens.tolist() == [100, 5000]
    with pytest.raises(ValueError, match="no timestamps"):
        build_stream(StreamConfig("lens.csv"), RequestClass.OFFLINE, 10, np.random.default_rng())


def test_missing_file_names_the_data_dir(trace_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="TIDAL_DATA_DIR"):
        load_trace("nope.csv")


def test_stream_window_and_filters(trace_dir: Path) -> None:
    rng = np.random.default_rng(0)
    reqs = build_stream(StreamConfig("t.csv", start_s=0.5), RequestClass.ONLINE, 2.0, rng)
    assert [r.arrival_s for r in reqs] == [0.0, 1.0]  # rows at 0.5 and 1.5, rebased
    lens = StreamConfig("lens.csv", arrival="uniform", rate=2.0, max_input_tokens=1000)
    reqs = build_stream(lens, RequestClass.OFFLINE, 3.0, rng)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert {r.input_tokens for r in reqs} == {100}


def test_workload_mixes_and_tags(trace_dir: Path) -> None:
    slo = Slo(1.0, 0.1)
    w = build_workload(
        StreamConfig("t.csv"), StreamConfig("lens.csv", arrival="uniform", rate=1.0), 4.0, 0, slo
    )
    assert [r.arrival_s for r in w] == sorted(r.arrival_s for r in w)
    assert len({r.req_id for r in w}) == len(w) == 8
    assert all((r.slo == slo) == (r.req_class is RequestClass.ONLINE) for r in w)
    # The offline stream does not perturb the online one.
    w2 = build_workload(
        StreamConfig("t.csv"), StreamConfig("lens.csv", arrival="uniform", rate=3.0), 4.0, 0, slo
    )
    on = [r for r in w if r.req_class is RequestClass.ONLINE]
    assert on == [r for r in w2 if r.req_class is RequestClass.ONLINE]


def test_stream_config_checks() -> None:
    with pytest.raises(ValueError, match="arrival"):
        StreamConfig("x.csv", arrival="weekly")
    with pytest.raises(ValueError, match="rate"):
        StreamConfig("x.csv", arrival="poisson")
    with pytest.raises(ValueError, match="not both"):
        StreamConfig("x.csv", rate=1.0, scale=2.0)


def test_real_azure_trace_shape() -> None:
    # The traces ship inside the repository (data/), so a clone alone finds them.
    tr = load_trace("azure2023_conv.norm.csv")
    assert len(tr) == 19366
    assert tr.arrival_s is not None and tr.arrival_s[0] == 0.0
    assert 3500 < tr.arrival_s[-1] < 3502


def test_input_scale_lengthens_prompts_before_the_filters(trace_dir: Path) -> None:
    rng = np.random.default_rng(0)
    long = StreamConfig("t.csv", input_scale=6.0, max_input_tokens=150)
    reqs = build_stream(long, RequestClass.ONLINE, 10.0, rng)
    # prompts 10/20/30/40 x6 = 60/120/180/240; the cap keeps the first two, at their arrivals
    assert [(r.arrival_s, r.input_tokens) for r in reqs] == [(0.0, 60), (0.5, 120)]  # rebased
    with pytest.raises(ValueError, match="input_scale"):
        StreamConfig("t.csv", input_scale=0)
