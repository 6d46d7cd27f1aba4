from __future__ import annotations

from tidal.sim.search import _search


def test_search_grows_then_bisects() -> None:
    # Condition holds below 5.3: doubling 1, 2, 4, 8 (fails), then bisect 6, 5, 5.5, 5.25.
    seen: list[float] = []

    def probe(x: float) -> dict[str, float]:
        seen.append(x)
        return {"x": x}

    best, best_s, probes, sat = _search(probe, lambda s: s["x"] <= 5.3, 1.0, 100.0, 4)
    assert seen == [1.0, 2.0, 4.0, 8.0, 6.0, 5.0, 5.5, 5.25]
    assert best == 5.25 and best_s == {"x": 5.25} and not sat
    assert len(probes) == 8


def test_search_stops_on_saturation() -> None:
    best, _, probes, sat = _search(
        lambda x: {"x": x}, lambda s: True, 1.0, 100.0, 4, lambda x, s: x >= 4
    )
    assert sat and best == 4.0 and len(probes) == 3
