"""Per-sequence token sampling: logits processors, truncation filters, and log-probabilities.

A ``TokenSampler`` is built once per sequence from its ``Sampling`` and asked, once per step, for
the next token given the last logits and the token history. One object per sequence makes a seeded
request repeat exactly (one ``rng``) and serves every path. The order follows llama.cpp and mlx-lm:
processors (bias, penalties, DRY), the constraint's mask, then argmax at temperature 0 or the
truncation filters (truncation.py) and temperature. Log-probabilities are taken before the filters.
``draw`` builds the pick lazily (a ``Draw``) so the next model step can be queued first.

DRY is dry.py. The order, each filter's definition and the logprobs rule: docs/sampling.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import mlx.core as mx
import msgspec
import numpy as np
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

from runtime.errors import InvalidRequest
from runtime.messages import Sampling
from runtime.text.dry import dry_penalties, sequence_breaker_ids
from runtime.text.truncation import truncate

if TYPE_CHECKING:
    from runtime.text.constraints import TokenMatcher

__all__ = ["Draw", "SampleResult", "TokenSampler", "sequence_breaker_ids"]

_NEG_INF = float("-inf")

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class SampleResult(msgspec.Struct, frozen=True):
    """One sampled token, with its log-probability and the top alternatives when asked for.

    ``logprob`` is None unless ``Sampling.logprobs``; ``top_logprobs`` holds
    ``Sampling.top_logprobs`` ``(token_id, logprob)`` pairs, most likely first (empty if 0).
    """

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Draw:
    """A token picked on the device and not read yet: its arrays (the token, and its
    log-probability and top alternatives when asked for) are evaluated by ``read``.

    ``token`` is a scalar array a model step can be fed before it is read. A draw made on the host
    (a greedy pick read off computed logits, ``TokenSampler.draw``) holds its token id already.
    """

    __slots__ = ("_logprob", "_token", "_top")

    def __init__(
        self,
        token: mx.array | int,
        logprob: mx.array | None = None,
        top: tuple[mx.array, mx.array] | None = None,
    ) -> None:
        self._token = token
        self._logprob = logprob
        self._top = top

    @property
    def token(self) -> mx.array:
        if isinstance(self._token, int):
            return mx.array(self._token, dtype=mx.int32)
        return self._token

    @property
    def arrays(self) -> list[mx.array]:
        """What ``read`` evaluates (pass to ``mx.async_eval`` to start it early)."""
        extra = [] if self._logprob is None else [self._logprob]
        return [self.token, *extra, *(self._top or ())]

    def start(self) -> None:
        """Start computing the draw on the device without waiting for it."""
        if not isinstance(self._token, int):  # a token picked on the host needs no MLX
            mx.async_eval(self.arrays)  # type: ignore[no-untyped-call]

    def read(self) -> SampleResult:
        """Wait for the draw and return it as host values."""
        if isinstance(self._token, int):
            return SampleResult(token=self._token)
        mx.eval(self.arrays)
        chosen = int(cast(int, self._token.item()))
        logprob = None if self._logprob is None else float(cast(float, self._logprob.item()))
        top: tuple[tuple[int, float], ...] = ()
        if self._top is not None:
            ids: list[int] = self._top[0].tolist()  # type: ignore[assignment]
            values: list[float] = self._top[1].tolist()  # type: ignore[assignment]
            top = tuple(sorted(zip(ids, values, strict=True), key=lambda p: (-p[1], p[0])))
        return SampleResult(token=chosen, logprob=logprob, top_logprobs=top)


class TokenSampler:
    """Picks a sequence's tokens under one ``Sampling``; built once per sequence, not thread-safe.

    ``vocab_size`` is the length of the logits vector. ``decode_token`` maps one token id to its
    text; it is used only at construction, and only when DRY is on, to find the token ids of
    ``dry_sequence_breakers``. Raises ``InvalidRequest`` if ``logit_bias`` names a token outside
    the vocabulary. The ``Sampling`` itself is assumed to have passed ``validate_sampling``.
    """

    def __init__(
        self,
        sampling: Sampling,
        vocab_size: int,
        decode_token: Callable[[int], str],
        matcher: TokenMatcher | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive (got {vocab_size})")
        self.sampling = sampling
        self.vocab_size = vocab_size
        # The constraint's grammar state (Sampling.constraint): the caller advances and releases it.
        self.matcher = matcher

        self._bias: tuple[mx.array, mx.array] | None = None
        if sampling.logit_bias:
            outside = sorted(t for t in sampling.logit_bias if not 0 <= t < vocab_size)
            if outside:
                raise InvalidRequest(
                    f"logit_bias names token ids outside the model's vocabulary of {vocab_size} "
                    f"(ids 0 to {vocab_size - 1}): {outside[:5]}; remove them"
                )
            ids = list(sampling.logit_bias)
            self._bias = (
                mx.array(ids, dtype=mx.int32),
                mx.array([sampling.logit_bias[t] for t in ids], dtype=mx.float32),
            )

        self._penalties: list[LogitsProcessor] = []
        n = sampling.penalty_context
        if n > 0:
            if sampling.repetition_penalty != 1.0:
                self._penalties.append(make_repetition_penalty(sampling.repetition_penalty, n))
            if sampling.presence_penalty != 0.0:
                self._penalties.append(make_presence_penalty(sampling.presence_penalty, n))
            if sampling.frequency_penalty != 0.0:
                self._penalties.append(make_frequency_penalty(sampling.frequency_penalty, n))

        self._dry = n > 0 and sampling.dry_multiplier > 0.0
        self._breakers: frozenset[int] = frozenset()
        if self._dry and sampling.dry_sequence_breakers:
            self._breakers = sequence_breaker_ids(
                decode_token, vocab_size, tuple(sampling.dry_sequence_breakers)
            )
        # Greedy with nothing to change the logits or report about them: the pick is their argmax.
        self._plain_argmax = (
            self.greedy
            and self._bias is None
            and not self._penalties
            and not self._dry
            and matcher is None
            and not sampling.logprobs
            and sampling.top_logprobs == 0
        )

    @property
    def plain_argmax(self) -> bool:
        """Whether the pick is the logits' argmax as they come (greedy, with nothing to change
        them or report about them): a backend may then give the token instead of the logits."""
        return self._plain_argmax

    @property
    def greedy(self) -> bool:
        """True when this sampler takes the argmax (temperature 0) and never uses its ``rng``."""
        return self.sampling.temperature == 0.0

    @property
    def needs_read_history(self) -> bool:
        """Whether every token of the history must be read first (DRY scans it on the host; a
        constraint's next mask depends on it), so the next token cannot be drawn after an unread
        ``fed`` one."""
        return self._dry or self.matcher is not None

    # ------------------------------------------------------------------ pipeline stages

    def _check_shape(self, logits: mx.array) -> None:
        """``ValueError`` unless ``logits`` is the ``(vocab_size,)`` vector of one position."""
        if logits.shape != (self.vocab_size,):
            raise ValueError(
                f"expected logits of shape ({self.vocab_size},), got {tuple(logits.shape)}"
            )

    def process(
        self, logits: mx.array, history: Sequence[int], fed: mx.array | None = None
    ) -> mx.array:
        """Logit bias, then repetition/presence/frequency penalties, then DRY; returns new logits.

        ``logits`` is the ``(vocab_size,)`` vector of the last position; it is not modified.
        ``fed`` is the history's last token when it is still an unread draw (``history`` then
        holds the tokens before it); raises ``ValueError`` if DRY is on, which needs it read.
        """
        self._check_shape(logits)
        out = logits.astype(mx.float32)
        if self._bias is not None:
            ids, values = self._bias
            out = out.at[ids].add(values)
        n = self.sampling.penalty_context
        if n <= 0 or not (history or fed is not None):
            return out
        if fed is not None and self._dry:
            raise ValueError("DRY reads the history on the host: read the fed token first")
        known = n if fed is None else n - 1  # a fed token takes the window's last place
        window = list(history[max(0, len(history) - known) :]) if known > 0 else []
        if self._penalties:
            in_vocab = [t for t in window if 0 <= t < self.vocab_size]
            if in_vocab or fed is not None:
                tokens = mx.array(in_vocab, dtype=mx.int32)
                if fed is not None:  # drawn from these logits' vocabulary, so always in it
                    tokens = mx.concatenate([tokens, fed.astype(mx.int32).reshape(1)])
                rows = out[None]  # mlx-lm's processors take (batch, vocab) and may write in place
                for penalty in self._penalties:
                    rows = penalty(tokens, rows)
                out = rows[0]
        if self._dry:
            penalties = self.dry_penalties(window)
            if penalties:
                ids_ = mx.array(list(penalties), dtype=mx.int32)
                amounts = mx.array(list(penalties.values()), dtype=mx.float32)
                out = out.at[ids_].subtract(amounts)
        return out

    def dry_penalties(self, window: Sequence[int]) -> dict[int, float]:
        """DRY: ``{token: amount to subtract}`` for the tokens that would extend a repetition
        (dry.py); ``window`` is the penalty window of the history, newest last."""
        return dry_penalties(self.sampling, self._breakers, self.vocab_size, window)

    def truncate(self, logprobs: mx.array, rng: random.Random) -> mx.array:
        """The truncation filters on log-probabilities (truncation.py); removed tokens get -inf."""
        return truncate(self.sampling, self.vocab_size, logprobs, rng)

    # ------------------------------------------------------------------ the step

    def sample(self, logits: mx.array, history: Sequence[int], rng: random.Random) -> SampleResult:
        """The next token for ``logits`` (the last position's, shape ``(vocab_size,)``).

        ``history`` is the prompt plus the tokens generated so far; ``rng`` is the sequence's own
        generator (seeded from ``Sampling.seed`` for reproducible output).
        """
        return self.draw(logits, history, rng).read()

    def draw(
        self,
        logits: mx.array,
        history: Sequence[int],
        rng: random.Random,
        fed: mx.array | None = None,
        *,
        computed: bool = False,
    ) -> Draw:
        """``sample`` without the wait: the pick as unevaluated arrays (see ``Draw``).

        ``fed``: the history's last token, still an unread draw (see ``process``). The host's
        ``rng`` is drawn from now, so draws made in step order give ``sample``'s tokens.
        ``computed``: ``logits`` hold their values already (a backend that is not pipelined); a
        plain greedy pick (no bias, penalty, DRY, constraint or logprobs) is then numpy's argmax
        of them, made at once (the same token: both take the first of equal maxima), without an
        MLX graph and the hand-off to MLX's thread.
        """
        if computed and fed is None and self._plain_argmax and logits.dtype == mx.float32:
            self._check_shape(logits)
            return Draw(int(np.argmax(np.asarray(logits))))
        s = self.sampling
        if fed is not None and self.matcher is not None:
            raise ValueError("a constraint's mask follows the last token: read the fed one first")
        processed = self.process(logits, history, fed)
        if self.matcher is not None:
            processed = self.matcher.apply(processed)
        want_lp = s.logprobs
        k = min(s.top_logprobs, self.vocab_size)
        logprobs: mx.array | None = None
        if self.greedy:
            token = mx.argmax(processed)
            if want_lp or k > 0:
                logprobs = processed - mx.logsumexp(processed, keepdims=True)
        else:
            # Every filter but top-p (which exponentiates) and the categorical draw are unchanged
            # by a constant shift, so normalising is skipped when nothing needs it.
            if want_lp or k > 0 or 0.0 < s.top_p < 1.0:
                logprobs = processed - mx.logsumexp(processed, keepdims=True)
            kept = self.truncate(processed if logprobs is None else logprobs, rng)
            key = mx.random.key(rng.getrandbits(32))
            token = mx.random.categorical(kept * (1.0 / s.temperature), key=key)

        chosen = None if logprobs is None or not want_lp else mx.take(logprobs, token)
        top = None
        if logprobs is not None and k > 0:
            top_ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
            top = (top_ids, mx.take(logprobs, top_ids))
        return Draw(token, chosen, top)

    def judge(
        self, logits: mx.array, history: Sequence[int], rng: random.Random, draft: int
    ) -> SampleResult:
        """The token at a position where ``draft`` was proposed (speculative decoding), read.

        Greedy: the argmax, as ``draw`` picks it (the draft is accepted when they agree). Else the
        standard rule for a draft that is certain (prompt lookup): accept it with probability
        ``p(draft)`` under the distribution ``draw`` would sample from (processors, constraint,
        filters, temperature), else sample from that distribution with the draft removed and the
        rest renormalised. Either way the token has exactly ``draw``'s distribution.
        """
        s = self.sampling
        if self.greedy:
            return self.draw(logits, history, rng).read()
        processed = self.process(logits, history)
        if self.matcher is not None:
            processed = self.matcher.apply(processed)
        logprobs = processed - mx.logsumexp(processed, keepdims=True)
        kept = self.truncate(logprobs, rng) * (1.0 / s.temperature)
        accept = rng.random()
        key = mx.random.key(rng.getrandbits(32))
        p_draft = mx.softmax(kept)[draft]
        residual = mx.where(mx.arange(kept.shape[0]) == draft, _NEG_INF, kept)
        token = mx.where(
            p_draft > accept, mx.array(draft), mx.random.categorical(residual, key=key)
        )
        k = min(s.top_logprobs, self.vocab_size)
        chosen = mx.take(logprobs, token) if s.logprobs else None
        top = None
        if k > 0:
            top_ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
            top = (top_ids, mx.take(logprobs, top_ids))
        return Draw(token, chosen, top).read()
