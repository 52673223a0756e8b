"""The one request builder the tests share: ``generate`` and ``prewarm`` messages of a model.

Tests name the request id, the prompt's tokens and (a generate's) ``max_tokens`` in that order;
everything else is a keyword: ``incarnation``, ``model`` and any ``Request`` field (a ``prompt``
or ``messages`` given instead of tokens replaces them). One builder, so that a change to the
request's shape (runtime/messages/request.py) is made once, here.
"""

from __future__ import annotations

from typing import Any

from runtime.messages import Generate, Prewarm, Request

DEFAULT_TOKENS = (1, 2, 3, 4)


def request(tokens: tuple[int, ...] | None = DEFAULT_TOKENS, **fields: Any) -> Request:
    """A ``Request`` of model ``"m"`` (unless ``model`` is given) for ``tokens``."""
    fields.setdefault("model", "m")
    if "prompt" not in fields and "messages" not in fields:
        fields.setdefault("prompt_tokens", tokens)
    return Request(**fields)


def generate(
    request_id: str = "a",
    tokens: tuple[int, ...] | None = DEFAULT_TOKENS,
    max_tokens: int | None = 4,
    *,
    incarnation: int = 1,
    **fields: Any,
) -> Generate:
    """A ``Generate`` of ``max_tokens`` tokens for ``tokens`` (fields: ``Request``'s)."""
    asked = request(tokens, max_tokens=max_tokens, **fields)
    return Generate(request_id=request_id, incarnation=incarnation, request=asked)


def prewarm(
    request_id: str = "w",
    tokens: tuple[int, ...] | None = DEFAULT_TOKENS,
    *,
    incarnation: int = 1,
    **fields: Any,
) -> Prewarm:
    """A ``Prewarm`` for ``tokens`` (fields: ``Request``'s a prewarm uses)."""
    return Prewarm(
        request_id=request_id, incarnation=incarnation, request=request(tokens, **fields)
    )
