"""`tidal`'s entry point: bad input is one line naming the problem, exit status 2."""

from __future__ import annotations

import pytest

from services.cli.main import main


def test_a_missing_config_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sim", "run", "--config", "no-such.yaml", "--out", "/tmp/tidal-test-none"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("tidal sim: error: config no-such.yaml does not exist")
    assert "Traceback" not in err and err.count("\n") == 1
