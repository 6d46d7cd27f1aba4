from __future__ import annotations

from pathlib import Path

import pytest

from tidal.config.cluster import load_config, override_streams, parse_config
from tidal.sim.build import instance_setups

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BASE = {
    "name": "t",
    "model": "qwen2.5-7b",
    "hardware": "a100-80gb",
    "instances": [{"role": "relaxed"}, {"role": "strict", "chunk_size": 256}],
    "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
    "online": {"source": "azure2023_conv.norm.csv"},
}


@pytest.mark.parametrize(
    "name",
    [
        "ooco",
        "ooco-long",
        "ooco-code",
        "hygen",
        "taichi",
        "taichi-arxiv",
        "omniserve",
        "omniserve-paper",
    ],
)
def test_example_configs_load(name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.name == name
    setups = instance_setups(cfg, cfg.policy)
    assert setups and all(s.num_blocks > 1000 for s in setups)


def test_bad_values_name_the_place() -> None:
    with pytest.raises(ValueError, match=r"instances\[0\].*role"):
        parse_config({**BASE, "instances": [{"role": "boss"}]})
    with pytest.raises(ValueError, match=r"slo.*> 0"):
        parse_config({**BASE, "slo": {"ttft_s": 0, "tpot_s": 1}})
    with pytest.raises(ValueError, match=r"unknown key.*'colour'"):
        parse_config({**BASE, "colour": "blue"})
    with pytest.raises(ValueError, match="mem_fraction"):
        parse_config({**BASE, "mem_fraction": 1.5})


def test_overrides(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text((CONFIGS / "ooco.yaml").read_text())
    cfg = load_config(p, ("instances[1].chunk_size=128", "cpu_workers.count=0", "offline=null"))
    assert cfg.instances[1].chunk_size == 128 and cfg.cpu_workers.count == 0
    assert cfg.offline is None
    cfg = override_streams(cfg, offline_lengths="arxiv.csv", seed=7, duration_s=60)
    assert cfg.offline is not None and cfg.offline.arrival == "uniform"
    assert cfg.seed == 7 and cfg.duration_s == 60
    with pytest.raises(ValueError, match="key=value"):
        load_config(p, ("nonsense",))


def test_policy_instances_and_slo_variants() -> None:
    cfg = load_config(CONFIGS / "taichi.yaml")
    assert [g.role for g in cfg.groups_for("pd-disagg")] == ["prefill", "decode"]
    assert cfg.policy_params("pd-disagg") == {}
    assert cfg.with_slo("sharegpt-slo2").slo.tpot_s == 0.07
    with pytest.raises(ValueError, match="unknown SLO"):
        cfg.with_slo("slo9")


def test_omniserve_paper_mix_is_the_papers() -> None:
    # OmniServe §5.1.1: LongBench-v2 BE requests average 8,952 in / 136 out, at most 12K tokens;
    # the config builds a stand-in from the arXiv table, and LS prompts are first-turn sized.
    import numpy as np

    from tidal.schemas.enums import RequestClass
    from tidal.workload.mix import build_workload

    cfg = load_config(CONFIGS / "omniserve-paper.yaml")
    reqs = build_workload(cfg.online, cfg.offline, 600.0, cfg.seed, cfg.slo)
    be = [r for r in reqs if r.req_class is RequestClass.OFFLINE]
    ls = [r for r in reqs if r.req_class is RequestClass.ONLINE]
    assert 7_500 < np.mean([r.input_tokens for r in be]) < 9_500
    assert max(r.input_tokens for r in be) <= 12_288
    assert 110 < np.mean([r.output_tokens for r in be]) < 160
    assert np.mean([r.input_tokens for r in ls]) < 400
    assert len(ls) / 600 == pytest.approx(4.0, rel=0.1)
    assert len(be) / 600 == pytest.approx(3.04, rel=0.1)
