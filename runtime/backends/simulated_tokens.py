"""The simulated model's arithmetic: which token follows a prefix, and what compute costs.

The next token is a pure function of the prefix's rolling hash, so any two paths to one prefix
(cold prefill, trimmed reuse, a checkpoint, an adopted warmup) give the same tokens, and
``greedy_continuation`` is the reference a test compares with. A state is its tokens and the hash
after each (so a trim is exact); a snapshot is one length and hash. Compute spends time through a
``ComputeClock``: real sleeps on the thread executor, virtual seconds in the simulator.
The backend built on them: simulated.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from runtime.backends.contract import SequenceState

if TYPE_CHECKING:
    import mlx.core as mx

EOS_TOKEN_ID = 256
VOCAB_SIZE = 257
# Generated tokens are drawn from these bytes so the text is readable and valid UTF-8.
_TEXT_TOKENS = tuple(b"abcdefghijklmnopqrstuvwxyz ")
_HASH_MOD = (1 << 61) - 1
_HASH_BASE = 1_000_003


class ComputeClock(Protocol):
    """Where simulated compute spends its time."""

    def spend(self, seconds: float) -> None: ...


class RealClock:
    """Spends real time: the compute thread sleeps, as a real model would keep it busy."""

    def spend(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class SimulatedFault(RuntimeError):
    """Raised by the simulated backend where its options inject a fault."""


class SimulatedState:
    """Tokens consumed so far plus the rolling hash after each one (so trims are exact)."""

    __slots__ = ("has_logits", "hashes", "tokens")

    def __init__(self, tokens: list[int] | None = None, hashes: list[int] | None = None) -> None:
        self.tokens: list[int] = tokens or []
        self.hashes: list[int] = hashes or []
        # False after a prefill that kept no logits: sampling then is an engine bug (the contract).
        self.has_logits = True

    @property
    def length(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Consume ``token_ids``, the rolling hash after each one recorded."""
        h = self.hashes[-1] if self.hashes else 0
        for token in token_ids:
            h = extend_hash(h, token)
            self.tokens.append(token)
            self.hashes.append(h)


class SimulatedSnapshot:
    """The untrimmable part of a state: its rolling hash after ``length`` tokens."""

    __slots__ = ("length", "nbytes", "prefix_hash")

    def __init__(self, length: int, prefix_hash: int, nbytes: int) -> None:
        self.length = length
        self.prefix_hash = prefix_hash
        self.nbytes = nbytes


def next_token_for(prefix_hash: int, eos_every: int) -> int:
    """The greedy next token after a prefix with this hash."""
    if eos_every > 0 and prefix_hash % eos_every == 0:
        return EOS_TOKEN_ID
    return _TEXT_TOKENS[prefix_hash % len(_TEXT_TOKENS)]


def extend_hash(prefix_hash: int, token_id: int) -> int:
    return (prefix_hash * _HASH_BASE + token_id + 1) % _HASH_MOD


def greedy_continuation(prompt: Sequence[int], n: int, eos_every: int = 0) -> list[int]:
    """What a cold greedy run would produce: the reference for equivalence tests."""
    h = 0
    for token in prompt:
        h = extend_hash(h, token)
    out: list[int] = []
    for _ in range(n):
        token = next_token_for(h, eos_every)
        if token == EOS_TOKEN_ID:
            break
        out.append(token)
        h = extend_hash(h, token)
    return out


def read_token(token: int | mx.array) -> int:
    """A token id, reading it first if it is a draw's array (the step needs its value now)."""
    return token if isinstance(token, int) else int(token.item())  # type: ignore[arg-type]


def own_state(state: SequenceState) -> SimulatedState:
    """Narrow an engine-held state back to ours (a foreign state is a programming error)."""
    if not isinstance(state, SimulatedState):
        raise TypeError(f"not a simulated state: {type(state).__name__}")
    return state
