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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn

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
from runtime.backends.simulated_batch import SimulatedBatch
from runtime.backends.simulated_tokens import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    ComputeClock,
    RealClock,
    SimulatedFault,
    SimulatedSnapshot,
    SimulatedState,
    extend_hash,
    greedy_continuation,
    next_token_for,
    own_state,
    read_token,
)
from runtime.backends.vision.media import refuse_media
from runtime.messages import ChatMessage, ModelSpec

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = [
    "EOS_TOKEN_ID",
    "VOCAB_SIZE",
    "ComputeClock",
    "RealClock",
    "SimulatedBackend",
    "SimulatedBatch",
    "SimulatedFault",
    "SimulatedSnapshot",
    "SimulatedState",
    "extend_hash",
    "greedy_continuation",
    "next_token_for",
]

_PEAK_LOGIT = 5.0  # greedy picks it; temperature 1 still explores (about 37% of draws)


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
            take_tail_tokens=options.take_tail_tokens,
        )
        self._probe: SimulatedProbe | None = None
        self.tidy_calls = 0
        self.takes = 0  # states cut back in place (take_state)
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
        self,
        state: SequenceState,
        length: int,
        snapshot: Snapshot | None = None,
        *,
        reach: int = 0,
    ) -> SimulatedState:
        state = own_state(state)
        if length > state.length or length < 0:
            raise CannotTrim(f"cannot copy {length} tokens of a {state.length}-token state")
        # Still held, as a llama.cpp sliding ring keeps cells past its window.
        reached = length < reach <= state.length <= reach + self._options.reach_back_tokens
        if reached:
            length, snapshot = reach, None
        if snapshot is not None:
            # The oracle: a snapshot restores only the state whose history it was taken from.
            if not isinstance(snapshot, SimulatedSnapshot) or snapshot.length != length:
                raise CannotTrim(f"the snapshot does not hold {length} tokens of this state")
            if length and snapshot.prefix_hash != state.hashes[length - 1]:
                raise ValueError("a snapshot was paired with a state it was not taken from")
        elif length < state.length and not self._options.trimmable and not reached:
            raise CannotTrim("this simulated cache is not trimmable")
        copy = SimulatedState(state.tokens[:length], state.hashes[:length])
        copy.has_logits = state.has_logits and length == state.length  # as MLX's copies keep them
        return copy

    def take_state(
        self,
        state: SequenceState,
        length: int,
        snapshot: Snapshot | None = None,
        *,
        reach: int = 0,
    ) -> SimulatedState:
        """``copy_state``'s checks, then ``state`` itself cut back (counted in ``takes``)."""
        cut = self.copy_state(state, length, snapshot, reach=reach)
        own = own_state(state)
        own.tokens, own.hashes, own.has_logits = cut.tokens, cut.hashes, cut.has_logits
        self.takes += 1
        return own

    def snapshot(self, state: SequenceState) -> SimulatedSnapshot:
        return self._snapshot(own_state(state), own_state(state).length)

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
        state = own_state(state)
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
                for done in range(len(token_ids)):
                    if stop.is_set():
                        self._interrupted(state, token_ids[:done], snapshot_at)
                    self._clock.spend(cost)
            state.extend(token_ids)
            state.has_logits = logits
            self._tidy_left = self._options.tidy_pieces
        return [self._snapshot(state, p) for p in snapshot_at]

    def _interrupted(
        self, state: SimulatedState, done: Sequence[int], snapshot_at: Sequence[int]
    ) -> NoReturn:
        """Stopped after ``done``: the state untouched, or (``interrupt_keeps_snapshots``) at the
        last snapshot point ``done`` passed, with the snapshots up to there."""
        end = state.length + len(done)
        passed = (
            [p for p in snapshot_at if p <= end] if self._options.interrupt_keeps_snapshots else []
        )
        if not passed:
            raise PrefillInterrupted("the sequence was aborted during this prefill")
        kept = passed[-1] - state.length
        state.extend(done[:kept])
        state.has_logits = False
        snapshots = [self._snapshot(state, p) for p in passed]
        raise PrefillInterrupted("the sequence was aborted; it kept its snapshots", kept, snapshots)

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
        state = own_state(state)
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

        own = own_state(state)
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
        own = own_state(state)
        fed, least = self._verified.pop(id(own), (0, 1))
        if not least <= keep <= fed:
            raise ValueError(f"rewind to {keep} tokens without a verify that fed as many")
        end = own.length - (fed - keep)
        del own.tokens[end:], own.hashes[end:]
        own.has_logits = True

    def draft(self, state: SequenceState, token_ids: Sequence[int], n: int) -> list[int]:
        """The greedy tokens after ``token_ids`` (``next_token_for``), all but the last fed; each
        pass charged as one decode step."""
        own = own_state(state)
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
        self.prefill(state, [read_token(token)])
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
