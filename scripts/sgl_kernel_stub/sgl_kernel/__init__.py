"""A stand-in for `sgl_kernel` so a real SGLang imports on a CPU with no SGLang kernels.

Only for `make test-sglang` (scripts/sglang_cpu_env.sh puts it on the scratch venv's path);
never on Tidal's own path. SGLang 0.5.23 imports some `sgl_kernel` names at module level on
every device (e.g. `sglang/kernels/ops/kvcache/cache_move.py` imports
`copy_all_layer_kv_cache_cpu`), and the only `sgl_kernel` on PyPI (`sglang-kernel` 0.4.10) is
CUDA-only; SGLang's CPU kernels build only from its repository. With this module:

- every name resolves to a function that raises if called, so a code path that needs a real
  kernel fails loudly instead of computing something else;
- no op is registered under `torch.ops.sgl_kernel`, so SGLang's own check
  (`sglang/srt/utils/common.py::_is_intel_amx_backend_available`, which looks for
  `torch.ops.sgl_kernel.convert_weight_packed`) is false, and its CPU layers take their
  torch-native paths (`forward_native`, `--attention-backend torch_native`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is Tidal's import-only stand-in "
            "(scripts/sgl_kernel_stub): this SGLang path needs SGLang's real CPU kernels"
        )

    missing.__name__ = name
    return missing
