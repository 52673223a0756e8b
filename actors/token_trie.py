"""A token trie that finds the best reusable cached prefix of a prompt in O(prompt length).

One trie indexes the live prefix entries of one (model, epoch, namespace) partition, one node per
token position, so a lookup walks the prompt once however many entries there are. A trimmable entry
serves any shared prefix, cut back; a non-trimmable ("checkpoint") entry only where its tokens end
and at its ``points``. At most ``len(prompt) - 1`` tokens are reused: a prompt keeps one token to
run. Every node caches ``subtree_best`` (the most recently used trimmable entry at or below it), so
a match needs no subtree walk; recency values must only grow (the caller passes a logical clock).

Placement, the reuse rules and ties: docs/design.md, "The token trie".
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.messages import ReusePath, TokenIds

# (recency, entry_id): comparing slots compares recency, which is unique per trie.
_Slot = tuple[int, int]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The best usable entry for a prompt: reuse its first ``matched`` tokens via ``path``."""

    entry_id: int
    matched: int
    path: ReusePath


class _Node:
    __slots__ = ("children", "restorable", "subtree_best", "trimmable")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.trimmable: _Slot | None = None
        self.restorable: set[int] = set()  # checkpoint entries restorable at this depth
        self.subtree_best: _Slot | None = None

    def is_empty(self) -> bool:
        return not self.children and self.trimmable is None and not self.restorable

    def recompute_subtree_best(self) -> None:
        best = self.trimmable
        for child in self.children.values():
            if child.subtree_best is not None and (best is None or child.subtree_best > best):
                best = child.subtree_best
        self.subtree_best = best


class TokenTrie:
    """Index of one partition's live entries by their tokens.

    Insert, remove and touch cost O(len(tokens)) (removal also scans the siblings on the path of
    the removed entry; touching a checkpoint entry is O(1)); ``best_match`` costs O(len(prompt))
    plus the entries restorable at the chosen node.
    """

    def __init__(self) -> None:
        self._root = _Node()
        self._size = 0
        # Checkpoint entries: the depths where each is restorable (its end last), and recency.
        self._depths: dict[int, tuple[int, ...]] = {}
        self._recency: dict[int, int] = {}

    def __len__(self) -> int:
        return self._size

    def find(self, tokens: TokenIds, trimmable: bool) -> int | None:
        """The id of the entry with exactly these tokens and trimmability, if indexed."""
        node = self._walk(tokens)
        if node is None:
            return None
        if trimmable:
            return None if node.trimmable is None else node.trimmable[1]
        ending_here = (e for e in node.restorable if self._depths[e][-1] == len(tokens))
        return next(ending_here, None)

    def insert(
        self,
        tokens: TokenIds,
        trimmable: bool,
        entry_id: int,
        recency: int,
        points: tuple[int, ...] = (),
    ) -> None:
        """Index an entry (restorable also at ``points``, for a checkpoint entry).

        Raises ``ValueError`` if tokens are empty, the slot is taken, a point is not strictly
        inside the tokens, or a trimmable entry has points (it serves every prefix already).
        """
        if not tokens:
            raise ValueError("a prefix entry needs at least one token")
        if trimmable and points:
            raise ValueError("a trimmable entry serves every prefix: it takes no points")
        if any(not 0 < p < len(tokens) for p in points):
            raise ValueError(f"points {points} must lie strictly inside {len(tokens)} tokens")
        if self.find(tokens, trimmable) is not None:
            raise ValueError(f"an entry with these tokens (trimmable={trimmable}) is indexed")
        path = [self._root]
        for token in tokens:
            path.append(path[-1].children.setdefault(token, _Node()))
        if trimmable:
            slot = (recency, entry_id)
            path[-1].trimmable = slot
            self._raise_subtree_best(path, slot)
        else:
            depths = (*sorted(set(points)), len(tokens))
            for depth in depths:
                path[depth].restorable.add(entry_id)
            self._depths[entry_id] = depths
            self._recency[entry_id] = recency
        self._size += 1

    def touch(self, entry_id: int, tokens: TokenIds, trimmable: bool, recency: int) -> None:
        """Mark an indexed entry as used at ``recency`` (greater than any recency seen before)."""
        if not trimmable:
            assert entry_id in self._recency, "touch of an entry that is not indexed"
            self._recency[entry_id] = recency
            return
        path = self._path(tokens)
        end = path[-1]
        assert end.trimmable is not None, "touch of an entry that is not indexed"
        end.trimmable = (recency, end.trimmable[1])
        self._raise_subtree_best(path, end.trimmable)

    def remove(self, entry_id: int, tokens: TokenIds, trimmable: bool) -> None:
        """Unindex an entry, pruning nodes that no longer lead anywhere."""
        path = self._path(tokens)
        removed: _Slot | None = None
        if trimmable:
            removed = path[-1].trimmable
            assert removed is not None, "removal of an entry that is not indexed"
            path[-1].trimmable = None
        else:
            assert entry_id in self._depths, "removal of an entry that is not indexed"
            for depth in self._depths.pop(entry_id):
                path[depth].restorable.discard(entry_id)
            del self._recency[entry_id]
        self._size -= 1
        for depth in range(len(tokens), -1, -1):
            node = path[depth]
            # Above the first ancestor whose best was not the removed entry, nothing changes.
            if removed is not None and node.subtree_best == removed:
                node.recompute_subtree_best()
            if depth > 0 and node.is_empty():
                del path[depth - 1].children[tokens[depth - 1]]

    def strict_prefix_trimmable(self, tokens: TokenIds) -> list[int]:
        """Ids of trimmable entries whose tokens strictly prefix ``tokens``, shortest first."""
        found: list[int] = []
        node = self._root
        for token in tokens[:-1]:
            child = node.children.get(token)
            if child is None:
                break
            node = child
            if node.trimmable is not None:
                found.append(node.trimmable[1])
        return found

    def best_match(self, prompt: TokenIds) -> PrefixMatch | None:
        """The entry that reuses the most tokens of ``prompt``, or None when nothing is usable.

        Ties prefer an entry used whole (EXACT or CHECKPOINT) over a trimmed one, then the most
        recently used.
        """
        limit = len(prompt) - 1  # leave one token to compute the next-token logits from
        if limit < 1:
            return None
        path = [self._root]
        for token in prompt[:limit]:
            child = path[-1].children.get(token)
            if child is None:
                break
            path.append(child)

        # Every trimmable entry below path[d] shares at least d tokens with the prompt, so the
        # deepest node with one below it gives the longest trimmable reuse.
        trim_depth = next(
            (d for d in range(len(path) - 1, 0, -1) if path[d].subtree_best is not None), 0
        )
        checkpoint_depth = next((d for d in range(len(path) - 1, 0, -1) if path[d].restorable), 0)
        matched = max(trim_depth, checkpoint_depth)
        if matched < 1:
            return None

        node = path[matched]
        # Candidates ranked by (used whole, recency).
        candidates: list[tuple[bool, int, int, ReusePath]] = []
        if trim_depth == matched:
            if node.trimmable is not None:
                candidates.append((True, *node.trimmable, ReusePath.EXACT))
            else:
                assert node.subtree_best is not None
                candidates.append((False, *node.subtree_best, ReusePath.TRIM))
        if checkpoint_depth == matched:
            recency, entry_id = max((self._recency[e], e) for e in node.restorable)
            candidates.append((True, recency, entry_id, ReusePath.CHECKPOINT))
        _, _, entry_id, path_kind = max(candidates)
        return PrefixMatch(entry_id=entry_id, matched=matched, path=path_kind)

    def _walk(self, tokens: TokenIds) -> _Node | None:
        node = self._root
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                return None
            node = child
        return node

    def _path(self, tokens: TokenIds) -> list[_Node]:
        path = [self._root]
        for token in tokens:
            path.append(path[-1].children[token])
        return path

    @staticmethod
    def _raise_subtree_best(path: list[_Node], slot: _Slot) -> None:
        for node in path:
            if node.subtree_best is None or slot > node.subtree_best:
                node.subtree_best = slot
