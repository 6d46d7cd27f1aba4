"""The `sim` engine's half of migration (`tidal.engine.migrate`): its emulated KV moves in chunks
of the emulated model's size, derived from the request's tokens and checked chunk by chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tidal.engine.migrate import KvSink, KvSource, export_whole, import_whole
from tidal.engine.sim.seq import RUNNING, SimSeq, decode_state, encode_state, kv_digest, kv_slice


@dataclass
class _Pattern:
    """The emulated KV's bytes, built once per request up to the largest chunk asked for: a
    chunk is a view into it (no per-chunk allocation holding the GIL)."""

    digest: bytes
    _buf: bytes = field(default=b"", repr=False)

    def view(self, start: int, end: int) -> memoryview:
        skip, n = start % len(self.digest), end - start
        if len(self._buf) < skip + n:
            self._buf = kv_slice(self.digest, 0, len(self.digest) + max(n, 2 * len(self._buf)))
        return memoryview(self._buf)[skip : skip + n]


@dataclass
class SimKvSource:
    req_id: str
    state: bytes
    num_tokens: int
    bytes_per_token: int
    digest: bytes

    def __post_init__(self) -> None:
        self._pattern = _Pattern(self.digest)

    def read(self, start: int, end: int) -> memoryview:
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"{self.req_id!r}: tokens [{start}, {end}) outside its KV")
        return self._pattern.view(start * self.bytes_per_token, end * self.bytes_per_token)


def _same_bytes(a: bytes | bytearray | memoryview, b: memoryview) -> bool:
    """Every byte compared, 8 at a time where the length allows: 0.1 ms per 4 MiB frame against
    0.8 ms byte-wise, time the receiving data-plane thread took from the decode loop."""
    word = np.uint64 if len(a) % 8 == 0 else np.uint8
    return len(a) == len(b) and np.array_equal(np.frombuffer(a, word), np.frombuffer(b, word))


@dataclass
class SimKvSink:
    req_id: str
    num_tokens: int
    bytes_per_token: int
    digest: bytes
    num_written: int = 0  # tokens whose KV arrived (chunks arrive in any order, each once)

    def __post_init__(self) -> None:
        self._pattern = _Pattern(self.digest)

    def write(self, start: int, data: bytes | bytearray | memoryview) -> None:
        bpt = self.bytes_per_token
        n = len(data) // bpt if bpt else 0
        if bpt == 0 or len(data) % bpt or not 0 <= start <= start + n <= self.num_tokens:
            raise ValueError(f"{self.req_id!r}: a KV chunk that does not fit its tokens")
        expected = self._pattern.view(start * bpt, (start + n) * bpt)
        if not _same_bytes(data, expected):
            raise ValueError(f"{self.req_id!r}: KV chunk does not match its tokens (corrupted)")
        self.num_written += n


class SimMigrateMixin:
    """Adds the four migration calls, and the one-buffer `export_request`/`import_request`."""

    seqs: dict[str, SimSeq]
    model_name: str
    kv_payload_bytes_per_token: int
    max_model_len: int

    def _init_migration(self) -> None:
        self.exporting: dict[str, SimSeq] = {}  # left the schedule, KV blocks kept
        self.importing: dict[str, tuple[SimSeq, SimKvSink]] = {}  # blocks held, KV arriving

    def _num_layers(self) -> int:
        raise NotImplementedError

    def _place(self, seq: SimSeq, num_tokens: int) -> None:
        raise NotImplementedError

    def _release(self, seq: SimSeq, keep_partial: bool = False) -> None:
        raise NotImplementedError

    def begin_export(self, req_id: str) -> KvSource:
        seq = self.seqs.get(req_id)
        if seq is None:
            raise KeyError(f"{req_id!r} is not in this engine")
        if seq.status != RUNNING and seq.num_kv_tokens:
            raise ValueError(f"{req_id!r} is {seq.status}; only a running request exports KV")
        del self.seqs[req_id]
        self.exporting[req_id] = seq
        n = seq.num_kv_tokens
        state = encode_state(seq, self.model_name)
        bpt = self.kv_payload_bytes_per_token
        return SimKvSource(req_id, state, n, bpt, kv_digest(seq.token_ids, n))

    def end_export(self, req_id: str, moved: bool) -> None:
        seq = self.exporting.pop(req_id)
        if moved:
            self._release(seq)
        else:
            self.seqs[req_id] = seq  # back in the schedule (its arrival orders it, not this)

    def begin_import(self, state: bytes) -> KvSink:
        seq = decode_state(state, self.model_name, self._num_layers())
        rid = seq.req_id
        if rid in self.seqs or rid in self.importing or rid in self.exporting:
            raise ValueError(f"request id {rid!r} is already in this engine")
        if len(seq.req.prompt_token_ids) + seq.req.sampling.max_tokens > self.max_model_len:
            raise ValueError(f"{rid!r} exceeds this model's context")
        n = seq.num_kv_tokens
        if n:
            self._place(seq, n)  # MemoryError when there is no room
        bpt = self.kv_payload_bytes_per_token
        sink = SimKvSink(rid, n, bpt, kv_digest(seq.token_ids, n))
        self.importing[rid] = (seq, sink)
        return sink

    def end_import(self, req_id: str, commit: bool) -> None:
        seq, sink = self.importing.pop(req_id)
        if commit and sink.bytes_per_token and sink.num_written != sink.num_tokens:
            self._release(seq)
            raise ValueError(f"{req_id!r}: {sink.num_written} of {sink.num_tokens} KV tokens came")
        if commit:
            self.seqs[req_id] = seq
        else:
            self._release(seq)

    def export_request(self, req_id: str, remove: bool = True) -> bytes:
        """The request in one buffer (state + emulated KV); with `remove` it leaves this engine."""
        return export_whole(self, req_id, remove)

    def import_request(self, data: bytes) -> None:
        import_whole(self, data)
