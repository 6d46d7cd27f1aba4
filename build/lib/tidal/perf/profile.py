"""A fitted profile: the parameters of every model one data set supported, as JSON.

    {"format": "tidal-perf-profile/1", "source": "...", "model": "llama-2-7b",
     "hardware": "a100-80gb", "tp": 1,
     "roofline": {RooflineParams fields}, "regression": {"coef": [...]},
     "modulewise": {ModuleWiseParams fields}}

Any section may be missing. Reading and writing files happens here, never in the models.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tidal.perf.roofline import RooflineParams

FORMAT = "tidal-perf-profile/1"


def roofline_to_dict(p: RooflineParams) -> dict[str, Any]:
    d = asdict(p)
    d["gemm_eff"] = [
        {"din": din, "dout": dout, "knots": [list(k) for k in knots]}
        for din, dout, knots in p.gemm_eff
    ]
    return d


def roofline_from_dict(d: dict[str, Any]) -> RooflineParams:
    d = dict(d)
    d["gemm_eff"] = tuple(
        (float(e["din"]), float(e["dout"]), tuple((float(a), float(b)) for a, b in e["knots"]))
        for e in d.get("gemm_eff", ())
    )
    return RooflineParams(**d)


def save_profile(profile: dict[str, Any], path: str | Path) -> None:
    out = {"format": FORMAT, **profile}
    Path(path).write_text(json.dumps(out, indent=2, sort_keys=False) + "\n")


def load_profile(path: str | Path) -> dict[str, Any]:
    d = json.loads(Path(path).read_text())
    if d.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (format={d.get('format')!r})")
    return dict(d)
