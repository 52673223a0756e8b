"""Request and response bodies: read within a size limit, decoded as JSON, errors answered.

Every route reads its body through ``read_body`` (a limit, so a client cannot make the server hold
more than a context could use; a non-JSON label refused by name) and decodes it with
``decode_body``, so a malformed body is a 400 naming what to fix, never a traceback. Errors, the
route's own and Starlette's (unknown paths, wrong methods), are answered in OpenAI's error shape.
See docs/http.md, "Errors".
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from runtime.server import replies as wire
from runtime.server.errors import HttpError, error_for_body, invalid

_T = TypeVar("_T")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes (413 past it, refused before reading when its
    declared length says so); a body labelled other than JSON is refused (415)."""
    refuse_non_json(request.headers.get("content-type"))
    too_large = HttpError(
        413,
        f"the request body is over this server's limit of {limit} bytes; send a shorter "
        "prompt (no model's context needs more)",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refused before reading any of it
        raise too_large
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        # Nobody is left to read the answer; this only keeps the log free of a traceback.
        raise HttpError(400, "the client disconnected", code=None) from None
    return bytes(body)


def refuse_non_json(content_type: str | None) -> None:
    """A body labelled as something else (a form post, say: curl's default) is refused by its
    label, so the client hears what to fix rather than a JSON syntax error; an unlabelled body
    is read as JSON."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if not media_type or media_type == "application/json" or media_type.endswith("+json"):
        return
    raise HttpError(
        415,
        f"the request body is labelled {media_type}; send JSON with the header "
        "Content-Type: application/json",
        code="unsupported_media_type",
    )


def decode_body(body: bytes, decoder: msgspec.json.Decoder[_T]) -> _T:
    """The body as the decoder's type; a body that does not fit it is a 400 naming the field."""
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as error:
        raise error_for_body(error) from None
    except RecursionError:  # arrays nested thousands deep in a field typed Any (tools)
        raise invalid(
            None, "the request body nests too deeply; send a flatter JSON object"
        ) from None


def json_response(body: object, status: int = 200) -> Response:
    """``body`` encoded as the wire's JSON."""
    return Response(wire.encoder.encode(body), status_code=status, media_type="application/json")


async def on_http_error(_request: Request, error: Exception) -> Response:
    """An ``HttpError`` as its OpenAI-shaped body, status and headers."""
    assert isinstance(error, HttpError)
    response = json_response(error.body(), error.status)
    response.headers.update(error.headers())
    return response


async def on_route_error(request: Request, error: Exception) -> Response:
    """Unknown paths and wrong methods, in the OpenAI error shape like everything else."""
    assert isinstance(error, HTTPException)
    message = f"{request.method} {request.url.path}: {error.detail}"
    return await on_http_error(request, HttpError(error.status_code, message, code=None))
