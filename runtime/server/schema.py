"""The OpenAI wire format: the request bodies the server accepts and the bodies it sends.

Requests decode with ``forbid_unknown_fields``, so a field the server does not know is refused by
name instead of dropped (a dropped field could change the output unnoticed). Fields it knows but
does not support are declared here with loose types, and ``translate`` refuses them with a
sentence. ``None`` means "not given" throughout. The runtime's extra samplers (``top_k``,
``min_p``, ...) are accepted as extra body fields, as vLLM and llama.cpp do.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from runtime.messages import Role

# --------------------------------------------------------------------------- requests


class _Body(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of request bodies: immutable, strict about unknown fields."""


class StreamOptions(_Body, frozen=True, kw_only=True):
    include_usage: bool = False


class _GenerationBody(_Body, frozen=True, kw_only=True):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None  # None: the server's only model (compat.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Completions tell UNSET (omitted: OpenAI's 16) from None (null: the rest of the context).
    max_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    user: str | None = None  # accepted, not used
    # The runtime's own samplers and routing (extra body fields).
    top_k: int | None = None
    min_p: float | None = None
    top_n_sigma: float | None = None
    typical_p: float | None = None  # llama-server's and vLLM's: locally typical sampling
    repetition_penalty: float | None = None
    penalty_context: int | None = None
    speculative: int | None = None  # most prompt-lookup drafts per pass (0: off)
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_sequence_breakers: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None  # vLLM's and llama-server's: the model's EOS does not end it
    session: str | None = None
    # True: this request aborts its session's older generates (a new keystroke's completion).
    supersede: bool | None = None
    cache_salt: str | None = None
    keep_alive: float | str | None = None  # Ollama's: the model's keep-alive from now on
    timeout_s: float | None = None  # the request's deadline (runtime error request_timeout)
    stall_timeout_s: float | None = None  # no token for this long after the first: stalled
    # The neighbours' names for the same things (llama-server, mlx_lm.server): aliases.py.
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    repetition_context_size: int | None = None
    presence_context_size: int | None = None
    frequency_context_size: int | None = None
    n_predict: int | None = None
    cache_prompt: bool | None = None
    id_slot: int | None = None
    # Structured output as llama-server spells it, plus regex (runtime/server/structured.py).
    json_schema: dict[str, Any] | bool | None = None
    grammar: str | None = None
    grammar_syntax: Literal["gbnf", "lark"] | None = None  # gbnf: the default, as llama-server
    regex: str | None = None
    # Accepted and ignored, with one log line per field (compat.py): no effect on the output.
    timings_per_token: Any = None
    return_tokens: Any = None
    n_keep: Any = None
    num_draft_tokens: Any = None


class CompletionRequest(_GenerationBody, frozen=True, kw_only=True):
    """``POST /v1/completions``. ``prompt`` is text or token ids (one prompt, not a batch)."""

    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ImageUrl(msgspec.Struct, frozen=True):
    """An ``image_url`` part's image: a data URL or an allowed local file (server/media.py);
    ``detail`` is accepted and ignored (the model's processor decides the resolution)."""

    url: str
    detail: str | None = None


class ContentPart(msgspec.Struct, frozen=True):
    """One part of a message's content: ``text`` or ``image_url`` (vision-language models).

    Unknown keys are allowed here: they belong to part types (audio, files) refused by type.
    """

    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None


class WireChatMessage(_Body, frozen=True, kw_only=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None
    reasoning_content: str | None = None  # an assistant turn's reasoning (translate.py)


class ChatCompletionRequest(_GenerationBody, frozen=True, kw_only=True):
    """``POST /v1/chat/completions``: messages go through the model's chat template."""

    messages: list[WireChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Accepted and ignored: they do not change the output.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    response_format: Any = None  # text, json_object, json_schema (runtime/server/structured.py)
    # Function tools, checked field by field in runtime/server/tools.py.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Template variables (vLLM's name), and reasoning_effort passed to the template as one.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # Known but unsupported: refused unless "off" (see translate.py).
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class PrewarmRequest(_Body, frozen=True, kw_only=True):
    """``POST /v1/prewarm`` (not OpenAI): cache a prompt's state before the request that needs it.

    One of ``prompt`` (text or token ids) and ``messages``; ``max_tokens`` is the coming
    request's, for its context check. A generate in the same ``session`` adopts or supersedes it.
    """

    model: str | None = None  # None: the server's only model (compat.py)
    prompt: str | list[int] | None = None
    messages: list[WireChatMessage] | None = None
    max_tokens: int | None = None
    session: str | None = None
    cache_salt: str | None = None
    # The coming chat request's tools: its prompt shows them (runtime/server/tools.py).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as the chat request's
    reasoning_effort: str | None = None
    keep_on_disk: bool = False  # also write it to the server's disk tier at once


completion_request_decoder = msgspec.json.Decoder(CompletionRequest)
chat_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
prewarm_request_decoder = msgspec.json.Decoder(PrewarmRequest)


class LoadRequest(_Body, frozen=True, kw_only=True):
    """``POST /v1/models/load``. ``keep_alive``: how long the model stays loaded once idle, in
    seconds or as a duration ("30s", "5m", "1h"); negative: forever; absent: the server's
    ``--keep-alive``."""

    model: str
    keep_alive: float | str | None = None


class UnloadRequest(_Body, frozen=True, kw_only=True):
    """``POST /v1/models/unload``."""

    model: str


load_request_decoder = msgspec.json.Decoder(LoadRequest)
unload_request_decoder = msgspec.json.Decoder(UnloadRequest)

# --------------------------------------------------------------------------- responses


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
