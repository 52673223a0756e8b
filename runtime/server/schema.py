"""The OpenAI wire format, requests: the bodies the server accepts (its answers: replies.py).

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


class VideoUrl(msgspec.Struct, frozen=True):
    """A ``video_url`` part's video (vLLM's part): a data URL or an allowed local file."""

    url: str


class ContentPart(msgspec.Struct, frozen=True):
    """One part of a message's content: ``text``, ``image_url`` or ``video_url`` (vision-language
    models; video: the video-capable families).

    Unknown keys are allowed here: they belong to part types (audio, files) refused by type.
    """

    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None
    video_url: VideoUrl | str | None = None


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
    timeout_s: float | None = None  # as a generate's: 504 request_timeout once it passes


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
