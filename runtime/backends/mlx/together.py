"""Several prompts prefilled in one batched pass, each into its own sequence state.

A pass over B rows reads every weight once, so on a CPU (and on a GPU with a small model) a padded
batch of prompts costs each one less than its own pass: measured ~0.8x per 64-token prompt in a
batch of 8 on SmolLM2-135M and Gemma 3 270M (scripts/batched_prefill_gain.py). This is mlx-lm's
own batch prompt processing (``PromptProcessingBatch.prompt`` in ``mlx_lm.generate``): the
per-sequence caches (empty, or holding a cached prefix) are merged into batch caches, the prompts
right-padded (``prepare`` masks the padding; ``finalize`` rolls it to the left, where the batch
caches keep it), then the last tokens go as one more pass (as mlx-lm's generate always runs the
last prompt token apart) and each row is extracted into an ordinary per-sequence cache again.
Every cache kind mlx-lm batches works: full attention, sliding windows, recurrent state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from runtime.backends.mlx.state import MlxState


def prefill_together(
    model: Any, states: Sequence[MlxState], token_ids: Sequence[Sequence[int]]
) -> None:
    """Extend each state in ``states`` with its ``token_ids`` (at least 2), keeping the logits
    after its last token. A state may hold a cached prefix already (of any length: ``merge`` pads
    the shorter ones on the left, as mlx-lm's ``BatchGenerator`` does with cached prompts)."""
    if len(states) != len(token_ids):
        raise ValueError("one list of token ids per state")
    if any(len(ids) < 2 for ids in token_ids):
        raise ValueError("prefill_together takes 2 tokens or more per state")
    layers = len(states[0].caches)
    batch = [states[0].caches[i].merge([s.caches[i] for s in states]) for i in range(layers)]
    heads = [list(ids[:-1]) for ids in token_ids]
    lengths = [len(h) for h in heads]
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    inputs = mx.array([h + [0] * (longest - len(h)) for h in heads])
    if any(padding):
        for layer in batch:
            layer.prepare(lengths=lengths, right_padding=padding)
    model(inputs, cache=batch)
    if any(padding):
        for layer in batch:
            layer.finalize()
    last = mx.array([[ids[-1]] for ids in token_ids])
    logits = model(last, cache=batch)[:, -1].astype(mx.float32)
    for row, (state, ids) in enumerate(zip(states, token_ids, strict=True)):
        state.caches = [layer.extract(row) for layer in batch]
        state.n_tokens += len(ids)
        state.logits = logits[row]
    mx.eval([c.state for s in states for c in s.caches], [s.logits for s in states])
