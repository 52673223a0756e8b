"""Cutting a llama.cpp sequence back to a prefix of itself: what a restore does to a copy of a
cached state (``copy_state``) or, where the engine takes the entry, to the state itself
(``take_state``; docs/reuse.md, "Taking an entry instead of copying it")."""

from __future__ import annotations

from runtime.backends.contract import CannotTrim, Snapshot
from runtime.backends.llamacpp.binding import PARTIAL_ONLY, Context
from runtime.backends.llamacpp.seqs import LlamaSnapshot, LlamaState, SeqPool


class Cutter:
    """A state's first tokens as a copy on a seq_id of its own (``copy_state``) or cut back in
    place (``take_state``): to ``reach`` where the sliding-window cells allow it, else to
    ``length`` from its snapshot. ``trimmable``: the backend's ``can_trim`` of the state;
    ``cell``: a sliding-window cell's serialized bytes (``ModelInfo.window_bytes_per_token``)."""

    def __init__(self, context: Context, pool: SeqPool, n_swa: int, recurrent: bool) -> None:
        self._context, self._pool = context, pool
        self._n_swa, self._recurrent = n_swa, recurrent

    def restore(
        self,
        source: LlamaState,
        length: int,
        snapshot: Snapshot | None,
        reach: int,
        *,
        trimmable: bool,
        cell: int,
        in_place: bool,
    ) -> LlamaState:
        """``source``'s first tokens: ``source`` itself cut back (``in_place``: take_state) or a
        copy on a seq_id of its own (copy_state)."""
        self._pool.reclaim()
        check_cut(source, length, snapshot, trimmable)
        if in_place:
            if length < source.n_tokens or snapshot is not None:
                seq = self._pool.resident(source)
                length, snapshot = self._cut(seq, source, length, snapshot, reach, cell)
                cut_to(source, source, length, snapshot)
            return source
        copy = LlamaState()
        if length == 0:
            return copy
        dst = self._pool.copy(source)
        try:
            # No reach: a copy goes through host memory, which holds only the window before its
            # last token, so a cut back inside it would only be counted short and undone.
            length, snapshot = self._cut(dst, source, length, snapshot, 0, cell)
        except CannotTrim:
            self._pool.release(dst)
            raise
        self._pool.bind(copy, dst)
        cut_to(copy, source, length, snapshot)
        return copy

    def _cut(
        self,
        seq: int,
        source: LlamaState,
        length: int,
        snapshot: Snapshot | None,
        reach: int,
        cell: int,
    ) -> tuple[int, Snapshot | None]:
        """Cut ``seq`` (holding ``source``'s cells) back to ``reach`` where its sliding-window
        cells still allow it, as llama-server does (it keeps n_ubatch cells past the window),
        else to ``length`` from ``snapshot``; returns the length and snapshot it used."""
        if (
            self._n_swa
            and not self._recurrent
            and length < reach <= source.n_tokens
            and cut_within_window(self._context, seq, reach, self._n_swa, cell)
        ):
            return reach, None
        cut(self._context, seq, length, snapshot)
        return length, snapshot


def check_cut(source: LlamaState, length: int, snapshot: Snapshot | None, trimmable: bool) -> None:
    """Raise ``CannotTrim`` unless ``source`` can be cut back to ``length`` (``trimmable``: the
    backend's ``can_trim(source)``)."""
    if not 0 <= length <= source.n_tokens:
        raise CannotTrim(f"cannot copy {length} tokens of a {source.n_tokens}-token state")
    if snapshot is not None:
        if not isinstance(snapshot, LlamaSnapshot) or snapshot.n_tokens != length:
            raise CannotTrim(f"the snapshot does not hold {length} tokens of this state")
    elif length < source.n_tokens and not trimmable:
        raise CannotTrim("a sliding-window or recurrent cache cannot be cut back here")


def cut(context: Context, seq: int, length: int, snapshot: Snapshot | None) -> None:
    """Cut seq_id ``seq``'s cells back to ``length`` tokens. The snapshot first: a recurrent
    state refuses to be cut back, and on a hybrid model its refusal leaves the attention cells
    uncut too; once the state is at ``length``, removing what lies past it removes only
    attention cells."""
    data = snapshot.data if isinstance(snapshot, LlamaSnapshot) else b""
    restored = not data or context.set_seq_data(data, seq, PARTIAL_ONLY)
    trimmed = restored and context.seq_rm(seq, length, -1)
    if not trimmed or context.seq_pos_max(seq) != length - 1:
        raise CannotTrim(f"llama.cpp could not cut this state back to {length} tokens")


def cut_within_window(context: Context, seq: int, reach: int, n_swa: int, cell_bytes: int) -> bool:
    """Cut seq_id ``seq`` back to ``reach`` tokens with no snapshot; True if its sliding-window
    layers still held every cell the tokens after ``reach`` attend to, else False (the
    full-attention cells before ``reach`` are kept either way, so a snapshot's restore may follow).

    llama.cpp reuses a sliding-window cell only once no later token of its sequence attends to it,
    so a cut back inside the window may find cells already gone. Which ones is not a matter of
    position alone, so this counts them: a state's sliding-window state (``PARTIAL_ONLY``) holds
    its cells within the window of its last token, ``cell_bytes`` each, and after the cut that
    window ends at ``reach``: it must have shrunk by exactly the cells cut away.
    """
    before, held = context.seq_size(seq, PARTIAL_ONLY), context.seq_pos_max(seq) + 1
    if not context.seq_rm(seq, reach, -1) or context.seq_pos_max(seq) != reach - 1:
        return False
    expected = before - (min(held, n_swa) - min(reach, n_swa)) * cell_bytes
    return context.seq_size(seq, PARTIAL_ONLY) == expected


def cut_to(state: LlamaState, source: LlamaState, length: int, snapshot: Snapshot | None) -> None:
    """``state``'s bookkeeping once its cells are ``source``'s first ``length`` tokens."""
    whole = length == source.n_tokens
    state.logits = source.logits if whole else None
    state.high_water = length if snapshot is not None else source.high_water
    state.n_tokens = length
