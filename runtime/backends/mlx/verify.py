"""Speculative verification on MLX: one pass over a token and its drafts, the rejected tail cut out.

``verify_pass`` runs the tokens as one multi-token pass and keeps every position's logits.
``rewind_pass`` cuts each layer back by the rejected tokens with its kind's ``rewind`` (full
attention lowers its offset, a sliding-window ring is cut short: no copy); a recurrent state holds
only its last step, so its layers go back to shallow copies taken before the pass and the kept
tokens run again. ``draft_pass`` is a draft model's side: it catches up with the sequence, then
decodes greedily in one lazy graph (no host round trip between drafts).

See docs/design.md, "Speculative decoding (prompt lookup)" and "with a draft model".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from runtime.backends.mlx.cache_kinds import kind_of
from runtime.backends.mlx.state import MlxState, Verified


def verify_pass(model: Any, own: MlxState, token_ids: Sequence[int]) -> mx.array:
    """``Backend.verify`` over ``model``'s caches in ``own``."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError("verify takes a token and at least one draft")
    before = [kind_of(c).undo_copy(c) for c in own.caches]
    start = own.n_tokens
    out = model(mx.array([ids]), cache=own.caches)
    logits: mx.array = out[0].astype(mx.float32)
    mx.eval(logits, [c.state for c in own.caches])
    own.n_tokens, own.logits = start + len(ids), logits[-1]
    own.verified = Verified(before, start, ids, logits)
    return logits


def draft_pass(model: Any, own: MlxState, token_ids: Sequence[int], n: int) -> list[int]:
    """``Backend.draft`` over ``model``'s caches in ``own``."""
    ids = list(token_ids)
    if not ids or n < 1:
        raise ValueError("draft takes a token to catch up with and one draft or more")
    if not all(kind_of(c).cut_back(c) for c in own.caches):
        raise ValueError("a draft model's layers must all cut back (full attention only)")
    before = [kind_of(c).undo_copy(c) for c in own.caches]
    start = own.n_tokens
    rows = [model(mx.array([ids]), cache=own.caches)[0, -1]]
    tokens = [mx.argmax(rows[-1])]
    for _ in range(n - 1):  # built lazily: MLX computes the whole chain in one evaluation
        rows.append(model(tokens[-1].reshape(1, 1), cache=own.caches)[0, -1])
        tokens.append(mx.argmax(rows[-1]))
    logits = mx.stack(rows).astype(mx.float32)
    mx.eval(tokens, logits, [c.state for c in own.caches])
    drafts: list[int] = mx.stack(tokens).tolist()  # type: ignore[assignment]
    fed = ids + drafts[:-1]
    own.n_tokens, own.logits = start + len(fed), logits[-1]
    own.verified = Verified(before, start, fed, logits, least=len(ids))
    return drafts


def rewind_pass(model: Any, own: MlxState, keep: int, *, cut: bool = True) -> bool:
    """``Backend.rewind``; ``cut`` False (the load probe found cutting back wrong) always runs
    the kept tokens again. Returns whether it did (the cost a recurrent layer brings)."""
    verified = own.verified
    if verified is None or not verified.least <= keep <= len(verified.token_ids):
        raise ValueError(f"rewind to {keep} tokens without a verify that fed as many")
    own.verified = None
    own.logits = verified.logits[keep - verified.least]
    drop = len(verified.token_ids) - keep
    if drop == 0:
        return False
    layers = [kind_of(c).rewind(c, drop) for c in own.caches] if cut else []
    if layers and all(c is not None for c in layers):
        own.caches[:] = layers
        own.n_tokens -= drop
        return False
    own.caches[:] = verified.before
    model(mx.array([verified.token_ids[:keep]]), cache=own.caches)
    mx.eval([c.state for c in own.caches])
    own.n_tokens = verified.start + keep
    return True
