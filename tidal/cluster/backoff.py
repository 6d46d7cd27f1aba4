"""Back-off of migration targets that could not be reached: after a failure the target takes no
migration for `base_s`, doubled after each further failure up to `max_s`; one success clears it.
The request whose migration failed stays where it is (on its source) meanwhile, so a lost or cut
off target costs a few attempts a minute, never hundreds a second. Pure: `now` is passed in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Failures:
    num: int  # consecutive failures
    until_s: float  # no migration toward the target before this


@dataclass
class TargetBackoff:
    base_s: float = 0.5  # wait after the first failure, seconds
    max_s: float = 30.0  # the cap of the doubling, seconds
    failing: dict[str, _Failures] = field(default_factory=dict)  # target key -> its failures
    num_backoffs: int = 0  # failures recorded, over all targets

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s:
            raise ValueError(f"back-off needs 0 < base_s <= max_s, got {self.base_s}, {self.max_s}")

    def failed(self, target: str, now: float) -> float:
        """Record a failed migration toward `target`; returns when it may be tried again."""
        f = self.failing.get(target)
        num = 1 if f is None else f.num + 1
        wait_s = min(self.max_s, self.base_s * 2 ** min(num - 1, 62))
        self.failing[target] = _Failures(num, now + wait_s)
        self.num_backoffs += 1
        return now + wait_s

    def succeeded(self, target: str) -> None:
        self.failing.pop(target, None)

    def is_backed_off(self, target: str, now: float) -> bool:
        f = self.failing.get(target)
        return f is not None and now < f.until_s

    def retry_at(self, target: str) -> float:
        """When `target` may be tried again (0 when it is not backed off)."""
        f = self.failing.get(target)
        return f.until_s if f is not None else 0.0
