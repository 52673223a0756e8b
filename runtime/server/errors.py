"""HTTP errors: each runtime error code mapped to a status and the OpenAI error body.

``{"error": {"message", "type", "param", "code"}}``. ``code`` is the runtime's stable code (see
runtime/errors.py), or ``unsupported_parameter`` / ``unsupported_value`` for OpenAI features this
server refuses. ``type`` is ``invalid_request_error`` for 4xx and ``server_error`` for 5xx, as
OpenAI does (a 404 for an unknown model included). Retryable errors answered with 503 carry
``Retry-After``. The table is in docs/http.md.
"""

from __future__ import annotations

import re

import msgspec

from runtime.errors import (
    ActorStopped,
    BackendError,
    ClusterResourcesMissing,
    ClusterUnavailable,
    ConstraintDeadEnd,
    ConstraintsUnsupported,
    ContextLengthExceeded,
    DuplicateRequestId,
    EngineCrashed,
    EngineProcessLost,
    InvalidApiKey,
    InvalidGrammar,
    InvalidMedia,
    InvalidModelSpec,
    InvalidRequest,
    InvalidSchema,
    KVBudgetExhausted,
    KVRequestTooLarge,
    MalformedMessage,
    MediaEvicted,
    MediaSourceRefused,
    MediaUnsupported,
    MlxRuntimeError,
    ModelAlreadyLoaded,
    ModelFailed,
    ModelFetchFailed,
    ModelLoadFailed,
    ModelLoading,
    ModelNotAvailable,
    ModelNotLoaded,
    ModelRestarting,
    ModelUnloading,
    RateLimited,
    RequestTimedOut,
    RuntimeClosed,
    ServerShuttingDown,
    StepTimedOut,
    StreamStalled,
    SupervisionEscalated,
    TooManyFrames,
    TooManyImages,
    UnsupportedCache,
    UnsupportedModelFormat,
)
from runtime.messages import Cancelled, Failed
from runtime.server.replies import ErrorBody, ErrorDetail, encoder
from runtime.server.schema import ChatCompletionRequest, CompletionRequest

RETRY_AFTER_S = 1
UNSUPPORTED_PARAMETER = "unsupported_parameter"
UNSUPPORTED_VALUE = "unsupported_value"

STATUS_BY_CODE: dict[str, int] = {
    InvalidRequest.code: 400,
    ContextLengthExceeded.code: 400,
    InvalidModelSpec.code: 400,
    InvalidSchema.code: 400,  # response_format's schema: the engine's words say what is wrong
    InvalidGrammar.code: 400,
    ConstraintsUnsupported.code: 400,
    ConstraintDeadEnd.code: 500,  # the grammar engine hit a limit mid-generation
    MalformedMessage.code: 400,
    KVRequestTooLarge.code: 400,  # it can never fit: the client must ask for less
    InvalidMedia.code: 400,  # the image part named: undecodable, too large, another format
    TooManyImages.code: 400,
    TooManyFrames.code: 400,  # frames sent directly past the video frame cap
    MediaUnsupported.code: 400,  # images to a text-only model, video to an image-only one
    MediaSourceRefused.code: 400,  # a remote URL, or a file outside --media-dir
    MediaEvicted.code: 503,  # more images in flight than the engine's store holds: retry
    ModelNotLoaded.code: 404,
    DuplicateRequestId.code: 409,
    ModelAlreadyLoaded.code: 409,
    ModelLoading.code: 409,  # its load is under way: wait, GET /v1/models shows when it is in
    ModelNotAvailable.code: 404,
    KVBudgetExhausted.code: 503,
    InvalidApiKey.code: 401,  # missing or wrong: one answer for both
    RateLimited.code: 429,  # this key's requests running and waiting are at its limit
    ModelUnloading.code: 503,
    ModelRestarting.code: 503,  # its engine crashed and is reloading
    ModelFailed.code: 503,  # out of service until an operator loads it again
    RuntimeClosed.code: 503,  # the server is shutting down
    ServerShuttingDown.code: 503,  # SIGINT/SIGTERM: requests in flight end with it
    RequestTimedOut.code: 504,  # the client's own timeout_s passed
    StreamStalled.code: 504,  # no token for stall_timeout_s: the engine is stuck or overloaded
    BackendError.code: 500,
    EngineCrashed.code: 500,
    StepTimedOut.code: 500,
    EngineProcessLost.code: 503,  # its process died; a new one is starting: retry
    ClusterUnavailable.code: 503,
    ClusterResourcesMissing.code: 503,
    ModelLoadFailed.code: 500,
    ModelFetchFailed.code: 503,  # the package index may answer later
    UnsupportedModelFormat.code: 400,
    UnsupportedCache.code: 400,  # the architecture's cache class has no adapter
    ActorStopped.code: 500,
    SupervisionEscalated.code: 500,
    MlxRuntimeError.code: 500,
}

# Runtime messages about a field start with its name; these runtime names differ on the wire.
_WIRE_NAME = {"prompt_tokens": "prompt", "namespace": "cache_salt"}
_WIRE_FIELDS = frozenset(
    (*CompletionRequest.__struct_fields__, *ChatCompletionRequest.__struct_fields__, *_WIRE_NAME)
)


class HttpError(Exception):
    """An answer instead of a result: an HTTP status and an OpenAI error body.

    ``retry_after`` (seconds) becomes a ``Retry-After`` header.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> ErrorBody:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorBody(error=detail)

    def encode(self) -> bytes:
        return encoder.encode(self.body())

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"retry-after": str(self.retry_after)}


def error_for_code(
    code: str, message: str, *, retryable: bool, param: str | None = None
) -> HttpError:
    """The HTTP form of a runtime error code (from an exception, a ``Failed`` or a ``Rejected``)."""
    status = STATUS_BY_CODE.get(code, 500)
    retry_after = RETRY_AFTER_S if retryable and status in (429, 503) else None
    return HttpError(status, message, code=code, param=param, retry_after=retry_after)


def error_for_runtime(error: MlxRuntimeError) -> HttpError:
    """The HTTP form of an error raised by the runtime's host API."""
    param = param_named_in(error.message) if isinstance(error, InvalidRequest) else None
    return error_for_code(error.code, error.message, retryable=error.retryable, param=param)


def error_for_failed(event: Failed, prompt_field: str) -> HttpError:
    """The HTTP form of a request that failed after the runtime accepted it."""
    if event.code == ContextLengthExceeded.code:
        param: str | None = prompt_field
    elif event.code == InvalidRequest.code:
        param = param_named_in(event.message)
    else:
        param = None
    return error_for_code(event.code, event.message, retryable=event.retryable, param=param)


def error_for_cancelled(event: Cancelled) -> HttpError:
    """A request the runtime cancelled although its client is still there (not a disconnect)."""
    if event.reason == "model_unloaded":
        message = "the model was unloaded while the request ran; try again once it is loaded"
        return error_for_code(ModelUnloading.code, message, retryable=True)
    message = f"the request was cancelled ({event.reason}) before it finished"
    return HttpError(409, message, code="request_cancelled")


def error_for_body(error: msgspec.DecodeError) -> HttpError:
    """Malformed JSON, a wrong type, a missing or an unknown field, named as the client wrote it."""
    text = str(error)
    if not isinstance(error, msgspec.ValidationError):
        return invalid(None, f"the request body is not valid JSON ({text}); send a JSON object")
    located = re.search(r"`\$\.?([^`]*)`", text)
    where = located.group(1) if located else ""
    unknown = re.match(r"Object contains unknown field `([^`]+)`", text)
    if unknown:
        param = _join(where, unknown.group(1))
        return HttpError(
            400,
            f"unknown parameter `{param}`: this server does not support it (docs/http.md lists "
            "the fields it accepts)",
            code=UNSUPPORTED_PARAMETER,
            param=param,
        )
    missing = re.match(r"Object missing required field `([^`]+)`", text)
    if missing:
        param = _join(where, missing.group(1))
        return invalid(param, f"missing required parameter `{param}`")
    described = re.sub(r"`\$\.?([^`]*)`", lambda m: f"`{m.group(1) or 'the body'}`", text)
    return invalid(where or None, f"invalid request body: {described}")


def model_not_loaded(name: str) -> HttpError:
    """A 404 for a request naming a model the server does not have."""
    message = f"model {name!r} is not loaded; GET /v1/models lists the models this server has"
    return HttpError(404, message, code=ModelNotLoaded.code, param="model")


def invalid(param: str | None, message: str) -> HttpError:
    """A 400 for a value the client must change."""
    return HttpError(400, message, code=InvalidRequest.code, param=param)


def unsupported(param: str, message: str, *, code: str = UNSUPPORTED_PARAMETER) -> HttpError:
    """A 400 for an OpenAI feature this server does not have (never silently ignored)."""
    return HttpError(400, message, code=code, param=param)


def param_named_in(message: str) -> str | None:
    """The request field a runtime validation message is about (they start with its name)."""
    leading = re.match(r"\w+", message)
    if leading is None or leading.group(0) not in _WIRE_FIELDS:
        return None
    return _WIRE_NAME.get(leading.group(0), leading.group(0))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
