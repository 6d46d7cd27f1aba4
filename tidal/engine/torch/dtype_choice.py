"""The torch engine's dtype on CPU, chosen by measured speed rather than by CPU flag.

A CPU flag says bf16 *can* run natively, not that it is faster for this model: at one row a
decode step is a chain of GEMVs bound by memory (bf16 moves half the bytes) or by per-call
overhead (oneDNN's is large at small shapes), and at larger batches by the GEMM kernel each
dtype gets. So `choose_dtype` times this model's own layer matmuls, laid out and dispatched
exactly as `LlamaModel` would (`llama.weight_layout` / `llama.linear`, packed weights for
multi-row calls where `tidal.engine.torch.packed` applies), in fp32 and bf16 at batch 1, 8 and
32 and at a prefill chunk's rows, on the threads set now, and picks the dtype with the lower
geometric mean of the time ratios. The prefill shape matters where oneDNN cannot pack bf16
(AVX2-only CPUs): there bf16 wins ~3x at batch 1 (half the bytes) but loses 2-4x in GEMMs, and
over decode shapes alone the mean sat near 1 and flipped with noise.

The choice is also per shape: where fp32 wins overall but bf16 takes under `SMALL_ROWS_RATIO` of
fp32's time at every calibrated row count up to some r (on AVX2: batch 1, often 8), the fp32
model runs its matmuls of up to r rows on bf16 weight copies (`bf16_weight_rows`, applied by
`LlamaModel.use_bf16_weights`; `small_rows`). A bf16 pick has no such split (fp32 copies for
large rows would be the mirror image; no CPU measured here wanted it). The weights are random, on
enough layers to stream from memory rather than cache (up to `CALIBRATION_BYTES` of bf16). The
choice is kept in `$TIDAL_CACHE_DIR` per CPU, torch version, thread count and model shape, so a
restart (or a noisy moment) does not change it; `TIDAL_DTYPE` or an explicit dtype overrides it.
A choice measured beside other work (`cpu_meter`) is cached too, and measured again at the first
start that finds the machine quiet.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from tidal import envs
from tidal.engine.torch import cpu_caps, cpu_meter, packed
from tidal.engine.torch.engine_config import default_dtype
from tidal.engine.torch.llama import linear, weight_layout
from tidal.engine.torch.model_config import ModelConfig

log = logging.getLogger(__name__)

CANDIDATES = (torch.float32, torch.bfloat16)
PREFILL_ROWS = 128  # a prefill chunk's rows (compute-bound, as every larger chunk is)
BATCHES = (1, 8, 32, PREFILL_ROWS)
CALIBRATION_BYTES = 96 << 20  # > a server CPU's last-level cache, so weights stream from DRAM
MAX_CALIBRATED_PARAMS = 2_000_000_000  # above this, a calibration copy costs too much memory
# bf16 weight copies serve a row count only where bf16 takes under this share of fp32's matmul
# time there: the split costs memory and a bf16 rounding of each matmul's input and output, so a
# near tie (or noise) does not buy it
SMALL_ROWS_RATIO = 0.8


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32" | "bfloat16"
    reason: str
    # dtype -> batch -> best ms of the calibrated layers' matmuls (empty when none measured)
    matmul_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    # dtype -> why it was not measured here (its matmuls raised on this CPU)
    skipped: dict[str, str] = field(default_factory=dict)
    cpu: str = ""  # `CpuCaps.summary()` of the CPU it was measured on ("" when not measured)
    # float32 only: matmuls of up to this many rows run on bf16 weight copies (0: none)
    bf16_weight_rows: int = 0
    # cores of other processes' work while it was measured (`cpu_meter`; 0 when not measured)
    others_busy_cores: float = 0.0

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r} ({self.reason})")
        return dt


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of each fused matmul of one layer."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def calibration_passes(
    cfg: ModelConfig, dtype: torch.dtype, batches: tuple[int, ...] = BATCHES
) -> dict[str, Callable[[], None]]:
    """batch -> one pass over the calibration layers' matmuls in `dtype`, run once already
    (first-call kernel setup, page faults; a dtype this CPU cannot run raises here)."""
    dev = torch.device("cpu")
    transposed, native = weight_layout(dev, dtype)
    shapes = _layer_shapes(cfg)
    layer_bytes = 2 * sum(a * b for a, b in shapes)
    n_layers = max(1, min(cfg.num_hidden_layers, math.ceil(CALIBRATION_BYTES / layer_bytes)))
    g = torch.Generator().manual_seed(0)
    layers = [
        [
            (torch.rand((a, b) if transposed else (b, a), generator=g) * 0.02).to(dtype)
            for a, b in shapes
        ]
        for _ in range(n_layers)
    ]
    # packed copies as `LlamaModel` makes them (multi-row calls run on them)
    pk = cpu_caps.can_pack(dev, dtype)
    packs = [[packed.pack(w.t() if transposed else w) if pk else None for w in ws] for ws in layers]
    out: dict[str, Callable[[], None]] = {}
    for m in batches:
        xs = [torch.rand(m, a, generator=g).to(dtype) for a, _ in shapes]

        def one_pass(xs: list[torch.Tensor] = xs) -> None:
            for ws, ps in zip(layers, packs, strict=True):
                for x, w, p in zip(xs, ws, ps, strict=True):
                    linear(x, w, None, transposed, native, p)

        one_pass()
        out[str(m)] = one_pass
    return out


def time_passes(
    passes: dict[str, dict[str, Callable[[], None]]], reps: int = 5
) -> dict[str, dict[str, float]]:
    """dtype -> batch -> best ms of `reps` runs of its pass. The dtypes take turns at each
    batch, so a burst of other load on a shared machine hits both, and the best run counts
    (load only ever adds time): one-after-the-other medians flipped choices here."""
    times: dict[str, dict[str, list[float]]] = {d: {b: [] for b in ps} for d, ps in passes.items()}
    for b in next(iter(passes.values()), {}):
        for _ in range(reps):
            for d, ps in passes.items():
                t0 = time.perf_counter()
                ps[b]()
                times[d][b].append(time.perf_counter() - t0)
    return {d: {b: 1e3 * min(ts) for b, ts in tb.items()} for d, tb in times.items()}


def _cache_key(cfg: ModelConfig) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    shape = _layer_shapes(cfg)
    dev = torch.device("cpu")
    pk = ",".join(f"{_name(dt)}:{cpu_caps.can_pack(dev, dt)}" for dt in CANDIDATES)
    caps = cpu_caps.probe().summary()
    raw = (
        f"{cpu}|{caps}|{torch.__version__}|{torch.get_num_threads()}|{shape}|packed {pk}"
        f"|rows {BATCHES}|small rows {SMALL_ROWS_RATIO}"
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _cache_path() -> Path:
    from tidal.engine.torch.weights import cache_dir

    return cache_dir() / "dtype-choice.json"


def small_rows(ratios: dict[str, float]) -> int:
    """The largest calibrated row count r such that bf16 takes under `SMALL_ROWS_RATIO` of
    fp32's time at every calibrated count up to r (0: not even at the smallest)."""
    rows = 0
    for b in sorted(ratios, key=int):
        if ratios[b] >= SMALL_ROWS_RATIO:
            break
        rows = int(b)
    return rows


def decide(matmul_ms: dict[str, dict[str, float]], note: str = "") -> DtypeChoice:
    """bf16 or fp32 from measured times: the lower geometric mean of bf16/fp32 time ratios
    (the one measured, if only one was), and for fp32 the rows bf16 copies serve
    (`small_rows`); `note` ends the reason."""
    if len(matmul_ms) == 1:
        (pick,) = matmul_ms
        return DtypeChoice(pick, f"measured: only {pick} runs here{note}", matmul_ms)
    fp, bf = matmul_ms["float32"], matmul_ms["bfloat16"]
    ratios = {b: bf[b] / fp[b] for b in fp}
    gm = math.exp(statistics.fmean(math.log(r) for r in ratios.values()))
    pick = "bfloat16" if gm < 1 else "float32"
    rows = small_rows(ratios) if pick == "float32" else 0
    per = ", ".join(f"{r:.2f} at batch {b}" for b, r in ratios.items())
    split = f", with bf16 weight copies for matmuls of up to {rows} rows" if rows > 1 else ""
    split = ", with bf16 weight copies for one-row matmuls" if rows == 1 else split
    reason = (
        f"measured: bf16 takes {per} of fp32's matmul time (geometric mean {gm:.2f}), so {pick}"
        f"{split}{note}"
    )
    return DtypeChoice(pick, reason, matmul_ms, bf16_weight_rows=rows)


def measure_candidates(cfg: ModelConfig) -> DtypeChoice:
    """Time every candidate this CPU runs and `decide`; the reason says which path bf16 took."""
    passes: dict[str, dict[str, Callable[[], None]]] = {}
    skipped: dict[str, str] = {}
    for dt in CANDIDATES:
        try:
            passes[_name(dt)] = calibration_passes(cfg, dt)
        except RuntimeError as e:  # e.g. a torch build or CPU without this dtype's kernels
            if dt == torch.float32:
                raise
            why = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            skipped[_name(dt)] = why
            log.info("dtype calibration: %s skipped, it cannot run here: %s", _name(dt), why)
    meter = cpu_meter.OthersMeter()
    measured = time_passes(passes)
    others = round(meter.cores(), 2)
    note = "".join(f"; {k} skipped: {v}" for k, v in skipped.items())
    bf = torch.bfloat16
    if _name(bf) in measured and not cpu_caps.can_pack(torch.device("cpu"), bf):
        why = cpu_caps.pack_refusal(bf) or "oneDNN is off in this process"
        note += f"; bf16 timed on plain matmuls (oneDNN bf16 packing off: {why})"
    if others > cpu_meter.LOADED_CORES:
        note += f"; measured beside {others:.2f} cores of other work (re-measured when quiet)"
    choice = decide(measured, note)
    return replace(
        choice, skipped=skipped, cpu=cpu_caps.probe().summary(), others_busy_cores=others
    )


def weight_rows(choice: DtypeChoice) -> int:
    """The rows bf16 weight copies serve for this chosen dtype: `TIDAL_BF16_WEIGHT_ROWS` when
    set, else the measured split."""
    env = envs.BF16_WEIGHT_ROWS.get()
    return int(env) if env else choice.bf16_weight_rows


def choose_dtype(cfg: ModelConfig, device: torch.device, use_cache: bool = True) -> DtypeChoice:
    """The dtype the engine should run `cfg` in on `device` (see the module docstring)."""
    if env := envs.DTYPE.get():
        return DtypeChoice(env, "TIDAL_DTYPE")
    if device.type != "cpu":
        return DtypeChoice(_name(default_dtype(device)), f"{device.type}: bf16")
    if cfg.num_params() > MAX_CALIBRATED_PARAMS:
        dt = _name(default_dtype(device))
        return DtypeChoice(dt, f"model too large to calibrate; {dt} by CPU flag")
    key = _cache_key(cfg)
    path = _cache_path()
    if not use_cache:
        return measure_candidates(cfg)
    if (hit := _cached(path, key)) is not None and not _remeasure(hit):
        return hit
    # One calibration at a time on this machine: sibling instances starting together (`tidal
    # up` starts two) each timed its matmuls under the other's load, and one such run cached
    # bf16 at 28x fp32's batch-1 time on a CPU where it takes 0.3x. The second waits, then
    # reads what the first measured.
    with _calibration_lock(path):
        if (hit := _cached(path, key)) is not None and not _remeasure(hit):
            return hit
        choice = measure_candidates(cfg)
        if hit is not None and choice.others_busy_cores >= hit.others_busy_cores:
            return hit  # no quieter than the cached one after all: keep that
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
        cached[key] = asdict(choice)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(cached, indent=1))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
    return choice


def _remeasure(hit: DtypeChoice) -> bool:
    """Whether a cached choice was measured under load and the machine is quiet now: then it is
    measured again (once quiet, for good). A loaded machine keeps the cached one, so a busy
    host does not pay a calibration at every start."""
    if hit.others_busy_cores <= cpu_meter.LOADED_CORES:
        return False
    quiet = cpu_meter.others_busy_now() < cpu_meter.QUIET_CORES
    if quiet:
        log.info(
            "dtype calibration: the cached one was measured beside %.2f cores of other work; "
            "the machine is quiet now, measuring again",
            hit.others_busy_cores,
        )
    return quiet


def _cached(path: Path, key: str) -> DtypeChoice | None:
    """The choice cached under `key` in `path`, or None."""
    try:
        c = json.loads(path.read_text())[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return DtypeChoice(
        c["dtype"],
        c["reason"] + " (cached)",
        c.get("matmul_ms", {}),
        c.get("skipped", {}),
        c.get("cpu", ""),
        c.get("bf16_weight_rows", 0),
        c.get("others_busy_cores", 0.0),
    )


@contextlib.contextmanager
def _calibration_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s lock file (flock: released if the holder dies); none where
    the file cannot be made (a read-only cache: each process then measures alone, as before)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
