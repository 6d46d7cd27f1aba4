"""Policies by name: ``make_policy("ooco", ctx)``.

A policy module registers its factory with ``@register_policy("name")`` at import time. Lookup
imports the modules listed in `_POLICY_MODULES` first, so callers never import policy modules
themselves; a listed module that does not exist yet is skipped (policies land one by one), any
other import error propagates.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tidal.policy.base import Policy, PolicyContext

PolicyFactory = Callable[[PolicyContext], Policy]

# Modules that register policies when imported; add yours here.
_POLICY_MODULES = (
    "tidal.policy.baselines",
    "tidal.policy.ooco",
    "tidal.policy.hygen",
    "tidal.policy.taichi",
    "tidal.policy.omniserve",
    "tidal.policy.tidal",
)

_FACTORIES: dict[str, PolicyFactory] = {}
_loaded = False


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Decorator: make `factory` available as `name` (lower case, '-' separated)."""

    def deco(factory: PolicyFactory) -> PolicyFactory:
        key = name.lower()
        if key in _FACTORIES and _FACTORIES[key] is not factory:
            raise ValueError(f"policy {name!r} is registered twice")
        _FACTORIES[key] = factory
        return factory

    return deco


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for mod in _POLICY_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:  # the module exists but something it imports is missing
                raise
    _loaded = True


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    _load_all()
    return sorted(_FACTORIES)


def make_policy(name: str, ctx: PolicyContext) -> Policy:
    """A fresh policy object named `name`, configured from `ctx`."""
    _load_all()
    key = name.lower().replace("_", "-")
    if key not in _FACTORIES:
        raise KeyError(f"unknown policy {name!r}; available: {', '.join(sorted(_FACTORIES))}")
    policy = _FACTORIES[key](ctx)
    policy.name = key
    return policy
