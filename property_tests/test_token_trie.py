"""The prefix index's radix tree (actors/token_trie.py) against a brute-force list of entries.

The prefix-cache machine (test_prefix_cache_machine.py) checks the same reuse rules through the
manager, on prompts of at most six tokens; this drives the tree alone with longer token runs over a
three-token vocabulary, so long edges are split at branches and points, and merged again when an
entry leaves. After every step the tree must answer as the list does (``best_match``, ``find``,
``strict_prefix_trimmable``) and stay a radix tree: every node but the root holds an entry or
branches, and every node's ``subtree_best`` is the newest trimmable entry at or below it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.token_trie import TokenTrie, _Node
from runtime.messages import ReusePath, TokenIds

token_runs = st.lists(st.integers(0, 2), min_size=1, max_size=14).map(tuple)
prompts = st.lists(st.integers(0, 2), max_size=16).map(tuple)


@dataclass
class Entry:
    entry_id: int
    tokens: TokenIds
    trimmable: bool
    points: tuple[int, ...]
    recency: int


def usable(entry: Entry, prompt: TokenIds) -> tuple[int, ReusePath] | None:
    """How many tokens of ``prompt`` the entry serves, straight from the rules."""
    limit = len(prompt) - 1
    if entry.trimmable:
        shared = 0
        while (
            shared < min(len(entry.tokens), len(prompt)) and entry.tokens[shared] == prompt[shared]
        ):
            shared += 1
        matched = min(shared, limit)
        path = ReusePath.EXACT if matched == len(entry.tokens) else ReusePath.TRIM
    else:
        depths = [
            d
            for d in (*entry.points, len(entry.tokens))
            if d <= limit and prompt[:d] == entry.tokens[:d]
        ]
        if not depths:
            return None
        matched, path = max(depths), ReusePath.CHECKPOINT
    return (matched, path) if matched >= 1 else None


class TrieMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.trie = TokenTrie()
        self.entries: dict[int, Entry] = {}
        self.clock = 0
        self.next_id = 1

    def _taken(self, tokens: TokenIds, trimmable: bool) -> bool:
        return any(e.tokens == tokens and e.trimmable == trimmable for e in self.entries.values())

    @rule(
        tokens=token_runs, trimmable=st.booleans(), points=st.lists(st.integers(1, 13), max_size=3)
    )
    def insert(self, tokens: TokenIds, trimmable: bool, points: list[int]) -> None:
        kept = () if trimmable else tuple(sorted({p for p in points if p < len(tokens)}))
        if self._taken(tokens, trimmable):
            return
        self.clock += 1
        entry = Entry(self.next_id, tokens, trimmable, kept, self.clock)
        self.next_id += 1
        self.trie.insert(tokens, trimmable, entry.entry_id, entry.recency, kept)
        self.entries[entry.entry_id] = entry

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        entry = self.entries.pop(data.draw(st.sampled_from(sorted(self.entries))))
        self.trie.remove(entry.entry_id, entry.tokens, entry.trimmable)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        entry = self.entries[data.draw(st.sampled_from(sorted(self.entries)))]
        self.clock += 1
        entry.recency = self.clock
        self.trie.touch(entry.entry_id, entry.tokens, entry.trimmable, entry.recency)

    @rule(prompt=prompts)
    def best_match(self, prompt: TokenIds) -> None:
        scored = [(s, e) for e in self.entries.values() if (s := usable(e, prompt)) is not None]
        got = self.trie.best_match(prompt)
        if not scored:
            assert got is None
            return
        (matched, path), best = max(
            scored, key=lambda s: (s[0][0], s[0][1] is not ReusePath.TRIM, s[1].recency)
        )
        assert got is not None
        assert (got.entry_id, got.matched, got.path) == (best.entry_id, matched, path)

    @rule(tokens=prompts, trimmable=st.booleans())
    def find_and_prefixes(self, tokens: TokenIds, trimmable: bool) -> None:
        same = [
            e.entry_id
            for e in self.entries.values()
            if e.tokens == tokens and e.trimmable == trimmable
        ]
        assert self.trie.find(tokens, trimmable) == (same[0] if same else None)
        shorter = sorted(
            (len(e.tokens), e.entry_id)
            for e in self.entries.values()
            if e.trimmable and len(e.tokens) < len(tokens) and tokens[: len(e.tokens)] == e.tokens
        )
        assert self.trie.strict_prefix_trimmable(tokens) == [entry_id for _, entry_id in shorter]

    @invariant()
    def it_stays_a_radix_tree(self) -> None:
        assert len(self.trie) == len(self.entries)

        def check(node: _Node, is_root: bool) -> None:
            if not is_root:
                assert node.edge, "an empty edge"
                assert node.holds_entry() or len(node.children) >= 2, "a node that could merge"
            best = node.trimmable
            for first, child in node.children.items():
                assert child.edge[0] == first
                check(child, False)
                if child.subtree_best is not None and (best is None or child.subtree_best > best):
                    best = child.subtree_best
            assert node.subtree_best == best

        check(self.trie._root, True)


TestTokenTrie = TrieMachine.TestCase
