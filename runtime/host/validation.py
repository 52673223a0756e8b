"""Input validation at the edge: a malformed request raises ``InvalidRequest`` before any work."""

from __future__ import annotations

import math
from typing import TypeGuard

from runtime.errors import InvalidRequest
from runtime.messages import GENERATE_ONLY, PREWARM_ONLY, Generate, Prewarm, Request, Sampling

MAX_ID_LENGTH = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1000  # each is held back from the stream until it cannot match
MAX_STOP_TOKEN_IDS = 1024
# Integers cross the wire as msgpack int64 (docs/protocols.md); seeds take OpenAI's range.
MAX_WIRE_INT = 2**63 - 1
MIN_WIRE_INT = -(2**63)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: object) -> bool:
    return _is_int(value) and 0 <= value <= MAX_WIRE_INT


def validate_request(message: Generate | Prewarm) -> None:
    """Raise ``InvalidRequest`` with a sentence saying what to change."""
    if not message.request_id or len(message.request_id) > MAX_ID_LENGTH:
        raise InvalidRequest(f"request_id must be 1 to {MAX_ID_LENGTH} characters")
    request = message.request
    _validate_kind(request, prewarm=isinstance(message, Prewarm))
    if not request.model:
        raise InvalidRequest("model must name a loaded model")
    if not request.namespace:
        raise InvalidRequest("namespace must be a non-empty string (default: 'default')")
    given = [x is not None for x in (request.prompt, request.prompt_tokens, request.messages)]
    if sum(given) != 1:
        raise InvalidRequest(
            "give exactly one of prompt (text), prompt_tokens (token ids) and messages (chat)"
        )
    if request.messages is not None and not request.messages:
        raise InvalidRequest("messages is empty; send at least one chat message")
    if request.prompt is not None and not isinstance(request.prompt, str):
        kind = type(request.prompt).__name__
        raise InvalidRequest(f"prompt must be text, not {kind}; pass token ids as prompt_tokens")
    if request.prompt is not None and not request.prompt:
        raise InvalidRequest("prompt is empty; send at least one character")
    if request.prompt_tokens is not None:
        if not request.prompt_tokens:
            raise InvalidRequest("prompt_tokens is empty; send at least one token id")
        if not all(_is_token_id(t) for t in request.prompt_tokens):
            raise InvalidRequest(
                "prompt_tokens must be token ids (integers 0 or more); "
                "to send text, pass it as prompt"
            )
    _validate_max_tokens(request.max_tokens)
    validate_timeouts(request)
    if request.keep_alive_s is not None:
        keep = request.keep_alive_s
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not keep >= 0:
            raise InvalidRequest(
                f"keep_alive_s must be 0 or more seconds (math.inf: never unload; got {keep!r})"
            )
    _validate_stops(request.stop, request.stop_token_ids)
    validate_sampling(request.sampling)


_DEFAULTS = Request(model="")


def _validate_kind(request: Request, *, prewarm: bool) -> None:
    """A field the request's kind does not use must keep its default: never dropped silently."""
    unused = GENERATE_ONLY if prewarm else PREWARM_ONLY
    for name in unused:
        if getattr(request, name) != getattr(_DEFAULTS, name):
            kind, other = ("a prewarm", "a generate") if prewarm else ("a generate", "a prewarm")
            raise InvalidRequest(f"{name} has no effect on {kind} (it is {other}'s); leave it out")


def _validate_max_tokens(max_tokens: object) -> None:
    if max_tokens is None:
        return
    if not _is_int(max_tokens):
        raise InvalidRequest(f"max_tokens must be a whole number of tokens (got {max_tokens!r})")
    if max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1 (got {max_tokens})")
    if max_tokens > MAX_WIRE_INT:  # past int64 it could not even travel as a message
        raise InvalidRequest(
            f"max_tokens must be at most the model's context length (got {max_tokens}); "
            "leave it out for the rest of the context"
        )


def _validate_stops(stop: tuple[object, ...], stop_token_ids: tuple[object, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(stop)}); "
            "keep the ones that matter"
        )
    if any(not isinstance(s, str) or not s for s in stop):
        raise InvalidRequest("stop strings must be non-empty strings; remove the empty one")
    longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise InvalidRequest(
            f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters "
            f"(one has {longest}); shorten it"
        )
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} are allowed (got {len(stop_token_ids)})"
        )
    if not all(_is_token_id(t) for t in stop_token_ids):
        raise InvalidRequest("stop_token_ids must be token ids (integers 0 or more)")


MAX_DRAFTS = 64  # Sampling.speculative: a pass over more drafts costs more than it could save


def validate_sampling(sampling: Sampling) -> None:
    """Refuse wrongly typed, NaN, infinite and out-of-range values, saying what to change."""
    s = sampling
    max_top_logprobs = 20
    max_logit_bias = 100.0
    # name, value, low, high, low inclusive, what is allowed (said to the person)
    ranges: tuple[tuple[str, object, float, float, bool, str], ...] = (
        ("temperature", s.temperature, 0.0, math.inf, True, "0 (greedy) or more"),
        ("top_p", s.top_p, 0.0, 1.0, False, "in (0, 1] (1 turns it off)"),
        ("min_p", s.min_p, 0.0, 1.0, True, "in [0, 1] (0 turns it off)"),
        ("typical_p", s.typical_p, 0.0, 1.0, False, "in (0, 1] (1 turns it off)"),
        ("top_n_sigma", s.top_n_sigma, 0.0, math.inf, True, "0 (off) or more"),
        ("xtc_probability", s.xtc_probability, 0.0, 1.0, True, "in [0, 1] (0 turns XTC off)"),
        (
            "xtc_threshold",
            s.xtc_threshold,
            0.0,
            0.5,
            True,
            "in [0, 0.5] (above 0.5 no two tokens can reach it, so XTC would never act)",
        ),
        ("dry_multiplier", s.dry_multiplier, 0.0, math.inf, True, "0 (DRY off) or more"),
        ("dry_base", s.dry_base, -math.inf, math.inf, True, "a finite number"),
        ("repetition_penalty", s.repetition_penalty, 0.0, math.inf, False, "above 0 (1 is off)"),
        ("presence_penalty", s.presence_penalty, -2.0, 2.0, True, "in [-2, 2] (0 is off)"),
        ("frequency_penalty", s.frequency_penalty, -2.0, 2.0, True, "in [-2, 2] (0 is off)"),
    )
    for name, value, low, high, low_inclusive, allowed in ranges:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"{name} must be a number {allowed} (got {value!r})")
        if not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number {allowed} (got {value})")
        above_low = low <= value if low_inclusive else low < value
        if not above_low or value > high:
            raise InvalidRequest(f"{name} must be {allowed} (got {value})")
    if s.dry_multiplier > 0 and not s.dry_base > 1.0:
        raise InvalidRequest(
            f"dry_base must be greater than 1 when DRY is on (dry_multiplier > 0); "
            f"got {s.dry_base} (the usual value is 1.75)"
        )

    # name, value, low, high, what is allowed
    integers: tuple[tuple[str, object, int, float, str], ...] = (
        ("top_k", s.top_k, 0, math.inf, "0 (off) or positive"),
        ("dry_allowed_length", s.dry_allowed_length, 1, math.inf, "1 or more (the usual is 2)"),
        ("penalty_context", s.penalty_context, 0, math.inf, "0 (penalties off) or more tokens"),
        ("top_logprobs", s.top_logprobs, 0, max_top_logprobs, f"0 to {max_top_logprobs}"),
    )
    if s.speculative is not None:
        integers += (("speculative", s.speculative, 0, MAX_DRAFTS, f"0 (off) to {MAX_DRAFTS}"),)
    for name, value, low, high, allowed in integers:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest(f"{name} must be an integer, {allowed} (got {value!r})")
        if not low <= value <= high:
            raise InvalidRequest(f"{name} must be {allowed} (got {value})")
    if not isinstance(s.logprobs, bool):
        raise InvalidRequest(f"logprobs must be true or false (got {s.logprobs!r})")
    if s.top_logprobs > 0 and not s.logprobs:
        raise InvalidRequest(
            f"top_logprobs={s.top_logprobs} needs logprobs=true; set logprobs or top_logprobs=0"
        )
    if s.seed is not None and (not _is_int(s.seed) or not MIN_WIRE_INT <= s.seed <= MAX_WIRE_INT):
        raise InvalidRequest(
            f"seed must be an integer from -2**63 to 2**63 - 1, or null for a random one "
            f"(got {s.seed!r})"
        )

    if not isinstance(s.dry_sequence_breakers, tuple | list) or not all(
        isinstance(b, str) and b for b in s.dry_sequence_breakers
    ):
        raise InvalidRequest(
            "dry_sequence_breakers must be a list of non-empty strings "
            f"(got {s.dry_sequence_breakers!r})"
        )

    if not isinstance(s.logit_bias, dict):
        raise InvalidRequest(f"logit_bias must map token ids to numbers (got {s.logit_bias!r})")
    for token, bias in s.logit_bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequest(
                f"logit_bias keys must be token ids (integers 0 or more); got {token!r}"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise InvalidRequest(
                f"logit_bias[{token}] must be a finite number in [-100, 100] (got {bias!r})"
            )
        if not -max_logit_bias <= bias <= max_logit_bias:
            raise InvalidRequest(
                f"logit_bias[{token}] must be in [-100, 100] (got {bias}); "
                "-100 bans a token, 100 all but forces it"
            )
    if s.constraint is not None:
        # Compiled without a tokenizer (about a millisecond for a typical schema), so a bad schema
        # or grammar gets its 400 before any work; the engine compiles it again per sequence.
        from runtime.text.constraints import grammar_of

        grammar_of(s.constraint)


def validate_timeouts(request: Request) -> None:
    """``timeout_s`` and ``stall_timeout_s``, when given, are positive finite seconds."""
    for name, value in (
        ("timeout_s", request.timeout_s),
        ("stall_timeout_s", request.stall_timeout_s),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"{name} must be a number of seconds (got {value!r})")
        if not math.isfinite(value) or value <= 0:
            absent = "no deadline" if name == "timeout_s" else "the runtime's default"
            raise InvalidRequest(
                f"{name} must be a positive, finite number of seconds (got {value!r}); "
                f"leave it out for {absent}"
            )
