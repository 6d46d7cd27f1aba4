"""The sim engine in real time (`SimEngineConfig.realtime`): a step blocks for its emulated
time, counted from the caller's origin so the host's own work overlaps it as on an accelerator,
and is cut at the layer boundary after a preemption request (OOCO §3.4.1); each step's wall
timings go to the step trace. Mixed into `engine.SimEngine`, which owns the state below."""

from __future__ import annotations

import json
import time
from typing import TextIO

from tidal.engine.preemption import LayerPreemption
from tidal.engine.sim.plan import Item, batch_shape


class RealtimeMixin:
    preemption: LayerPreemption
    step_origin: float | None
    last_step_end_s: float
    step_trace: TextIO | None
    _step_start_s: float

    def _wait_layers(self, layer_s: list[float], first: int) -> int:
        """Realtime: block until layers [first, done) have taken their emulated time, counted
        from the step's origin (`step_origin`, else now), and return `done`: `num_layers`, or
        the boundary after the layer a preemption request arrived in. One interruptible wait
        for the whole step (not one per layer: 30 wake-ups a step cost the instance a good
        part of a core), then a sleep to the end of the layer the request arrived in."""
        num_layers = len(layer_s)
        now = time.perf_counter()
        origin, self.step_origin = self.step_origin, None
        start = now if origin is None else max(min(origin, now), self.last_step_end_s)
        self._step_start_s = start
        ends: list[float] = []  # when each layer from `first` on ends
        t = start
        for layer in range(first, num_layers):
            t += layer_s[layer]
            ends.append(t)
        done = num_layers
        if ends and self.preemption.wait(max(0.0, ends[-1] - now)):
            at = time.perf_counter()
            # the layer running when the request came runs out; the step stops after it
            k = next((i for i, end in enumerate(ends) if end >= at), len(ends) - 1)
            done = min(num_layers, first + k + 1)
            time.sleep(max(0.0, ends[k] - time.perf_counter()))
        # NOTE: a step whose host work ran past its emulated end ended then (`now`), not at the
        # emulated end: counting the next one from the emulated end would run the following
        # steps in no time until the timeline caught up (after a 300 ms stall, ~25 decode steps
        # of 12 ms came out ~8 ms apart), which no accelerator does. Only the sleep's own wake-up
        # lag (`late_s`) is made up, as it is this emulation's and not the host's.
        self.last_step_end_s = max(ends[done - first - 1] if done > first else start, start, now)
        return done

    def trace_step(self, called: float, emulated_s: float, items: list[Item]) -> None:
        """One line of `step_trace`: `host_s` is the caller's work from the step's start (its
        origin) to the call (planning, publishing, the thread hop), `wall_s` start to end;
        `late_s` how far the end fell past max(start + emulated, call) (the wake-up lag)."""
        end, start = time.perf_counter(), self._step_start_s
        shape = batch_shape(items)
        rec = {
            "unix_s": round(time.time(), 6),
            "emulated_s": round(emulated_s, 6),
            "host_s": round(max(0.0, called - start), 6),
            "wall_s": round(end - start, 6),
            "late_s": round(end - max(start + emulated_s, called), 6),
            "num_prefill_tokens": shape.num_prefill_tokens,
            "num_decode_tokens": shape.num_decode_reqs,
        }
        assert self.step_trace is not None
        self.step_trace.write(json.dumps(rec) + "\n")

    def trace_event(self, event: str, req_id: str) -> None:
        """One line of `step_trace` for a request: `add` (it joined the engine), `first` (its
        first output token was made here), at `unix_s`."""
        assert self.step_trace is not None
        rec = {"event": event, "req_id": req_id, "unix_s": round(time.time(), 6)}
        self.step_trace.write(json.dumps(rec) + "\n")
