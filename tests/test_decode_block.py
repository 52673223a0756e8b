"""Decode blocks (``Backend.decode_block``, as on llama.cpp): a lone stream's decode step reads up
to that many tokens on the compute thread before the loop sees them.

The output never changes (tokens, text, logprobs, seeded draws, endings; a block's tokens reach the
client in one event); a sequence's first token is still shown by a step of its own; a block ends
early at an end, an abort, or when other work waits for the slot (``StepJob.yield_to``); a step
that fails inside a block still shows the tokens before it. Virtual time, and ``run_decode`` on the
simulated backend directly.
"""

from __future__ import annotations

import random
import threading

import pytest

from actors.engine.decode import run_decode
from actors.engine.jobs import StepJob
from actors.engine.sequence import Decoding, Phase, Sequence
from runtime.backends.simulated import SimulatedBackend, greedy_continuation
from runtime.messages import Admit, Failed, Finished, Sampling, TokensEmitted
from runtime.testing.harness import ModelOption, engine, make_sim, sim_spec
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator
from runtime.text.detokenizer import IncrementalDetokenizer
from tests.test_engine_pipelined import PROMPT, SAMPLINGS, entries_match_their_states, events

DECODE_S = 1.0


def sim(**options: ModelOption) -> Simulator:
    """Prefill is free, each decode step takes a second."""
    return make_sim(sim_spec(decode_s_per_token=DECODE_S, **options))


def output(s: Simulator, request_id: str) -> tuple[object, ...]:
    """What the request's client got, however its tokens were split into events (a block's go
    out together): its tokens, text and logprobs, then its terminal event."""
    shown = [e for e in events(s, request_id) if isinstance(e, TokensEmitted)]
    return (
        tuple(t for e in shown for t in e.token_ids),
        "".join(e.text for e in shown),
        tuple(p for e in shown for p in e.logprobs),
        s.terminal(request_id, 1),
    )


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize(
    ("n", "eos_every", "stop"),
    [(12, 0, ()), (40, 7, ()), (40, 0, ("o",)), (1, 0, ()), (2, 0, ())],
    ids=["length", "eos", "stop-string", "one-token", "two-tokens"],
)
def test_blocks_give_the_output_of_single_steps(
    sampling: Sampling, n: int, eos_every: int, stop: tuple[str, ...]
) -> None:
    outputs = []
    for block, queued in ((1, False), (4, False), (4, True), (3, True)):
        s = sim(eos_every=eos_every, queue_steps=queued, decode_block=block)
        s.send(generate("a", PROMPT, n, sampling=sampling, stop=stop))
        s.run_until_quiescent()
        outputs.append(output(s, "a"))
        entries_match_their_states(s)
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3]


def test_the_first_token_comes_alone_then_the_rest_in_blocks() -> None:
    s = sim(decode_block=4)
    s.send(generate("a", PROMPT, 20))
    s.run_until(lambda: bool(s.emitted_tokens("a", 1)))
    assert len(s.emitted_tokens("a", 1)) == 1  # not held back for a block
    s.run_until(lambda: len(s.emitted_tokens("a", 1)) > 1)
    assert len(s.emitted_tokens("a", 1)) == 5  # the next step read four
    s.run_until_quiescent()
    assert s.emitted_tokens("a", 1) == greedy_continuation(PROMPT, 20)
    end = s.terminal("a", 1)
    assert isinstance(end, Finished) and end.usage.completion_tokens == 20


def test_a_failure_inside_a_block_comes_after_the_tokens_before_it() -> None:
    # Call 1 prefills the prompt, call 2 feeds the first token (a block's first step), call 3
    # the second token: the block's second step fails.
    s = sim(decode_block=4, fail_prefill_call=3)
    s.send(generate("a", PROMPT, 10))
    s.run_until_quiescent()
    kinds = [type(e) for e in events(s, "a")]
    assert kinds == [TokensEmitted, TokensEmitted, Failed]
    assert s.emitted_tokens("a", 1) == greedy_continuation(PROMPT, 2)


# --------------------------------------------------------------------------- run_decode itself


def decoding_sequence(backend: SimulatedBackend, max_tokens: int = 50) -> Sequence:
    """A sequence whose prompt is in and whose first token was read (the next step feeds it)."""
    request = generate("r", None, max_tokens)
    seq = Sequence.admitted(Admit(sequence_id=1, epoch=1, session="s", request=request), "m")
    seq.tokens = PROMPT
    seq.phase = Phase.DECODING
    seq.rng = random.Random(0)
    seq.state = backend.new_state()
    backend.prefill(seq.state, list(PROMPT))
    seq.decoding = Decoding(list(PROMPT), IncrementalDetokenizer(backend.decode))
    first = StepJob(seq)
    run_decode(first, seq, backend)
    assert first.token is not None and not first.more  # a first token is read alone
    return seq


class _NoTime:
    def spend(self, seconds: float) -> None:
        """Compute costs nothing here."""


def block_backend(block: int) -> SimulatedBackend:
    return SimulatedBackend.load(sim_spec(decode_block=block), _NoTime())


def test_a_block_reads_up_to_its_size_and_feeds_each_token_it_read() -> None:
    backend = block_backend(4)
    seq = decoding_sequence(backend)
    job = StepJob(seq)
    run_decode(job, seq, backend)
    tokens = [r.token for r in (job, *job.more)]
    assert tokens == greedy_continuation(PROMPT, 5)[1:]
    assert job.prefilled == 4  # the first token and three read in the block, each fed once
    assert seq.decoding is not None and seq.decoding.pending == tokens[-1]  # the next one feeds it


def test_a_block_ends_when_the_loop_wants_the_slot_or_the_sequence_is_aborted() -> None:
    backend = block_backend(8)
    seq = decoding_sequence(backend)
    waiting = threading.Event()
    waiting.set()
    job = StepJob(seq, yield_to=waiting)
    run_decode(job, seq, backend)
    assert job.token is not None and job.more == []  # one token, then the slot goes back
    seq.abort.set()
    aborted = StepJob(seq)
    run_decode(aborted, seq, backend)
    assert aborted.skipped and aborted.token is None


def test_a_block_stops_at_max_tokens_and_never_with_stop_strings() -> None:
    backend = block_backend(8)
    seq = decoding_sequence(backend, max_tokens=3)
    job = StepJob(seq)
    run_decode(job, seq, backend)
    assert len([job, *job.more]) == 2  # tokens 2 and 3 of 3
    assert seq.decoding is not None and seq.decoding.ended
    request = generate("r", None, 50, stop=("zz",))
    stopping = decoding_sequence(backend)
    stopping.admit = Admit(sequence_id=1, epoch=1, session="s", request=request)
    job = StepJob(stopping)
    run_decode(job, stopping, backend)
    assert job.more == []  # a stop string is matched on the loop: it sees every token


def test_batched_streams_in_blocks_give_the_output_of_single_steps() -> None:
    outputs = []
    for block in (1, 4):
        s = sim(decode_block=block, eos_every=9)
        for i in range(3):
            prompt = (*PROMPT, *bytes([65 + i]))
            s.send(generate(f"r{i}", prompt, 12 + 5 * i))
        s.run_until_quiescent()
        outputs.append([output(s, f"r{i}") for i in range(3)])
        entries_match_their_states(s)
        assert engine(s).counters.snapshot().get("batch_steps", 0) > 0
    assert outputs[0] == outputs[1]
