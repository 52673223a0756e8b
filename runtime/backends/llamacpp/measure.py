"""What a llama.cpp load measures on the model it loaded: the cache layout, read off real
sequence states, the reuse strategy that layout allows, and the fixed cost of a pass.

The engine's reuse, budget and chunking decisions all start from this ``ModelInfo``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Protocol

from runtime.backends.contract import Backend, ModelInfo, ReuseStrategy
from runtime.backends.llamacpp.binding import PARTIAL_ONLY, Context
from runtime.backends.llamacpp.seqs import SeqPool, own_state
from runtime.backends.mlx.facts import effective_eos_ids
from runtime.backends.options import LlamaCppOptions
from runtime.text.chat import has_chat_template


class Loaded(Backend, Protocol):
    """The backend measuring reads (``LlamaCppBackend``, which imports this module: a protocol,
    not that class, so the two do not import each other): the contract and its llama.cpp parts."""

    path: Path

    @property
    def context(self) -> Context: ...

    @property
    def pool(self) -> SeqPool: ...


_TIMED_PASSES = 8  # the fastest of these is the fixed cost of a pass (noise only adds to it)


def measure_model(
    backend: Loaded,
    options: LlamaCppOptions,
    facts: dict[str, Any],
    *,
    n_swa: int,
    recurrent: bool,
) -> ModelInfo:
    """Read the cache layout off real sequence states, and time a one-token pass. ``n_swa`` and
    ``recurrent``: the cache kind, as the backend read it off the model at construction."""
    ctx = backend.context
    state = own_state(backend.new_state())
    sizes = {}
    for n in (1, 2):
        backend.prefill(state, [0] * (n - state.n_tokens), logits=False)
        seq = backend.pool.resident(state)
        sizes[n] = (ctx.seq_size(seq), ctx.seq_size(seq, PARTIAL_ONLY))
    per_token = sizes[2][0] - sizes[1][0]
    partial_per_token = sizes[2][1] - sizes[1][1]
    pass_s = min(_timed_pass(backend) for _ in range(_TIMED_PASSES))
    # An abort lands between graph nodes: as many chances per pass as the graph has nodes.
    asked = ctx.abort_checks
    backend.prefill(backend.new_state(), [0], logits=False, stop=threading.Event())
    stop_checks = max(ctx.model_int("n_layer"), ctx.abort_checks - asked)
    context = ctx.n_ctx_seq
    if recurrent:
        reuse, reason = (
            ReuseStrategy.CHECKPOINT,
            (
                "a recurrent state cannot be cut back (llama_memory_seq_rm refuses part of a "
                "sequence): reuse restores snapshots of its state"
            ),
        )
    elif n_swa:
        reuse, reason = (
            ReuseStrategy.CHECKPOINT,
            (
                f"sliding-window layers ({n_swa} tokens) reuse cells that leave the "
                "window: checkpoints snapshot only those layers "
                "(llama_state_seq_get_data_ext) and cut the full-attention layers back from "
                "the state they came from"
            ),
        )
    else:
        reuse, reason = (
            ReuseStrategy.TRIM,
            ("every layer is full attention: trim to the common prefix (llama_memory_seq_rm)"),
        )
    tokenizer = backend.chat_tokenizer
    eos = effective_eos_ids(tokenizer, backend.path, {"eos_token_id": facts.get("eos_token_id")})
    return ModelInfo(
        context_length=context,
        vocab_size=ctx.n_vocab,
        eos_token_ids=eos,
        reuse=reuse,
        reuse_reason=reason,
        bytes_per_token=per_token - (partial_per_token if n_swa else 0),
        window_tokens=n_swa or None,
        window_bytes_per_token=partial_per_token if n_swa else 0,
        # What does not grow with the sequence: the recurrent state and the headers.
        fixed_state_bytes=sizes[1][0] - per_token if recurrent else 0,
        # As can_trim reads it: the exact-reuse throwaway row reaches one cell further.
        trims_below=0 if recurrent else max(n_swa - int(ctx.pads_lone_rows), 0),
        pass_s=pass_s,
        stop_checks=stop_checks,
        together_snapshot_tokens=context,
        chat_template=has_chat_template(tokenizer),
        verifies=False,  # no verification pass yet: requests decode one token per pass
        take_tail_tokens=options.take_tail_tokens,
    )


def _timed_pass(backend: Loaded) -> float:
    state = backend.new_state()  # dropped after: its seq_id goes back to the pool
    start = time.perf_counter()
    backend.prefill(state, [0], logits=False)
    return time.perf_counter() - start
