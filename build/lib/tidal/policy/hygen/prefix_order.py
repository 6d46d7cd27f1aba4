"""HyGen's offline order: prefix-sharing maximisation (papers/hygen.md §4.3, App. A.2) and the
freshness/utility-ratio extension against starvation (App. A.3).

`PrefixTrie` is a radix (path-compressed) trie over prompt token ids whose leaves are requests;
`next_request()` is the first waiting request in DFS order (children in insertion order, a node's
own requests before its children), found by descending the first child with a non-zero subtree
count. `FreshnessIndex` plays the self-balancing BST of Alg. 4 (a heap with lazy deletion: same
O(log n) bounds for what Alg. 4 needs — insert, delete, oldest). `OfflineOrder` draws from one or
the other with the utility ratio u.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...]  # token ids on the edge from the parent
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # first token of edge -> child
    reqs: dict[Hashable, None] = field(default_factory=dict)  # requests ending here, in order
    count: int = 0  # requests in this subtree


def _lcp(a: tuple[int, ...], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class PrefixTrie:
    """App. A.2: waiting offline requests in a prefix tree, served in DFS order."""

    def __init__(self) -> None:
        self._root = _Node((), None)
        self._where: dict[Hashable, _Node] = {}

    def __len__(self) -> int:
        return self._root.count

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._where

    def insert(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Add a request keyed by its prompt token ids (an empty prompt sits at the root)."""
        if req_id in self._where:
            raise KeyError(f"request {req_id!r} already in the prefix trie")
        node, i = self._root, 0
        node.count += 1
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(tuple(tokens[i:]), node)
                node.children[tokens[i]] = child
                child.count = 1
                node, i = child, len(tokens)
                break
            k = _lcp(child.edge, tokens, i)
            if k < len(child.edge):  # split the edge; the dict slot keeps its DFS position
                mid = _Node(child.edge[:k], node, count=child.count)
                child.edge, child.parent = child.edge[k:], mid
                mid.children[child.edge[0]] = child
                node.children[tokens[i]] = mid
                child = mid
            child.count += 1
            node, i = child, i + k
        node.reqs[req_id] = None
        self._where[req_id] = node

    def remove(self, req_id: Hashable) -> None:
        """Delete a scheduled request; empty branches are pruned."""
        node: _Node | None = self._where.pop(req_id)
        assert node is not None
        del node.reqs[req_id]
        while node is not None:
            node.count -= 1
            parent = node.parent
            if node.count == 0 and parent is not None:
                del parent.children[node.edge[0]]
            node = parent

    def next_request(self) -> Hashable | None:
        """The first waiting request in DFS order, or None when empty."""
        node = self._root
        if node.count == 0:
            return None
        while True:
            if node.reqs:
                return next(iter(node.reqs))
            for child in node.children.values():
                if child.count > 0:
                    node = child
                    break
            else:  # pragma: no cover - counts guarantee a non-empty child
                return None

    def dfs_order(self) -> list[Hashable]:
        """Every waiting request in DFS order (for inspection and tests)."""
        out: list[Hashable] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            out.extend(node.reqs)
            stack.extend(reversed(list(node.children.values())))
        return out


class FreshnessIndex:
    """App. A.3's freshness tree: the stalest (earliest-arrived) waiting request first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._live: set[Hashable] = set()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def insert(self, req_id: Hashable, arrival_s: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (arrival_s, self._seq, req_id))
        self._live.add(req_id)

    def remove(self, req_id: Hashable) -> None:
        self._live.discard(req_id)

    def next_request(self) -> Hashable | None:
        while self._heap and self._heap[0][2] not in self._live:
            heapq.heappop(self._heap)
        return self._heap[0][2] if self._heap else None


class OfflineOrder:
    """The offline queue order of HyGen (Alg. 3/4): prefix trie DFS, stalest-first with
    probability 1 − u; plain FCFS when prefix sharing is off."""

    def __init__(self, prefix_sharing: bool, utility_ratio: float, rng: random.Random) -> None:
        self.prefix_sharing = prefix_sharing
        self.utility_ratio = utility_ratio
        self._rng = rng
        self._trie = PrefixTrie()
        self._fresh = FreshnessIndex()

    def __len__(self) -> int:
        return len(self._fresh)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._trie

    def add(self, req_id: Hashable, tokens: Sequence[int], arrival_s: float) -> None:
        self._trie.insert(req_id, tokens if self.prefix_sharing else ())
        self._fresh.insert(req_id, arrival_s)

    def remove(self, req_id: Hashable) -> None:
        """Delete from both structures (Alg. 4 lines 32-33)."""
        self._trie.remove(req_id)
        self._fresh.remove(req_id)

    def pick(self) -> Hashable | None:
        """Alg. 4 lines 23-28: the next candidate (not removed until it is scheduled)."""
        if not self.prefix_sharing:
            return self._fresh.next_request()
        if self.utility_ratio >= 1.0 or self._rng.random() < self.utility_ratio:
            return self._trie.next_request()
        return self._fresh.next_request()

    def drain(self, limit: int) -> Iterator[Hashable]:
        """Up to `limit` candidates in order, each removed as it is yielded."""
        for _ in range(limit):
            r = self.pick()
            if r is None:
                return
            self.remove(r)
            yield r
