"""Attention piggybacking on the instance side (OmniServe §3.2.2-3.2.3, §4 residual management).

An *offloaded* request keeps its KV on a CPU-attention worker. Its decode token still runs every
dense module on the instance, batched with the step's own rows layer by layer (layer-wise
batching): at layer l its row joins the step's QKV matmul, its q, k, v go to the worker
(`CpuAttnLink.send`) and its residual waits here, keyed by (request, layer) in the request's
`CpuProgress`. The step does not wait: whenever that layer's attention output has arrived — in
this step or a later one — the row joins the step's o_proj and MLP at the same layer, then the
next layer's QKV, and so on. After the last layer its logits are sampled with the step's.

`Piggyback` is one step's view of this for `LlamaModel.forward_layers`: which rows enter QKV at a
layer (`enter`), where their q/k/v go (`send`), whose results are back (`arrived`) and where the
rows go after the MLP (`advance`). Only the requests the policy admitted this step take part
(the piggyback control of §3.3.6 bounds them); the rest keep their place for a later step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from tidal.engine.torch.sequence import Sequence


class CpuAttnLink(Protocol):
    """The instance's CPU-attention workers, as the engine thread uses them. Every call is
    thread-safe and returns at once except `offload`, `recall` and `wait`."""

    def offload(self, req_id: str, kv: torch.Tensor, reserve_tokens: int) -> str:
        """Give KV (L, 2, T, Hk, D) to a worker; its id, or OffloadRefused."""
        ...

    def recall(self, req_id: str) -> torch.Tensor:
        """The KV back from its worker (which keeps a copy until `drop`); KeyError if lost."""
        ...

    def drop(self, req_id: str) -> None: ...

    def send(
        self,
        layer: int,
        rows: list[tuple[str, int]],
        qkv: torch.Tensor,
        num_heads: int,
        scale: float,
    ) -> None:
        """Attention of (req_id, position) rows at `layer`; qkv (B, H + 2Hk, D)."""
        ...

    def take(self, layer: int, req_ids: list[str]) -> dict[str, torch.Tensor]:
        """Outputs (H*D,) that have arrived for these requests at `layer` (removed)."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Sleep until any output arrives (True) or the timeout passes."""
        ...

    def take_lost(self) -> set[str]:
        """Requests whose worker died or failed them since the last call (removed)."""
        ...

    def capacity(self) -> tuple[int, int]:
        """(live workers, KV bytes free over them)."""
        ...


class Piggyback:
    """One step's offloaded rows. `wait_s` > 0 (a step with no rows of its own) lets `arrived`
    wait that long for a layer's outputs, since the instance has nothing else to do."""

    def __init__(
        self,
        seqs: list[Sequence],
        link: CpuAttnLink,
        embed: Callable[[torch.Tensor], torch.Tensor],
        num_layers: int,
        device: torch.device,
        wait_s: float = 0.0,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.seqs, self.link, self.embed = seqs, link, embed
        self.num_layers, self.device = num_layers, device
        self.wait_s, self.should_stop = wait_s, should_stop
        self._entering: list[Sequence] = []
        self._post: list[Sequence] = []
        # rows by where they stand, so each layer touches only its own rows
        self._fresh = [s for s in seqs if s.cpu is not None and s.cpu.at_boundary]
        self._pre: dict[int, list[Sequence]] = {}
        self._wait: dict[int, list[Sequence]] = {}
        for s in seqs:
            if s.cpu is not None and not s.cpu.at_boundary:
                book = self._pre if s.cpu.stage == "pre" else self._wait
                book.setdefault(s.cpu.layer, []).append(s)
        self.overhead_s = 0.0  # residual store and queue work on the engine thread

    def enter(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(residuals (m, hidden), positions (m,)) of the rows entering QKV at `layer`."""
        t0 = time.perf_counter()
        if layer == 0 and self._fresh:
            fresh, self._fresh = self._fresh, []
            ids = torch.tensor([s.token_ids[s.num_computed] for s in fresh], device=self.device)
            x0 = self.embed(ids)
            for i, s in enumerate(fresh):
                assert s.cpu is not None
                s.cpu.stage, s.cpu.layer, s.cpu.x = "pre", 0, x0[i : i + 1]
            self._pre.setdefault(0, []).extend(fresh)
        rows = self._pre.pop(layer, [])
        self._entering = rows
        if not rows:
            self.overhead_s += time.perf_counter() - t0
            return None
        x = torch.cat([_x(s) for s in rows])
        pos = torch.tensor([s.num_computed for s in rows], device=self.device)
        self.overhead_s += time.perf_counter() - t0
        return x, pos

    def send(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> None:
        """q (m, H, D), k and v (m, Hk, D) of the rows `enter` gave, in that order."""
        rows = self._entering
        qkv = torch.cat([q, k, v], dim=1)
        self.link.send(layer, [(s.req_id, s.num_computed) for s in rows], qkv, q.shape[1], scale)
        for s in rows:
            assert s.cpu is not None
            s.cpu.stage = "wait"  # its residual stays in s.cpu.x until the output is back
        self._wait.setdefault(layer, []).extend(rows)
        self._entering = []

    def arrived(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(residuals (m, hidden), attention outputs (m, H*D)) of the rows whose output for
        `layer` is back; they join this layer's o_proj and MLP."""
        waiting = self._wait.get(layer)
        if not waiting:
            return None
        t0 = time.perf_counter()
        ids = [s.req_id for s in waiting]
        got = self.link.take(layer, ids)
        waited = 0.0
        if self.wait_s > 0 and len(got) < len(ids):
            w0 = time.perf_counter()
            deadline = w0 + self.wait_s
            while len(got) < len(ids) and (left := deadline - time.perf_counter()) > 0:
                if self.should_stop is not None and self.should_stop():
                    break
                self.link.wait(min(left, 0.005))
                got |= self.link.take(layer, [i for i in ids if i not in got])
            waited = time.perf_counter() - w0  # waiting for the worker is not overhead
        rows = [s for s in waiting if s.req_id in got]
        self._wait[layer] = [s for s in waiting if s.req_id not in got]
        self._post = rows
        if not rows:
            self.overhead_s += time.perf_counter() - t0 - waited
            return None
        x = torch.cat([_x(s) for s in rows])
        o = torch.stack([got[s.req_id] for s in rows]).to(device=self.device, dtype=x.dtype)
        self.overhead_s += time.perf_counter() - t0 - waited
        return x, o

    def advance(self, layer: int, x: torch.Tensor) -> None:
        """The rows of `arrived` after this layer's MLP: they enter QKV at `layer + 1` (or are
        done, after the last layer)."""
        for i, s in enumerate(self._post):
            assert s.cpu is not None
            s.cpu.stage, s.cpu.layer, s.cpu.x = "pre", layer + 1, x[i : i + 1]
        self._pre.setdefault(layer + 1, []).extend(self._post)
        self._post = []

    def finish(self) -> tuple[list[Sequence], torch.Tensor] | None:
        """Rows that ran every layer this step, with their final hidden states (m, hidden) for
        logits; their token's KV is on the worker at every layer now, so they are back at a
        token boundary."""
        rows = self._pre.pop(self.num_layers, [])
        if not rows:
            return None
        hidden = torch.cat([_x(s) for s in rows])
        for s in rows:
            assert s.cpu is not None
            s.num_computed += 1
            s.cpu.stage, s.cpu.layer, s.cpu.x = "idle", 0, None
        return rows, hidden


def _x(s: Sequence) -> torch.Tensor:
    assert s.cpu is not None and s.cpu.x is not None
    return s.cpu.x
