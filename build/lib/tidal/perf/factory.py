"""`make_step_model`: one call that turns catalogue names (and optionally a profile) into a
`StepModel` for the simulator, the `sim` engine and the policies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tidal.perf.api import StepModel
from tidal.perf.catalog import hardware_spec, model_spec
from tidal.perf.profile import load_profile, roofline_from_dict
from tidal.perf.roofline import RooflineModel, RooflineParams

KINDS = ("roofline", "regression", "modulewise")


def make_step_model(
    model: str,
    hardware: str,
    tp: int = 1,
    kind: str = "roofline",
    profile: str | Path | dict[str, Any] | None = None,
) -> StepModel:
    """A step-latency model for `model` on `tp` x `hardware`.

    kind: "roofline" (OOCO; uncalibrated datasheet x typical efficiency unless the profile has a
    `roofline` section), "regression" (HyGen) or "modulewise" (OmniServe). The last two need a
    profile with their section: they are pure fits and have no datasheet default.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    m, hw = model_spec(model), hardware_spec(hardware)
    prof = load_profile(profile) if isinstance(profile, str | Path) else (profile or {})
    if kind == "roofline":
        if "roofline" in prof:
            params = roofline_from_dict(prof["roofline"])
        else:
            params = RooflineParams.from_hardware(hw, m.bytes_per_value)
        return RooflineModel(m, params, tp)
    if kind not in prof:
        raise ValueError(f"kind {kind!r} needs a profile with a {kind!r} section (tidal perf fit)")
    if kind == "regression":
        from tidal.perf.regression import RegressionModel

        return RegressionModel(tuple(float(c) for c in prof["regression"]["coef"]))
    from tidal.perf.modulewise import modulewise_from_dict

    return modulewise_from_dict(prof["modulewise"])
