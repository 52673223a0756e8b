"""The neighbours' names for the runtime's request fields: llama-server's and mlx_lm.server's.

A client written for llama-server or mlx_lm.server sends their names; where one means what a field
of ours means, ``canonical`` moves its value to our field, so everything after it (translate.py,
the runtime's validation) sees one name. Where two names for one thing are both sent with
different values, the request is refused (``conflicting_parameters``, naming both): picking one
could change the output unnoticed. Their sampling fields with no counterpart here stay unknown
fields, refused by name.

Each name and what it becomes: docs/http.md, "The neighbours' names".
"""

from __future__ import annotations

from typing import Final, TypeVar

import msgspec

from runtime.server.errors import HttpError, invalid
from runtime.server.schema import ChatCompletionRequest, CompletionRequest

CONFLICTING_PARAMETERS: Final = "conflicting_parameters"
WHOLE_HISTORY: Final = 1 << 31  # a penalty window no prompt and reply can outgrow
_PENALTY_WINDOWS: Final = (
    "penalty_context",
    "repeat_last_n",
    "repetition_context_size",
    "presence_context_size",
    "frequency_context_size",
)
_ALIASES_CLEARED: Final = {name: None for name in ("repeat_penalty", *_PENALTY_WINDOWS[1:])}

RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)
T = TypeVar("T")


def canonical(request: RequestT) -> RequestT:
    """``request`` with the neighbours' names moved to ours (module docstring); raises
    ``HttpError`` for two names that disagree and for values without a meaning."""
    repetition_penalty = _one_value(
        ("repetition_penalty", request.repetition_penalty),
        ("repeat_penalty", request.repeat_penalty),
    )
    windows = [(name, _window(name, getattr(request, name))) for name in _PENALTY_WINDOWS]
    session = _one_value(("session", request.session), ("id_slot", _slot_session(request)))
    replaced = msgspec.structs.replace(
        request,
        repetition_penalty=repetition_penalty,
        penalty_context=_one_value(*windows),
        session=session,
        id_slot=None,
        n_predict=None,
        **_ALIASES_CLEARED,
    )
    return _with_token_limit(replaced, request.n_predict)


def _one_value(*named: tuple[str, T | None]) -> T | None:
    """The value the given names agree on (None when none was given)."""
    given = [(name, value) for name, value in named if value is not None]
    for name, value in given[1:]:
        first_name, first = given[0]
        if value != first:
            raise HttpError(
                400,
                f"{first_name} ({first}) and {name} ({value}) name the same setting with "
                "different values; send one of them",
                code=CONFLICTING_PARAMETERS,
                param=name,
            )
    return given[0][1] if given else None


def _window(name: str, value: int | None) -> int | None:
    if name == "repeat_last_n" and value == -1:  # llama-server's "the whole context"
        return WHOLE_HISTORY
    return value


def _slot_session(request: CompletionRequest | ChatCompletionRequest) -> str | None:
    slot = request.id_slot
    if slot is None or slot == -1:
        return None
    if slot < 0:
        raise invalid("id_slot", f"id_slot must be -1 (any slot) or a slot number (got {slot})")
    return f"slot-{slot}"


def _with_token_limit(request: RequestT, n_predict: int | None) -> RequestT:
    """``n_predict`` as the endpoint's own token limit (after checking it agrees with it)."""
    if n_predict is None:
        return request
    if n_predict == 0 or n_predict < -1:
        raise invalid(
            "n_predict", f"n_predict must be -1 (no limit) or at least 1 (got {n_predict})"
        )
    limit = None if n_predict == -1 else n_predict
    given = [] if request.max_tokens is msgspec.UNSET else [("max_tokens", request.max_tokens)]
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        given.append(("max_completion_tokens", request.max_completion_tokens))
    for name, value in given:
        if value != limit:
            raise HttpError(
                400,
                f"n_predict ({n_predict}) and {name} ({value}) name the same limit with "
                "different values; send one of them",
                code=CONFLICTING_PARAMETERS,
                param="n_predict",
            )
    if given:
        return request
    return msgspec.structs.replace(request, max_tokens=limit)
