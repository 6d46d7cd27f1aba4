"""Request classes: any number of them, ordered by priority, declared in the cluster config.

```yaml
classes:
  - {name: interactive, priority: 2, ttft_ms: 1000, tpot_ms: 100, queue_bound: 8}
  - {name: standard, priority: 1, ttft_ms: 4000, tpot_ms: 250, queue_bound: 4, demote: true}
  - {name: batch, priority: 0, best_effort: true}
default_class: standard        # what a request naming no class gets (default: the highest)
class_keys:                    # API key (or its owner id, `key-<sha256[:16]>`) -> pin | cap
  sk-team-a: {cap: standard}
  sk-etl: {pin: batch}
```

A class with SLOs (its own `ttft_ms`/`tpot_ms`, or the config's `slo` when it names none) runs
as the engine's `online` kind with that SLO; a `best_effort` class runs as `offline` (held until
the policy finds slack). Without a `classes:` section the built-in pair is the table: `online`
(priority 1, the config's SLO) and `offline` (priority 0, best effort).

A class's `admission` is `slo` (the policy's admission control may refuse a request whose TTFT
it cannot meet) or `queue` (never refused for its SLO: it waits, and may miss it).

Demote, then reject (Niyama / BROS): a request its class cannot take — the class's queue bound
is full, or the scheduler refuses it (the policy's SLO admission, a full held queue) — is offered
to the next looser class when its class has `demote: true`, and on down while each class it
reaches allows it; it is rejected (429) only when none can take it. `ClassTable.chain` is that
rule, which the gateway and the simulator both follow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from tidal.schemas.enums import RequestClass

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
ADMISSIONS = ("slo", "queue")


@dataclass(frozen=True)
class RequestClassSpec:
    """One request class."""

    name: str  # lower-case letters, digits, _ and -; what X-Tidal-Class / request_class name
    priority: int  # higher is served first; unique in the table
    ttft_ms: float | None = None  # the class's TTFT target, ms (None: the config's `slo`)
    tpot_ms: float | None = None  # the class's TPOT target, ms (None: the config's `slo`)
    best_effort: bool = False  # no SLO: runs as offline work, in slack
    queue_bound: int | None = None  # most of its requests in flight at one gateway (None: no
    # bound); past it a request is demoted (with `demote`) or turned away with a 429
    demote: bool = False  # a request this class cannot take may run in the next looser class
    # "slo": the policy's admission control may refuse a request whose SLO it cannot meet
    # (then: demote or 429); "queue": never refused for its SLO, it waits (and may miss it)
    admission: str = "slo"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"class name {self.name!r}: 1-32 lower-case letters, digits, '_' or '-'"
            )
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"class {self.name}: priority must be an integer")
        for what, ms in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms)):
            if ms is not None and not (isinstance(ms, int | float) and 0 < ms <= 86_400_000):
                raise ValueError(f"class {self.name}: {what} must be in (0, 86400000] ms")
        if self.best_effort and (self.ttft_ms is not None or self.tpot_ms is not None):
            raise ValueError(f"class {self.name}: a best_effort class has no ttft_ms/tpot_ms")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"class {self.name}: admission must be one of {ADMISSIONS}")
        if self.best_effort and self.admission != "slo":
            raise ValueError(f"class {self.name}: a best_effort class has no SLO admission")
        if self.queue_bound is not None and (
            not isinstance(self.queue_bound, int) or self.queue_bound < 1
        ):
            raise ValueError(f"class {self.name}: queue_bound must be an integer >= 1")

    @property
    def slo_admission(self) -> bool:
        """Whether the policy's admission control may refuse its requests for their SLO."""
        return self.admission == "slo"

    @property
    def kind(self) -> RequestClass:
        """How the engines and policies run it: online (with an SLO) or offline."""
        return RequestClass.OFFLINE if self.best_effort else RequestClass.ONLINE


@dataclass(frozen=True)
class KeyRule:
    """What an API key may ask: `pin` (always this class) or `cap` (this class or looser)."""

    pin: str | None = None
    cap: str | None = None

    def __post_init__(self) -> None:
        if (self.pin is None) == (self.cap is None):
            raise ValueError("a key rule is {pin: CLASS} or {cap: CLASS}")


class ClassError(ValueError):
    """A request named a class it may not have (the gateway answers 400)."""


@dataclass(frozen=True)
class ClassTable:
    """The classes, highest priority first, and what a request picks by default."""

    classes: tuple[RequestClassSpec, ...]
    default: str = ""  # "" : the highest-priority class
    keys: Mapping[str, KeyRule] = field(default_factory=dict)  # API key or owner id -> rule

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("classes: at least one class is needed")
        ordered = tuple(sorted(self.classes, key=lambda c: -c.priority))
        object.__setattr__(self, "classes", ordered)
        names = [c.name for c in ordered]
        if len(set(names)) != len(names):
            raise ValueError(f"classes: names must be unique, got {names}")
        prios = [c.priority for c in ordered]
        if len(set(prios)) != len(prios):
            raise ValueError(f"classes: priorities must be unique, got {prios}")
        if not ordered[-1].best_effort:
            # NOTE: the Batch API's lines run in the lowest class, as offline work.
            raise ValueError(
                f"classes: the lowest class ({ordered[-1].name}) takes the Batch API's lines "
                "and must be best_effort: true"
            )
        if self.default and self.default not in names:
            raise ValueError(f"default_class {self.default!r} is not a class; have {names}")
        for key, rule in self.keys.items():
            for target in (rule.pin, rule.cap):
                if target is not None and target not in names:
                    raise ValueError(f"class_keys: {target!r} is not a class; have {names}")
            if not key:
                raise ValueError("class_keys: an empty key")

    # ---- looking up ----

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.classes]

    @property
    def default_name(self) -> str:
        """The class of a request that names none."""
        return self.default or self.classes[0].name

    @property
    def lowest(self) -> RequestClassSpec:
        """The loosest class: the Batch API's lines run in it."""
        return self.classes[-1]

    def get(self, name: str) -> RequestClassSpec:
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(name)

    def resolve(self, asked: str | None, key: str | None = None) -> RequestClassSpec:
        """The class a request runs in: the one it `asked` (None: the default) as the API
        `key`'s rule allows; ClassError (a 400) naming the classes when it may not."""
        rule = self.keys.get(key) if key else None
        if rule is not None and rule.pin is not None:
            if asked and asked != rule.pin:
                raise ClassError(f"this API key is pinned to class {rule.pin!r}, asked {asked!r}")
            return self.get(rule.pin)
        name = asked or self.default_name
        if name not in self.names:
            raise ClassError(f"unknown request class {name!r}; classes: {', '.join(self.names)}")
        spec = self.get(name)
        if rule is not None and rule.cap is not None:
            cap = self.get(rule.cap)
            if spec.priority > cap.priority:
                if asked:
                    raise ClassError(
                        f"this API key may use class {cap.name!r} or looser, asked {name!r}"
                    )
                spec = cap  # the default is above the key's cap: it gets its cap
        return spec

    def looser(self, spec: RequestClassSpec) -> RequestClassSpec | None:
        """The next class below `spec`, if `spec` lets a request it cannot take move there."""
        if not spec.demote:
            return None
        i = self.classes.index(spec)
        return self.classes[i + 1] if i + 1 < len(self.classes) else None

    def chain(self, spec: RequestClassSpec) -> list[RequestClassSpec]:
        """`spec`, then each class a request it cannot take is offered in turn."""
        out = [spec]
        while (nxt := self.looser(out[-1])) is not None:
            out.append(nxt)
        return out

    def has_room(self, spec: RequestClassSpec, num_in_flight: int) -> bool:
        """Whether a class with `num_in_flight` of its requests in flight takes one more."""
        return spec.queue_bound is None or num_in_flight < spec.queue_bound


def default_table(default_name: str = "") -> ClassTable:
    """The built-in pair: `online` (the config's SLO) above `offline` (best effort)."""
    return ClassTable(
        (
            RequestClassSpec("online", 1),
            RequestClassSpec("offline", 0, best_effort=True),
        ),
        default=default_name,
    )


def parse_classes(
    raw: Any, default: Any = None, keys: Any = None, where: str = "config"
) -> ClassTable:
    """A `ClassTable` from the config's `classes`, `default_class` and `class_keys` entries
    (each may be None); ValueError naming the entry that is wrong."""
    if default is not None and not isinstance(default, str):
        raise ValueError(f"{where}.default_class: a class name, got {default!r}")
    rules: dict[str, KeyRule] = {}
    if keys is not None:
        if not isinstance(keys, Mapping):
            raise ValueError(f"{where}.class_keys: a mapping of API key -> {{pin|cap: CLASS}}")
        for k, v in keys.items():
            rules[str(k)] = _build(KeyRule, v, f"{where}.class_keys[...]")  # never echo a key
    if raw is None:
        table = default_table(default or "")
        try:
            return ClassTable(table.classes, table.default, rules)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise ValueError(f"{where}.classes: a list of classes, each {{name, priority, ...}}")
    specs = tuple(_build(RequestClassSpec, c, f"{where}.classes[{i}]") for i, c in enumerate(raw))
    try:
        return ClassTable(specs, default or "", rules)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e
