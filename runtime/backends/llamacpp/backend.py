"""The llama.cpp backend: a GGUF model run by llama.cpp's kernels behind the same contract as MLX.

On a CPU, llama.cpp's quantized kernels are the fastest way to run a GGUF file; behind the same
backend contract the engine's scheduling, reuse, budget and samplers work unchanged above it.
Every sequence is a seq_id of one llama.cpp context with KV cells of its own (``seqs``), so a
decode step carries one token of many sequences and several prompts prefill in one
``llama_decode``. Logits come back as float32 ``mx.array``s, so the runtime's own samplers,
penalties and grammar masks act on them as on MLX.

Reuse per cache kind, abortable prefill, and the tiny recurrent models the tests write:
docs/models.md, "The llama.cpp backend" and "The llama.cpp backend, inside".
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from runtime.backends.contract import (
    DecodeBatchHandle,
    ModelInfo,
    PrefillInterrupted,
    SequenceState,
    Snapshot,
)
from runtime.backends.llamacpp.binding import PARTIAL_ONLY, Context
from runtime.backends.llamacpp.build import cpus_given
from runtime.backends.llamacpp.cuts import Cutter
from runtime.backends.llamacpp.files import gguf_file_of
from runtime.backends.llamacpp.measure import measure_model
from runtime.backends.llamacpp.passes import Row
from runtime.backends.llamacpp.persist import Persisting
from runtime.backends.llamacpp.seqs import LlamaSnapshot, LlamaState, SeqPool, own_state
from runtime.backends.llamacpp.tokenizer import direct_decoder, load_tokenizer, tokenizer_dir
from runtime.backends.model_source import converted_models_dir
from runtime.backends.options import LlamaCppOptions, options_as
from runtime.backends.vision.media import refuse_media
from runtime.errors import BackendError, InvalidModelSpec
from runtime.messages import ChatMessage, ModelSpec
from runtime.text.constraints import ConstraintEngine

# seq_ids ``tidy`` keeps free while the engine idles: one for a request's new sequence, one for
# a copy of a cached prefix it branches from.
SPARE_SEQS = 2
log = logging.getLogger("mlx_actor_runtime.llamacpp")


# ModelInfo.verifies is False here, so the engine never asks for a verification pass.
_NO_SPECULATION = "speculative decoding is not implemented on the llama.cpp backend"


class LlamaCppBackend(Persisting):
    """The backend contract (``runtime.backends.contract``) over llama.cpp, on one thread; the
    disk tier's ``Persistent`` through ``Persisting`` (persist.py)."""

    def __init__(self, context: Context, tokenizer: Any, pool: SeqPool) -> None:
        self._context = context
        self._tokenizer = tokenizer
        self._decode_direct = direct_decoder(tokenizer)
        self._pool = pool
        self._info: ModelInfo | None = None
        self._n_swa = context.model_int("n_swa")
        self._recurrent = context.model_flag("is_recurrent") or context.model_flag("is_hybrid")
        self._cuts = Cutter(context, pool, self._n_swa, self._recurrent)
        self._partial = self._recurrent or self._n_swa > 0  # snapshots hold the partial state
        if self._recurrent and context.pads_lone_rows:
            # A throwaway row (passes.py) advances a recurrent state, and llama.cpp cannot take
            # one token back out of it: so no padding here (docs/models.md).
            log.info("exact_reuse has no effect on a recurrent or hybrid model")
            context.pads_lone_rows = False
        self._constraints: ConstraintEngine | None = None
        self._decode_block = 1
        self.path = Path(".")
        self._identity: tuple[str | None, bool] = (None, False)  # (sha256, exact_reuse): persist

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, spec: ModelSpec, options: LlamaCppOptions | None = None) -> LlamaCppBackend:
        """Load ``spec.path`` (a .gguf file or a known model) into llama.cpp.

        Raises ``InvalidModelSpec`` (bad options), ``UnsupportedModelFormat`` (not a GGUF file,
        or an architecture llama.cpp cannot load) or ``ModelLoadFailed`` (llama-cpp-python
        missing, the file unreadable), each saying what to do.
        """
        if options is None:
            options = options_as(spec, LlamaCppOptions)
        gguf, sha256 = gguf_file_of(spec)
        threads = options.n_threads or cpus_given()
        # Room for every batch member, a prefilling state, a copy in the making and one more.
        sequences = options.max_sequences or options.max_batch + 3
        if sequences < options.max_batch + 2:
            raise InvalidModelSpec(
                f"option 'max_sequences' of model {spec.name!r} is {sequences}; it must be at "
                f"least max_batch + 2 ({options.max_batch + 2})"
            )
        context = Context(
            gguf,
            context_length=options.context_length or 0,
            n_batch=options.n_batch,
            n_seq_max=sequences,
            n_threads=threads,
            exact_reuse=options.exact_reuse,
        )
        try:
            tokenizer, facts = load_tokenizer(tokenizer_dir(gguf, converted_models_dir(), sha256))
            backend = cls(context, tokenizer, SeqPool(context, sequences))
            backend.path = gguf
            backend._identity = (sha256, options.exact_reuse)
            backend._decode_block = options.decode_block
            backend._info = measure_model(
                backend, options, facts, n_swa=backend._n_swa, recurrent=backend._recurrent
            )
        except BaseException:
            context.close()
            raise
        log.debug(
            "model %r: llama.cpp, %d threads, %d sequences of %d KV cells",
            spec.name,
            threads,
            sequences,
            context.n_ctx_seq,
        )
        return backend

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise RuntimeError("the model is still loading")
        return self._info

    @property
    def context(self) -> Context:
        """The llama.cpp context (the decode batch and tests use it)."""
        return self._context

    @property
    def pool(self) -> SeqPool:
        return self._pool

    # ------------------------------------------------------------------ tokens

    @property
    def chat_tokenizer(self) -> Any:
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def prepare_media(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        refuse_media(messages, "the llama.cpp backend serves text models only")
        return messages

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._decode_direct is not None:
            return self._decode_direct(list(token_ids))
        return str(self._tokenizer.decode(list(token_ids)))

    # ------------------------------------------------------------------ states

    def new_state(self) -> LlamaState:
        return LlamaState()

    def can_trim(self, state: SequenceState) -> bool:
        """A sliding-window state cuts back only while it has never reached its window (llama.cpp
        reuses a sliding layer's cells once no later token attends to them); recurrent never."""
        own = own_state(state)
        if self._recurrent:
            return own.n_tokens == 0
        # A throwaway row one past the end (binding.Context.decode) reached one cell further.
        reach = own.high_water + int(self._context.pads_lone_rows)
        return self._n_swa == 0 or reach < self._n_swa

    def copy_state(
        self, state: SequenceState, length: int, snapshot: Snapshot | None = None, *, reach: int = 0
    ) -> LlamaState:
        return self._restore(own_state(state), length, snapshot, reach, in_place=False)

    def take_state(
        self, state: SequenceState, length: int, snapshot: Snapshot | None = None, *, reach: int = 0
    ) -> LlamaState:
        """``state`` itself cut back to ``length`` or ``reach``: no copy of its cells (cuts.py)."""
        return self._restore(own_state(state), length, snapshot, reach, in_place=True)

    def _restore(
        self, source: LlamaState, n: int, snapshot: Snapshot | None, reach: int, *, in_place: bool
    ) -> LlamaState:
        trimmable, cell = self.can_trim(source), self.info.window_bytes_per_token
        return self._cuts.restore(
            source, n, snapshot, reach, trimmable=trimmable, cell=cell, in_place=in_place
        )

    def snapshot(self, state: SequenceState) -> LlamaSnapshot:
        """The sliding-window or recurrent cells at the state's length (empty: none)."""
        own = own_state(state)
        if not self._partial or own.n_tokens == 0:
            return LlamaSnapshot(b"", own.n_tokens)
        seq = self._pool.resident(own)
        return LlamaSnapshot(self._context.get_seq_data(seq, PARTIAL_ONLY), own.n_tokens)

    def state_nbytes(self, state: SequenceState) -> int:
        own = own_state(state)
        if own.seq is None and own.spilled is not None:
            return len(own.spilled)
        return self.info.kv_bytes(own.n_tokens)

    # ------------------------------------------------------------------ prefill

    def prefill(
        self,
        state: SequenceState,
        token_ids: Sequence[int],
        *,
        logits: bool = True,
        snapshot_at: Sequence[int] = (),
        stop: threading.Event | None = None,
    ) -> list[LlamaSnapshot]:
        own = own_state(state)
        if not token_ids:
            return []
        self._pool.reclaim()
        ids, start = list(token_ids), own.n_tokens
        end = start + len(ids)
        if any(not start < p <= end for p in snapshot_at):
            raise ValueError(f"snapshot points {list(snapshot_at)} outside ({start}, {end}]")
        seq = self._pool.resident(own)
        # A snapshot of partial state is read between calls, so calls end at each point.
        cuts = sorted({*(snapshot_at if self._partial else ()), end})
        n_batch = self._context.n_batch
        calls = sum(-(-(b - a) // n_batch) for a, b in itertools.pairwise([start, *cuts]))
        # A call after the first may reuse sliding cells the state before this prefill needs,
        # and llama.cpp cannot take back even one interrupted call on a recurrent state: both
        # are undone from a copy taken first. Where the first call ends at a snapshot point, an
        # interrupted later call goes back to the last snapshot instead (PrefillInterrupted.kept)
        # and no copy is taken: it costs what a checkpoint does (Gemma 3 270M: 2-3 ms).
        first_end = min(cuts[0], start + n_batch)
        back_to_snapshot = self._partial and not self._recurrent and first_end in snapshot_at
        undone_by_copy = self._recurrent or (self._partial and calls > 1 and not back_to_snapshot)
        saved = self.snapshot(own) if stop is not None and undone_by_copy else None
        before = (own.logits, own.high_water)
        snapshots: list[LlamaSnapshot] = []
        out: list[mx.array] = []
        try:
            pos = start
            for cut in cuts:
                while pos < cut:
                    if stop is not None and stop.is_set():
                        raise PrefillInterrupted(
                            "the sequence was aborted between llama_decode calls"
                        )
                    upto = min(cut, pos + self._context.n_batch)
                    rows = [
                        Row(seq, p, ids[p - start], logits and p == end - 1)
                        for p in range(pos, upto)
                    ]
                    out = self._context.decode(rows, stop)
                    pos = upto
                    own.n_tokens, own.high_water = pos, max(own.high_water, pos)
                if cut in snapshot_at:
                    snapshots.append(self.snapshot(own))
        except PrefillInterrupted:
            # llama.cpp drops what the interrupted call added (not from a recurrent state); the
            # rest is undone here: the partial state put back first (copy_state says why), then
            # the cells past ``start`` (or the last snapshot's point) removed.
            back = snapshots[-1] if back_to_snapshot and snapshots else None
            undo, keep = (saved, start) if back is None else (back, back.n_tokens)
            data = b"" if undo is None else undo.data
            restored = not data or self._context.set_seq_data(data, seq, PARTIAL_ONLY)
            if not (restored and self._context.seq_rm(seq, keep, -1)):
                raise BackendError(
                    "llama.cpp could not undo an interrupted prefill; load the model again"
                ) from None
            own.n_tokens = keep
            own.logits, own.high_water = before[0] if back is None else None, max(before[1], keep)
            if back is not None:
                message = "the sequence was aborted; the prefill kept what it had snapshotted"
                raise PrefillInterrupted(message, keep - start, snapshots) from None
            raise
        own.logits = out[0] if logits else None
        snapshots += [LlamaSnapshot(b"", p) for p in snapshot_at if not self._partial]
        snapshots.sort(key=lambda s: s.n_tokens)
        return snapshots

    def prefill_together(
        self,
        states: Sequence[SequenceState],
        token_ids: Sequence[Sequence[int]],
        snapshot_at: Sequence[Sequence[int]] = (),
    ) -> list[list[LlamaSnapshot]]:
        """Every prompt's tokens as rows of shared ``llama_decode`` calls (each its own seq_id),
        keeping each one's last logits. Each prompt is cut at its snapshot points into
        segments; round k decodes every prompt's k-th segment, then snapshots those that end at
        a point (other sequences' rows never change a sequence's cells)."""
        owns = [own_state(s) for s in states]
        points = list(snapshot_at) or [[] for _ in token_ids]
        if len(points) != len(token_ids) or len(owns) != len(token_ids):
            raise ValueError("prefill_together takes one list of tokens and points per state")
        if any(len(ids) < 2 for ids in token_ids):
            raise ValueError("prefill_together takes 2 tokens or more per state")
        segments: list[list[tuple[int, int]]] = []
        for own, ids, at in zip(owns, token_ids, points, strict=True):
            start, end = own.n_tokens, own.n_tokens + len(ids)
            if any(not start < p <= end for p in at):
                raise ValueError(f"snapshot points {list(at)} outside ({start}, {end}]")
            cuts = [start, *sorted({*(at if self._partial else ()), end})]
            segments.append(list(itertools.pairwise(cuts)))
        # Equal rests: one pass, which needs one run of ids in increasing order (seqs.py).
        # Unequal: one pass each (ids decreasing), faster than llama.cpp's equal sub-passes.
        equal = len({len(ids) for ids in token_ids}) == 1  # measured: docs/models.md
        got = self._pool.resident_together(owns, one_run=equal)
        by_seq = sorted(zip(got, range(len(owns)), strict=True), reverse=not equal)
        taken: list[dict[int, LlamaSnapshot]] = [{} for _ in owns]
        for round_ in range(max(len(s) for s in segments)):
            rows: list[Row] = []
            owners: list[int] = []  # the state of each row that keeps logits
            for seq, index in by_seq:
                if round_ >= len(segments[index]):
                    continue
                begin, until = segments[index][round_]
                start = segments[index][0][0]  # the state's length before this call
                for pos in range(begin, until):
                    last = pos == segments[index][-1][1] - 1
                    rows.append(Row(seq, pos, token_ids[index][pos - start], last))
                    owners += [index] if last else []
            kept: list[mx.array] = []
            for begin in range(0, len(rows), self._context.n_batch):
                kept += self._context.decode(rows[begin : begin + self._context.n_batch])
            for index, row_logits in zip(owners, kept, strict=True):
                owns[index].logits = row_logits
            for index, own in enumerate(owns):
                if round_ < len(segments[index]):
                    own.n_tokens = segments[index][round_][1]
                    own.high_water = max(own.high_water, own.n_tokens)
                    if own.n_tokens in points[index]:
                        taken[index][own.n_tokens] = self.snapshot(own)
        return [
            [taken[i].get(p) or LlamaSnapshot(b"", p) for p in at] for i, at in enumerate(points)
        ]

    def logits(self, state: SequenceState) -> mx.array:
        own = own_state(state)
        if own.logits is None:
            raise RuntimeError("logits() before any prefill")
        return own.logits

    # ------------------------------------------------------------------ decode

    @property
    def pipelined(self) -> bool:
        return False  # llama_decode computes before it returns: no graph to build ahead

    @property
    def queues_steps(self) -> bool:
        return True  # the next step starts as this one ends, not when the loop has seen it

    @property
    def decode_block(self) -> int:
        return self._decode_block

    def feed(self, state: SequenceState, token: mx.array) -> mx.array:
        own = own_state(state)
        self._pool.reclaim()
        seq = self._pool.resident(own)
        fed = int(token.astype(mx.int32).item())  # type: ignore[arg-type]
        row = Row(seq, own.n_tokens, fed, True)
        (logits,) = self._context.decode([row])
        own.n_tokens += 1
        own.high_water = max(own.high_water, own.n_tokens)
        own.logits = logits
        return logits

    def open_batch(self) -> DecodeBatchHandle | None:
        from runtime.backends.llamacpp.batch import LlamaDecodeBatch

        return LlamaDecodeBatch(self._context, self._pool)

    def verify(self, state: SequenceState, token_ids: Sequence[int]) -> mx.array:
        raise NotImplementedError(_NO_SPECULATION)

    def rewind(self, state: SequenceState, keep: int) -> None:
        raise NotImplementedError(_NO_SPECULATION)

    def draft(self, state: SequenceState, token_ids: Sequence[int], n: int) -> list[int]:
        raise NotImplementedError(_NO_SPECULATION)

    def vocabulary(self) -> list[str]:
        raise NotImplementedError(_NO_SPECULATION)  # asked only of a model that verifies

    def deferred_probe(self) -> None:
        return None  # nothing is left to probe after a llama.cpp load

    def tidy(self) -> bool:
        """Move the least recently used idle state to host memory while fewer than
        ``SPARE_SEQS`` seq_ids are free, so the next request's sequence or copy finds one
        without paying that move on its way to its first token (a 1,970-token SmolLM2 state:
        ~20 ms, mostly fresh host memory's page faults, against 3 ms for its tokens); then grow
        the copy buffer to the largest resident state, for the same page faults."""
        self._pool.reclaim()
        return self._pool.make_spare(SPARE_SEQS) or self._pool.ready_copy_buffer()

    def constraint_engine(self) -> ConstraintEngine:
        if self._constraints is None:
            self._constraints = ConstraintEngine(self._tokenizer, self.info.eos_token_ids)
        return self._constraints

    def close(self) -> None:
        """Free the context and the model."""
        if self._constraints is not None:
            self._constraints.close()
            self._constraints = None
        self._context.close()
