"""The text form of an emulated step model, `MODEL@HARDWARE[,tp=N][,kind=K][,profile=PATH]`: what
a live sim-engine instance is told (`--sim-step-model`) so that it emulates the same model the
simulator builds from a config (`make_step_model(model, hardware, tp, kind, profile)`). A plain
`MODEL@HARDWARE` keeps its meaning: one GPU, the uncalibrated roofline."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.perf.api import StepModel
from tidal.perf.catalog import hardware_spec, model_spec
from tidal.perf.factory import KINDS, make_step_model
from tidal.perf.helpers import kv_capacity_tokens
from tidal.perf.linear import DEFAULT_SIM_STEP_MODEL, ZERO_STEP_MODEL, LinearStepModel


@dataclass(frozen=True, slots=True)
class StepModelSpec:
    model: str
    hardware: str
    tp: int = 1
    kind: str = "roofline"
    profile: str | None = None

    def __str__(self) -> str:
        out = f"{self.model}@{self.hardware}"
        if self.tp != 1:
            out += f",tp={self.tp}"
        if self.kind != "roofline":
            out += f",kind={self.kind}"
        if self.profile:
            out += f",profile={self.profile}"
        return out

    def build(self) -> StepModel:
        return make_step_model(self.model, self.hardware, self.tp, self.kind, self.profile)

    def kv_geometry(self, mem_fraction: float) -> tuple[int, int, int]:
        """(KV bytes per token on one of the tp GPUs, layers, KV tokens an instance holds), as
        the simulator counts them (`tidal.sim.build.kv_geometry`)."""
        m, hw = model_spec(self.model), hardware_spec(self.hardware)
        tokens = kv_capacity_tokens(m, hw, self.tp, mem_fraction)
        if tokens < 1:
            raise ValueError(f"{self.model} does not fit the memory of {self.tp}x {self.hardware}")
        return int(m.kv_bytes_per_token(self.tp)), m.num_layers, tokens


def parse_spec(spec: str) -> StepModelSpec:
    """`MODEL@HARDWARE[,tp=N][,kind=K][,profile=PATH]`; ValueError naming what is wrong. The
    model and hardware must be in the catalog (`tidal perf` lists them)."""
    head, *opts = spec.split(",")
    model, sep, hardware = head.partition("@")
    if not sep or not model or not hardware:
        raise ValueError(
            f"step model {spec!r}: expected MODEL@HARDWARE[,tp=N][,kind=K][,profile=PATH]"
        )
    try:
        model_spec(model)
        hardware_spec(hardware)
    except KeyError as e:
        raise ValueError(f"step model {spec!r}: {e.args[0]}") from None
    fields: dict[str, str] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or key not in ("tp", "kind", "profile") or key in fields or not value:
            raise ValueError(f"step model {spec!r}: bad option {opt!r} (tp=N, kind=K, profile=P)")
        fields[key] = value
    try:
        tp = int(fields.get("tp", "1"))
    except ValueError:
        raise ValueError(f"step model {spec!r}: tp must be a whole number") from None
    if tp < 1:
        raise ValueError(f"step model {spec!r}: tp must be at least 1")
    kind = fields.get("kind", "roofline")
    if kind not in KINDS:
        raise ValueError(f"step model {spec!r}: kind must be one of {', '.join(KINDS)}")
    return StepModelSpec(model, hardware, tp, kind, fields.get("profile"))


def parse_step_model(spec: str) -> StepModel:
    """`zero`, `linear` (`DEFAULT_SIM_STEP_MODEL`), `linear:BASE_S,PER_TOKEN_S,DECODE_REQ_S,
    CTX_TOKEN_S` (a `LinearStepModel`: seconds per step, per token, per decoding request, per
    decode context token), or `MODEL@HARDWARE[,tp=N][,kind=K][,profile=PATH]` for a `tidal.perf`
    model (`tidal.perf.spec`; e.g. `llama-2-7b@a100-80gb`, `yi-34b@a100-80gb,tp=2`)."""
    if spec == "zero":
        return ZERO_STEP_MODEL
    if spec == "linear":
        return DEFAULT_SIM_STEP_MODEL
    if spec.startswith("linear:"):
        try:
            coeffs = [float(x) for x in spec.removeprefix("linear:").split(",")]
        except ValueError:
            raise ValueError(f"--sim-step-model {spec!r}: coefficients must be numbers") from None
        if len(coeffs) != 4:
            raise ValueError(f"--sim-step-model {spec!r}: linear takes exactly 4 coefficients")
        base_s, per_token_s, per_decode_req_s, per_ctx_token_s = coeffs
        return LinearStepModel(
            base_s=base_s,
            per_token_s=per_token_s,
            per_decode_req_s=per_decode_req_s,
            per_ctx_token_s=per_ctx_token_s,
            per_attn_pair_s=0.0,
        )
    if "@" in spec:
        return parse_spec(spec).build()
    raise ValueError(
        f"--sim-step-model {spec!r}: expected zero, linear[:...] or "
        "MODEL@HARDWARE[,tp=N][,kind=K][,profile=PATH]"
    )
