"""How much longer an instance's steps run than its step model says: measured over predicted
step time, over the last steps.

A step profile is fitted to one engine alone on its cores. Live, engines may share cores (two
instances pinned to one core with `--engine-cores`): each then runs about half the time and its
steps take about twice the prediction (measured, docs/colocation.md: 2.0-2.2x on either
instance while both step). A policy that fills a step up to a latency budget with the model's
predictions (`tidal`'s strict step, `tidal.policy.tidal.budget`) overruns that budget by the same
factor unless it knows it. The instance measures it here, step by step, and hands it to the
policy as `InstanceState.step_time_scale`; the simulator, whose steps are the model's own,
leaves it at 1, unless its instances share devices (`tidal.sim.sharing`): there each step's
time under sharing over its time alone feeds this same measure.

The figure is the sum of the measured times over the sum of the predicted ones over the last
`window` steps, so the long steps (the ones a budget fills) weigh most and a run of short decode
steps does not hide them. It never goes below 1: a budget tuned on the model's predictions is
only ever tightened by a measurement, never loosened by a quiet spell.
"""

from __future__ import annotations

from collections import deque

# Steps predicted shorter than this say little about the model (timer noise, a step that did
# almost nothing): not counted.
MIN_PREDICTED_S = 1e-3
# A measured/predicted ratio no engine step of ours reaches; a larger one is a stall (a
# descheduled process, a pause), capped so one such step cannot shut a budget for long.
MAX_RATIO = 8.0


class StepTimeScale:
    """Measured / predicted step time over the last `window` steps, at least 1."""

    def __init__(self, window: int = 32) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        self._steps: deque[tuple[float, float]] = deque(maxlen=window)
        self._predicted = 0.0
        self._measured = 0.0

    def observe(self, predicted_s: float, measured_s: float) -> None:
        """One step's predicted and measured wall time, seconds."""
        if predicted_s < MIN_PREDICTED_S or measured_s < 0.0:
            return
        measured_s = min(measured_s, MAX_RATIO * predicted_s)
        if len(self._steps) == self._steps.maxlen:
            p, m = self._steps[0]
            self._predicted -= p
            self._measured -= m
        self._steps.append((predicted_s, measured_s))
        self._predicted += predicted_s
        self._measured += measured_s

    @property
    def value(self) -> float:
        if not self._steps:
            return 1.0
        return max(1.0, self._measured / self._predicted)
