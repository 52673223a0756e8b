"""The truncation filters: which tokens stay in play before the temperature draw.

Top-k, top-n-sigma, typical-p, top-p, min-p and XTC, in llama.cpp's order, each on
log-probabilities, setting a removed token's to -inf. They run only when a sequence samples
(temperature above 0); log-probabilities a client asks for are taken before them (sampling.py).

Each filter's definition: docs/sampling.md.
"""

from __future__ import annotations

import math
import random

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from runtime.messages import Sampling
from runtime.text.typical import apply_typical_p

_NEG_INF = float("-inf")


def truncate(
    sampling: Sampling, vocab_size: int, logprobs: mx.array, rng: random.Random
) -> mx.array:
    """Top-k, top-n-sigma, typical-p, top-p, min-p, XTC on log-probabilities; removed tokens
    get -inf.

    Only top-p needs them normalised; the others (typical-p normalises its own) accept
    logits shifted by any constant.

    Draws XTC's coin from ``rng`` (only when ``xtc_probability > 0``).
    """
    s = sampling
    lp = logprobs
    if 0 < s.top_k < vocab_size:
        lp = apply_top_k(lp, s.top_k)
    if s.top_n_sigma > 0.0:
        lp = _top_n_sigma(lp, s.top_n_sigma)
    if 0.0 < s.typical_p < 1.0:
        lp = apply_typical_p(lp, s.typical_p)
    if 0.0 < s.top_p < 1.0:
        lp = apply_top_p(lp, s.top_p)
    if s.min_p > 0.0:
        lp = apply_min_p(lp, s.min_p)
    if s.xtc_probability > 0.0 and rng.random() < s.xtc_probability:
        lp = _exclude_top_choices(lp, s.xtc_threshold)
    return lp


def _top_n_sigma(logprobs: mx.array, n: float) -> mx.array:
    """Keep tokens whose logit is within ``n`` standard deviations of the best one.

    Mean and (population) standard deviation are taken over the tokens still in play (finite);
    shifting every logit by a constant (as log-softmax does) changes nothing.
    """
    alive = mx.isfinite(logprobs)
    count = alive.sum()
    mean = mx.where(alive, logprobs, 0.0).sum() / count
    variance = mx.where(alive, mx.square(logprobs - mean), 0.0).sum() / count
    threshold = logprobs.max() - n * mx.sqrt(variance)
    return mx.where(logprobs >= threshold, logprobs, _NEG_INF)


def _exclude_top_choices(logprobs: mx.array, threshold: float) -> mx.array:
    """XTC: remove every token with probability ``>= threshold`` except the least probable one.

    Probabilities are renormalised over the tokens still in play; with fewer than two tokens at
    or over the threshold nothing changes.
    """
    probs = mx.softmax(logprobs)
    over = mx.logical_and(probs >= threshold, mx.isfinite(logprobs))
    least = mx.where(over, probs, math.inf).min()
    remove = mx.logical_and(over, probs > least)
    return mx.where(remove, _NEG_INF, logprobs)
