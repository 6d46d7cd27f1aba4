"""`tidal/config/limits.py`: the output budget of a request, the one rule the instance (which
runs it) and the scheduler (which plans for it) apply."""

from __future__ import annotations

from tidal.config.limits import fit_max_tokens


def test_a_default_max_tokens_gets_what_the_context_leaves() -> None:
    assert fit_max_tokens(16384, True, 1000, 8192) == 7192
    assert fit_max_tokens(100, True, 1000, 8192) == 100  # the default fits: kept
    assert fit_max_tokens(16384, True, 9000, 8192) == 1  # never below one (the instance rejects)


def test_a_client_set_max_tokens_is_kept_and_an_unknown_context_fits_nothing() -> None:
    assert fit_max_tokens(16384, False, 1000, 8192) == 16384
    assert fit_max_tokens(16384, True, 1000, 0) == 16384
