"""The batch keeper's step order: a new batch is validated before a pile of cancelled batches is
finalized, and a step ends only a few batches (the rest wait for the next step)."""

from __future__ import annotations

from typing import Any

from services.batch.keeper import ENDS_PER_STEP, Keeper
from tidal.batch.objects import Batch


class _Store:
    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    async def list_batches(self) -> list[Batch]:
        return [b for b in self.batches if b.status in ("validating", "cancelling")]


class _Dispatcher:
    async def cancel_batch(self, batch_id: str) -> int:
        return 0


class _RecordingKeeper(Keeper):
    """The keeper's own `step`; validation and finalization only recorded (and the status set)."""

    calls: list[str]

    async def validate(self, batch: Batch, now_s: float, backlog: int = 0) -> int:
        self.calls.append(f"validate {batch.id}")
        batch.status = "in_progress"
        return 1

    async def finalize(self, batch: Batch, final: str, now_s: float) -> None:
        self.calls.append(f"{final} {batch.id}")
        batch.status = final


def _batch(i: int, status: str) -> Batch:
    return Batch(f"b{i}", "/v1/completions", "f", "24h", status, 0, 10**10)


async def test_a_new_batch_is_validated_before_cancelled_ones_are_finalized() -> None:
    batches = [_batch(i, "cancelling") for i in range(10)] + [_batch(10, "validating")]
    store: Any = _Store(batches)
    keeper = _RecordingKeeper(store=store, bus=None, dispatcher=_Dispatcher())  # type: ignore[arg-type]
    keeper.calls = []
    await keeper.step(0.0)
    assert keeper.calls[0] == "validate b10"
    assert keeper.calls[1:] == [f"cancelled b{i}" for i in range(ENDS_PER_STEP)]
    assert keeper.kick.is_set()  # the rest in the next step, at once
    steps = 1
    while any(b.status == "cancelling" for b in batches):
        keeper.kick.clear()
        await keeper.step(0.0)
        steps += 1
    assert sorted(c for c in keeper.calls if c.startswith("cancelled")) == sorted(
        f"cancelled b{i}" for i in range(10)
    )
    assert steps == -(-10 // ENDS_PER_STEP)
