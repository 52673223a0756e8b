"""Locally typical sampling (Meister et al. 2022, "Locally Typical Sampling"; llama.cpp's and
Hugging Face's ``typical_p``): keep the tokens whose information content (``-log p``) is closest
to the distribution's entropy, the fewest of them, in that order, whose probability adds up to
``typical_p``. It drops both the over-likely tokens that make text repetitive and the unlikely
tail. Kept apart from sampling.py, which runs it among its truncation filters (after
top-n-sigma, before top-p: llama.cpp's order).
"""

from __future__ import annotations

import mlx.core as mx

_NEG_INF = float("-inf")


def apply_typical_p(logprobs: mx.array, mass: float) -> mx.array:
    """``logprobs`` (one row, any constant shift) with every token outside the locally typical
    set of ``mass`` (in (0, 1)) set to -inf; tokens already at -inf stay out."""
    alive = mx.isfinite(logprobs)
    lp = logprobs - mx.logsumexp(logprobs, keepdims=True)  # renormalised over the survivors
    probs = mx.exp(lp)
    entropy = -mx.where(alive, probs * lp, 0.0).sum()
    distance = mx.where(alive, mx.abs(-lp - entropy), mx.inf)
    order = mx.argsort(distance)  # most typical first
    ordered = mx.take(probs, order)
    before = mx.cumsum(ordered) - ordered  # the mass of the more typical tokens
    keep_ordered = before < mass  # the first is always kept: nothing comes before it
    keep = mx.take(keep_ordered, mx.argsort(order))  # back to token order
    return mx.where(mx.logical_and(keep, alive), logprobs, _NEG_INF)
