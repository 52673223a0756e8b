"""DRY ("don't repeat yourself"): the penalty on tokens that would extend a repeated run.

A token that continued an earlier occurrence of the history's latest tokens is penalised, more
the longer the repeat, unless a sequence breaker (a token whose text holds one of
``dry_sequence_breakers``) ends it. ``sequence_breaker_ids`` scans the vocabulary once per
tokenizer; ``dry_penalties`` runs per step on the penalty window. The sampler subtracts the
penalties from the logits (sampling.py).

The definition and its parameters: docs/sampling.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from runtime.messages import Sampling

# DRY measures a repeated suffix at most this many tokens beyond ``dry_allowed_length``: it bounds
# the per-step work (window x this) and the exponent; longer repeats get the same penalty.
_DRY_MAX_EXTRA = 50
# A DRY penalty is clamped here so it stays finite in float32 (the token is banned in effect).
_DRY_MAX_PENALTY = 1e9


@functools.lru_cache(maxsize=8)
def sequence_breaker_ids(
    decode_token: Callable[[int], str], vocab_size: int, breakers: tuple[str, ...]
) -> frozenset[int]:
    """Token ids whose text contains any of ``breakers``: one scan of the vocabulary.

    Cached per ``(decode_token, vocab_size, breakers)``: pass a stable callable (such as a
    tokenizer's bound method, which compares equal across accesses) so sequences share the scan.
    Ids the tokenizer cannot decode (padding rows of the embedding) are not breakers.
    """
    needles = tuple(b for b in breakers if b)
    if not needles:
        return frozenset()
    found = set()
    for token_id in range(vocab_size):
        try:
            text = decode_token(token_id)
        except Exception:  # tokenizers raise assorted errors for ids past their vocabulary
            continue
        if any(needle in text for needle in needles):
            found.add(token_id)
    return frozenset(found)


def dry_penalties(
    sampling: Sampling, breakers: frozenset[int], vocab_size: int, window: Sequence[int]
) -> dict[int, float]:
    """DRY: ``{token: amount to subtract}`` for the tokens that would extend a repetition.

    ``window`` is the penalty window of the history (its last token is the newest); ``breakers``
    are ``sequence_breaker_ids``'s.
    """
    s = sampling
    n = len(window)
    if n < 2 or window[-1] in breakers:
        return {}
    last = window[-1]
    cap = s.dry_allowed_length + _DRY_MAX_EXTRA
    longest: dict[int, int] = {}
    for i in range(n - 1):
        if window[i] != last:
            continue
        following = window[i + 1]
        if following in breakers or not 0 <= following < vocab_size:
            continue
        length = 1  # window[i] == last already
        while length < cap:
            j = i - length
            if j < 0:
                break
            previous = window[n - 1 - length]
            if window[j] != previous or previous in breakers:
                break
            length += 1
        if length > longest.get(following, 0):
            longest[following] = length
    penalties: dict[int, float] = {}
    log_limit = math.log(_DRY_MAX_PENALTY)
    for token, length in longest.items():
        if length < s.dry_allowed_length:
            continue
        exponent = length - s.dry_allowed_length
        log_amount = math.log(s.dry_multiplier) + exponent * math.log(s.dry_base)
        penalties[token] = (
            _DRY_MAX_PENALTY if log_amount >= log_limit else s.dry_multiplier * s.dry_base**exponent
        )
    return penalties
