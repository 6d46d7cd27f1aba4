"""Enumerations that travel in wire messages and that every layer (policy, engine, services)
shares. Nothing else lives here."""

from __future__ import annotations

import enum


class RequestClass(enum.StrEnum):
    """Latency class of a request: `online` has TTFT/TPOT SLOs, `offline` is best effort."""

    ONLINE = "online"
    OFFLINE = "offline"
