"""Several fresh prompts prefilled in one batched pass, each into its own sequence state.

A pass over B rows reads every weight once, so on a CPU (and on a GPU with a small model) a padded
batch of prompts costs each one less than its own pass: measured ~0.8x per 64-token prompt in a
batch of 8 on SmolLM2-135M and Gemma 3 270M (scripts/batched_prefill_gain.py). This is mlx-lm's
own batch prompt processing (``PromptProcessingBatch.prompt`` in ``mlx_lm.generate``): the empty
per-sequence caches are merged into batch caches, the prompts right-padded (``prepare`` masks the
padding; ``finalize`` rolls it to the left, where the batch caches keep it), then the last tokens
go as one more pass (as mlx-lm's generate always runs the last prompt token apart) and each row is
extracted into an ordinary per-sequence cache again. Every cache kind mlx-lm batches works: full
attention, sliding windows, recurrent state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from runtime.backends.mlx.state import MlxState


def prefill_together(
    model: Any, states: Sequence[MlxState], prompts: Sequence[Sequence[int]]
) -> None:
    """Prefill each empty state in ``states`` with its prompt (at least 2 tokens), keeping the
    logits after its last token. Raises ``ValueError`` for a state that is not empty."""
    if len(states) != len(prompts):
        raise ValueError("one prompt per state")
    if any(s.n_tokens for s in states) or any(len(p) < 2 for p in prompts):
        raise ValueError("prefill_together takes empty states and prompts of 2 tokens or more")
    layers = len(states[0].caches)
    batch = [states[0].caches[i].merge([s.caches[i] for s in states]) for i in range(layers)]
    heads = [list(p[:-1]) for p in prompts]
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
    last = mx.array([[p[-1]] for p in prompts])
    logits = model(last, cache=batch)[:, -1].astype(mx.float32)
    for row, (state, prompt) in enumerate(zip(states, prompts, strict=True)):
        state.caches = [layer.extract(row) for layer in batch]
        state.n_tokens = len(prompt)
        state.logits = logits[row]
    mx.eval([c.state for s in states for c in s.caches], [s.logits for s in states])
