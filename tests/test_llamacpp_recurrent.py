"""The llama.cpp backend on recurrent and hybrid models: every state operation on real GGUF files.

No recurrent or hybrid GGUF can be fetched here, so tests/llamacpp_tiny_gguf.py writes tiny ones
(random weights, SmolLM2's tokenizer): ``mamba`` (llama.cpp's memory is recurrent only), ``lfm2``
(hybrid: a KV cache for its attention layers beside a recurrent state for its short-convolution
layers) and ``lfm2-swa`` (the same with a 32-token attention window). llama.cpp refuses to cut
back part of a recurrent state (``llama_memory_seq_rm`` returns false), so reuse restores
snapshots (``llama_state_seq_get_data_ext`` with ``PARTIAL_ONLY``); each operation here must give
what a cold run gives, with the real state bytes charged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors.engine.checkpoints import CheckpointPolicy
from runtime.backends.contract import CannotTrim, PrefillInterrupted, ReuseStrategy
from runtime.backends.llamacpp.backend import LlamaCppBackend
from runtime.backends.llamacpp.binding import PARTIAL_ONLY
from runtime.backends.llamacpp.seqs import LlamaState
from runtime.backends.options import DEFAULT_CHECKPOINT_EVERY
from runtime.messages import ModelSpec
from tests.llamacpp_support import StopAfter, batch_greedy, greedy
from tests.test_real_model_reuse import CORPUS

ARCHS = ("mamba", "lfm2", "lfm2-swa")
N_BATCH = 64  # several llama_decode calls per prefill, with prompts of a few hundred tokens
TEXT = " ".join(CORPUS[:3])


def load(path: Path, **options: Any) -> LlamaCppBackend:
    # exact_reuse: flash attention off, whose passes split differently sum 0.01 apart on lfm2.
    opts = {"n_threads": 1, "n_batch": N_BATCH, "context_length": 1024, "exact_reuse": True}
    opts.update(options)
    return LlamaCppBackend.load(
        ModelSpec(name=path.stem, backend="llamacpp", path=str(path), options=opts)
    )


@pytest.fixture(scope="module", params=ARCHS)
def backend(
    request: pytest.FixtureRequest, tiny_llama_gguf: Callable[[str], Path]
) -> Iterator[LlamaCppBackend]:
    loaded = load(tiny_llama_gguf(request.param))
    yield loaded
    loaded.close()


def cold(backend: LlamaCppBackend, ids: Sequence[int]) -> tuple[list[int], np.ndarray]:
    """The logits after ``ids`` prefilled from nothing, and 6 greedy tokens after them."""
    state = backend.new_state()
    backend.prefill(state, ids)
    logits = np.array(backend.logits(state))
    return greedy(backend, state), logits


def assert_equals_cold(backend: LlamaCppBackend, state: LlamaState, ids: Sequence[int]) -> None:
    want_tokens, want_logits = cold(backend, ids)
    got_logits = np.array(backend.logits(state))
    # Passes split differently sum differently in the last bits (passes.py); far from a tie.
    assert np.abs(got_logits - want_logits).max() < 1e-3
    assert greedy(backend, state) == want_tokens


def test_llama_cpp_loads_them_as_the_architectures_they_are(
    tiny_llama_gguf: Callable[[str], Path],
) -> None:
    """Recurrent or hybrid as llama.cpp reports them, reused through checkpoints, at the
    periodic spacing docs/reuse.md gives them by default."""
    facts = {}
    for arch in ARCHS:
        backend = load(tiny_llama_gguf(arch))
        try:
            ctx = backend.context
            info = backend.info
            spacing = CheckpointPolicy(DEFAULT_CHECKPOINT_EVERY, 1 << 30).spacing(info)
            flags = (ctx.model_flag("is_recurrent"), ctx.model_flag("is_hybrid"))
            facts[arch] = (*flags, info.window_tokens, spacing)
            assert info.reuse is ReuseStrategy.CHECKPOINT
            assert info.vocab_size == 49152
            assert backend.encode("Hello, world!") == ctx.tokenize("Hello, world!")
        finally:
            backend.close()
    assert facts == {
        "mamba": (True, False, None, 64),  # no full-attention KV: the narrowest spacing
        "lfm2": (False, True, None, 64),  # a snapshot costs ~2 tokens of its attention KV
        # Every attention layer is windowed: the only state that grows past the window is
        # llama.cpp's 12 bytes of cell bookkeeping per token, so a snapshot weighs ~1,500
        # tokens of it and the spacing is the widest, checkpoint_every_tokens.
        "lfm2-swa": (False, True, 32, DEFAULT_CHECKPOINT_EVERY),
    }


def test_the_kv_budget_charges_llama_cpps_real_state_bytes(backend: LlamaCppBackend) -> None:
    """What a state and a snapshot are charged is what llama.cpp writes for them: a constant
    recurrent state on mamba; on lfm2 its attention cells grow per token beside it."""
    ids = backend.encode(TEXT)
    state = backend.new_state()
    for length in (1, 40, 150):
        backend.prefill(state, ids[state.length : length], logits=False)
        seq = backend.pool.resident(state)
        assert backend.state_nbytes(state) == backend.context.seq_size(seq), length
        snapshot = backend.snapshot(state)
        assert snapshot.nbytes == backend.context.seq_size(seq, PARTIAL_ONLY) > 0
        assert snapshot.nbytes <= backend.info.snapshot_bytes
    grows = backend.info.bytes_per_token > 0
    assert grows == backend.context.model_flag("is_hybrid")


def test_a_recurrent_state_is_never_cut_back_but_restores_at_a_snapshot(
    backend: LlamaCppBackend,
) -> None:
    """llama.cpp itself refuses to remove part of the sequence; the backend says it cannot
    trim, and a copy at a snapshot taken inside the prefill continues like a cold run."""
    ids = backend.encode(TEXT)[:150]
    edited = ids[:100] + backend.encode(" A different ending about ships.")
    source = backend.new_state()
    (snapshot,) = backend.prefill(source, ids, snapshot_at=[100])
    source_logits = np.array(backend.logits(source))
    assert snapshot.length == 100
    assert not backend.can_trim(source)
    with pytest.raises(CannotTrim):
        backend.copy_state(source, 100)
    scratch = backend.copy_state(source, len(ids))  # a whole copy needs no cut
    assert backend.context.seq_rm(backend.pool.resident(scratch), 100, -1) is False
    restored = backend.copy_state(source, 100, snapshot)
    assert restored.length == 100
    backend.prefill(restored, edited[100:])
    assert_equals_cold(backend, restored, edited)
    assert np.array_equal(np.array(backend.logits(source)), source_logits)
    assert_equals_cold(backend, source, ids)


@pytest.mark.parametrize(
    ("added", "stop_at"),
    # A llama_decode of these models checks the flag 58-88 times: 100 lands in the second call.
    [(30, 2), (30, 6), (150, 2), (150, 100)],
    ids=["inside-a-lone-call", "late-in-a-lone-call", "inside-the-first-call", "a-later-call"],
)
def test_an_interrupted_prefill_leaves_the_state_as_before(
    backend: LlamaCppBackend, added: int, stop_at: int
) -> None:
    """llama.cpp cannot take back what an aborted ``llama_decode`` wrote into a recurrent state
    (its own undo is a partial ``seq_rm``, refused): the backend puts the state back itself,
    whether the prefill was one call or several."""
    ids = backend.encode(TEXT)
    state = backend.new_state()
    backend.prefill(state, ids[:50])
    before = np.array(backend.logits(state))
    stop = StopAfter(stop_at)
    with pytest.raises(PrefillInterrupted):
        backend.prefill(state, ids[50 : 50 + added], stop=stop)
    assert stop.checks >= 2, "it gave up before its first llama_decode ran"
    assert state.length == 50
    assert backend.context.seq_pos_max(backend.pool.resident(state)) == 49
    assert np.array_equal(np.array(backend.logits(state)), before)
    backend.prefill(state, ids[50:200], stop=threading.Event())
    assert_equals_cold(backend, state, ids[:200])


def test_a_decode_batch_equals_each_sequence_alone(backend: LlamaCppBackend) -> None:
    prompts = [backend.encode(text) for text in (CORPUS[0], CORPUS[1] + CORPUS[2], "Hi")]
    alone = [cold(backend, ids)[0] for ids in prompts]
    states = []
    for ids in prompts:
        states.append(backend.new_state())
        backend.prefill(states[-1], ids)
    batch, slots, drawn = batch_greedy(backend, states, 6)
    assert [drawn[slot] for slot in slots] == alone
    left = batch.leave(slots[0])
    assert left.length == len(prompts[0]) + 6
    assert greedy(backend, states[2]) == alone[2]  # the joined state was left as it was


def test_prefill_together_snapshots_restore_exactly(backend: LlamaCppBackend) -> None:
    """Prompts in shared ``llama_decode`` calls, each cut at its snapshot points."""
    prompts = [backend.encode(text) for text in (TEXT, CORPUS[3], CORPUS[4] + CORPUS[5])]
    states = [backend.new_state() for _ in prompts]
    snaps = backend.prefill_together(states, prompts, [[200], [20, 40], []])
    for state, ids in zip(states, prompts, strict=True):
        assert state.length == len(ids)
        assert_equals_cold(backend, state, ids)
    assert [[s.length for s in one] for one in snaps] == [[200], [20, 40], []]
    edited = prompts[0][:200] + backend.encode(" Nobody knows.")
    restored = backend.copy_state(states[0], 200, snaps[0][0])
    backend.prefill(restored, edited[200:])
    assert_equals_cold(backend, restored, edited)


def test_states_beyond_the_sequence_slots_move_to_host_and_back(
    tiny_llama_gguf: Callable[[str], Path],
) -> None:
    """3 seq_ids, 5 live states: recurrent states spill to host bytes and come back whole."""
    for arch in ARCHS:
        backend = load(tiny_llama_gguf(arch), max_sequences=3, max_batch=1)
        try:
            prompts = [backend.encode(CORPUS[i]) for i in range(5)]
            states = []
            for ids in prompts:
                states.append(backend.new_state())
                backend.prefill(states[-1], ids)
            assert backend.pool.spills >= 2
            for state, ids in zip(states, prompts, strict=True):
                assert_equals_cold(backend, state, ids)
        finally:
            backend.close()


def test_exact_reuse_is_refused_quietly_where_a_throwaway_row_cannot_be_taken_back(
    tiny_llama_gguf: Callable[[str], Path],
) -> None:
    """``exact_reuse`` pads a lone row with a throwaway one and removes its cell after
    (passes.py); a recurrent state cannot give a token back, so these models load and decode
    without padding (before, the load itself failed: llama_decode error -1)."""
    for arch in ARCHS:
        backend = load(tiny_llama_gguf(arch), exact_reuse=True)
        try:
            assert not backend.context.pads_lone_rows
            ids = backend.encode(CORPUS[0])
            state = backend.new_state()
            backend.prefill(state, ids)
            drawn = greedy(backend, state)
            assert state.length == len(ids) + len(drawn)
            assert backend.context.seq_pos_max(backend.pool.resident(state)) == state.length - 1
        finally:
            backend.close()
