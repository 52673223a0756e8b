"""What a request asks for, as one value: the HTTP server and the host API both build it, and the
``Generate`` / ``Prewarm`` messages carry it as is, to the engine's ``Sequence``.

One value means no layer copies a request's fields by hand: a new field is added here, filled in
at the edge that receives it (runtime/server/translate.py for HTTP) and read where it is honoured.
Fields that only a generate uses keep their defaults on a prewarm (validation refuses others).
See docs/design.md, "One request value".
"""

from __future__ import annotations

import msgspec

from runtime.messages.vocabulary import ChatMessage, ChatOptions, Sampling, TokenIds


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request: the prompt, how to sample it and the request's own options.

    Exactly one of ``prompt`` (text), ``prompt_tokens`` and ``messages`` (chat) is set.
    ``max_tokens`` None: the rest of the context, capped by the engine's default (a prewarm's is
    the generate's to come: chat windows then render the same). ``session`` groups requests that
    may supersede each other's prewarms (default: model plus namespace); with ``supersede`` a
    generate also aborts the session's older generates (a new keystroke).
    ``timeout_s``: the request ends ``Failed(request_timeout)`` that long after the router accepted
    it. ``stall_timeout_s``: it ends ``Failed(stream_stalled)`` when no token came for that long
    after its first (None: ``RuntimeConfig.stall_timeout_s``).
    ``anonymous``: the host cannot tell this request's client from others' (the HTTP server's
    requests without ``session``); it still adopts a prewarm of its session that it extends, but
    it never supersedes another request, and no request supersedes it.
    ``reuse_prefix`` False: prefill the whole prompt, restoring nothing (no prefix-cache lookup,
    no prewarm adopted); the state it leaves is still cached for later requests.
    ``keep_alive_s``: from this request on, the model's keep-alive (seconds idle before it is
    unloaded; ``math.inf``: never), as Ollama's per-request ``keep_alive``; None: unchanged.
    ``ignore_eos``: the model's end-of-sequence tokens do not end it (``stop_token_ids`` still do,
    and so does a constraint's end, which only EOS can follow): it runs to ``max_tokens``.
    ``keep_on_disk`` (a prewarm's): its state is also written to the prefix cache's disk tier as
    soon as it is cached, not only once evicted; without a disk tier it changes nothing.
    """

    model: str
    prompt: str | None = None
    prompt_tokens: TokenIds | None = None
    messages: tuple[ChatMessage, ...] | None = None
    chat: ChatOptions = ChatOptions()
    sampling: Sampling = Sampling()
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: TokenIds = ()
    ignore_eos: bool = False
    namespace: str = "default"
    session: str | None = None
    supersede: bool = False
    timeout_s: float | None = None
    stall_timeout_s: float | None = None
    anonymous: bool = False
    reuse_prefix: bool = True
    keep_alive_s: float | None = None
    keep_on_disk: bool = False


# Fields a prewarm leaves at their defaults: it samples nothing and streams nothing.
GENERATE_ONLY = (
    "sampling",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "supersede",
    "stall_timeout_s",
    "reuse_prefix",
    "keep_alive_s",
)
PREWARM_ONLY = ("keep_on_disk",)
