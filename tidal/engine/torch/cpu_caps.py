"""What this CPU, and the torch build on it, can run: probed once per process.

Why: on an AVX2-only x86 CPU (no AVX-512, no AMX) the default stack did not start.
oneDNN packs bf16 weights only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and torch refuses
otherwise (`mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or
avx512bw, avx512vl and avx512dq`; fp16 needs avx512_fp16 or avx_ne_convert, so even this Zen 4
refuses it). Asking whether oneDNN is enabled, as `can_pack` once did, says nothing about
that, and neither does a CPU flag about what a given torch/oneDNN build accepts. So packing is
asked of oneDNN itself: a one-time trial (pack a tiny weight, run one packed matmul) whose
RuntimeError becomes the reason the engine runs plain matmuls instead. fp32 packs on any
x86 oneDNN runs on (AVX2 included), so only where oneDNN is off or missing.

The rest is what the other CPU-dependent choices read instead of /proc/cpuinfo each:
`engine_config.default_dtype` (native bf16), the native kernels' build flags
(`tidal.engine.torch.native`) and the dtype calibration's cache key (`dtype_choice`).

`TIDAL_CPU_ISA=avx2` forces the answer for an AVX2-only CPU on any x86 machine (tests, and
reproducing that CPU's paths here): no AVX-512 or AMX flags, no AVX-NE-CONVERT, no oneDNN
bf16/fp16 packing (fp32 packing stays), kernels built without AVX-512. It can only take
abilities away. For the libraries' own dispatch to follow, also set torch's
`ATEN_CPU_CAPABILITY=avx2` (ATen's kernels; `isa` then reads "AVX2") and oneDNN's
`ONEDNN_MAX_CPU_ISA=AVX2` (then the trial is refused for real, with torch's message): both are
read once, at first use, so only a fresh process obeys them.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass

import torch

from tidal import envs
from tidal.engine.torch import packed

log = logging.getLogger(__name__)

FORCED_ISAS = ("avx2",)  # what TIDAL_CPU_ISA may say ("" = probe the machine)
# flags an AVX2-only x86 CPU lacks (avx_ne_convert would let oneDNN pack bf16 without AVX-512)
_NOT_ON_AVX2 = ("avx512", "amx", "avx_ne_convert")


@dataclass(frozen=True)
class CpuCaps:
    machine: str  # platform.machine(): "x86_64", "aarch64", ...
    isa: str  # torch's ATen dispatch level: "AVX512", "AVX2", "DEFAULT", "NEON", "SVE256", ...
    flags: frozenset[str]  # /proc/cpuinfo "flags" (x86) / "Features" (arm); empty if unreadable
    forced: str  # TIDAL_CPU_ISA ("" when the machine was probed as it is)

    @property
    def is_x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64", "i386", "i686")

    @property
    def has_avx512(self) -> bool:
        """AVX-512 Foundation usable by code compiled here (the native kernels)."""
        if not self.is_x86:
            return False
        if self.flags:
            return "avx512f" in self.flags
        return self.isa.startswith("AVX512") and not self.forced

    @property
    def has_native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 / AMX-BF16)."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def summary(self) -> str:
        """One line for logs, reports and cache keys."""
        forced = f", forced by TIDAL_CPU_ISA={self.forced}" if self.forced else ""
        avx512 = "AVX-512" if self.has_avx512 else "no AVX-512"
        bf16 = "native bf16" if self.has_native_bf16 else "no native bf16"
        return f"{self.machine}, torch ISA {self.isa}, {avx512}, {bf16}{forced}"


def forced_isa() -> str:
    """TIDAL_CPU_ISA, checked."""
    value = envs.CPU_ISA.get().strip().lower()
    if value and value not in FORCED_ISAS:
        raise ValueError(
            f"{envs.CPU_ISA.name}={value!r}: expected one of {', '.join(FORCED_ISAS)} "
            "(or unset to probe this CPU)"
        )
    return value


def _cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@functools.cache
def probe() -> CpuCaps:
    """This process's answer (cached: neither the CPU nor the env var changes under it)."""
    forced = forced_isa()
    flags = _cpuinfo_flags()
    isa = torch.backends.cpu.get_cpu_capability()
    if forced == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_NOT_ON_AVX2))
        if isa.startswith("AVX512"):
            isa = "AVX2"  # ATen itself keeps AVX-512 unless ATEN_CPU_CAPABILITY=avx2
    return CpuCaps(platform.machine(), isa, flags, forced)


def _pack_trial(dtype: torch.dtype) -> None:
    """Pack a tiny `dtype` weight for oneDNN and run one packed matmul on it."""
    w = torch.ones(16, 32, dtype=dtype)
    packed.linear_packed(torch.ones(2, 32, dtype=dtype), packed.pack(w), None)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether multi-row matmuls of `dtype` on `device` run on oneDNN-packed weights
    (`packed`): oneDNN is on and accepts `dtype` on this CPU (`pack_refusal` logs why not,
    once)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
        and torch.backends.mkldnn.is_available()
        and torch._C._get_mkldnn_enabled()
        and not pack_refusal(dtype)
    )


@functools.cache
def pack_refusal(dtype: torch.dtype) -> str:
    """Why oneDNN cannot run `dtype` matmuls on packed weights here ("" when it can); the
    first refusal of each dtype is logged, once."""
    why = ""
    try:
        _pack_trial(dtype)
    except (RuntimeError, AttributeError) as e:  # AttributeError: a torch without the ops
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not why and probe().forced == "avx2" and dtype != torch.float32:
        why = "TIDAL_CPU_ISA=avx2, as on an AVX2-only CPU (oneDNN needs AVX-512 or AVX-NE-CONVERT)"
    if why:
        name = str(dtype).removeprefix("torch.")
        log.info("oneDNN %s packing off: %s; plain matmuls", name, why)
    return why


def cache_clear() -> None:
    """Forget the answers (tests that change TIDAL_CPU_ISA)."""
    probe.cache_clear()
    pack_refusal.cache_clear()
