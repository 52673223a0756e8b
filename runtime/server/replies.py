"""The OpenAI wire format's answers: the bodies and stream chunks the server sends.

Each is a frozen msgspec Struct encoded by the one ``encoder``; a field left ``UNSET`` is left out
of the JSON, so a body carries only what OpenAI's (or llama-server's, for ``timings``) shape has
for it. The request bodies are schema.py's. Field by field: docs/http.md, "Responses".
"""

from __future__ import annotations

from typing import Literal

import msgspec


class _Reply(msgspec.Struct, frozen=True, kw_only=True):
    """Base of response bodies. ``UNSET`` fields are left out of the JSON."""


class PromptTokensDetails(_Reply, frozen=True, kw_only=True):
    cached_tokens: int


class WireUsage(_Reply, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Only when the request's max_tokens was past the room its prompt left: the limit it ran with.
    max_tokens_clamped_to: int | msgspec.UnsetType = msgspec.UNSET


class Timings(_Reply, frozen=True, kw_only=True):
    """llama-server's per-request ``timings``: ``prompt_*`` the prompt tokens prefilled (not
    restored from the cache, which ``cache_n`` counts), ``predicted_*`` the generated tokens;
    milliseconds, rates per second (None when the time measured is 0)."""

    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float | None
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float | None
    predicted_per_second: float | None
    cache_n: int
    max_tokens_clamped_to: int | msgspec.UnsetType = msgspec.UNSET  # as in usage
    # llama-server's speculative fields: drafts verified and accepted (only when it drafted).
    draft_n: int | msgspec.UnsetType = msgspec.UNSET
    draft_n_accepted: int | msgspec.UnsetType = msgspec.UNSET


class CompletionLogprobs(_Reply, frozen=True, kw_only=True):
    """The legacy completions form: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Reply, frozen=True, kw_only=True):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class TextCompletion(_Reply, frozen=True, kw_only=True):
    """A ``/v1/completions`` response, or (``object`` "text_completion" too) one stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: WireUsage | msgspec.UnsetType | None = msgspec.UNSET
    timings: Timings | msgspec.UnsetType = msgspec.UNSET
    error: ErrorDetail | msgspec.UnsetType = msgspec.UNSET  # a stream the server stopped


class TopLogprob(_Reply, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None  # None for an alternative the runtime did not detokenize


class TokenLogprob(_Reply, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Reply, frozen=True, kw_only=True):
    content: list[TokenLogprob]


class WireFunctionCall(_Reply, frozen=True, kw_only=True):
    name: str
    arguments: str  # a JSON object's text


class WireToolCall(_Reply, frozen=True, kw_only=True):
    id: str
    function: WireFunctionCall
    type: Literal["function"] = "function"


class AssistantMessage(_Reply, frozen=True, kw_only=True):
    content: str | None  # None: the reply is tool calls only
    role: Literal["assistant"] = "assistant"
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET  # only when the model reasoned
    tool_calls: list[WireToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(_Reply, frozen=True, kw_only=True):
    message: AssistantMessage
    finish_reason: str
    index: int = 0
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Reply, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: WireUsage
    timings: Timings | msgspec.UnsetType = msgspec.UNSET


class DeltaFunction(_Reply, frozen=True, kw_only=True):
    name: str | msgspec.UnsetType = msgspec.UNSET
    arguments: str = ""


class DeltaToolCall(_Reply, frozen=True, kw_only=True):
    """A piece of call ``index``: its first piece has ``id``, ``type`` and the function's name,
    later ones add to its arguments (how OpenAI streams calls)."""

    index: int
    function: DeltaFunction
    id: str | msgspec.UnsetType = msgspec.UNSET
    type: Literal["function"] | msgspec.UnsetType = msgspec.UNSET


class Delta(_Reply, frozen=True, kw_only=True):
    role: Literal["assistant"] | msgspec.UnsetType = msgspec.UNSET
    content: str | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[DeltaToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChatChunkChoice(_Reply, frozen=True, kw_only=True):
    delta: Delta
    index: int = 0
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Reply, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: WireUsage | msgspec.UnsetType | None = msgspec.UNSET
    timings: Timings | msgspec.UnsetType = msgspec.UNSET
    error: ErrorDetail | msgspec.UnsetType = msgspec.UNSET  # a stream the server stopped


class PrewarmResult(_Reply, frozen=True, kw_only=True):
    """How a prewarm ended: its state cached, taken over by a generate, or replaced by one."""

    model: str
    status: Literal["prewarmed", "adopted", "superseded"]
    prompt_tokens: int
    cached_tokens: int  # already cached before the prewarm ran
    object: Literal["prewarm"] = "prewarm"


ModelSource = Literal["configured", "known", "converted", "loaded"]
ModelCardState = Literal[
    "loading", "loaded", "unloading", "restarting", "failed", "idle", "preparing", "available"
]


class ModelCard(_Reply, frozen=True, kw_only=True):
    """OpenAI's model object (``id``, ``object``, ``created``, ``owned_by``) plus this server's
    fields, which an OpenAI client keeps as extras. ``state``: the runtime's (``loading``,
    ``loaded``, ``unloading``, ``restarting``, ``failed``, ``idle``: unloaded by its keep-alive),
    ``preparing`` (being fetched or converted before its load), or ``available`` (loadable: a
    configured, known or converted model not loaded now). ``expires_at``: when the keep-alive
    unloads it (Unix seconds; null: busy, not loaded, or kept forever). ``cache``: for a known
    model, what a load must do first (``not_fetched``, ``downloaded``, ``converted``)."""

    id: str
    created: int
    state: ModelCardState
    source: ModelSource
    context_length: int | None = None
    keep_alive: float | None = None  # seconds; null: kept loaded
    expires_at: int | None = None
    live_requests: int = 0
    cache: Literal["converted", "downloaded", "not_fetched"] | None = None
    description: str | None = None
    failure: str | None = None
    # Capabilities the load probe switched off for this model (batch_decode, batch_prefill,
    # snapshot_reach_back, trim), each with why; null: none off, or not loaded.
    limits: dict[str, str] | None = None
    placement: str | None = None  # an engine in a process of its own: its Ray node and pid
    # A model served by several replicas (ModelSpec.replicas): one card for the name, and here
    # each replica's own (id NAME@i, its state, requests and placement); null: one engine.
    replicas: list[ModelCard] | None = None
    # The prefix cache's disk tier for this model: entries, bytes, hits, load_ms (null: off).
    disk_cache: dict[str, int] | None = None
    object: Literal["model"] = "model"
    owned_by: str = "mlx-actor-runtime"


class ModelLoadResult(_Reply, frozen=True, kw_only=True):
    """Answer to ``POST /v1/models/load``."""

    model: str
    status: Literal["loaded"] = "loaded"
    epoch: int
    context_length: int
    reuse_path: str
    keep_alive: float | None


class ModelUnloadResult(_Reply, frozen=True, kw_only=True):
    """Answer to ``POST /v1/models/unload``: its memory is free."""

    model: str
    status: Literal["unloaded"] = "unloaded"
    epoch: int


class ModelList(_Reply, frozen=True, kw_only=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorDetail(_Reply, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Reply, frozen=True, kw_only=True):
    error: ErrorDetail


Chunk = TextCompletion | ChatCompletionChunk
encoder = msgspec.json.Encoder()
