"""The llama.cpp backend on both real models, against llama.cpp itself where it can be.

Token ids equal llama.cpp's own tokenizer's; greedy output equals llama-cpp-python's ``Llama``
(the field's standard loop over the same GGUF); every state operation of the backend contract
(trim, snapshot restore on Gemma 3's sliding window, an interrupted prefill, a decode batch, a
batched prefill, states moved to host memory) gives what a cold run gives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime.backends.contract import CannotTrim, PrefillInterrupted, ReuseStrategy
from runtime.backends.llamacpp.backend import LlamaCppBackend
from runtime.backends.llamacpp.seqs import LlamaState, runs
from runtime.backends.llamacpp.tokenizer import direct_decoder
from runtime.messages import ChatMessage, ChatOptions, ModelSpec
from runtime.text.chat import prepare_chat
from tests.llamacpp_support import StopAfter, batch_greedy, greedy
from tests.test_real_model_reuse import CORPUS

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900)]

MODELS = ("smollm2-135m-instruct", "gemma3-270m")
CHUNK = 256  # the engine's default prefill chunk
DOC = "\n\n".join(CORPUS)  # ~800 tokens: past Gemma 3's 512-token window
TOKEN_CORPUS = (
    "Hello, world!",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # squares\n",
    "    \n\n\t\t  leading and   trailing   runs of   whitespace    \n\n\n",
    "naïve café — Straße, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어",
    "emoji 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, combining e\u0301 and zero\u200bwidth",
    "numbers 3.14159 1,000,000 0x1F 12345678901234567890 and dates 2024-06-01",
    "<|im_start|>user\nliteral special tokens in text<|im_end|> <start_of_turn> <bos>",
    "SELECT * FROM t WHERE name LIKE '%x%' AND id IN (1, 2, 3);\n",
    "a" * 300 + " " + "ab" * 150,
    DOC,
)
Backends = Callable[[str], Any]


@pytest.fixture(params=MODELS)
def backend(request: pytest.FixtureRequest, real_llama: Backends) -> LlamaCppBackend:
    loaded: LlamaCppBackend = real_llama(request.param)
    return loaded


def prefill(backend: LlamaCppBackend, state: LlamaState, ids: Sequence[int], **kw: Any) -> Any:
    """Prefill in the engine's chunks, logits kept after the last."""
    out: list[Any] = []
    for begin in range(0, len(ids), CHUNK):
        piece = ids[begin : begin + CHUNK]
        last = begin + CHUNK >= len(ids)
        points = [
            p for p in kw.get("snapshot_at", ()) if state.length < p <= state.length + len(piece)
        ]
        out += backend.prefill(state, piece, logits=last, snapshot_at=points)
    return out


def cold(backend: LlamaCppBackend, ids: Sequence[int], n: int = 8) -> list[int]:
    state = backend.new_state()
    prefill(backend, state, ids)
    return greedy(backend, state, n)


# ---------------------------------------------------------------------- one source of tokens


def test_token_ids_equal_llama_cpps_own(backend: LlamaCppBackend) -> None:
    """Our tokenizer (from the GGUF) and llama_tokenize agree on a varied corpus, chat too."""
    for text in TOKEN_CORPUS:
        assert backend.encode(text) == backend.context.tokenize(text), text[:40]
    messages = [
        ChatMessage("system", "You are terse. 🙂"),
        ChatMessage("user", "Write `print('héllo')` in\n\n  Python."),
        ChatMessage("assistant", "print('héllo')"),
        ChatMessage("user", "And in C?"),
    ]
    tokens = backend.chat_tokenizer
    prepared = prepare_chat(tokens, messages, ChatOptions(), 16, backend.info.context_length)
    rendered = tokens.decode(prepared.tokens)
    assert list(prepared.tokens) == backend.context.tokenize(rendered, add_special=False)


# ---------------------------------------------------------------------- greedy = llama.cpp's


def test_decode_goes_straight_to_the_rust_tokenizer_and_gives_what_the_wrapper_gives(
    backend: LlamaCppBackend,
) -> None:
    """The detokenizer's decode skips the Hugging Face layers (tokenizer.py ``direct_decoder``)
    on both models, with the same text for every prefix of every corpus text's ids; a tokenizer
    that cleans up spaces keeps the wrapper's decode."""
    wrapper = backend.chat_tokenizer
    assert direct_decoder(wrapper) is not None
    for text in TOKEN_CORPUS[:-1]:
        ids = backend.encode(text)
        for end in range(len(ids) + 1):
            assert backend.decode(ids[:end]) == wrapper.decode(ids[:end])

    class Cleaning:
        _tokenizer = SimpleNamespace(clean_up_tokenization_spaces=True, _tokenizer=object())

    assert direct_decoder(Cleaning()) is None


def test_greedy_equals_llama_cpps_own_greedy(backend: LlamaCppBackend) -> None:
    """Chunked prefill, then the B=1 path: the tokens ``llama_cpp.Llama`` picks greedily."""
    from llama_cpp import Llama

    ids = backend.encode(DOC + "\n\nQ: Who was the first keeper?\nA:")
    oracle = Llama(model_path=str(backend.path), n_ctx=2048, n_threads=1, verbose=False)
    try:
        expected = []
        for token in oracle.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
            expected.append(token)
            if len(expected) == 16:
                break
    finally:
        oracle.close()
    assert cold(backend, ids, 16) == expected


def test_a_steps_logits_are_an_array_of_their_own_past_the_next_pass(
    backend: LlamaCppBackend,
) -> None:
    """Logits are copied once, from the buffer the next ``llama_decode`` overwrites straight into
    an ``mx.array`` (binding.py): a float32 (vocab,) array that later passes leave unchanged."""
    state, other = backend.new_state(), backend.new_state()
    prefill(backend, state, backend.encode(CORPUS[0]))
    first = backend.logits(state)
    assert (first.dtype, first.shape) == (mx.float32, (backend.info.vocab_size,))
    kept = np.array(first)
    prefill(backend, other, backend.encode(CORPUS[1]))
    after = backend.feed(state, mx.array(int(np.argmax(kept))))
    assert np.array_equal(np.array(first), kept)
    assert not np.array_equal(np.array(after), kept)


# ---------------------------------------------------------------------- reuse


def test_a_trimmed_copy_continues_like_a_cold_prefill(backend: LlamaCppBackend) -> None:
    """Cut back to a common prefix (below Gemma's window, where it still trims), then a new
    suffix: the same greedy tokens as the whole prompt computed anew; the source is untouched."""
    window = backend.info.window_tokens or 10**9
    ids = backend.encode(CORPUS[0] + " " + CORPUS[1])[: min(300, window - 1)]
    edited = ids[:200] + backend.encode(" A different ending about ships.")[1:]
    source = backend.new_state()
    prefill(backend, source, ids)
    source_logits = np.array(backend.logits(source))
    assert backend.can_trim(source)
    copy = backend.copy_state(source, 200)
    prefill(backend, copy, edited[200:])
    assert greedy(backend, copy, 8) == cold(backend, edited)
    assert np.array_equal(np.array(backend.logits(source)), source_logits)
    assert greedy(backend, source, 4) == cold(backend, ids, 4)


def test_gemma_sliding_window_restores_from_snapshots(real_llama: Backends) -> None:
    """Past the window a Gemma 3 state cannot be cut back, but restores exactly at a snapshot
    (its sliding layers' cells) over its full-attention cells cut back."""
    backend: LlamaCppBackend = real_llama("gemma3-270m")
    assert backend.info.reuse is ReuseStrategy.CHECKPOINT
    assert backend.info.window_tokens == 512
    ids = backend.encode(DOC)
    assert len(ids) > 700
    state = backend.new_state()
    (snap,) = prefill(backend, state, ids, snapshot_at=[600])
    assert snap.length == 600 and 0 < snap.nbytes < backend.state_nbytes(state)
    assert not backend.can_trim(state)
    with pytest.raises(CannotTrim):
        backend.copy_state(state, 600)
    edited = ids[:600] + backend.encode(" The keepers sang.")[1:]
    restored = backend.copy_state(state, 600, snap)
    prefill(backend, restored, edited[600:])
    assert greedy(backend, restored, 8) == cold(backend, edited)
    # A whole copy needs no snapshot; the original still continues as it would have.
    whole = backend.copy_state(state, len(ids))
    assert greedy(backend, whole, 4) == greedy(backend, state, 4) == cold(backend, ids, 4)


def test_a_state_taken_in_place_continues_like_a_cold_prefill(backend: LlamaCppBackend) -> None:
    """``take_state`` cuts the state itself back (SmolLM2: trimmed; Gemma 3, past its window:
    its snapshot put back into the same seq_id first), keeping its seq_id, and a new suffix then
    gives the greedy tokens of the whole edited prompt computed anew; the whole state taken keeps
    its logits."""
    ids = backend.encode(DOC)
    assert len(ids) > 700
    state = backend.new_state()
    (snap,) = prefill(backend, state, ids, snapshot_at=[600])
    seq = state.seq
    edited = ids[:600] + backend.encode(" The keepers sang.")[1:]
    point = None if backend.can_trim(state) else snap
    taken = backend.take_state(state, 600, point)
    assert taken is state and (state.seq, state.length) == (seq, 600)
    prefill(backend, taken, edited[600:])
    assert greedy(backend, taken, 8) == cold(backend, edited)
    whole = backend.new_state()
    prefill(backend, whole, ids)
    kept = backend.logits(whole)
    assert backend.take_state(whole, len(ids)) is whole and backend.logits(whole) is kept
    assert greedy(backend, whole, 4) == cold(backend, ids, 4)


def test_a_taken_state_is_cut_back_past_its_snapshot_only_while_it_holds_the_window(
    backend: LlamaCppBackend,
) -> None:
    """Gemma 3 (a 512-token window): ``reach`` 700 of an ~800-token state taken in place cuts
    there, no snapshot; a copy (the window only) and a state whose cells before the cut were
    reused (2,400 tokens) restore the snapshot instead. Each continues as a restore from a
    snapshot at the length it reports does (Gemma's passes are not bit-exact against a cold run
    of other passes: the reuse suite's xfails)."""
    ids = backend.encode(DOC)
    edit = backend.encode(" The keepers sang.")[1:]

    def taken_at(prompt: list[int], at: int, reach: int = 0, copy: bool = False) -> Any:
        state = backend.new_state()
        (snap,) = prefill(backend, state, prompt, snapshot_at=[at])
        cut = backend.copy_state if copy else backend.take_state
        restored = cut(state, at, snap, reach=reach)
        prefill(backend, restored, edit)
        return restored.length, greedy(backend, restored, 6)

    state = backend.new_state()
    prefill(backend, state, ids)
    if backend.can_trim(state):
        pytest.skip("a trimmable state cuts back anywhere: reach is for sliding windows")
    assert taken_at(ids, 600, reach=700) == taken_at(ids, 700)
    assert taken_at(ids, 600, reach=700, copy=True) == taken_at(ids, 600)
    long_ids = backend.encode("\n\n".join([DOC, DOC, DOC]))[:2400]
    # Positions 789-1,299 have left Gemma's 1,024-cell stream: the snapshot at 1,000 it is.
    assert taken_at(long_ids, 1000, reach=1300) == taken_at(long_ids, 1000)


def test_an_interrupted_prefill_leaves_the_state_as_before(backend: LlamaCppBackend) -> None:
    """Stopped inside its second ``llama_decode`` (past Gemma's window, where llama.cpp reuses
    sliding cells): the state is as it was, and prefilling the same tokens again equals cold."""
    ids = backend.encode(DOC + "\n\n" + DOC)
    state = backend.new_state()
    prefill(backend, state, ids[:600])
    before = np.array(backend.logits(state))
    stop = StopAfter(400)
    with pytest.raises(PrefillInterrupted):
        backend.prefill(state, ids[600:1400], stop=stop)
    assert stop.checks > 3, "it gave up before its first llama_decode ran"
    assert state.length == 600
    assert np.array_equal(np.array(backend.logits(state)), before)
    assert backend.context.seq_pos_max(state.seq or 0) == 599
    backend.prefill(state, ids[600:1400], stop=threading.Event())
    assert greedy(backend, state, 6) == cold(backend, ids[:1400], 6)


def test_a_prefill_stopped_past_its_snapshot_point_keeps_the_state_there(
    backend: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a sliding-window model, its first call ends at the snapshot point 700, so no copy of
    the window is taken first; stopped inside the next call, it goes back to that snapshot: the
    state is at 700, as a clean prefill to 700 leaves it (``PrefillInterrupted.kept``)."""
    if backend.info.window_tokens is None:
        pytest.skip("no sliding window: an interrupted call is cut off, nothing is copied first")
    ids = backend.encode(DOC + "\n\n" + DOC)
    state = backend.new_state()
    prefill(backend, state, ids[:600])
    taken: list[int] = []
    snapshot = backend.snapshot
    monkeypatch.setattr(backend, "snapshot", lambda own: taken.append(own.length) or snapshot(own))
    with pytest.raises(PrefillInterrupted) as stopped:
        backend.prefill(state, ids[600:1400], snapshot_at=[700], stop=StopAfter(600))
    assert (stopped.value.kept, [s.n_tokens for s in stopped.value.snapshots]) == (100, [700])
    assert taken == [700], "a copy was taken to undo the prefill to its start"
    assert state.length == 700
    assert backend.context.seq_pos_max(state.seq or 0) == 699
    backend.prefill(state, ids[700:1400])
    clean = backend.new_state()
    prefill(backend, clean, ids[:600])
    backend.prefill(clean, ids[600:700], logits=False)
    backend.prefill(clean, ids[700:1400])
    assert greedy(backend, state, 6) == greedy(backend, clean, 6)


# ---------------------------------------------------------------------- batching


def test_a_decode_batch_equals_each_sequence_alone(backend: LlamaCppBackend) -> None:
    """Three sequences of different lengths, one ``llama_decode`` per step: each draws what it
    draws alone; join leaves the state untouched and leave hands back a working state."""
    prompts = [backend.encode(text) for text in (CORPUS[0], CORPUS[1] + CORPUS[2], "Hi")]
    alone = [cold(backend, ids, 6) for ids in prompts]
    states = []
    for ids in prompts:
        states.append(backend.new_state())
        prefill(backend, states[-1], ids)
    batch, slots, drawn = batch_greedy(backend, states, 5)
    left = batch.leave(slots[0])
    drawn[slots[0]].append(int(mx.argmax(backend.logits(left)).item()))
    assert left.length == len(prompts[0]) + 5
    assert drawn[slots[0]] == alone[0]
    assert [drawn[s][:5] for s in slots[1:]] == [a[:5] for a in alone[1:]]
    assert greedy(backend, states[2], 6) == alone[2]  # the joined state was left as it was


def test_a_greedy_member_gets_its_argmax_in_place_and_leaves_with_its_logits(
    backend: LlamaCppBackend, real_gguf: Callable[[str], Any]
) -> None:
    """A slot asked for its argmax gets the id ``np.argmax`` picks from the logits a plain step
    returns, the other slot its logits; a member leaving after such a step, right away or after
    another ``llama_decode`` overwrote llama.cpp's buffer, leaves with the logits it would have
    had (copied out before that decode). With ``exact_reuse`` (throwaway rows in the call) and,
    on SmolLM2, without (the engine's default)."""
    greedy_in_place(backend)
    if backend.context.n_vocab < 100_000:  # once, not per model
        plain = few_sequences(real_gguf, max_sequences=8, max_batch=4)
        try:
            greedy_in_place(plain)
        finally:
            plain.close()


def greedy_in_place(backend: LlamaCppBackend) -> None:
    prompts = [backend.encode(text) for text in (CORPUS[0], CORPUS[1])]
    states = []
    for ids in prompts:
        states.append(backend.new_state())
        prefill(backend, states[-1], ids)
    first = {0: int(mx.argmax(backend.logits(states[0])).item())}
    first[1] = int(mx.argmax(backend.logits(states[1])).item())

    def two_steps(argmax: set[int]) -> tuple[Any, list[dict[int, Any]]]:
        batch = backend.open_batch()
        assert batch is not None
        slots = [batch.join(state) for state in states]
        assert slots == [0, 1]
        out = [batch.step(first, argmax)]
        out.append(batch.step({0: 7, 1: 7}, argmax))  # any tokens: the same in both runs
        return batch, out

    plain, expected = two_steps(set())
    picked, got = two_steps({0})
    for want, have in zip(expected, got, strict=True):
        assert have[0] == int(np.argmax(np.asarray(want[0])))  # an id, not an array
        assert isinstance(have[1], mx.array) and mx.array_equal(have[1], want[1])
    prefill(backend, backend.new_state(), prompts[0][:5])  # overwrites llama.cpp's logits
    assert mx.array_equal(picked.leave(0).logits, plain.leave(0).logits)
    assert mx.array_equal(picked.leave(1).logits, plain.leave(1).logits)
    again = backend.open_batch()
    assert again is not None
    slot = again.join(states[0])
    token = again.step({slot: first[0]}, {slot})[slot]
    assert isinstance(token, int)
    assert mx.array_equal(again.leave(slot).logits, expected[0][0])  # left before any decode


def test_prefill_together_equals_each_alone(backend: LlamaCppBackend) -> None:
    """Prompts in shared ``llama_decode`` calls, with snapshots inside them on Gemma."""
    prompts = [backend.encode(text) for text in (DOC, CORPUS[3], CORPUS[4] + CORPUS[5])]
    states = [backend.new_state() for _ in prompts]
    points = [[600], [20], []]
    snaps = backend.prefill_together(states, prompts, points)
    for state, ids in zip(states, prompts, strict=True):
        assert state.length == len(ids)
        assert greedy(backend, state, 5) == cold(backend, ids, 5)
    assert [s.length for s in snaps[0]] == [600]
    edited = prompts[0][:600] + backend.encode(" Nobody knows.")[1:]
    if backend.info.reuse is ReuseStrategy.CHECKPOINT:
        restored = backend.copy_state(states[0], 600, snaps[0][0])
    else:
        restored = backend.copy_state(states[0], 600)
    prefill(backend, restored, edited[600:])
    assert greedy(backend, restored, 5) == cold(backend, edited, 5)


def few_sequences(
    real_gguf: Callable[[str], Any], *, max_sequences: int, max_batch: int, exact: bool = False
) -> LlamaCppBackend:
    """SmolLM2 on llama.cpp with only ``max_sequences`` seq_ids (the caller closes it)."""
    from tests.llamacpp_support import require_llama_cpp

    require_llama_cpp()
    real_gguf("smollm2-135m-instruct")
    options = {"max_sequences": max_sequences, "max_batch": max_batch, "n_threads": 1}
    options |= {"exact_reuse": True} if exact else {}
    spec = ModelSpec(name="small", backend="llamacpp", path="smollm2-135m-instruct",
                     options={**options, "context_length": 1024})  # fmt: skip
    return LlamaCppBackend.load(spec)


def prefilled(backend: LlamaCppBackend, n: int) -> tuple[list[list[int]], list[LlamaState]]:
    """The first ``n`` corpus texts' tokens, and a state prefilled with each, in that order."""
    prompts = [backend.encode(CORPUS[i]) for i in range(n)]
    states = []
    for ids in prompts:
        states.append(backend.new_state())
        prefill(backend, states[-1], ids)
    return prompts, states


def test_states_beyond_the_sequence_slots_move_to_host_and_back(
    real_gguf: Callable[[str], Any],
) -> None:
    """With 3 seq_ids, 5 live states: the least recently used ones are saved to host memory and
    restored when used, each continuing as it would have."""
    backend = few_sequences(real_gguf, max_sequences=3, max_batch=1)
    try:
        prompts, states = prefilled(backend, 5)
        assert backend.pool.spills >= 2
        assert sum(s.seq is None for s in states) >= 2
        for state, ids in zip(states, prompts, strict=True):
            assert greedy(backend, state, 4) == cold(backend, ids, 4)
        del states  # their seq_ids come back: 3 more states need no spill
        spills = backend.pool.spills
        again = [backend.new_state() for _ in range(3)]
        for state, ids in zip(again, prompts[:3], strict=True):
            prefill(backend, state, ids)
        assert backend.pool.spills == spills
    finally:
        backend.close()


def test_tidy_frees_two_slots_ahead_of_need_so_a_branch_copies_without_a_spill(
    real_gguf: Callable[[str], Any],
) -> None:
    """Every seq_id held by a state: ``tidy`` spills the least recently used ones, one per call,
    until two are free (the spills grow the copy buffer on the way), then has nothing to do; a
    copy (a request branching from a cached prefix) and a new state then take those two without
    spilling or growing the buffer, and the spilled state still continues as it would have."""
    backend = few_sequences(real_gguf, max_sequences=4, max_batch=2)
    try:
        prompts, states = prefilled(backend, 4)
        assert backend.pool.spills == 0 and not backend.pool.census().free
        assert [backend.tidy() for _ in range(3)] == [True, True, False]
        assert len(backend.pool.census().free) == 2 and backend.pool.spills == 2
        assert states[0].seq is None and states[1].seq is None  # the least recently used
        context = backend.context
        grown = context.copy_buffer_bytes
        assert grown >= max(context.seq_size(s.seq) for s in states[2:] if s.seq is not None)
        branch = backend.copy_state(states[3], len(prompts[3]) - 5)
        assert context.copy_buffer_bytes == grown  # the copy found it ready
        fresh = backend.new_state()
        prefill(backend, fresh, prompts[2][:40])
        assert backend.pool.spills == 2  # neither paid a spill
        prefill(backend, branch, prompts[3][-5:])
        assert greedy(backend, branch, 4) == cold(backend, prompts[3], 4)
        assert greedy(backend, states[0], 4) == cold(backend, prompts[0], 4)
    finally:
        backend.close()


def test_a_decode_batch_keeps_its_seq_ids_one_run_and_each_member_decodes_as_alone(
    real_gguf: Callable[[str], Any],
) -> None:
    """llama.cpp makes one pass of a step only over consecutive seq_ids (seqs.py). With ids
    0-6 held by states and 3 freed: members join on 7 and 8, then on 6, whose state moves to 3;
    a member leaving from the middle of the run leaves a hole that the next step closes (the
    state it left as moves to a freed id, the top member into the hole). Every member draws
    what it draws alone, and the moved states continue as they would have (a step after the
    move is not compared: a 2-row pass sums otherwise than one row, a near-tie here)."""
    backend = few_sequences(real_gguf, max_sequences=9, max_batch=3)
    try:
        prompts, states = prefilled(backend, 7)
        assert [state.seq for state in states] == list(range(7))
        states[3] = backend.new_state()  # the old state is dropped: seq_id 3 is freed
        batch, slots, drawn = batch_greedy(backend, states[:3], 3)
        assert batch.runs == 1 and backend.pool.moves == 1 and states[6].seq == 3
        states[4] = backend.new_state()  # frees seq_id 4 for the state leaving below
        left = batch.leave(slots[0])
        assert left.seq == 7 and batch.runs == 2  # the first to join took 7, between 6 and 8
        top = backend.context.seq_size(8)
        batch.close_holes()  # as the next step() does first
        assert batch.runs == 1 and backend.pool.moves == 2 and left.seq == 4
        assert backend.context.seq_size(7) == top and backend.context.seq_size(8) < 100  # emptied
        tokens = {slot: drawn[slot][-1] for slot in slots[1:]}
        assert set(batch.step(tokens)) == set(slots[1:])
        assert drawn[slots[0]] + greedy(backend, left, 3) == cold(backend, prompts[0], 6)
        for slot, ids in zip(slots[1:], prompts[1:3], strict=True):
            assert drawn[slot] == cold(backend, ids, 3)
        assert greedy(backend, states[6], 4) == cold(backend, prompts[6], 4)
    finally:
        backend.close()


def test_with_every_seq_id_held_a_join_spills_the_holder_of_the_id_that_keeps_one_run(
    real_gguf: Callable[[str], Any],
) -> None:
    """Ids 0-4 all held by states (as when streams join right after their prefill, the states
    they were prefilled in still holding ids): the first member's copy spills the least recently
    used state other than its source (on 1) and takes 1; the next one's source holds 2, so it
    wants 0, and with no id free the state on 0 goes to host memory instead of the member
    taking an id off the run (before: 3, and every step two passes). Each member draws what it
    draws alone, and the spilled states continue as they would have."""
    backend = few_sequences(real_gguf, max_sequences=5, max_batch=2)
    try:
        prompts, states = prefilled(backend, 5)
        assert not backend.pool.census().free
        batch, slots, drawn = batch_greedy(backend, [states[0], states[2]], 3)
        assert batch.runs == 1 and backend.pool.moves == 0 and backend.pool.spills == 2
        assert states[0].seq is None and states[1].seq is None  # both on host now
        for slot, ids in zip(slots, (prompts[0], prompts[2]), strict=True):
            assert drawn[slot] == cold(backend, ids, 3)
        for index in (0, 1):
            assert greedy(backend, states[index], 3) == cold(backend, prompts[index], 3)
    finally:
        backend.close()


def test_a_together_prefill_of_equal_rests_takes_one_run_of_seq_ids_and_each_equals_cold(
    real_gguf: Callable[[str], Any],
) -> None:
    """Equal rests are one pass only over consecutive seq_ids, as a decode step (seqs.py). With
    ids 0-6 held, the states on 1 and 4 continue together with a new one, 9 tokens each: the new
    one takes 2 (its state moves to a free id), then the state on 3 moves off and the one on 4
    into it, so the three hold 1-3 (before: 1, 4 and 7, three passes). Each then draws what its
    whole prompt draws cold, and so do the states that moved (exact_reuse: the same sums)."""
    backend = few_sequences(real_gguf, max_sequences=9, max_batch=3, exact=True)
    try:
        prompts, states = prefilled(backend, 7)
        fresh = backend.new_state()
        group = [states[1], states[4], fresh]
        rests = [prompts[5][:9], prompts[2][:9], backend.encode(CORPUS[7])[:9]]
        backend.prefill_together(group, rests)
        assert [state.seq for state in group] == [1, 3, 2] and runs(s.seq for s in group) == 1
        assert backend.pool.moves == 3 and (states[2].seq, states[3].seq) == (7, 8)
        for state, head, rest in zip(group, (prompts[1], prompts[4], []), rests, strict=True):
            assert greedy(backend, state, 4) == cold(backend, [*head, *rest], 4)
        for index in (2, 3, 6):
            assert greedy(backend, states[index], 4) == cold(backend, prompts[index], 4)
        # Unequal rests go one pass each (faster than llama.cpp's equal sub-passes): no moves.
        again = [backend.new_state(), backend.new_state()]
        backend.prefill_together(again, [prompts[0][:12], prompts[0][:20]])
        assert backend.pool.moves == 3
        assert greedy(backend, again[1], 4) == cold(backend, prompts[0][:20], 4)
    finally:
        backend.close()


def test_tidy_grows_the_copy_buffer_for_the_largest_resident_state(
    real_gguf: Callable[[str], Any],
) -> None:
    """Slots to spare, so nothing to spill: ``tidy`` grows the buffer that a copy goes through
    to hold the largest resident state (its page faults off a branch's path), once."""
    backend = few_sequences(real_gguf, max_sequences=4, max_batch=2)
    try:
        _, states = prefilled(backend, 2)
        context = backend.context
        largest = max(context.seq_size(s.seq) for s in states if s.seq is not None)
        assert context.copy_buffer_bytes < largest
        assert [backend.tidy() for _ in range(2)] == [True, False]
        assert context.copy_buffer_bytes >= largest
        assert backend.pool.spills == 0
    finally:
        backend.close()


# ---------------------------------------------------------------------- exact_reuse


def test_exact_reuse_makes_a_decoded_token_equal_the_same_token_prefilled(
    real_gguf: Callable[[str], Any],
) -> None:
    """With ``exact_reuse`` a reply's tokens fed one at a time leave the KV a prefill of the
    same tokens leaves: the next pass's logits are bit for bit a cold prefill's (passes.py). On
    SmolLM2 without it (llamafile's kernels) they differ by 0.2-0.8 after 300 tokens."""
    from tests.llamacpp_support import require_llama_cpp

    require_llama_cpp()
    real_gguf("smollm2-135m-instruct")
    options = {"n_threads": 1, "exact_reuse": True, "max_batch": 2, "context_length": 1024}
    spec = ModelSpec(
        name="exact", backend="llamacpp", path="smollm2-135m-instruct", options=options
    )
    exact = LlamaCppBackend.load(spec)
    try:
        ids = exact.encode(DOC)[:320]
        for fed in (300, 301, 310):
            reply = exact.new_state()
            prefill(exact, reply, ids[:fed])
            for token in ids[fed : fed + 4]:  # decoded, as a reply is: one row per pass
                exact.feed(reply, mx.array(token))
            prefill(exact, reply, ids[fed + 4 :])
            whole = exact.new_state()
            prefill(exact, whole, ids)
            got, want = np.array(exact.logits(reply)), np.array(exact.logits(whole))
            assert np.array_equal(got, want), f"after {fed}: {np.abs(got - want).max()}"
    finally:
        exact.close()
