"""Fields other servers' clients send, read the way those servers read them.

No ``model``: the one model the server has is used, as llama-server and mlx_lm.server do (with
several, or none, the request is refused naming them). ``keep_alive`` (Ollama's): the model's
keep-alive from this request on. ``chat_template_kwargs`` (vLLM, SGLang, llama-server) and
``reasoning_effort`` (OpenAI) reach the chat template as variables. Known fields that do not change
the output are accepted and ignored, logged once per name (``FieldNotes``); anything else unknown is
still refused by name, since a dropped field could change the output unnoticed.

See docs/http.md.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Final

from runtime.server.aliases import CONFLICTING_PARAMETERS
from runtime.server.errors import HttpError, invalid
from runtime.server.models import parse_keep_alive
from runtime.server.schema import ChatCompletionRequest, CompletionRequest, PrewarmRequest

log = logging.getLogger("mlx_actor_runtime.server")

# Accepted and ignored: each only asks for extra output or tunes speed, never the tokens.
IGNORED_FIELDS: Final = {
    "timings_per_token": "llama-server: timings in every chunk; the last chunk carries them",
    "return_tokens": "llama-server: token ids in the answer",
    "n_keep": "llama-server: tokens kept when the context shifts; this server never shifts it",
    "num_draft_tokens": "mlx_lm.server: speculative decoding's draft length (speed only)",
}
REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high")

Request = CompletionRequest | ChatCompletionRequest | PrewarmRequest


class FieldNotes:
    """Logs an ignored field the first time a request sends it (one line per field name)."""

    def __init__(self) -> None:
        self._noted: set[str] = set()

    def note(self, request: CompletionRequest | ChatCompletionRequest) -> None:
        for name, why in IGNORED_FIELDS.items():
            if getattr(request, name) is not None and name not in self._noted:
                self._noted.add(name)
                log.info("requests send %s; ignored (%s). Said once.", name, why)


def default_model(known: list[str]) -> str:
    """The model a request without ``model`` gets: the server's only one. Raises ``HttpError``
    (400, ``param`` model) when it has several or none."""
    if len(known) == 1:
        return known[0]
    if not known:
        raise invalid("model", "model is missing and this server has no model; name one to load")
    raise invalid(
        "model",
        f"model is missing and this server has {len(known)} models ({', '.join(sorted(known))}); "
        "name one (GET /v1/models lists them)",
    )


def keep_alive_s(request: CompletionRequest | ChatCompletionRequest) -> float | None:
    """The request's ``keep_alive`` in seconds (``math.inf``: keep the model loaded); None when
    it sends none. Raises ``HttpError`` for a value that is not a duration."""
    if request.keep_alive is None:
        return None
    try:
        seconds = parse_keep_alive(request.keep_alive)
    except ValueError as error:
        raise invalid("keep_alive", str(error)) from None
    return math.inf if seconds is None else seconds


def template_kwargs(request: ChatCompletionRequest | PrewarmRequest) -> str | None:
    """``chat_template_kwargs`` with ``reasoning_effort`` as the template variable of that name,
    as JSON text for ``ChatOptions.template_kwargs``; None when neither is sent."""
    kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
    effort = request.reasoning_effort
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise invalid(
                "reasoning_effort",
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)} (got {effort!r})",
            )
        given = kwargs.get("reasoning_effort", effort)
        if given != effort:
            raise HttpError(
                400,
                f"reasoning_effort ({effort}) and chat_template_kwargs.reasoning_effort ({given}) "
                "disagree; send one of them",
                code=CONFLICTING_PARAMETERS,
                param="reasoning_effort",
            )
        kwargs["reasoning_effort"] = effort
    return json.dumps(kwargs) if kwargs else None
