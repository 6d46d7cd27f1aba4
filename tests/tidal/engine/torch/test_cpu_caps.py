"""What the CPU can run (`tidal.engine.torch.cpu_caps`) and the fallbacks that follow from it: no
oneDNN packing where oneDNN refuses it (an AVX2-only CPU), `TIDAL_CPU_ISA=avx2` to
behave as one here, and native kernels built with the flags the compiler and CPU allow."""

from __future__ import annotations

import logging
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tidal.engine.torch.test_llama import greedy, prompt
from tidal.engine.api import EngineRequest
from tidal.engine.torch import cpu_caps, dtype_choice, native, packed
from tidal.engine.torch.engine_config import default_dtype

CPU = torch.device("cpu")
# torch 2.13's refusal on an AVX2-only CPU, word for word
REFUSAL = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
    "avx512bw, avx512vl and avx512dq"
)


@pytest.fixture(autouse=True)
def fresh_caps() -> Iterator[None]:
    """Each test probes anew, and leaves no answer made under its env behind."""
    cpu_caps.cache_clear()
    yield
    cpu_caps.cache_clear()


def test_unforced_probe_is_torch_and_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIDAL_CPU_ISA", raising=False)
    caps = cpu_caps.probe()
    assert caps.forced == "" and caps.isa == torch.backends.cpu.get_cpu_capability()
    assert cpu_caps.probe() is caps  # cached
    assert caps.has_native_bf16 == bool({"avx512_bf16", "amx_bf16"} & caps.flags)
    assert default_dtype(CPU) == (torch.bfloat16 if caps.has_native_bf16 else torch.float32)


def test_forced_avx2_takes_avx512_amx_and_bf16_packing_away(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIDAL_CPU_ISA", "avx2")
    caps = cpu_caps.probe()
    assert caps.forced == "avx2" and not caps.isa.startswith("AVX512")
    assert not caps.has_avx512 and not caps.has_native_bf16
    assert not [f for f in caps.flags if f.startswith(("avx512", "amx", "avx_ne_convert"))]
    assert "forced by TIDAL_CPU_ISA=avx2" in caps.summary()
    with caplog.at_level(logging.INFO, logger="tidal.engine.torch.cpu_caps"):
        assert not cpu_caps.can_pack(CPU, torch.bfloat16)
        assert not cpu_caps.can_pack(CPU, torch.bfloat16)
    # either oneDNN's own refusal (ONEDNN_MAX_CPU_ISA=AVX2 set too) or the forced one
    why = cpu_caps.pack_refusal(torch.bfloat16)
    assert "avx512" in why.lower() or "AVX-512" in why
    lines = [r.getMessage() for r in caplog.records if "packing off" in r.getMessage()]
    assert lines == [f"oneDNN bfloat16 packing off: {why}; plain matmuls"]  # once
    assert default_dtype(CPU) == torch.float32
    assert cpu_caps.can_pack(CPU, torch.float32)  # oneDNN packs fp32 on AVX2
    if caps.is_x86:
        assert native.arch_flag_choices(caps)[0] == ("-march=native", "-mno-avx512f")


def test_an_unknown_forced_isa_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match=r"TIDAL_CPU_ISA='avx9'.*avx2"):
        cpu_caps.probe()


def test_a_refused_trial_turns_packing_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(REFUSAL)

    monkeypatch.setattr(packed, "pack", refuse)
    with caplog.at_level(logging.INFO, logger="tidal.engine.torch.cpu_caps"):
        assert cpu_caps.pack_refusal(torch.bfloat16) == REFUSAL
        assert not cpu_caps.can_pack(CPU, torch.bfloat16)
    assert [r.getMessage() for r in caplog.records] == [
        f"oneDNN bfloat16 packing off: {REFUSAL}; plain matmuls"
    ]
    assert not cpu_caps.can_pack(CPU, torch.float32)  # fp32's trial is refused the same way


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_engine_without_packing_decodes_as_the_packed_one(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    # the packed GEMM gives F.linear's numbers (bf16: exactly; fp32: to rounding, and a greedy
    # decode's argmax does not move), so the plain path must give the same tokens
    prompts = {"a": prompt(20, 31), "b": prompt(9, 32)}

    def run() -> tuple[dict[str, list[int]], int]:
        engine = make_engine("qwen2", dtype=dtype)
        toks: dict[str, list[int]] = {r: [] for r in prompts}
        for rid, p in prompts.items():  # decoded together: multi-row matmuls
            engine.add(EngineRequest(rid, p, greedy(6)))
        while engine.has_work():
            for ev in engine.step().events:
                toks[ev.req_id] += ev.token_ids
        return toks, len(engine.model.packed_w)

    got_default, num_packed = run()
    assert (num_packed > 0) == (not cpu_caps.pack_refusal(getattr(torch, dtype)))

    def refuse(w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(REFUSAL)

    monkeypatch.setattr(packed, "pack", refuse)
    cpu_caps.cache_clear()
    got_plain, num_plain = run()
    assert num_plain == 0 and got_plain == got_default


@pytest.mark.usefixtures("quiet_machine")  # the second call reads the cache
def test_calibration_under_forced_avx2_is_its_own_cache_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.tidal.engine.torch.test_dtype_choice import TINY

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DTYPE", raising=False)
    real = dtype_choice.calibration_passes
    monkeypatch.setattr(
        dtype_choice, "calibration_passes", lambda cfg, dt: real(cfg, dt, batches=(1, 2))
    )
    monkeypatch.delenv("TIDAL_CPU_ISA", raising=False)
    key_probed = dtype_choice._cache_key(TINY)
    monkeypatch.setenv("TIDAL_CPU_ISA", "avx2")
    cpu_caps.cache_clear()
    assert dtype_choice._cache_key(TINY) != key_probed
    choice = dtype_choice.choose_dtype(TINY, CPU)
    assert "forced by TIDAL_CPU_ISA=avx2" in choice.cpu and choice.skipped == {}
    assert "bf16 timed on plain matmuls (oneDNN bf16 packing off:" in choice.reason
    again = dtype_choice.choose_dtype(TINY, CPU)
    assert again.reason == choice.reason + " (cached)" and again.cpu == choice.cpu


@pytest.mark.usefixtures("quiet_machine")  # the second call reads the cache
def test_a_dtype_that_cannot_run_is_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.tidal.engine.torch.test_dtype_choice import TINY

    def passes(cfg: Any, dt: torch.dtype) -> dict[str, Any]:
        if dt == torch.bfloat16:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'BFloat16'")
        return {"1": lambda: None}

    monkeypatch.setattr(dtype_choice, "calibration_passes", passes)
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DTYPE", raising=False)
    choice = dtype_choice.choose_dtype(TINY, CPU)
    assert choice.dtype == "float32" and set(choice.matmul_ms) == {"float32"}
    assert choice.skipped == {"bfloat16": "\"addmm_impl_cpu_\" not implemented for 'BFloat16'"}
    assert choice.reason.startswith("measured: only float32 runs here; bfloat16 skipped: ")
    assert dtype_choice.choose_dtype(TINY, CPU).skipped == choice.skipped  # kept in the cache


def test_native_flag_choices_per_cpu() -> None:
    def caps(machine: str, *flags: str) -> cpu_caps.CpuCaps:
        return cpu_caps.CpuCaps(machine, "X", frozenset(flags), "")

    assert native.arch_flag_choices(caps("x86_64", "avx2", "avx512f"))[0] == ("-march=native",)
    no512 = native.arch_flag_choices(caps("x86_64", "avx2", "fma"))
    assert no512 == [("-march=native", "-mno-avx512f"), ("-mcpu=native",), ()]
    # nothing x86 on arm: -march=native first (recent GCC/Clang), -mcpu=native, then none
    assert native.arch_flag_choices(caps("aarch64", "asimd", "bf16")) == [
        ("-march=native",),
        ("-mcpu=native",),
        (),
    ]


def _refusing_gxx(tmp_path: Path, flag: str, error: str) -> Path:
    """A g++ that fails, saying `error`, when given `flag`, and is g++ otherwise."""
    cxx = tmp_path / "picky-g++"
    cxx.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" {flag} "*)\n'
        f'  echo "{error}" >&2\n'
        "  exit 1;;\n"
        "esac\n"
        f'exec {shutil.which("g++")} "$@"\n'
    )
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    return cxx


def _load_built_by(
    cxx: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    level: int,
) -> Any:
    """`native.load()` with `cxx` as the compiler, into a fresh cache under `tmp_path`, its
    log records at `level` and above in `caplog`."""
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TIDAL_NATIVE", "1")
    native.load.cache_clear()
    try:
        with caplog.at_level(level, logger="tidal.engine.torch.native"):
            return native.load()
    finally:
        native.load.cache_clear()


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the kernels with")
def test_native_kernels_build_without_march_where_the_compiler_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # a compiler that rejects -march=native, as some aarch64 compilers do
    error = "picky-g++: error: unrecognized command-line option '-march=native'"
    cxx = _refusing_gxx(tmp_path, "-march=native", error)
    lib = _load_built_by(cxx, tmp_path, monkeypatch, caplog, logging.INFO)
    assert lib is not None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("native decode kernels built with ")
    assert "not -march=native" in line and "unrecognized command-line option" in line
    bf = torch.bfloat16  # the kernels work: an RMSNorm of ones is ones
    x, w, h = torch.ones(1, 8, dtype=bf), torch.ones(8, dtype=bf), torch.empty(1, 8, dtype=bf)
    lib.tidal_add_rms_norm(x.data_ptr(), None, w.data_ptr(), h.data_ptr(), 1, 8, 1e-6)
    assert torch.equal(h, torch.ones(1, 8, dtype=bf))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the kernels with")
def test_forced_avx2_builds_the_kernels_without_avx512(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIDAL_CPU_ISA", "avx2")
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TIDAL_NATIVE", "1")
    monkeypatch.delenv("CXX", raising=False)
    if not cpu_caps.probe().is_x86:
        pytest.skip("TIDAL_CPU_ISA=avx2 changes the build flags on x86 only")
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="tidal.engine.torch.native"):
            assert native.load() is not None
    finally:
        native.load.cache_clear()
    assert [r.getMessage() for r in caplog.records] == [
        "native decode kernels built with -march=native -mno-avx512f -fopenmp: TIDAL_CPU_ISA=avx2"
    ]
    (so,) = (tmp_path / "native").glob("decode_ops-*.so")
    if objdump := shutil.which("objdump"):  # no AVX-512 register anywhere in the code
        asm = subprocess.run([objdump, "-d", str(so)], capture_output=True, text=True).stdout
        assert "vfmadd" in asm or "vmul" in asm  # still vectorised (AVX2)
        assert "%zmm" not in asm and "%k1" not in asm


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the kernels with")
def test_a_compiler_without_openmp_builds_the_kernels_on_one_thread(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a compiler that refuses -fopenmp (no OpenMP runtime): the same kernels, built without it
    # (the attention then on the calling thread alone), the fallback logged
    cxx = _refusing_gxx(tmp_path, "-fopenmp", "error: no OpenMP")
    built = _load_built_by(cxx, tmp_path, monkeypatch, caplog, logging.WARNING)
    assert built is not None
    (so,) = (tmp_path / "cache" / "native").glob("decode_ops-*.so")
    assert "gomp" not in subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
    assert any(
        "not -march=native" in r.getMessage() and "-fopenmp" in r.getMessage()
        for r in caplog.records
    )
    g = torch.Generator().manual_seed(6)
    bf, H, Hk, D, T = torch.bfloat16, 9, 3, 64, 40
    qkv = torch.randn(1, (H + 2 * Hk) * D, generator=g).to(bf)
    kc, vc = (torch.randn(T, Hk, D, generator=g).to(bf) for _ in range(2))
    out, scores = torch.empty(1, H * D, dtype=bf), torch.empty(4 * 8 * T)
    built.tidal_decode_attention(
        qkv.data_ptr(), kc.data_ptr(), vc.data_ptr(), None, 0, T, H, Hk, D, D**-0.5,
        scores.data_ptr(), 4, out.data_ptr(),
    )  # fmt: skip
    q = qkv[:, : H * D].view(1, Hk, H // Hk, D).float()
    k, v = (c.transpose(0, 1).unsqueeze(0).float() for c in (kc, vc))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=D**-0.5)
    torch.testing.assert_close(out.float().view(1, Hk, H // Hk, D), ref, atol=2e-2, rtol=0)
