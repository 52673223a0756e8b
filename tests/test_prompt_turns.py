"""Newcomers whose prompts finish in one job go ahead of the decode work, within a stall limit
(actors/engine/turns.py): who may jump, in which order, and for how long."""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.sequence import Decoding, Phase, Sequence
from actors.engine.turns import PromptTurns
from runtime.backends.simulated import greedy_continuation
from runtime.messages import Admit, Generate, ModelSpec, Prewarm, TokensEmitted
from runtime.testing import requests
from runtime.testing.harness import ModelOption, make_sim, sim_spec
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator
from runtime.text.detokenizer import IncrementalDetokenizer

# --------------------------------------------------------------------------- PromptTurns alone


@dataclass
class _State:
    length: int


def _seq(
    seq_id: int, phase: Phase, prompt: int = 100, done: int = 0, *, prewarm: bool = False
) -> Sequence:
    request: Generate | Prewarm
    if prewarm:
        request = requests.prewarm(f"r{seq_id}", None)
    else:
        request = requests.generate(f"r{seq_id}", None, 8)
    seq = Sequence.admitted(Admit(sequence_id=seq_id, epoch=1, session="s", request=request), "m")
    seq.tokens = tuple(range(prompt))
    seq.phase = phase
    seq.state = _State(done)
    if phase is Phase.DECODING:
        seq.decoding = Decoding(list(seq.tokens), IncrementalDetokenizer(lambda ids: ""))
    return seq


def _decoding(seq_id: int, read: int = 3) -> Sequence:
    seq = _seq(seq_id, Phase.DECODING, done=100)
    assert seq.decoding is not None
    seq.decoding.read = read
    return seq


def test_only_a_generate_finishing_its_prompt_in_one_job_goes_ahead() -> None:
    turns = PromptTurns(stall_s=1.0, max_batch=8, batching=True)
    running = _decoding(1)
    long = _seq(2, Phase.PREFILLING, prompt=500, done=0)  # 500 left, chunks of 64: waits
    prewarm = _seq(3, Phase.RESTORING, prewarm=True)  # never joins a batch: waits
    everyone = [running, long, prewarm]
    assert turns.ahead_of_decoding([long, prewarm, running], everyone, 64, now=0.0) is None
    last_chunk = _seq(4, Phase.PREFILLING, prompt=500, done=450)
    restoring = _seq(5, Phase.RESTORING)
    first_draw = _decoding(6, read=0)
    ready = [long, last_chunk, restoring, first_draw, running]
    everyone += [last_chunk, restoring, first_draw]
    # The first draw goes first (it ends a time to first token), then in the ready order.
    assert turns.ahead_of_decoding(ready, everyone, 64, now=0.0) is first_draw
    assert turns.ahead_of_decoding(ready[:3], everyone, 64, now=0.1) is last_chunk


def test_the_decode_work_waits_at_most_the_stall_limit_then_goes_first() -> None:
    turns = PromptTurns(stall_s=0.5, max_batch=8, batching=True)
    running, newcomer = _decoding(1), _seq(2, Phase.RESTORING)
    everyone = [running, newcomer]
    assert turns.ahead_of_decoding([newcomer], everyone, 64, now=10.0) is newcomer
    assert turns.ahead_of_decoding([newcomer], everyone, 64, now=10.4) is newcomer
    assert not turns.decode_owed(10.4)
    assert turns.ahead_of_decoding([newcomer], everyone, 64, now=10.5) is None
    assert turns.decode_owed(10.5)
    turns.decode_ran()  # the clock starts again
    assert not turns.decode_owed(10.6)
    assert turns.ahead_of_decoding([newcomer], everyone, 64, now=10.6) is newcomer


def test_nobody_goes_ahead_of_a_full_batch_nor_without_batching() -> None:
    newcomer = _seq(9, Phase.RESTORING)
    full = [_decoding(i) for i in range(1, 3)]
    turns = PromptTurns(stall_s=1.0, max_batch=2, batching=True)
    assert turns.ahead_of_decoding([newcomer], [*full, newcomer], 64, now=0.0) is None
    alone = PromptTurns(stall_s=1.0, max_batch=8, batching=False)
    assert alone.ahead_of_decoding([newcomer], [full[0], newcomer], 64, now=0.0) is None
    off = PromptTurns(stall_s=0.0, max_batch=8, batching=True)
    assert off.ahead_of_decoding([newcomer], [full[0], newcomer], 64, now=0.0) is None


# --------------------------------------------------------------------------- in the engine

PER_TOKEN = 0.001
NEWCOMERS = 4


def _spec(**options: ModelOption) -> ModelSpec:
    return sim_spec(chunk=8, prefill_s_per_token=PER_TOKEN, decode_s_per_token=PER_TOKEN, **options)


def _running_tokens_while_newcomers_start(sim: Simulator) -> tuple[int, list[list[int]]]:
    """Two streams decode in a batch; NEWCOMERS short prompts arrive together. Returns how many
    tokens the running streams showed before every newcomer had its first token."""
    prompts = {"a": tuple(range(10, 16)), "b": tuple(range(20, 26))}
    for rid, prompt in prompts.items():
        sim.send(generate(rid, prompt, 80))
    sim.advance(0.03)
    arrived = len(sim.host_messages)
    for n in range(NEWCOMERS):
        prompt = tuple(range(100 + 10 * n, 106 + 10 * n))  # one chunk
        prompts[f"n{n}"] = prompt
        sim.send(generate(f"n{n}", prompt, 4))
    sim.run_until_quiescent()
    shown = {rid: 0 for rid in prompts}
    running_before = 0
    for message in sim.host_messages[arrived:]:
        if not isinstance(message, TokensEmitted):
            continue
        if message.request_id in ("a", "b") and any(shown[f"n{n}"] == 0 for n in range(NEWCOMERS)):
            running_before += len(message.token_ids)
        shown[message.request_id] += len(message.token_ids)
    outputs = [sim.emitted_tokens(rid, 1) for rid in prompts]
    expected = [greedy_continuation(p, 80 if rid in "ab" else 4) for rid, p in prompts.items()]
    assert outputs == expected
    return running_before, outputs


def test_newcomers_get_their_first_token_before_the_running_streams_step_again() -> None:
    sim = make_sim(_spec())
    running_before, _ = _running_tokens_while_newcomers_start(sim)
    assert running_before <= 2  # at most the step already under way when they arrived


def test_newcomers_and_the_batch_take_turns_when_the_stall_limit_is_zero() -> None:
    sim = make_sim(_spec(decode_stall_ms=0.0))
    running_before, _ = _running_tokens_while_newcomers_start(sim)
    assert running_before >= 2 * (NEWCOMERS - 1)  # a batch step between newcomers


def test_a_short_stall_limit_lets_the_streams_step_before_every_newcomer_has_drawn() -> None:
    # The newcomers' prompts (6 tokens each, 1 ms a token) are prefilled together in 24 ms.
    sim = make_sim(_spec(decode_stall_ms=1.0))
    running_before, _ = _running_tokens_while_newcomers_start(sim)
    assert running_before > 2
