"""Continuous batching on llama.cpp: one ``llama_decode`` per step, one token per sequence.

Each member is a seq_id of the model's one context. ``join`` copies the state's cells to a seq_id
the batch owns (``SeqPool.copy``), ``step`` runs one row per member (its seq_id and position), and
``leave`` hands the seq_id back as an ordinary state. A greedy member's token is the argmax of its
row read in place (``argmax``; the row is copied out only if still needed at the next decode).
Each row attends to its own cells through llama.cpp's mask, so lengths may differ. llama.cpp makes
one pass of a step only over consecutive seq_ids (``SeqPool.acquire_beside``): members join on ids
that keep the batch one run, rows go in in seq_id order, and a hole a member leaves is closed
before the next step. A dropped batch (a failed step) gives its seq_ids back.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from runtime.backends.contract import SequenceState
from runtime.backends.llamacpp.binding import Context
from runtime.backends.llamacpp.passes import Row
from runtime.backends.llamacpp.seqs import LlamaState, SeqPool, own_state, runs


@dataclass
class _Member:
    seq: int
    n_tokens: int
    high_water: int
    logits: mx.array | None


class LlamaDecodeBatch:
    """Sequences decoded together (``runtime.backends.contract.DecodeBatchHandle``)."""

    def __init__(self, context: Context, pool: SeqPool) -> None:
        self._context = context
        self._pool = pool
        self._members: dict[int, _Member] = {}
        self._next_slot = 0
        # Members whose last logits are still only in llama.cpp's buffer: slot -> row index.
        self._in_place: dict[int, int] = {}
        context.row_keepers.add(self)
        # A failed step makes the engine drop the batch without a leave() per member: without
        # this their seq_ids were lost for good (found by tests/test_llamacpp_faults.py).
        weakref.finalize(self, _give_back, pool, self._members)

    def __len__(self) -> int:
        return len(self._members)

    def join(self, state: SequenceState) -> int:
        """Add a prefilled sequence (its cells are shared, the state left as it is); a slot."""
        own = own_state(state)
        if own.n_tokens <= 0:
            raise ValueError("join() needs a prefilled state (at least one token)")
        self._pool.reclaim()
        dst = self._pool.copy(own, beside=[member.seq for member in self._members.values()])
        slot = self._next_slot
        self._next_slot += 1
        self._members[slot] = _Member(dst, own.n_tokens, own.high_water, own.logits)
        return slot

    def leave(self, slot: int) -> LlamaState:
        """Take ``slot`` out as an independent state (its seq_id and logits)."""
        member = self._members.pop(self._check(slot))
        row = self._in_place.pop(slot, None)
        if row is not None:  # still in llama.cpp's buffer: no decode since (``keep_rows``)
            member.logits = mx.array(self._context.row_view(row))
        state = LlamaState()
        self._pool.bind(state, member.seq)
        state.n_tokens, state.high_water, state.logits = (
            member.n_tokens,
            member.high_water,
            member.logits,
        )
        return state

    def step(
        self, tokens: Mapping[int, int | mx.array], argmax: Collection[int] = ()
    ) -> dict[int, mx.array | int]:
        """One ``llama_decode`` feeding each member its token; each one's (vocab,) logits, or for
        a slot in ``argmax`` (a plain greedy sampler's) the id of its largest logit, the first
        of equal ones as ``np.argmax`` picks them: read in place, with no copy of the row."""
        if set(tokens) != set(self._members):
            missing = sorted(set(self._members) - set(tokens))
            extra = sorted(set(tokens) - set(self._members))
            raise ValueError(
                f"step() needs one token per member (missing {missing}, not members {extra})"
            )
        if not self._members:
            return {}
        self.close_holes()
        # In seq_id order: llama.cpp takes a run of ids in one pass only in increasing order.
        slots = sorted(self._members, key=lambda slot: self._members[slot].seq)
        rows = []
        for slot in slots:
            member, token = self._members[slot], tokens[slot]
            fed = token if isinstance(token, int) else int(token.astype(mx.int32).item())  # type: ignore[arg-type]
            rows.append(Row(member.seq, member.n_tokens, fed, True))
        self._in_place.clear()  # every member gets new logits: the old rows are not needed
        out: dict[int, mx.array | int] = {}
        ctx = self._context
        for begin in range(0, len(rows), ctx.n_batch):
            piece, piece_slots = rows[begin : begin + ctx.n_batch], slots[begin:]
            at = ctx.decode_in_place(piece) if argmax else None
            if at is not None:
                for i, slot in zip(at, piece_slots, strict=False):
                    if slot in argmax:
                        out[slot] = int(np.argmax(ctx.row_view(i)))
                        self._in_place[slot] = i
                    else:
                        out[slot] = mx.array(ctx.row_view(i))
                    self._advance(slot, None if slot in argmax else out[slot])
                continue
            for slot, row_logits in zip(piece_slots, ctx.decode(piece), strict=False):
                out[slot] = row_logits
                self._advance(slot, row_logits)
        return out

    def _advance(self, slot: int, logits: mx.array | int | None) -> None:
        member = self._members[slot]
        member.n_tokens += 1
        member.high_water = max(member.high_water, member.n_tokens)
        member.logits = logits if isinstance(logits, mx.array) else None

    def keep_rows(self) -> None:
        """Copy the rows of greedy members out of llama.cpp's buffer (``RowKeeper``): called
        before any ``llama_decode`` of the context and before a member leaves."""
        for slot, i in self._in_place.items():
            if slot in self._members:
                self._members[slot].logits = mx.array(self._context.row_view(i))
        self._in_place.clear()

    @property
    def runs(self) -> int:
        """The runs of consecutive seq_ids the members hold: the passes a step takes."""
        return runs(member.seq for member in self._members.values())

    def close_holes(self) -> None:
        """Move the top member into each hole of the members' ids (a state that holds the hole
        moves off it first), while copies succeed: one copy each, where a split costs a pass
        every step."""
        while self.runs > 1:
            by_seq = {member.seq: member for member in self._members.values()}
            hole = next(seq for seq in range(min(by_seq), max(by_seq)) if seq not in by_seq)
            top = by_seq[max(by_seq)]
            if not self._pool.holder_moves_off(hole) or not self._pool.move_member(top.seq, hole):
                return
            top.seq = hole

    def _check(self, slot: int) -> int:
        if slot not in self._members:
            raise KeyError(f"slot {slot} is not in this batch")
        return slot


def _give_back(pool: SeqPool, members: dict[int, _Member]) -> None:
    """The finalizer of a dropped batch (any thread): its members' seq_ids go back to the pool."""
    pool.give_back_later(member.seq for member in members.values())
