"""The torch engine's half of migration (`tidal.engine.migrate`): KV is read out of the request's
own blocks and written into the reserved blocks of the target, a token range at a time, in the
cache's layout ((L, 2, T, Hk, D) per chunk); the request's state is MessagePack (no pickle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from tidal.engine.api import Tokenizer
from tidal.engine.migrate import KvSink, KvSource, export_whole, import_whole
from tidal.engine.torch import kv_transfer as kvt
from tidal.engine.torch.kv_cache import BlockAllocator
from tidal.engine.torch.sampling import Detokenizer, make_generator
from tidal.engine.torch.sequence import PartialChunk, SeqStatus, Sequence

if TYPE_CHECKING:
    from tidal.engine.torch.core_share import CoreShare

FORMAT = "tidal-torch-request/2"


class _State(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    model: str
    shape: list[int]  # (L, 2, Hk, D) of the KV cache
    request: dict[str, Any]
    token_ids: list[int]
    num_computed: int
    num_kv_tokens: int
    emitted: str
    partial: tuple[int, int, list[int], bytes] | None  # num_tokens, layer, hidden shape, bytes
    rng: bytes | None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes without a copy (any dtype, bf16 included)."""
    array: Any = t.contiguous().view(torch.uint8).reshape(-1).numpy()
    return memoryview(array)


@dataclass
class TorchKvSource:
    req_id: str
    state: bytes
    num_tokens: int
    bytes_per_token: int
    kv: torch.Tensor
    block_ids: list[int]
    block_size: int

    def read(self, start: int, end: int) -> memoryview:
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"{self.req_id!r}: tokens [{start}, {end}) outside its KV")
        slots = kvt.token_slots(self.block_ids, start, end, self.block_size)
        return tensor_bytes(kvt.gather_kv(self.kv, slots))


@dataclass
class TorchKvSink:
    req_id: str
    num_tokens: int
    bytes_per_token: int
    kv: torch.Tensor
    block_ids: list[int]
    block_size: int
    num_written: int = 0

    def write(self, start: int, data: bytes | bytearray | memoryview) -> None:
        bpt = self.bytes_per_token
        n = len(data) // bpt
        if len(data) % bpt or not 0 <= start <= start + n <= self.num_tokens:
            raise ValueError(f"{self.req_id!r}: a KV chunk that does not fit its tokens")
        if n == 0:
            return
        L, two, _, hk, d = self.kv.shape
        raw = torch.frombuffer(
            bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8
        )
        chunk = raw.view(self.kv.dtype).view(L, two, n, hk, d)
        kvt.scatter_kv(
            self.kv, kvt.token_slots(self.block_ids, start, start + n, self.block_size), chunk
        )
        self.num_written += n


class TorchMigrateMixin:
    """Adds the four migration calls, and the one-buffer `export_request`/`import_request`."""

    seqs: dict[str, Sequence]
    kv: torch.Tensor
    block_size: int
    allocator: BlockAllocator
    model_name: str
    tokenizer: Tokenizer
    kv_bytes_per_token: float
    core_share: CoreShare | None

    if TYPE_CHECKING:

        def has_work(self) -> bool: ...

    def _init_migration(self) -> None:
        self.exporting: dict[str, Sequence] = {}
        self.importing: dict[str, tuple[Sequence, TorchKvSink]] = {}

    def _kv_shape(self) -> list[int]:
        return list(self.kv.shape[:2]) + list(self.kv.shape[3:])  # (L, 2, Hk, D)

    def _kv_tokens(self, seq: Sequence) -> int:
        return seq.num_computed + (seq.partial.num_tokens if seq.partial else 0)

    def _free(self, seq: Sequence) -> None:
        raise NotImplementedError

    def _register_blocks(self, seq: Sequence) -> None:
        raise NotImplementedError

    def begin_export(self, req_id: str) -> KvSource:
        seq = self.seqs.get(req_id)
        if seq is None:
            raise KeyError(f"{req_id!r} is not in this engine")
        n = self._kv_tokens(seq)
        if seq.status in (SeqStatus.OFFLOADED, SeqStatus.SWAPPED) and n:
            raise ValueError(f"{req_id!r} is {seq.status}; bring its KV back first")
        p = seq.partial
        partial = None
        if p is not None:
            hidden = p.hidden.to("cpu")
            partial = (p.num_tokens, p.layer, list(hidden.shape), bytes(tensor_bytes(hidden)))
        state = _State(
            format=FORMAT,
            model=self.model_name,
            shape=self._kv_shape(),
            request=kvt.request_to_dict(seq.req),
            token_ids=list(seq.token_ids),
            num_computed=seq.num_computed,
            num_kv_tokens=n,
            emitted=seq.detok.emitted,
            partial=partial,
            rng=None if seq.generator is None else bytes(seq.generator.get_state().numpy()),
        )
        del self.seqs[req_id]
        self.exporting[req_id] = seq
        if self.core_share is not None and not self.has_work():
            # the last request is leaving: hand the cores to the engine it goes to now, not
            # when this engine's busy stamp (3 of its prefill steps) lapses
            self.core_share.idle()
        return TorchKvSource(
            req_id,
            msgspec.msgpack.encode(state),
            n,
            int(self.kv_bytes_per_token),
            self.kv,
            list(seq.block_ids),
            self.block_size,
        )

    def end_export(self, req_id: str, moved: bool) -> None:
        seq = self.exporting.pop(req_id)
        if moved:
            self._free(seq)
        else:
            self.seqs[req_id] = seq

    def begin_import(self, state: bytes) -> KvSink:
        try:
            st = msgspec.msgpack.decode(state, type=_State)
        except (msgspec.MsgspecError, ValueError, TypeError) as e:
            raise ValueError(f"not a torch engine request export: {e}") from None
        if st.format != FORMAT:
            raise ValueError(f"unknown request export format {st.format!r} (expected {FORMAT!r})")
        if st.model != self.model_name or st.shape != self._kv_shape():
            raise ValueError(
                f"request exported by {st.model!r} with KV {st.shape}; this engine serves "
                f"{self.model_name!r} with KV {self._kv_shape()}"
            )
        req = kvt.request_from_dict(st.request)
        rid = req.req_id
        if rid in self.seqs or rid in self.importing or rid in self.exporting:
            raise ValueError(f"request id {rid!r} is already in this engine")
        if not 0 <= st.num_computed <= st.num_kv_tokens <= len(st.token_ids):
            raise ValueError(f"{rid!r}: inconsistent token counts in the export")
        seq = Sequence(
            req=req,
            token_ids=list(st.token_ids),
            num_prompt=len(req.prompt_token_ids),
            detok=Detokenizer(self.tokenizer, req.sampling.stop),
            generator=make_generator(req.sampling),
        )
        seq.detok.emitted = st.emitted
        if seq.generator is not None and st.rng is not None:
            seq.generator.set_state(torch.frombuffer(bytearray(st.rng), dtype=torch.uint8))
        seq.num_computed = st.num_computed
        if st.partial is not None:
            num, layer, shape, raw = st.partial
            hidden = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.kv.dtype)
            seq.partial = PartialChunk(num, layer, hidden.view(shape).to(self.kv.device))
        n = st.num_kv_tokens
        need = -(-n // self.block_size)
        if not self.allocator.can_allocate(need):
            raise MemoryError(f"{rid!r} needs {need} KV blocks, {self.allocator.num_free} free")
        seq.block_ids = self.allocator.allocate(need)
        seq.status = SeqStatus.RUNNING if n else SeqStatus.WAITING
        bpt = int(self.kv_bytes_per_token)
        sink = TorchKvSink(rid, n, bpt, self.kv, list(seq.block_ids), self.block_size)
        self.importing[rid] = (seq, sink)
        return sink

    def end_import(self, req_id: str, commit: bool) -> None:
        seq, sink = self.importing.pop(req_id)
        if commit and sink.num_written != sink.num_tokens:
            self._free(seq)
            raise ValueError(f"{req_id!r}: {sink.num_written} of {sink.num_tokens} KV tokens came")
        if not commit:
            self._free(seq)
            return
        seq.num_registered = 0  # fresh blocks: registered for prefix reuse from now on
        self._register_blocks(seq)
        self.seqs[req_id] = seq

    def export_request(self, req_id: str, remove: bool = True) -> bytes:
        """The request in one buffer (state + KV); with `remove` it leaves this engine."""
        return export_whole(self, req_id, remove)

    def import_request(self, data: bytes) -> None:
        import_whole(self, data)
