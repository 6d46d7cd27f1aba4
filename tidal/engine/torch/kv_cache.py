"""Paged-KV block allocator with a prefix cache (plain Python, asserted invariants).

A block holds `block_size` consecutive tokens of one sequence. Blocks are ref-counted: a full
block whose KV is computed is registered under a chained hash of its tokens (hash of the parent
block's hash and its own token ids), so a later request with the same prefix shares it (HyGen
§4.3 orders the offline queue to maximise such sharing). A block whose ref count drops to zero
goes to the tail of the free queue but keeps its hash and KV; allocation pops from the head, so
cached blocks are evicted least-recently-freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ROOT_HASH = 0


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hash of every *full* block of `token_ids`."""
    out: list[int] = []
    h = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start : start + block_size])))
        out.append(h)
    return out


class NoFreeBlocksError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # free queue, head = next to evict; values unused (an ordered set)
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_hits = 0  # blocks served from the prefix cache, for telemetry

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (cached-but-unreferenced ones included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict_hash(b)
            assert self.ref_count[b] == 0, f"block {b} in free queue with refs"
            self.ref_count[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        # Free in reverse: a sequence's tail blocks are the least likely to be shared again,
        # so they go nearer the head of the queue and are evicted first.
        for b in reversed(blocks):
            assert self.ref_count[b] > 0, f"double free of block {b}"
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self._free[b] = None

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Take a reference on the longest cached run of `hashes`; returns those block ids."""
        if not self.enable_prefix_cache:
            return []
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            if self.ref_count[b] == 0:
                del self._free[b]
            self.ref_count[b] += 1
            out.append(b)
        self.num_prefix_hits += len(out)
        return out

    def register(self, block: int, h: int) -> None:
        """Mark a full, computed block as reusable under hash `h`."""
        assert self.ref_count[block] > 0, f"register of free block {block}"
        if not self.enable_prefix_cache or self.block_hash[block] is not None:
            return
        if h in self._cached:  # an identical block already cached: keep the older one
            return
        self.block_hash[block] = h
        self._cached[h] = block

    def _evict_hash(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            assert self._cached.get(h) == b
            del self._cached[h]
            self.block_hash[b] = None

    def check_integrity(self, owners: Sequence[Sequence[int]] | None = None) -> None:
        """Assert the allocator's invariants; with `owners` (every live block table), also that
        each block's ref count equals the number of tables holding it."""
        assert len(self._free) == len(set(self._free)), "duplicate in free queue"
        for b in range(self.num_blocks):
            rc = self.ref_count[b]
            assert rc >= 0, f"negative ref count on block {b}"
            assert (rc == 0) == (b in self._free), f"block {b}: refs {rc} vs free-queue membership"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h, f"hash map and block {b} disagree"
        assert sum(h is not None for h in self.block_hash) == len(self._cached)
        if owners is not None:
            counts = [0] * self.num_blocks
            for table in owners:
                for b in table:
                    counts[b] += 1
            assert counts == self.ref_count, "ref counts differ from live block tables"
