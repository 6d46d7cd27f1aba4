"""OmniServe (papers/omniserve.md §3.3): LS/BE co-serving with CPU attention for overflowed BE
decodes. `control` holds the admission inequality (§3.3.3), chunk-prefill binary search (§3.3.4),
BE decode control (§3.3.5) and layer-wise piggyback control (§3.3.6); configured by
`OmniConfig`."""

from __future__ import annotations

from tidal.policy.omniserve.config import OmniConfig
from tidal.policy.omniserve.control import admit_ls, fit_decodes, max_chunk, piggyback_admission

__all__ = ["OmniConfig", "admit_ls", "fit_decodes", "max_chunk", "piggyback_admission"]

# Registers the `omniserve` policy.
from tidal.policy.omniserve import policy as _policy  # noqa: F401
