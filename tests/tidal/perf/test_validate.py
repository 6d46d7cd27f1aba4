from __future__ import annotations

import numpy as np

from tidal.perf.catalog import hardware_spec, model_spec
from tidal.perf.kernel_timings import read_kernel_timings
from tidal.perf.roofline import RooflineParams
from tidal.perf.validate import dense_s, dense_tables, guess_hardware, heldout_token_mask

from .conftest import write_vidur_csv

NS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024]


def _kt(tmp_path):  # type: ignore[no-untyped-def]
    base = RooflineParams.from_hardware(hardware_spec("h100"))
    write_vidur_csv(tmp_path / "h100_x.csv", model_spec("llama-2-7b"), base, [1, 2], NS)
    return read_kernel_timings(tmp_path / "h100_x.csv")


def test_heldout_token_counts_are_a_fifth_and_never_the_ends(tmp_path) -> None:
    kt = _kt(tmp_path)
    held = heldout_token_mask(kt)
    ns = sorted(set(kt.num_tokens[held].tolist()))
    assert ns == [4.0, 48.0, 256.0]  # NS[2::5]: every 5th distinct count from the 3rd
    assert 1.0 not in ns and 1024.0 not in ns
    assert guess_hardware(kt.source) == "h100"


def test_dense_tables_use_only_the_rows_they_are_given(tmp_path) -> None:
    kt = _kt(tmp_path)
    held = heldout_token_mask(kt)
    tables = dense_tables(kt, ~held)
    for tp, knots in tables.items():
        train_ns = set(kt.num_tokens[(~held) & (kt.tp == tp)].tolist())
        assert {k[0] for k in knots} <= train_ns
        rows = (~held) & (kt.tp == tp)
        y = dict(zip(kt.num_tokens[rows].tolist(), dense_s(kt)[rows].tolist(), strict=True))
        assert all(np.isclose(v, y[n]) for n, v in knots)  # knots are the measurements
