"""The host API's typed keywords: ``Request``'s fields as ``**options``, and the one ``Request``.

``Runtime.generate``, ``complete`` and ``prewarm`` take a request's fields as keywords, typed here
so a caller's checker sees them. Python cannot derive a TypedDict from a Struct, so each list
repeats ``Request``'s fields (less ``model`` and ``prompt``, which are positional, and the other
kind's own fields) plus the documented extras; tests/test_host_options.py fails when they drift.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from runtime.messages import ChatMessage, ChatOptions, Request, Sampling
from runtime.text.coalesce import CoalescePolicy


class PrewarmOptions(TypedDict, total=False):
    """``Runtime.prewarm``'s keywords: ``Request``'s fields but ``GENERATE_ONLY``, and its id."""

    prompt_tokens: tuple[int, ...] | list[int] | None
    messages: Sequence[ChatMessage] | None
    chat: ChatOptions | None  # None: ChatOptions()
    max_tokens: int | None
    namespace: str
    session: str | None
    request_id: str | None  # None: a fresh one
    timeout_s: float | None
    anonymous: bool
    keep_on_disk: bool


class GenerateOptions(TypedDict, total=False):
    """``Runtime.generate``'s keywords: ``Request``'s fields but ``PREWARM_ONLY`` (a list may stand
    for a tuple), its id and the stream's ``coalesce`` policy (None: ``config.coalesce``)."""

    prompt_tokens: tuple[int, ...] | list[int] | None
    messages: Sequence[ChatMessage] | None
    chat: ChatOptions | None  # None: ChatOptions()
    max_tokens: int | None
    sampling: Sampling | None  # None: Sampling() (greedy)
    stop: tuple[str, ...] | list[str]
    stop_token_ids: tuple[int, ...] | list[int]
    ignore_eos: bool
    namespace: str
    session: str | None
    request_id: str | None  # None: a fresh one
    coalesce: CoalescePolicy | None
    supersede: bool
    timeout_s: float | None
    stall_timeout_s: float | None
    anonymous: bool
    reuse_prefix: bool
    keep_alive_s: float | None


# The keywords that are not ``Request`` fields: the message's id and the stream's policy.
EXTRAS = frozenset({"request_id", "coalesce"})
_TUPLES = frozenset({"prompt_tokens", "messages", "stop", "stop_token_ids"})


def request_of(model: str, prompt: str | None, options: Mapping[str, Any]) -> Request:
    """The keywords as one ``Request``: sequences held as tuples, None as the default options.
    An unknown keyword raises ``TypeError``, as for any function."""
    fields: dict[str, Any] = {
        name: tuple(value) if name in _TUPLES and value is not None else value
        for name, value in options.items()
        if name not in EXTRAS and not (name in ("chat", "sampling") and value is None)
    }
    return Request(model=model, prompt=prompt, **fields)
