"""`tidal up` in a control-plane install (no torch): no CPU-attention workers by default, and a
clear error, before anything starts, for what needs the `[engine]` extra."""

from __future__ import annotations

import pytest

from services.cli import up
from services.cli.main import main


def test_without_torch_the_default_starts_no_cpu_attn_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(up, "has_torch", lambda: False)
    assert up.num_cpu_attn(None) == 0
    assert up.num_cpu_attn(2) == 2
    monkeypatch.setattr(up, "has_torch", lambda: True)
    assert up.num_cpu_attn(None) == 1


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["up", "--engine", "torch"], "the torch engine"),
        (["up", "--engine", "sim", "--cpu-attn", "1"], "--cpu-attn workers"),
    ],
)
def test_without_torch_torch_parts_fail_before_starting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], what: str
) -> None:
    monkeypatch.setattr(up, "has_torch", lambda: False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{what} need PyTorch" in err and "tidal-serve[engine]" in err


@pytest.mark.parametrize(
    ("policy", "instances", "what"),
    [
        ("tidal", "aggregated", "aggregated instances"),
        ("ooco", "aggregated,strict", "aggregated instances"),
        ("tidal", "strict,strict", "no relaxed instance"),
    ],
)
def test_ooco_policies_on_roles_without_relaxed_instances_fail_before_starting(
    capsys: pytest.CaptureFixture[str], policy: str, instances: str, what: str
) -> None:
    # Online prefill goes only to relaxed instances: these stacks would hang every online request.
    argv = ["up", "--engine", "sim", "--policy", policy, "--instances", instances]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"policy {policy} runs on relaxed and strict instances" in err and what in err
