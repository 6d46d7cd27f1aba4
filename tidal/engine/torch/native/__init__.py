"""Native CPU kernels for the torch engine's decode steps (`decode_ops.cpp`) and one-row matmuls
(`gemv.cpp`), with what they share (`vec.h`).

Built on first use with the machine's C++ compiler (`-O3 -march=native`) into a cache keyed by
the source, the flags and the CPU, then loaded with ctypes: no torch headers, so a build takes
about a second, and a ctypes call costs ~1 us where a torch op costs 5-30 us. `load()` returns
None, once logged, where that cannot be done (no compiler, a failed build, `TIDAL_NATIVE=0`):
the engine then runs its plain torch path, which computes the same values.

The attention splits its (row, KV head) pairs over the calling thread's OpenMP team
(`-fopenmp`; built without it where the compiler refuses). The source is plain C++ (no
intrinsics); only the target flags depend on the CPU
(`arch_flag_choices`): `-march=native` where `cpu_caps` allows what this CPU has, with
`-mno-avx512f` on an x86 CPU without AVX-512 or forced to behave as one (`TIDAL_CPU_ISA=avx2`);
if the compiler refuses, `-mcpu=native` (what some aarch64/POWER compilers want), then no
target flag at all, each fallback logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from tidal import envs
from tidal.engine.tokenizer import cache_dir as engine_cache_dir
from tidal.engine.torch import cpu_caps

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = (_HERE / "decode_ops.cpp", _HERE / "gemv.cpp")  # built into one library
HEADERS = (_HERE / "vec.h",)
# -fno-trapping-math lets floor() inline, so the exp loops vectorise; rounding is unchanged
FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp-simd", "-shared", "-fPIC")
# links libgomp.so.1: in a process that loaded torch, torch's own copy (same soname), so the
# kernels' parallel regions run on the team torch's GEMMs use on that thread
OPENMP = "-fopenmp"
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "tidal_add_rms_norm": (_P, _P, _P, _P, _I, _I, _F),
    "tidal_rope_kv_write": (_P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I),
    "tidal_decode_attention": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _P, _I, _P),
    "tidal_decode_attention_rows": (_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _P, _I, _P),
    "tidal_silu_mul": (_P, _P, _I, _I),
}
GEMV = "tidal_gemv_bf16"  # (x, W, bias or None, y, n_in, n_out); its own signature, one variant
# the same kernels for an fp32 model: with bf16 weight copies (`_f32`: fp32 residual, norms, KV,
# bf16 matmul inputs and outputs), and on its fp32 matmuls (`_f32io`: everything fp32)
_SIGNATURES |= {f"{k}_f32": v for k, v in _SIGNATURES.items() if k != "tidal_silu_mul"} | {
    f"{k}_f32io": v for k, v in _SIGNATURES.items()
}


def cache_dir() -> Path:
    """Where built kernels are kept: `native/` under the engine's cache (`TIDAL_CACHE_DIR`)."""
    return engine_cache_dir() / "native"


def _cpu_key() -> bytes:
    """What `-march=native` depends on: the machine and its CPU's feature flags."""
    flags = b""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            flags = next((ln for ln in f if ln.startswith((b"flags", b"Features"))), b"")
    except OSError:
        pass
    return platform.machine().encode() + flags


def arch_flag_choices(caps: cpu_caps.CpuCaps) -> list[tuple[str, ...]]:
    """Target flags to try, best first: the CPU's own ISA as far as `caps` allows it, then
    forms other compilers take, then none (portable, slower)."""
    first: tuple[str, ...] = ("-march=native",)
    if caps.is_x86 and not caps.has_avx512:
        first += ("-mno-avx512f",)  # NOTE: harmless where the CPU has none; binding if forced
    return [first, ("-mcpu=native",), ()]


def build(compiler: str, out_dir: Path, arch: tuple[str, ...] = ("-march=native",)) -> Path:
    """Compile `SOURCES` with `arch` target flags into `out_dir` (atomically: concurrent
    builders race harmlessly)."""
    src = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    flags = (*FLAGS, *arch)
    key = hashlib.sha256(src + " ".join(flags).encode() + _cpu_key()).hexdigest()[:16]
    so = out_dir / f"decode_ops-{key}.so"
    if so.exists():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", tmp],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return so


def _first_error(e: Exception) -> str:
    """The line of a failed build worth logging: the compiler's first error, else its first."""
    lines = (getattr(e, "stderr", "") or str(e)).strip().splitlines() or [repr(e)]
    return next((ln for ln in lines if "error" in ln), lines[0]).strip()[:300]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels, built if needed; None (logged once) where they cannot be had."""
    if envs.NATIVE.get() == "0":
        return None
    compiler = shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")
    if compiler is None:
        log.info("native decode kernels off: no C++ compiler (g++) on PATH; torch ops instead")
        return None
    caps = cpu_caps.probe()
    # OpenMP first (the attention splits over the caller's team), then the same without it (a
    # compiler with no OpenMP runtime: the attention on one thread)
    archs = arch_flag_choices(caps)
    choices = [(*arch, OPENMP) for arch in archs] + archs
    refused: list[str] = []  # why each earlier choice failed
    lib = None
    for arch in choices:
        try:
            lib = ctypes.CDLL(str(build(compiler, cache_dir(), arch)))
            break
        except (OSError, subprocess.SubprocessError) as e:
            refused.append(f"{' '.join(arch) or 'no target flag'}: {_first_error(e)}")
    if lib is None:
        log.warning(
            "native decode kernels off: build failed (%s); torch ops instead", "; ".join(refused)
        )
        return None
    if refused:
        log.warning(
            "native decode kernels built with %s, not %s (%s)",
            " ".join(arch) or "no target flag",
            " ".join(choices[0]),
            "; ".join(refused),
        )
    elif caps.forced:
        log.info(
            "native decode kernels built with %s: TIDAL_CPU_ISA=%s", " ".join(arch), caps.forced
        )
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    gemv = getattr(lib, GEMV)
    gemv.argtypes, gemv.restype = (_P, _P, _P, _P, _I, _I), None
    return lib
