"""A radix tree of tokens: the best reusable cached prefix of a prompt in O(prompt length).

One trie indexes the live prefix entries of one (model, epoch, namespace) partition. A trimmable
entry serves any shared prefix, cut back; a non-trimmable ("checkpoint") entry only where its tokens
end and at its ``points``. At most ``len(prompt) - 1`` tokens are reused: a prompt keeps one token
to run. Tokens with no entry and no branch along them are one edge, compared as a slice: a lookup,
take or commit (each on a request's way to its first token) visits a few nodes, not one per token.
Every node caches ``subtree_best`` (the most recently used trimmable entry at or below it); recency
values must only grow. Placement, the reuse rules and ties: docs/design.md, "The token trie".
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
    """The position after ``edge``, the tokens from its parent's position to its own."""

    __slots__ = ("children", "edge", "restorable", "subtree_best", "trimmable")

    def __init__(self, edge: TokenIds) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}  # by the first token of the child's edge
        self.trimmable: _Slot | None = None
        self.restorable: set[int] = set()  # checkpoint entries restorable at this position
        self.subtree_best: _Slot | None = None

    def holds_entry(self) -> bool:
        return self.trimmable is not None or bool(self.restorable)

    def recompute_subtree_best(self) -> None:
        best = self.trimmable
        for child in self.children.values():
            if child.subtree_best is not None and (best is None or child.subtree_best > best):
                best = child.subtree_best
        self.subtree_best = best


def _shared(edge: TokenIds, tokens: TokenIds, start: int, stop: int) -> int:
    """How many leading tokens of ``edge`` equal ``tokens[start:stop]``."""
    length = min(len(edge), stop - start)
    if edge[:length] == tokens[start : start + length]:  # the usual case: one C comparison
        return length
    return next(i for i in range(length) if edge[i] != tokens[start + i])


class TokenTrie:
    """Index of one partition's live entries by their tokens.

    Insert, remove and touch cost O(len(tokens)) in slice comparisons plus O(nodes on the path)
    (removal also scans the children of the nodes its entry was best below; touching a checkpoint
    entry is O(1)); ``best_match`` costs the same plus the entries restorable at the chosen node.
    """

    def __init__(self) -> None:
        self._root = _Node(())
        self._size = 0
        # Checkpoint entries: the depths where each is restorable (its end last), and recency.
        self._depths: dict[int, tuple[int, ...]] = {}
        self._recency: dict[int, int] = {}

    def __len__(self) -> int:
        return self._size

    def find(self, tokens: TokenIds, trimmable: bool) -> int | None:
        """The id of the entry with exactly these tokens and trimmability, if indexed."""
        path = self._path(tokens)
        if path is None:
            return None
        node = path[-1]
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
        tokens = tuple(tokens)  # edges are slices of it: a list would make list edges
        depths = (*sorted(set(points)), len(tokens))
        path, at = self._make_path(tokens, depths)
        if trimmable:
            slot = (recency, entry_id)
            path[-1].trimmable = slot
            for node in path:
                if node.subtree_best is None or slot > node.subtree_best:
                    node.subtree_best = slot
        else:
            for depth in depths:
                at[depth].restorable.add(entry_id)
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
        assert path is not None, "touch of an entry that is not indexed"
        assert path[-1].trimmable is not None, "touch of an entry that is not indexed"
        slot = (recency, path[-1].trimmable[1])
        path[-1].trimmable = slot
        for node in path:
            if node.subtree_best is None or slot > node.subtree_best:
                node.subtree_best = slot

    def remove(self, entry_id: int, tokens: TokenIds, trimmable: bool) -> None:
        """Unindex an entry, pruning and merging nodes that no longer hold an entry or a branch."""
        path = self._path(tokens)
        assert path is not None, "removal of an entry that is not indexed"
        removed: _Slot | None = None
        if trimmable:
            removed = path[-1].trimmable
            assert removed is not None, "removal of an entry that is not indexed"
            path[-1].trimmable = None
        else:
            assert entry_id in self._depths, "removal of an entry that is not indexed"
            at = self._at_depths(path)
            for depth in self._depths.pop(entry_id):
                at[depth].restorable.discard(entry_id)
            del self._recency[entry_id]
        self._size -= 1
        for index in range(len(path) - 1, -1, -1):
            node = path[index]
            # Above the first ancestor whose best was not the removed entry, nothing changes.
            if removed is not None and node.subtree_best == removed:
                node.recompute_subtree_best()
            if index == 0 or node.holds_entry():
                continue
            parent = path[index - 1]
            if not node.children:
                del parent.children[node.edge[0]]
            elif len(node.children) == 1:  # no entry, no branch: one edge with its child
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                parent.children[node.edge[0]] = child

    def strict_prefix_trimmable(self, tokens: TokenIds) -> list[int]:
        """Ids of trimmable entries whose tokens strictly prefix ``tokens``, shortest first."""
        found: list[int] = []
        node, depth, limit = self._root, 0, len(tokens) - 1
        while depth < limit:
            child = node.children.get(tokens[depth])
            if child is None or depth + len(child.edge) > limit:
                break
            if _shared(child.edge, tokens, depth, limit) < len(child.edge):
                break
            node, depth = child, depth + len(child.edge)
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
        # The nodes the prompt reaches whole, with their depths; then, where it stops inside an
        # edge, that edge's node and how far into the prompt it still matches.
        path: list[tuple[_Node, int]] = [(self._root, 0)]
        partial: tuple[_Node, int] | None = None
        node, depth = self._root, 0
        while depth < limit:
            child = node.children.get(prompt[depth])
            if child is None:
                break
            shared = _shared(child.edge, prompt, depth, limit)
            if shared < len(child.edge):
                partial = (child, depth + shared)
                break
            node, depth = child, depth + shared
            path.append((node, depth))

        # Every trimmable entry below a position shares its depth's tokens with the prompt, so
        # the deepest position with one below it gives the longest trimmable reuse.
        trim: tuple[_Node, int] | None = None
        if partial is not None and partial[0].subtree_best is not None:
            trim = partial
        else:
            trim = next(((n, d) for n, d in reversed(path[1:]) if n.subtree_best is not None), None)
        checkpoint = next(((n, d) for n, d in reversed(path[1:]) if n.restorable), None)
        trim_depth = 0 if trim is None else trim[1]
        checkpoint_depth = 0 if checkpoint is None else checkpoint[1]
        matched = max(trim_depth, checkpoint_depth)
        if matched < 1:
            return None

        # Candidates ranked by (used whole, recency).
        candidates: list[tuple[bool, int, int, ReusePath]] = []
        if trim is not None and trim_depth == matched:
            trim_node = trim[0]
            if trim is not partial and trim_node.trimmable is not None:
                candidates.append((True, *trim_node.trimmable, ReusePath.EXACT))
            else:
                assert trim_node.subtree_best is not None
                candidates.append((False, *trim_node.subtree_best, ReusePath.TRIM))
        if checkpoint is not None and checkpoint_depth == matched:
            recency, entry_id = max((self._recency[e], e) for e in checkpoint[0].restorable)
            candidates.append((True, recency, entry_id, ReusePath.CHECKPOINT))
        _, _, entry_id, path_kind = max(candidates)
        return PrefixMatch(entry_id=entry_id, matched=matched, path=path_kind)

    def _path(self, tokens: TokenIds) -> list[_Node] | None:
        """The nodes from the root to the one at exactly ``tokens``; None if there is none."""
        path, node, depth = [self._root], self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or _shared(child.edge, tokens, depth, len(tokens)) < len(child.edge):
                return None
            node, depth = child, depth + len(child.edge)
            path.append(node)
        return path

    def _make_path(
        self, tokens: TokenIds, depths: tuple[int, ...]
    ) -> tuple[list[_Node], dict[int, _Node]]:
        """The nodes from the root to ``tokens``' end, made (splitting edges) where missing, with
        a node at each of ``depths`` (ascending, ``len(tokens)`` last); and those by depth."""
        path, at = [self._root], {}
        node, depth, stops = self._root, 0, iter(depths)
        stop = next(stops)
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                child = _Node(tokens[depth:stop])
                node.children[tokens[depth]] = child
            else:
                shared = _shared(child.edge, tokens, depth, stop)
                if shared < len(child.edge):  # a branch or a stop inside the edge: split it
                    upper = _Node(child.edge[:shared])
                    upper.children[child.edge[shared]] = child
                    upper.subtree_best = child.subtree_best
                    child.edge = child.edge[shared:]
                    node.children[upper.edge[0]] = upper
                    child = upper
            node, depth = child, depth + len(child.edge)
            path.append(node)
            if depth == stop:
                at[depth] = node
                stop = next(stops, stop)
        return path, at

    def _at_depths(self, path: list[_Node]) -> dict[int, _Node]:
        """``path``'s nodes by their depth."""
        at, depth = {}, 0
        for node in path:
            depth += len(node.edge)
            at[depth] = node
        return at
