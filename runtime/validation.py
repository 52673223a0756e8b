"""Input validation at the edge: a malformed request raises ``InvalidRequest`` before any work."""

from __future__ import annotations

import math

from runtime.errors import InvalidRequest
from runtime.messages import Generate, Prewarm, Sampling

MAX_ID_LENGTH = 256


def validate_request(request: Generate | Prewarm) -> None:
    """Raise ``InvalidRequest`` with a sentence saying what to change."""
    if not request.request_id or len(request.request_id) > MAX_ID_LENGTH:
        raise InvalidRequest(f"request_id must be 1 to {MAX_ID_LENGTH} characters")
    if not request.model:
        raise InvalidRequest("model must name a loaded model")
    if not request.namespace:
        raise InvalidRequest("namespace must be a non-empty string (default: 'default')")
    if (request.prompt is None) == (request.prompt_tokens is None):
        raise InvalidRequest("give exactly one of prompt (text) and prompt_tokens (token ids)")
    if request.prompt is not None and not request.prompt:
        raise InvalidRequest("the prompt is empty; send at least one character")
    if request.prompt_tokens is not None:
        if not request.prompt_tokens:
            raise InvalidRequest("prompt_tokens is empty; send at least one token id")
        if any(not isinstance(t, int) or t < 0 for t in request.prompt_tokens):
            raise InvalidRequest("prompt_tokens must be non-negative integers")
    if isinstance(request, Generate):
        if request.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1 (got {request.max_tokens})")
        validate_sampling(request.sampling)


def validate_sampling(sampling: Sampling) -> None:
    """Refuse NaN and out-of-range sampling values."""
    checks = (
        (sampling.temperature, 0.0, math.inf, "temperature", "0 (greedy) or more"),
        (sampling.top_p, 0.0, 1.0, "top_p", "in (0, 1]"),
        (sampling.min_p, 0.0, 1.0, "min_p", "in [0, 1]"),
    )
    for value, low, high, name, allowed in checks:
        if not math.isfinite(value) or not low <= value <= high:
            raise InvalidRequest(f"{name} must be {allowed} (got {value})")
    if sampling.top_p == 0.0:
        raise InvalidRequest("top_p must be in (0, 1] (got 0.0)")
    if sampling.top_k < 0:
        raise InvalidRequest(f"top_k must be 0 (off) or positive (got {sampling.top_k})")
