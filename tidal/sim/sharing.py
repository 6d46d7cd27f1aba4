"""Instances that share devices: their steps run under processor sharing.

Live, the torch co-location bench pins both engine instances to one core (`--engine-cores 0`,
one torch thread each): while both step, the OS gives each about half the core, and every kind
of step takes about twice what the step profile says, the profile being fitted to one engine
alone on one core (docs/colocation.md). A config says so with `num_devices`
(`ClusterConfig.num_devices`, as the offline limit's `num_devices`, `tidal.sim.limit`): its N
instances share D < N devices. While k steps are in flight then, each progresses at
min(1, D / k) of its own rate: processor sharing, the OS's time slices (milliseconds, against
steps of tens to hundreds) averaged over a step; a one-thread step never runs faster than alone.
`ClusterConfig.shared_device_slowdown` (c, default 1) adds what the time share leaves out:
while k > D steps share the devices each runs at (D / k) / c, a step doing more work beside
another than alone (caches and memory bandwidth shared; measured for the torch engines on one
core by `python -m tidal_bench.colocation.shared_core`). Alone on a device (k <= D) a step runs
at its own rate whatever c is.
Turn-taking (one whole step after the other) is the alternative; it is not what the OS does,
and it would leave a step's time alone unchanged while the live ones all stretched about
twice (2.0-2.2x on both instances, docs/colocation.md).

Each step is computed at its own rate (`tidal.sim.span`). After every event the simulator calls
`settle`: where the number of steps in flight changed, what is left of every span in flight is
stretched or shrunk by the new slowdown over the one its times assumed (`Span.rescale`), so a
step's end is computed again whenever another step starts or ends. Layer cuts (OOCO §3.4.1)
find their boundaries on the rescaled times.

The live instance measures each whole step against what its step model predicts
(`tidal.perf.step_scale`) and hands the policy `InstanceState.step_time_scale`; here each whole
step's time under sharing over its time alone feeds the same measure (Σ over Σ, the last 32
steps, at least 1), so a policy's budget reacts as it does live. Without sharing the simulator
leaves it at 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidal.perf.step_scale import StepTimeScale
from tidal.policy.state import InstanceState
from tidal.sim.span import Span


@dataclass(slots=True, eq=False)
class _Flight:
    """A span in flight and what it would take alone."""

    span: Span
    alone: list[float]  # each step's end after the span's start, alone on a device
    cpu_token_s: float  # its CPU-attention token's time as computed alone (CPU workers apart)
    slowdown: float = 1.0  # what its times assume now


class DeviceShare:
    """`num_instances` instances on `num_devices` shared devices (fewer than the instances).
    `step_at(t, (instance, version))` schedules a span's new end; `slowdown`: c, each shared
    step's work beside the others over its work alone (`ClusterConfig.shared_device_slowdown`)."""

    def __init__(
        self,
        num_devices: int,
        num_instances: int,
        step_at: Callable[[float, tuple[int, int]], None],
        slowdown: float = 1.0,
        window: int = 32,
    ) -> None:
        if not 1 <= num_devices < num_instances:
            raise ValueError(
                f"num_devices must be in [1, {num_instances}) to share them, got {num_devices}"
            )
        if slowdown < 1.0:
            raise ValueError(f"shared_device_slowdown must be >= 1, got {slowdown}")
        self.num_devices = num_devices
        self.contention = slowdown  # c: each shared step's extra over its time share
        self._step_at = step_at
        self._flights: dict[int, _Flight] = {}
        self.scales = [StepTimeScale(window) for _ in range(num_instances)]

    def slowdown(self, num_steps: int) -> float:
        """How much longer each of `num_steps` steps in flight takes than alone: k / D times c
        while k > D share D devices, else 1."""
        if num_steps <= self.num_devices:
            return 1.0
        return num_steps / self.num_devices * self.contention

    def settle(
        self, spans: Sequence[Span | None], instances: Sequence[InstanceState], now: float
    ) -> None:
        """The spans in flight at `now` (new ones with their times alone) under the slowdown
        their number gives; each whose end moved gets a new end event."""
        f = self.slowdown(sum(1 for s in spans if s is not None))
        flights = self._flights
        for iid, span in enumerate(spans):
            if span is None:
                continue
            fl = flights.get(iid)
            if fl is None or fl.span is not span:  # started now: its times are alone
                alone = [b - span.start_s for b in span.bounds]
                fl = flights[iid] = _Flight(span, alone, span.cpu_token_s)
            if fl.slowdown == f:
                continue
            moved = span.rescale(now, f / fl.slowdown)
            fl.slowdown = f
            if span.cpu:  # the CPU workers' part is not on the shared devices
                span.cpu_token_s = max(span.bounds[0], fl.cpu_token_s)
            if moved:
                instances[iid].busy_until_s = span.end_s
                self._step_at(span.end_s, (iid, span.version))

    def ended(self, inst: InstanceState, span: Span) -> None:
        """`span` ended on `inst`: each of its whole steps that computed something feeds the
        instance's measured step time over its time alone (`InstanceState.step_time_scale`),
        as the live instance measures it; a step cut at a layer does not (nor live)."""
        fl = self._flights.pop(inst.instance_id, None)
        if fl is None or fl.span is not span or span.cut_layer:
            return
        if not (span.prefill or span.decode or span.cpu):  # moves only: live predicts none
            return
        scale = self.scales[inst.instance_id]
        t, a = span.start_s, 0.0
        for j in range(span.k):
            scale.observe(fl.alone[j] - a, span.bounds[j] - t)
            t, a = span.bounds[j], fl.alone[j]
        inst.step_time_scale = scale.value
