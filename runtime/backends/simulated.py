"""A deterministic model backend an engine cannot tell from a real one.

The next token is a pure function of the token prefix (a rolling hash), so any two paths to the same
prefix (cold prefill, trimmed reuse, checkpoint, adopted warmup) must produce the same tokens: that
is the oracle for prefix reuse. Compute "costs" time through a ``ComputeClock``: real sleeps on the
thread executor, virtual seconds in the simulator. Faults are data in a ``ModelSpec``. Hosts load
``ModelSpec(backend="simulated", options=...)`` with ``SimulatedModelOptions``. Loading imports no
MLX, but its logits are MLX arrays so that the one sampler treats them as a real model's.

See docs/design.md, "Testing tools".
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from runtime.backends import simulated_persist
from runtime.backends.contract import (
    CannotTrim,
    Capability,
    ModelInfo,
    PrefillInterrupted,
    ReuseStrategy,
    SequenceState,
    Snapshot,
    Verdict,
)
from runtime.backends.disk.host import HostState
from runtime.backends.options import SimulatedModelOptions, options_as
from runtime.backends.vision.media import refuse_media
from runtime.messages import ChatMessage, ModelSpec

if TYPE_CHECKING:
    import mlx.core as mx

EOS_TOKEN_ID = 256
VOCAB_SIZE = 257
# Generated tokens are drawn from these bytes so the text is readable and valid UTF-8.
_TEXT_TOKENS = tuple(b"abcdefghijklmnopqrstuvwxyz ")
_HASH_MOD = (1 << 61) - 1
_HASH_BASE = 1_000_003
_PEAK_LOGIT = 5.0  # greedy picks it; temperature 1 still explores (about 37% of draws)


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


class SimulatedBackend:
    """The ``Backend`` implementation. Thread-confined like a real one: only the compute thread."""

    def __init__(self, options: SimulatedModelOptions, clock: ComputeClock) -> None:
        self._options = options
        self._clock = clock
        self._prefill_calls = 0
        self._sample_calls = 0
        self._lock = threading.Lock()  # catches accidental use from two threads at once
        # Tokens each state's last ``verify`` or ``draft`` fed, and the fewest a rewind keeps.
        self._verified: dict[int, tuple[int, int]] = {}
        strategy = ReuseStrategy.TRIM if options.trimmable else ReuseStrategy.CHECKPOINT
        self._info = ModelInfo(
            context_length=options.context_length,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=frozenset({EOS_TOKEN_ID}),
            reuse=strategy,
            reuse_reason=(
                "simulated trimmable cache"
                if options.trimmable
                else "simulated non-trimmable cache (sliding-window/recurrent behaviour)"
            ),
            bytes_per_token=options.bytes_per_token,
            fixed_state_bytes=options.fixed_state_bytes,
            pass_s=options.decode_s_per_token or options.prefill_s_per_token,  # a 1-token prefill
            together_snapshot_tokens=options.context_length,
            chat_template=False,  # chat_tokenizer below: the fallback format
        )
        self._probe: SimulatedProbe | None = None
        self.tidy_calls = 0
        self._tidy_left = 0  # pieces of housekeeping the last prefill left
        if options.probe_steps:
            self._probe = SimulatedProbe(self, options.probe_steps, self._info)
            pending = tuple(
                Verdict(capability=c, on=False, why="the simulated load probe is pending")
                for c in Capability
            )
            self._info = msgspec.structs.replace(
                self._info, reuse=ReuseStrategy.NONE, capabilities=pending, probe_pending=True
            )

    @classmethod
    def load(
        cls, spec: ModelSpec, clock: ComputeClock, options: SimulatedModelOptions | None = None
    ) -> SimulatedBackend:
        """Build from a spec with its decoded ``options`` (decoded here when not given, as for a
        direct call); raises ``InvalidModelSpec`` (bad options) or ``SimulatedFault``."""
        if options is None:
            options = options_as(spec, SimulatedModelOptions)
        clock.spend(options.load_s)
        if options.fail_load:
            raise SimulatedFault(f"simulated load failure for {spec.name!r}")
        return cls(options, clock)

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def chat_tokenizer(self) -> SimulatedBackend:
        """No chat template: ``prepare_chat`` falls back to "role: content" lines."""
        return self

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def prepare_media(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        refuse_media(messages, "the simulated backend has no vision tower")
        return messages

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def new_state(self) -> SimulatedState:
        return SimulatedState()

    def can_trim(self, state: SequenceState) -> bool:
        # As on MLX, a state cached before the probe's verdict is kept whole (capabilities.py).
        return self._options.trimmable and not self._info.probe_pending

    def copy_state(
        self, state: SequenceState, length: int, snapshot: Snapshot | None = None
    ) -> SimulatedState:
        state = _own(state)
        if length > state.length or length < 0:
            raise CannotTrim(f"cannot copy {length} tokens of a {state.length}-token state")
        if snapshot is not None:
            # The oracle: a snapshot restores only the state whose history it was taken from.
            if not isinstance(snapshot, SimulatedSnapshot) or snapshot.length != length:
                raise CannotTrim(f"the snapshot does not hold {length} tokens of this state")
            if length and snapshot.prefix_hash != state.hashes[length - 1]:
                raise ValueError("a snapshot was paired with a state it was not taken from")
        elif length < state.length and not self._options.trimmable:
            raise CannotTrim("this simulated cache is not trimmable")
        copy = SimulatedState(state.tokens[:length], state.hashes[:length])
        copy.has_logits = state.has_logits and length == state.length  # as MLX's copies keep them
        return copy

    def snapshot(self, state: SequenceState) -> SimulatedSnapshot:
        return self._snapshot(_own(state), _own(state).length)

    def _snapshot(self, state: SimulatedState, length: int) -> SimulatedSnapshot:
        prefix_hash = state.hashes[length - 1] if length else 0
        nbytes = 0 if self._options.trimmable else self._options.fixed_state_bytes
        return SimulatedSnapshot(length, prefix_hash, nbytes)

    def prefill(
        self,
        state: SequenceState,
        token_ids: Sequence[int],
        *,
        logits: bool = True,
        snapshot_at: Sequence[int] = (),
        stop: threading.Event | None = None,
    ) -> list[SimulatedSnapshot]:
        state = _own(state)
        start, end = state.length, state.length + len(token_ids)
        if any(not start < p <= end for p in snapshot_at):
            raise ValueError(f"snapshot points {list(snapshot_at)} outside ({start}, {end}]")
        with self._lock:
            self._prefill_calls += 1
            if self._prefill_calls == self._options.fail_prefill_call:
                raise SimulatedFault(f"injected fault in prefill call {self._prefill_calls}")
            cost = self._options.prefill_s_per_token
            if len(token_ids) == 1:
                cost = self._options.decode_s_per_token or cost
            if stop is None or len(token_ids) == 1:
                self._clock.spend(cost * len(token_ids))
            else:  # token by token, giving up (state untouched) once stopped, as MLX's layers do
                for _ in token_ids:
                    if stop.is_set():
                        raise PrefillInterrupted("the sequence was aborted during this prefill")
                    self._clock.spend(cost)
            state.extend(token_ids)
            state.has_logits = logits
            self._tidy_left = self._options.tidy_pieces
        return [self._snapshot(state, p) for p in snapshot_at]

    def prefill_together(
        self,
        states: Sequence[SequenceState],
        token_ids: Sequence[Sequence[int]],
        snapshot_at: Sequence[Sequence[int]] = (),
    ) -> list[list[SimulatedSnapshot]]:
        """One prompt after the other (the virtual clock charges each as ``prefill`` does)."""
        self._check_probed()
        if len(states) != len(token_ids) or any(len(ids) < 2 for ids in token_ids):
            raise ValueError("prefill_together takes 2 tokens or more per state")
        points = list(snapshot_at) or [[] for _ in token_ids]
        if len(points) != len(token_ids):
            raise ValueError("snapshot_at takes one list of points per state")
        return [
            self.prefill(state, ids, snapshot_at=at)
            for state, ids, at in zip(states, token_ids, points, strict=True)
        ]

    def logits(self, state: SequenceState) -> mx.array:
        """A peak at the greedy next token over pseudo-random noise seeded by the prefix hash.

        Greedy decoding therefore follows ``next_token_for``; samplers and penalties act on these
        logits exactly as on a real model's.
        """
        state = _own(state)
        if not state.has_logits:
            raise RuntimeError("logits() after a prefill that kept none")
        return self.logits_after(state.hashes[-1] if state.hashes else 0)

    def logits_after(self, h: int) -> mx.array:
        """The logits after a prefix whose rolling hash is ``h`` (see ``logits``)."""
        import mlx.core as mx  # at the first logits: loading a simulated model needs no MLX

        with self._lock:
            self._sample_calls += 1
            if self._sample_calls == self._options.fail_sample_call:
                raise SimulatedFault(f"injected fault in sample call {self._sample_calls}")
            noise = random.Random(h).random
            values = [noise() * 2.0 - 1.0 for _ in range(VOCAB_SIZE)]
            values[next_token_for(h, self._options.eos_every)] = _PEAK_LOGIT
            return mx.array(values, dtype=mx.float32)

    def verify(self, state: SequenceState, token_ids: Sequence[int]) -> mx.array:
        """One pass (charged as one decode step) over a token and its drafts."""
        import mlx.core as mx

        own = _own(state)
        if len(token_ids) < 2:
            raise ValueError("verify takes a token and at least one draft")
        with self._lock:
            self._clock.spend(self._options.decode_s_per_token)
            before = own.length
            own.extend(token_ids)
            own.has_logits = True
            self._verified[id(own)] = (len(token_ids), 1)
        return mx.stack([self.logits_after(h) for h in own.hashes[before:]])

    def rewind(self, state: SequenceState, keep: int) -> None:
        """Drop the rejected drafts: the oracle's state is its tokens, whatever the cache kind."""
        own = _own(state)
        fed, least = self._verified.pop(id(own), (0, 1))
        if not least <= keep <= fed:
            raise ValueError(f"rewind to {keep} tokens without a verify that fed as many")
        end = own.length - (fed - keep)
        del own.tokens[end:], own.hashes[end:]
        own.has_logits = True

    def draft(self, state: SequenceState, token_ids: Sequence[int], n: int) -> list[int]:
        """The greedy tokens after ``token_ids`` (``next_token_for``), all but the last fed; each
        pass charged as one decode step."""
        own = _own(state)
        if not token_ids or n < 1:
            raise ValueError("draft takes a token to catch up with and one draft or more")
        if not self._options.trimmable:
            raise ValueError("a draft model's layers must all cut back (full attention only)")
        with self._lock:
            self._clock.spend(self._options.decode_s_per_token * n)
            own.extend(token_ids)
            drafts = [next_token_for(own.hashes[-1], self._options.eos_every)]
            for _ in range(n - 1):
                own.extend(drafts[-1:])
                drafts.append(next_token_for(own.hashes[-1], self._options.eos_every))
            own.has_logits = True
            self._verified[id(own)] = (len(token_ids) + n - 1, len(token_ids))
        return drafts

    def vocabulary(self) -> list[str]:
        """Bytes 0-255 by value, then the end of sequence."""
        return [*(f"<0x{b:02X}>" for b in range(256)), "</s>"]

    @property
    def pipelined(self) -> bool:
        """As the options say. ``feed`` reads its token and computes at once, so a pipelined
        simulated step is charged when it is built, not when its token is read (as on MLX)."""
        return self._options.pipelined

    @property
    def queues_steps(self) -> bool:
        """As the options say (``queue_steps``, or ``pipelined``, which queues as MLX does)."""
        return self._options.pipelined or self._options.queue_steps

    @property
    def decode_block(self) -> int:
        return 1 if self._options.pipelined else self._options.decode_block

    def feed(self, state: SequenceState, token: mx.array) -> mx.array:
        self.prefill(state, [_read_token(token)])
        return self.logits(state)

    def open_batch(self) -> SimulatedBatch | None:
        return None if self._info.probe_pending else SimulatedBatch(self)

    def deferred_probe(self) -> SimulatedProbe | None:
        probe, self._probe = self._probe, None
        return probe

    def tidy(self) -> bool:
        with self._lock:
            self.tidy_calls += 1  # for tests: how often the engine asked
            if not self._tidy_left:
                return False
            self._tidy_left -= 1
            self._clock.spend(self._options.tidy_step_s)
            return True

    def _check_probed(self) -> None:
        """What a real model's pending probe guards against: batched work before its verdict."""
        if self._info.probe_pending:
            raise AssertionError("a batched pass before the load probe's verdict")

    def _probed(self, info: ModelInfo) -> ModelInfo:
        self._info = info
        return info

    def fingerprint(self) -> str:
        return simulated_persist.fingerprint(self._options)

    def export_state(self, state: SequenceState, points: Mapping[int, Snapshot]) -> HostState:
        return simulated_persist.export_state(state, points)

    def import_state(self, host: HostState) -> tuple[SequenceState, dict[int, Snapshot]]:
        return simulated_persist.import_state(host)

    def state_nbytes(self, state: SequenceState) -> int:
        return self._info.kv_bytes(state.length)

    def constraint_engine(self) -> None:
        return None  # its byte "tokenizer" is no vocabulary a grammar engine can read

    def close(self) -> None:
        pass


class SimulatedProbe:
    """A deferred load probe that spends ``probe_step_s`` per piece and then turns on what the
    options declare (the info the model would have had with a cached verdict)."""

    def __init__(self, backend: SimulatedBackend, steps: int, probed: ModelInfo) -> None:
        self._backend = backend
        self._left = steps
        self._probed = probed

    def step(self) -> ModelInfo | None:
        self._backend._clock.spend(self._backend._options.probe_step_s)
        self._left -= 1
        return None if self._left > 0 else self._backend._probed(self._probed)


def _read_token(token: int | mx.array) -> int:
    """A token id, reading it first if it is a draw's array (the step needs its value now)."""
    return token if isinstance(token, int) else int(token.item())  # type: ignore[arg-type]


def _own(state: SequenceState) -> SimulatedState:
    """Narrow an engine-held state back to ours (a foreign state is a programming error)."""
    if not isinstance(state, SimulatedState):
        raise TypeError(f"not a simulated state: {type(state).__name__}")
    return state


class SimulatedBatch:
    """A decode batch of simulated states: one step costs one decode step, however many rows."""

    def __init__(self, backend: SimulatedBackend) -> None:
        self._backend = backend
        self._rows: dict[int, SimulatedState] = {}
        self._next_slot = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def padding_tokens(self) -> int:
        """Left padding mlx-lm's batch KV would hold for these rows: B * longest - sum of lengths
        (rows are right-aligned; a leave drops the padding every row shares)."""
        lengths = [row.length for row in self._rows.values()]
        return len(lengths) * max(lengths) - sum(lengths) if lengths else 0

    def join(self, state: SequenceState) -> int:
        own = _own(state)
        if self._backend._options.fail_join:
            raise SimulatedFault("injected fault: this model's states cannot join a batch")
        self._next_slot += 1
        self._rows[self._next_slot] = SimulatedState(list(own.tokens), list(own.hashes))
        return self._next_slot

    def leave(self, slot: int) -> SimulatedState:
        return self._rows.pop(slot)

    def step(self, tokens: Mapping[int, int | mx.array]) -> dict[int, mx.array]:
        if set(tokens) != set(self._rows):
            raise ValueError("a batch step needs exactly one token for every member")
        self._backend._check_probed()
        self._backend._clock.spend(self._backend._options.decode_s_per_token)
        ids = {slot: _read_token(t) for slot, t in tokens.items()}
        hashes = {
            slot: extend_hash(self._rows[slot].hashes[-1] if self._rows[slot].hashes else 0, t)
            for slot, t in ids.items()
        }
        # One forward pass: a fault leaves every row as it was (no row advances alone).
        logits = {slot: self._backend.logits_after(h) for slot, h in hashes.items()}
        for slot, token in ids.items():
            self._rows[slot].tokens.append(token)
            self._rows[slot].hashes.append(hashes[slot])
        return logits
