"""Sequence states over llama.cpp's seq_ids: who holds which id, and moving idle ones to host.

Every sequence of a model lives in one llama.cpp context as a seq_id with a stream of KV cells of
its own (binding.py), and a decode step can carry one token of each of many sequences. A context
has a fixed number of seq_ids (``n_seq_max``) while the engine may hold any number of states (the
prefix cache's entries, sessions' pins). So a ``LlamaState`` is a handle that is *resident* (holds
a seq_id) or *spilled* (its cells saved by ``llama_state_seq_get_data`` into host bytes, its seq_id
freed): when no seq_id is free the least recently used state is spilled, and using it again
restores it. An idle engine spills ahead of need (``make_spare``, through
``LlamaCppBackend.tidy``).

States the engine drops give their seq_id back through ``weakref.finalize`` (so does a decode
batch it drops, for its members' ids); the finalizer may run on any thread, so it only queues the
id, and the compute thread frees it at its next call.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from runtime.backends.contract import SequenceState
from runtime.backends.llamacpp.binding import Context
from runtime.errors import BackendError


class LlamaState:
    """A sequence: its seq_id (None while spilled or still empty), the tokens it has consumed,
    the logits after the last one, and ``high_water``, the longest it has ever been (a
    sliding-window cache may have reused its cells below that; see ``LlamaCppBackend.can_trim``)."""

    __slots__ = (
        "__weakref__",
        "_release",
        "high_water",
        "logits",
        "n_tokens",
        "seq",
        "spilled",
        "used",
    )

    def __init__(self) -> None:
        self.seq: int | None = None
        self.n_tokens = 0
        self.high_water = 0
        self.logits: mx.array | None = None
        self.spilled: bytes | None = None
        self.used = 0
        self._release: weakref.finalize | None = None  # type: ignore[type-arg]

    @property
    def length(self) -> int:
        return self.n_tokens


class LlamaSnapshot:
    """The partial state (sliding-window or recurrent cells) of a sequence at ``length`` tokens,
    as ``llama_state_seq_get_data_ext(..., PARTIAL_ONLY)`` wrote it; empty on a model whose every
    cache can be cut back."""

    __slots__ = ("data", "n_tokens")

    def __init__(self, data: bytes, n_tokens: int) -> None:
        self.data = data
        self.n_tokens = n_tokens

    @property
    def length(self) -> int:
        return self.n_tokens

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class SeqCensus:
    """Where a pool's seq_ids (``0 .. size - 1``) are: free, held by a live state,
    or queued to be freed. An id in none of them belongs to a decode batch, or is lost for good;
    one in two of them (or twice in one) is handed out twice."""

    size: int
    free: tuple[int, ...]
    held: tuple[int, ...]
    dropped: tuple[int, ...]

    @property
    def sound(self) -> bool:
        """Every id in exactly one place: what must hold while no decode batch has members."""
        return sorted((*self.free, *self.held, *self.dropped)) == list(range(self.size))


def own_state(state: SequenceState) -> LlamaState:
    if not isinstance(state, LlamaState):
        raise TypeError(f"not a llama.cpp state: {type(state).__name__}")
    return state


class SeqPool:
    """The context's seq_ids: free ones, the states holding the others, and spilling."""

    def __init__(self, context: Context, n_seq_max: int) -> None:
        self._context = context
        self.size = n_seq_max
        self._free = list(range(n_seq_max - 1, -1, -1))  # pop() hands out 0 first
        self._holders: dict[int, weakref.ref[LlamaState]] = {}
        self._dropped: collections.deque[int] = collections.deque()  # queued by finalizers
        self._clock = itertools.count(1)
        self.spills = 0  # states moved to host so far (a statistic)
        self.moves = 0  # states moved to another seq_id to keep a batch's ids one run

    def acquire(self, keep: tuple[int, ...] = ()) -> int:
        """A free seq_id with no cells; spills the least recently used state not in ``keep``
        when none is free. Raises ``BackendError`` when every seq_id is in use by a batch."""
        self.reclaim()
        if not self._free and not self._spill_one(keep):
            raise BackendError(
                "every llama.cpp sequence slot is in use by a running sequence; load the model "
                "with a larger max_sequences"
            )
        return self._free.pop()

    def release(self, seq: int) -> None:
        """Free ``seq``'s cells and give the id back (one not bound to a state)."""
        self._context.seq_rm(seq, 0, -1)
        self._free.append(seq)

    def bind(self, state: LlamaState, seq: int) -> None:
        """Make ``state`` the holder of ``seq`` (its cells are the state's)."""
        state.seq = seq
        state.spilled = None
        state.used = next(self._clock)
        self._holders[seq] = weakref.ref(state)
        state._release = weakref.finalize(state, self._dropped.append, seq)

    def unbind(self, state: LlamaState) -> int:
        """Take ``state``'s seq_id from it (its cells stay): the caller now owns the id."""
        seq = state.seq
        if seq is None:
            raise ValueError("the state holds no seq_id")
        if state._release is not None:
            state._release.detach()
            state._release = None
        del self._holders[seq]
        state.seq = None
        return seq

    def resident(self, state: LlamaState, keep: tuple[int, ...] = ()) -> int:
        """``state``'s seq_id, restoring it from host bytes (or giving an empty state a fresh
        one) first; marks it used now."""
        if state.seq is None:
            self._settle(state, self.acquire(keep))
        state.used = next(self._clock)
        assert state.seq is not None
        return state.seq

    def resident_together(self, states: Sequence[LlamaState], *, one_run: bool) -> list[int]:
        """``resident`` for states computed together (``prefill_together``); their ids, in
        ``states``' order. With ``one_run``, on one run of consecutive seq_ids where it can be
        had, for the reason ``acquire_beside`` gives: a state holding an id keeps it, one
        without takes an id beside the others, then a member off the run moves into a hole
        (one copy of its cells, where a split costs a pass)."""
        self.reclaim()
        for state in states:
            if state.seq is None:
                members = tuple(s.seq for s in states if s.seq is not None)
                seq = self.acquire_beside(members, keep=members) if one_run else None
                self._settle(state, self.acquire(members) if seq is None else seq)
        while one_run and runs(ids := [s.seq for s in states if s.seq is not None]) > 1:
            hole = next(seq for seq in range(min(ids), max(ids)) if seq not in ids)
            top = max(states, key=lambda s: s.seq or 0)
            if not self.holder_moves_off(hole) or not self._move(top, hole):
                break
        return [self.resident(state) for state in states]

    def _settle(self, state: LlamaState, seq: int) -> None:
        """Bind ``state`` (holding no id) to the free id ``seq``, restoring its spilled cells;
        raises ``BackendError`` (``seq`` freed) where llama.cpp has no room for them."""
        if state.spilled is not None and not self._context.set_seq_data(state.spilled, seq):
            self._free.append(seq)
            raise BackendError(
                "llama.cpp could not restore a sequence moved to host memory (its KV cache "
                "has no room); load the model with a larger context_length"
            )
        self.bind(state, seq)

    def copy(self, source: LlamaState, beside: Collection[int] = ()) -> int:
        """A new seq_id (bound to no state) holding a copy of ``source``'s cells, one that keeps
        ``beside`` (a decode batch's ids) one run where it can (``acquire_beside``). Copied
        through a host buffer (``Context.copy_seq``): llama.cpp defers a copy between streams to
        the next decode, after anything else written to the copy meanwhile; and a copy must lay
        its cells out as the source's.
        Raises ``BackendError`` when llama.cpp has no room for it."""
        if source.seq is None and source.spilled is not None:
            dst = self.acquire_beside(beside)  # already host bytes: no need to restore it first
            copied = self._context.set_seq_data(source.spilled, dst)
        else:
            src = self.resident(source)
            dst = self.acquire_beside(beside, keep=(src,))
            copied = self._context.copy_seq(src, dst)
        if not copied:
            self._free.append(dst)
            raise BackendError(
                "llama.cpp could not copy a sequence (no room in its KV cells); load the model "
                "with a larger context_length"
            )
        return dst

    def acquire_beside(self, run: Collection[int], keep: tuple[int, ...] = ()) -> int:
        """A free seq_id that keeps ``run`` (a decode batch's ids) consecutive: a hole in it,
        else the id after it or before it. llama.cpp computes a step over several streams as
        one pass only where their seq_ids are consecutive (``split_equal`` takes "only
        increasing sequence ids", each one more than the last), else one pass per run of ids:
        measured on SmolLM2, a step of 8 rows took 52-61 ms on scattered ids against 28-31 on
        consecutive ones. A state holding the wanted id (not one in ``keep``) moves to a free id
        first, or to host memory when none is free (one copy of its cells, paid once, where a
        split is paid every step). With no
        batch yet: the start of the longest run of free ids, for the members that follow."""
        self.reclaim()
        if not run:
            if not self._free:
                return self.acquire(keep)
            seq = _longest_run_start(self._free)
            self._free.remove(seq)
            return seq
        for seq in _wanted(run, self.size):
            if seq in self._free:
                self._free.remove(seq)
                return seq
        for seq in _wanted(run, self.size):
            if seq not in keep and self._relocate(seq):
                self._free.remove(seq)
                return seq
        return self.acquire(keep)

    def move_member(self, src: int, dst: int) -> bool:
        """Move a decode batch member's cells from ``src`` to the free id ``dst`` (a batch
        closing a hole in its run); ``src`` is freed. False (nothing moved) without room."""
        if dst not in self._free or not self._context.copy_seq(src, dst):
            return False
        self._free.remove(dst)
        self.release(src)
        return True

    def holder_moves_off(self, seq: int) -> bool:
        """Free ``seq`` if a state holds it, by moving that state to another free id or to host
        memory; whether ``seq`` is free now."""
        self.reclaim()
        return seq in self._free or self._relocate(seq)

    def _relocate(self, seq: int) -> bool:
        """Move the state holding ``seq`` to another free id (a copy of its cells), or spill it
        to host memory when no id is free, and free ``seq``; False where no state holds it.
        Spilling is one copy of its cells too, where a split costs a pass every step: 4 streams
        on Gemma 3 over HTTP joined on ids 2, 6, 7 and 10 while every id was held (the states
        they were prefilled in among them), and their first 4 steps took 50-85 ms against 31-35
        once the ids were one run."""
        ref = self._holders.get(seq)
        state = None if ref is None else ref()
        if state is None:
            return False
        if self._free:
            return self._move(state, self._free[-1])
        self._spill(seq, state)
        return True

    def _move(self, state: LlamaState, dst: int) -> bool:
        """Move ``state``'s cells to the free id ``dst`` (one copy) and free the id it held;
        False (nothing moved) where it holds none or llama.cpp has no room."""
        src = state.seq
        if src is None or dst not in self._free or not self._context.copy_seq(src, dst):
            return False
        self._free.remove(dst)
        used = state.used
        self.unbind(state)
        self.release(src)
        self.bind(state, dst)
        state.used = used  # moved, not used: its place in the spill order stays
        self.moves += 1
        return True

    def make_spare(self, count: int) -> bool:
        """Spill the least recently used state if fewer than ``count`` ids are free and one is
        held by a state (not a batch); whether it did."""
        return len(self._free) < count and self._spill_one(keep=())

    def ready_copy_buffer(self) -> bool:
        """Grow the host buffer that copies and spills go through to hold the largest resident
        state; whether it grew (so a branch of the longest cached prompt pays no page faults)."""
        sizes = [
            self._context.seq_size(seq) for seq, ref in self._holders.items() if ref() is not None
        ]
        return bool(sizes) and self._context.grow_copy_buffer(max(sizes))

    def give_back_later(self, seqs: Iterable[int]) -> None:
        """Queue ``seqs`` (owned by no state) to be freed at the compute thread's next call; safe
        from any thread, as a finalizer needs."""
        self._dropped.extend(seqs)

    def census(self) -> SeqCensus:
        """Where every seq_id is now. Read-only; call it while no compute runs (a test at
        quiescence), since the compute thread moves ids between these."""
        held = [seq for seq, ref in self._holders.items() if ref() is not None]
        return SeqCensus(
            size=self.size,
            free=tuple(sorted(self._free)),
            held=tuple(sorted(held)),
            dropped=tuple(sorted(self._dropped)),
        )

    def reclaim(self) -> None:
        """Free the seq_ids of states the engine dropped (queued by their finalizers)."""
        while self._dropped:
            self.release(self._dropped.popleft())

    def _spill_one(self, keep: tuple[int, ...]) -> bool:
        """Spill the least recently used state not in ``keep``; False when no state holds one."""
        held = [
            (state.used, seq, state)
            for seq, ref in self._holders.items()
            if seq not in keep and (state := ref()) is not None
        ]
        if not held:
            return False
        _, seq, state = min(held, key=lambda item: item[0])
        self._spill(seq, state)
        return True

    def _spill(self, seq: int, state: LlamaState) -> None:
        """Save ``state``'s cells (on ``seq``) to host bytes and free ``seq``."""
        data = self._context.get_seq_data(seq)
        self.unbind(state)
        state.spilled = data
        self.release(seq)
        self.spills += 1


def runs(seqs: Iterable[int]) -> int:
    """How many runs of consecutive ids ``seqs`` make: the passes llama.cpp splits a decode
    step over them into (``SeqPool.acquire_beside``)."""
    return len(_runs(seqs))


def _runs(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """The runs of consecutive ids in ``seqs``, lowest first: (first id, length) each."""
    found: list[tuple[int, int]] = []
    for seq in sorted(set(seqs)):
        if found and seq == found[-1][0] + found[-1][1]:
            found[-1] = (found[-1][0], found[-1][1] + 1)
        else:
            found.append((seq, 1))
    return found


def _wanted(run: Collection[int], size: int) -> list[int]:
    """The ids that keep ``run`` one run, best first: its holes, then the id after it, then the
    one before it."""
    low, high = min(run), max(run)
    holes = [seq for seq in range(low + 1, high) if seq not in run]
    return holes + [seq for seq in (high + 1, low - 1) if 0 <= seq < size]


def _longest_run_start(free: Iterable[int]) -> int:
    """The first id of the longest run of consecutive ids in ``free`` (the lowest on a tie)."""
    first, _ = max(_runs(free), key=lambda run: run[1])  # max keeps the first of equals
    return first
