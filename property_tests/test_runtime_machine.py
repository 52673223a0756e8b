"""The whole runtime on the simulator, against the protocol's invariants (docs/protocols.md).

Hypothesis picks the simulator's seed (so which actor runs next), whether decode steps are
pipelined (as on MLX: a step is built on a token before it is read, and a lone stream keeps one
step queued) or only queued (as on llama.cpp), and a program of host actions (prewarms in the
default session, named sessions or anonymous, alone or several at once: the same prompt, one
extending or cutting another); after every step the invariants are checked. A failure shrinks to
a short program and replays.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actors.engine.core import EngineCore
from actors.engine.lifecycle import LEGAL_MOVES
from actors.engine.sequence import COMPUTE_PHASES, Phase, Sequence
from runtime.backends.simulated import SimulatedBatch, SimulatedState, greedy_continuation
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import Address, Context
from runtime.messages import (
    Cancel,
    Cancelled,
    CommandFailed,
    Failed,
    Finished,
    FinishReason,
    Generate,
    HolderKind,
    Message,
    ModelLoaded,
    ModelUnloaded,
    Prewarm,
    Rejected,
    RequestKind,
    ResetPrefixes,
    Started,
    TokensProduced,
    UnloadModel,
)
from runtime.testing.faults import without_faults
from runtime.testing.harness import engines, kv_keeper, prefix_cache, router, sim_spec
from runtime.testing.requests import generate, prewarm
from runtime.testing.simulator import Simulator

BYTES_PER_TOKEN = 100
BUDGET = 6_000  # small enough that reservations queue, are evicted for, and time out
REQUEST_IDS = ("r1", "r2", "r3")
TERMINALS = (Finished, Cancelled, Failed)
EXPIRY_CODES = ("request_timeout", "stream_stalled")
prompts = st.lists(st.sampled_from([97, 98, 99]), min_size=1, max_size=12).map(tuple)
# (session, anonymous): the default session, named ones, or anonymous (an HTTP client's, no session)
sessions = st.sampled_from([(None, False), ("s1", False), ("s2", False), (None, True)])
SHAPES = ("same", "longer", "shorter", "other")


class RuntimeMachine(RuleBasedStateMachine):
    @initialize(
        seed=st.integers(0, 2**16),
        trimmable=st.booleans(),
        pipelined=st.booleans(),
        queue_steps=st.booleans(),  # without pipelined: queued steps as on llama.cpp
        # 2: about every other token ends on an EOS, which a pipelined step has fed already.
        eos_every=st.sampled_from([0, 2]),
        # 3: a first load with no cached probe verdict: limited (no batching, no reuse path)
        # until the engine has run the probe's pieces while idle (actors/engine/probing.py).
        probe_steps=st.sampled_from([0, 3]),
        # 3: a lone stream's step reads up to 3 tokens (decode blocks, as on llama.cpp).
        decode_block=st.sampled_from([1, 3]),
        # 2: each prefill leaves two pieces of idle housekeeping (Backend.tidy), run once the
        # engine has idled a while (actors/engine/tidying.py).
        tidy_pieces=st.sampled_from([0, 2]),
        # 6: a generate's restore takes its entry in place where it loses at most 6 tokens and
        # no other sequence holds or may look it up (llama.cpp's default; docs/reuse.md).
        take_tail=st.sampled_from([0, 6]),
        # 5: a non-trimmable state still cuts back, without a snapshot, to within 5 tokens of
        # its end (a llama.cpp sliding ring keeps cells past its window: copy_state's reach).
        reach_back=st.sampled_from([0, 5]),
    )
    def start(
        self,
        seed: int,
        trimmable: bool,
        pipelined: bool,
        eos_every: int,
        probe_steps: int = 0,
        queue_steps: bool = False,
        decode_block: int = 1,
        tidy_pieces: int = 0,
        take_tail: int = 0,
        reach_back: int = 0,
    ) -> None:
        config = RuntimeConfig(kv_budget_bytes=BUDGET, reservation_timeout_s=0.05)
        self.sim = Simulator(seed=seed, config=config)
        self.watched: weakref.WeakSet[EngineCore] = weakref.WeakSet()  # token sends checked
        self.sim.check_every_step(self.batch_padding_is_reserved)
        self.sim.check_every_step(self.no_token_after_an_abort)
        self.sim.check_every_step(self.caches_stay_within_their_reservation)
        self.sim.check_every_step(self.one_prewarm_computes_per_session)
        self.sim.check_every_step(self.identical_prewarms_compute_once)
        # Every phase change any engine makes is recorded, and checked against the table.
        self.moves: list[tuple[int, Phase, Phase]] = []
        self.moved: set[tuple[Phase, Phase]] = set()
        self._unrecord = _record_moves(self.moves)
        self.sim.check_every_step(self.every_phase_change_is_in_the_table)
        self.spec = sim_spec(
            chunk=3,
            trimmable=trimmable,
            bytes_per_token=BYTES_PER_TOKEN,
            # Non-trimmable: each checkpoint snapshot costs this (every 4 tokens and len - 1),
            # so snapshots compete for the budget and join their final entries as points.
            fixed_state_bytes=150,
            checkpoint_every_tokens=4,
            prefill_s_per_token=0.001,
            decode_s_per_token=0.002,
            pipelined=pipelined,
            queue_steps=queue_steps,
            decode_block=decode_block,
            eos_every=eos_every,
            probe_steps=probe_steps,
            probe_step_s=0.003,
            tidy_pieces=tidy_pieces,
            tidy_step_s=0.004,
            take_tail_tokens=take_tail,
            reach_back_tokens=reach_back,
        )
        self.eos_every = eos_every
        self.incarnation = 0
        self.sent: dict[tuple[str, int], Generate | Prewarm] = {}
        self.deadlines: dict[tuple[str, int], float] = {}  # virtual time each must end by
        self.cancelled_by_host: set[tuple[str, int]] = set()
        self.model_loaded = False
        self.unloads: list[tuple[int, int]] = []  # (epoch, host messages seen when it replied)
        self._load()

    def _load(self) -> None:
        reply = self.sim.load(self.spec)
        assert isinstance(reply, ModelLoaded)
        self.model_loaded = True

    def _next(self) -> int:
        self.incarnation += 1
        return self.incarnation

    # ------------------------------------------------------------------ rules

    @rule(
        request_id=st.sampled_from(REQUEST_IDS),
        prompt=prompts,
        max_tokens=st.integers(1, 6),
        session=sessions,
    )
    def generate(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        max_tokens: int,
        session: tuple[str | None, bool] = (None, False),
    ) -> None:
        request = generate(
            request_id,
            prompt,
            max_tokens,
            incarnation=self._next(),
            session=session[0],
            anonymous=session[1],
        )
        self.sent[(request_id, request.incarnation)] = request
        self.sim.send(request)

    @rule(
        request_id=st.sampled_from(REQUEST_IDS),
        prompt=prompts,
        max_tokens=st.integers(1, 6),
        timeout_s=st.sampled_from([0.001, 0.004, 0.02]),
        # Tokens come every 0.002 s: 0.001 stalls after the first, 0.05 never does.
        stall_timeout_s=st.sampled_from([None, 0.001, 0.05]),
    )
    def generate_with_deadline(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        max_tokens: int,
        timeout_s: float,
        stall_timeout_s: float | None,
    ) -> None:
        request = generate(
            request_id,
            prompt,
            max_tokens,
            incarnation=self._next(),
            timeout_s=timeout_s,
            stall_timeout_s=stall_timeout_s,
        )
        key = (request_id, request.incarnation)
        self.sent[key] = request
        # The router takes it before time moves (the simulator delivers all mail first).
        self.deadlines[key] = self.sim.clock.now + timeout_s
        self.sim.send(request)

    @rule(burst=st.lists(st.tuples(prompts, st.integers(1, 6)), min_size=2, max_size=3))
    def generate_together(self, burst: list[tuple[tuple[int, ...], int]]) -> None:
        # Prompts of different lengths decoding at once: batches with left padding to pay for.
        for request_id, (prompt, max_tokens) in zip(REQUEST_IDS, burst, strict=False):
            self.generate(request_id, prompt, max_tokens)

    @rule(request_id=st.sampled_from(REQUEST_IDS), prompt=prompts, session=sessions)
    def prewarm(
        self, request_id: str, prompt: tuple[int, ...], session: tuple[str | None, bool]
    ) -> None:
        request = prewarm(
            request_id, prompt, incarnation=self._next(), session=session[0], anonymous=session[1]
        )
        self.sent[(request_id, request.incarnation)] = request
        self.sim.send(request)

    @rule(
        prompt=prompts,
        burst=st.lists(
            st.tuples(st.sampled_from(SHAPES), sessions, st.sampled_from([0, 0, 3, 8])),
            min_size=2,
            max_size=3,
        ),
    )
    def prewarm_together(
        self, prompt: tuple[int, ...], burst: list[tuple[str, tuple[str | None, bool], int]]
    ) -> None:
        # Focus changes: the same prompt again, or one extending, cutting or leaving it, in one
        # session or across sessions, all in flight at once: each sent at once or a few simulator
        # steps after the one before (so often while that one prefills, to be adopted).
        for request_id, (shape, session, steps) in zip(REQUEST_IDS, burst, strict=False):
            self.deliver(steps)
            self.prewarm(request_id, _shaped(prompt, shape), session)

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        # Any incarnation ever sent, including finished ones: a late cancel must be a no-op.
        key = data.draw(st.sampled_from(sorted(self.sent)))
        self.cancelled_by_host.add(key)
        self.sim.send(Cancel(request_id=key[0], incarnation=key[1]))

    @rule()
    def unload(self) -> None:
        reply = self.sim.ask(UnloadModel(model="m"))
        assert isinstance(reply, (ModelUnloaded, CommandFailed))
        if isinstance(reply, ModelUnloaded):
            self.unloads.append((reply.epoch, len(self.sim.host_messages)))
        self.model_loaded = False

    @precondition(lambda self: not self.model_loaded)
    @rule()
    def load(self) -> None:
        self._load()

    @rule()
    def reset(self) -> None:
        self.sim.ask(ResetPrefixes(model="m"))

    @rule(steps=st.integers(1, 20))
    def deliver(self, steps: int) -> None:
        for _ in range(steps):
            if not self.sim.step():
                break

    @rule(seconds=st.sampled_from([0.001, 0.003, 0.01, 0.1]))
    def advance(self, seconds: float) -> None:
        self.sim.advance(seconds)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def one_terminal_and_nothing_after(self) -> None:
        for key in self.sent:
            events = self.sim.events(*key)
            ends = [i for i, e in enumerate(events) if isinstance(e, (*TERMINALS, Rejected))]
            assert len(ends) <= 1, (key, events)
            if ends:
                assert ends[0] == len(events) - 1, (key, events)

    @invariant()
    def deadlines_are_kept(self) -> None:
        """A request with ``timeout_s`` has ended once its deadline has passed; one that ended
        on a deadline or a stall counts exactly the tokens it showed."""
        for key, due in self.deadlines.items():
            terminal = self.sim.terminal(*key)
            if self.sim.clock.now >= due:
                assert terminal is not None, (key, due, self.sim.clock.now)
            if isinstance(terminal, Failed) and terminal.code in EXPIRY_CODES:
                shown = len(self.sim.emitted_tokens(*key))
                assert terminal.usage.completion_tokens == shown, (key, terminal)

    @invariant()
    def kv_never_over_budget(self) -> None:
        kv = kv_keeper(self.sim)
        assert 0 <= kv.reserved_bytes <= kv.budget_bytes
        assert kv.reserved_bytes + kv.free_bytes == kv.budget_bytes

    def batch_padding_is_reserved(self) -> None:
        """Checked after every simulator step: a batch's real padding is always paid for (the
        simulated batch read inside a fault wrapper, where the fuzzer put one)."""
        kv = kv_keeper(self.sim)
        for engine in engines(self.sim):
            batch = without_faults(engine.decode_batch)
            assert batch is None or isinstance(batch, SimulatedBatch)
            padding = 0 if batch is None else batch.padding_tokens
            held = sum(
                nbytes
                for holder, nbytes in kv.holdings().items()
                if holder.kind is HolderKind.BATCH_PADDING and holder.epoch == engine.epoch
            )
            # The join waited for the grant; the give-back comes after the rows left.
            assert held >= BYTES_PER_TOKEN * padding, (held, padding)

    def no_token_after_an_abort(self) -> None:
        """Checked from an engine's start on: it never sends a token of a sequence whose abort
        flag is set, or that has ended (a cancel lands before the next emitted token)."""
        for engine in engines(self.sim):
            if engine not in self.watched:
                self.watched.add(engine)
                _check_token_sends(engine)

    def caches_stay_within_their_reservation(self) -> None:
        """Checked after every simulator step: a sequence's cache holds at most its prompt and
        ``max_tokens`` (what it reserved), tokens fed ahead of the client included."""
        for engine in engines(self.sim):
            for key in self.sent:
                started = _first(self.sim.events(*key), Started)
                seq = None if started is None else engine.sequence(started.sequence_id)
                if seq is None or seq.state is None or seq.epoch != engine.epoch:
                    continue
                assert seq.tokens is not None
                assert seq.state.length <= len(seq.tokens) + seq.max_tokens, key

    def _live_prewarms_computing(self) -> list[Sequence]:
        """Live prewarms in a compute phase (restoring, prefilling), abort not set."""
        live = router(self.sim).live_sequences()
        return [
            seq
            for engine in engines(self.sim)
            for sequence_id in live
            if (seq := engine.sequence(sequence_id)) is not None
            and seq.kind is RequestKind.PREWARM
            and seq.phase in COMPUTE_PHASES
            and not seq.abort.is_set()
        ]

    def one_prewarm_computes_per_session(self) -> None:
        """Checked after every simulator step: in a session, at most one prewarm is computing
        (a newer one supersedes, adopts or follows the older), anonymous ones aside."""
        sessions = Counter(
            (seq.epoch, seq.session) for seq in self._live_prewarms_computing() if not seq.anonymous
        )
        assert all(n == 1 for n in sessions.values()), sessions

    def identical_prewarms_compute_once(self) -> None:
        """Checked after every simulator step: two live prewarms never compute the same tokens
        (identical concurrent prewarms follow one), whatever their sessions."""
        work = Counter(
            (seq.epoch, seq.namespace, seq.tokens) for seq in self._live_prewarms_computing()
        )
        assert all(n == 1 for n in work.values()), work

    @invariant()
    def entries_hold_exactly_their_keys(self) -> None:
        """Every cached state holds exactly the tokens its prefix entry is keyed by, tokens fed
        ahead and never shown (an EOS, or read after a cancel) included."""
        by_epoch = {engine.epoch: engine for engine in engines(self.sim)}
        for entry in prefix_cache(self.sim).entries():
            engine = by_epoch.get(entry.epoch)
            state = None if engine is None else engine.entry_state(entry.entry_id)
            if state is None:  # dropped by the engine, its DropEntries on the way
                continue
            assert isinstance(state, SimulatedState)
            assert tuple(state.tokens) == entry.tokens, (entry, state.tokens)

    @invariant()
    def cancel_only_hits_what_it_names(self) -> None:
        for key in self.sent:
            terminal = self.sim.terminal(*key)
            if isinstance(terminal, Cancelled) and terminal.reason == "cancelled":
                assert key in self.cancelled_by_host, key

    @invariant()
    def greedy_output_equals_cold_run(self) -> None:
        for key, request in self.sent.items():
            terminal = self.sim.terminal(*key)
            if not isinstance(request, Generate) or terminal is None:
                continue
            asked = request.request
            assert asked.prompt_tokens is not None
            emitted = self.sim.emitted_tokens(*key)
            expected = greedy_continuation(
                asked.prompt_tokens, asked.max_tokens, eos_every=self.eos_every
            )
            assert emitted == expected[: len(emitted)], (key, emitted, expected)
            if isinstance(terminal, Finished) and terminal.reason is FinishReason.LENGTH:
                assert emitted == expected

    @invariant()
    def unload_only_after_its_work_ended(self) -> None:
        for epoch, seen in self.unloads:
            for key in self.sent:
                started = _first(self.sim.events(*key), Started)
                if started is None or started.epoch != epoch:
                    continue
                terminal = self.sim.terminal(*key)
                assert terminal is not None, key
                assert self.sim.host_messages.index(terminal) < seen, key

    def every_phase_change_is_in_the_table(self) -> None:
        """Each phase change an engine made is a legal move (actors/engine/lifecycle.py)."""
        for seq_id, source, target in self.moves:
            assert target in LEGAL_MOVES[source], f"sequence {seq_id}: {source} -> {target}"
            self.moved.add((source, target))
        self.moves.clear()

    def stop_recording_moves(self) -> None:
        """Put ``Sequence.move`` back. Each machine wraps it anew, so a teardown that skips this
        leaves its wrapper on for every later example: a chain one call deeper per example, each
        link appending to a list nobody clears (10,000 nightly examples grew to 20 GB)."""
        if hasattr(self, "_unrecord"):
            self._unrecord()
            del self._unrecord

    def teardown(self) -> None:
        self.stop_recording_moves()
        if not hasattr(self, "sim"):
            return
        self.sim.run_until_quiescent()
        for key in self.sent:
            assert self.sim.terminal(*key) is not None, f"{key} never ended"
        kv, prefix = kv_keeper(self.sim), prefix_cache(self.sim)
        # Quiescent: every reserved byte belongs to a cached prefix entry; nothing leaked.
        assert kv.reserved_bytes == prefix.total_bytes, (kv.holdings(), prefix.entries())


def _shaped(prompt: tuple[int, ...], shape: str) -> tuple[int, ...]:
    match shape:
        case "longer":
            return (*prompt, 98, 97)
        case "shorter":
            return prompt[:-1] or prompt
        case "other":
            return (99, *prompt)
    return prompt


def _first(events: list[Message], kind: type[Started]) -> Started | None:
    return next((e for e in events if isinstance(e, kind)), None)


def _record_moves(moves: list[tuple[int, Phase, Phase]]) -> Callable[[], None]:
    """Record every ``Sequence.move`` (legal or not, before it is checked) into ``moves``, until
    the returned function is called."""
    move = Sequence.move

    def recorded(seq: Sequence, to: Phase) -> None:
        moves.append((seq.sequence_id, seq.phase, to))
        move(seq, to)

    Sequence.move = recorded  # type: ignore[method-assign]
    return lambda: setattr(Sequence, "move", move)


def _check_token_sends(engine: EngineCore) -> None:
    """Wrap ``engine.handle`` so that each token it sends is checked as it is sent."""
    handle = engine.handle

    def checked(message: Message, sender: Address, ctx: Context) -> None:
        send = ctx.send

        def send_checked(to: Address, sent: Message) -> None:
            if isinstance(sent, TokensProduced):
                seq = engine.sequence(sent.sequence_id)
                assert seq is not None, f"a token of ended sequence {sent.sequence_id}"
                assert not seq.abort.is_set(), f"a token after sequence {seq.sequence_id}'s abort"
            send(to, sent)

        ctx.send = send_checked  # type: ignore[method-assign]
        handle(message, sender, ctx)

    engine.handle = checked  # type: ignore[method-assign]


TestRuntimeMachine = RuntimeMachine.TestCase
