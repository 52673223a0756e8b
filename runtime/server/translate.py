"""OpenAI request bodies → the runtime's one ``Request`` value, refusing what it cannot honour.

Every field either reaches the runtime, is listed as having no effect on the output (``user``,
``store``, ``metadata``...), or is refused with a 400 naming it: a feature that would change the
output is never dropped silently. Value ranges are the runtime's to check (``validate_sampling``);
this module only checks what the runtime cannot see (wire-only fields and shapes).
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.messages import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    ChatMessage,
    ChatOptions,
    ImagePart,
    Sampling,
    VideoPart,
)
from runtime.messages import Request as RuntimeRequest
from runtime.server.aliases import canonical
from runtime.server.compat import keep_alive_s, template_kwargs
from runtime.server.errors import UNSUPPORTED_VALUE, invalid, unsupported
from runtime.server.media import MediaSources, image_part, video_part
from runtime.server.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    PrewarmRequest,
    WireChatMessage,
)
from runtime.server.structured import constraint_of
from runtime.server.tools import (
    ToolSetup,
    chat_options,
    check_answers,
    tool_fields,
    tool_setup,
)

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI samples unless told otherwise; the runtime's default is 0
LEGACY_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM do
MAX_LOGPROBS = 20

# Wire fields with the same name and meaning in ``Sampling``; None on the wire keeps its default.
_SAMPLER_FIELDS = (
    "top_p",
    "min_p",
    "top_n_sigma",
    "typical_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "penalty_context",
    "speculative",
    "xtc_probability",
    "xtc_threshold",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "seed",
)


class RuntimeCall(msgspec.Struct, frozen=True, kw_only=True):
    """One OpenAI request as the runtime's ``Request`` (sent on as it is), plus how to answer it."""

    request: RuntimeRequest
    stream: bool
    include_usage: bool
    tools: ToolSetup | None = None  # chat requests with tools: the output is parsed for calls


def completion_call(request: CompletionRequest) -> RuntimeCall:
    """``/v1/completions``; raises ``HttpError`` for refused fields."""
    request = canonical(request)  # the neighbours' field names (aliases.py)
    _refuse_choices(request.n, request.best_of)
    if request.echo:
        raise unsupported(
            "echo", "echo (returning the prompt with the completion) is not supported"
        )
    if request.suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported")
    logprobs = request.logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise invalid("logprobs", f"logprobs must be 0 to {MAX_LOGPROBS} (got {logprobs})")
    prompt, prompt_tokens = _one_prompt(request.prompt)
    max_tokens = request.max_tokens
    return _call(
        request,
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        max_tokens=LEGACY_DEFAULT_MAX_TOKENS if max_tokens is msgspec.UNSET else max_tokens,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
    )


NO_MEDIA = MediaSources()


def chat_call(request: ChatCompletionRequest, sources: MediaSources = NO_MEDIA) -> RuntimeCall:
    """``/v1/chat/completions``; raises ``HttpError`` for refused fields and message shapes.
    ``sources``: where ``image_url`` parts may come from (server/media.py)."""
    request = canonical(request)  # the neighbours' field names (aliases.py)
    _refuse_choices(request.n, None)
    for field, value, off, why in (
        ("functions", request.functions, (None, []), "functions are deprecated; send tools"),
        (
            "function_call",
            request.function_call,
            (None, "none"),
            "function_call is deprecated; send tool_choice",
        ),
        ("modalities", request.modalities, (None, ["text"]), "only text output is supported"),
        ("audio", request.audio, (None,), "audio output is not supported"),
        ("prediction", request.prediction, (None,), "predicted outputs are not supported"),
        ("verbosity", request.verbosity, (None,), "verbosity is not supported"),
        ("web_search_options", request.web_search_options, (None,), "web search is not supported"),
    ):
        if value not in off:
            raise unsupported(field, f"{field}: {why}")
    tools = tool_setup(request)
    call = _call(
        request,
        messages=_chat_messages(request.messages, sources),
        max_tokens=_chat_max_tokens(request),
        logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs or 0,
        response_format=request.response_format,
    )
    # An OpenAI client owns its context: no history window, an over-long conversation is
    # refused (context_length_exceeded), never trimmed.
    asked = msgspec.structs.replace(call.request, chat=_chat_options(tools, request))
    call = msgspec.structs.replace(call, request=asked)
    if tools is None:
        return call
    forced = tools.constraint
    sampling = asked.sampling
    if forced is not None and sampling.constraint is not None:
        raise invalid(
            "tool_choice",
            f'tool_choice "{tools.choice}" constrains the output to tool calls; it cannot be '
            "combined with response_format, json_schema, grammar or regex",
        )
    sampling = msgspec.structs.replace(sampling, constraint=forced or sampling.constraint)
    asked = msgspec.structs.replace(asked, sampling=sampling)
    return msgspec.structs.replace(call, tools=tools, request=asked)


def prewarm_call(request: PrewarmRequest, sources: MediaSources = NO_MEDIA) -> RuntimeRequest:
    """``/v1/prewarm``; messages (images included) are checked as ``chat_call`` checks them."""
    prompt = request.prompt
    messages = request.messages
    tools = tool_setup(request)
    if tools is not None and messages is None:
        raise invalid("tools", "tools go with messages: a text prompt is sent as it is")
    return RuntimeRequest(
        model=_model(request),
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_tokens=None if prompt is None or isinstance(prompt, str) else tuple(prompt),
        messages=None if messages is None else _chat_messages(messages, sources),
        # Rendered exactly as the chat request it prepares.
        chat=_chat_options(tools, request),
        max_tokens=request.max_tokens,
        namespace=_namespace(request.cache_salt),
        session=request.session,
        anonymous=request.session is None,  # as for a generate (_call)
        keep_on_disk=request.keep_on_disk,
        timeout_s=request.timeout_s,  # checked by the runtime, as a generate's (400 timeout_s)
    )


def _chat_options(
    tools: ToolSetup | None, request: ChatCompletionRequest | PrewarmRequest
) -> ChatOptions:
    """The tools' chat options plus the template variables (compat.py)."""
    return msgspec.structs.replace(chat_options(tools), template_kwargs=template_kwargs(request))


def _model(request: CompletionRequest | ChatCompletionRequest | PrewarmRequest) -> str:
    """The model named (the app names the server's only model for a request without one)."""
    if request.model is None:
        raise invalid("model", "model is missing; name one (GET /v1/models lists them)")
    return request.model


def _supersede(request: CompletionRequest | ChatCompletionRequest) -> bool:
    """Only a client's own older requests may be cut short: without a session the server cannot
    tell whose they are (docs/http.md)."""
    if request.supersede and request.session is None:
        raise invalid(
            "supersede",
            "supersede needs a session: send the same session with each of your requests, so "
            "that a new one aborts only your own older ones",
        )
    return bool(request.supersede)


def _namespace(cache_salt: str | None) -> str:
    """Requests with different salts never share cached prefixes (the runtime's namespaces)."""
    if cache_salt is not None and not cache_salt:
        raise invalid("cache_salt", "cache_salt must be a non-empty string when given")
    return cache_salt or "default"


def _call(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    prompt: str | None = None,
    prompt_tokens: tuple[int, ...] | None = None,
    messages: tuple[ChatMessage, ...] | None = None,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    response_format: Any = None,
) -> RuntimeCall:
    stop = request.stop
    constraint = constraint_of(
        response_format=response_format,
        json_schema=request.json_schema,
        grammar=request.grammar,
        grammar_syntax=request.grammar_syntax,
        regex=request.regex,
    )
    asked = RuntimeRequest(
        model=_model(request),
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        messages=messages,
        max_tokens=max_tokens,
        sampling=msgspec.structs.replace(
            _sampling(request, logprobs, top_logprobs), constraint=constraint
        ),
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=bool(request.ignore_eos),
        namespace=_namespace(request.cache_salt),
        session=request.session,
        supersede=_supersede(request),
        timeout_s=request.timeout_s,
        stall_timeout_s=request.stall_timeout_s,
        # Without a session the server cannot tell its clients apart: this request must not
        # cut another's work short, nor have its own cut short (docs/http.md).
        anonymous=request.session is None,
        reuse_prefix=request.cache_prompt is not False,  # llama-server's cache_prompt
        keep_alive_s=keep_alive_s(request),
    )
    return RuntimeCall(
        request=asked,
        stream=request.stream,
        include_usage=request.stream_options is not None and request.stream_options.include_usage,
    )


def _sampling(
    request: CompletionRequest | ChatCompletionRequest, logprobs: bool, top_logprobs: int
) -> Sampling:
    given: dict[str, Any] = {
        name: getattr(request, name)
        for name in _SAMPLER_FIELDS
        if getattr(request, name) is not None
    }
    if request.top_k is not None:
        given["top_k"] = 0 if request.top_k == -1 else request.top_k  # vLLM spells "off" as -1
    if request.logit_bias is not None:
        given["logit_bias"] = request.logit_bias
    if request.dry_sequence_breakers is not None:
        given["dry_sequence_breakers"] = tuple(request.dry_sequence_breakers)
    temperature = request.temperature
    return msgspec.structs.replace(
        Sampling(),
        temperature=OPENAI_DEFAULT_TEMPERATURE if temperature is None else temperature,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        **given,
    )


def _one_prompt(
    prompt: str | list[str | int | list[int]],
) -> tuple[str | None, tuple[int, ...] | None]:
    """Text or token ids; a list holding one prompt is that prompt, a batch is refused."""
    if isinstance(prompt, str):
        return prompt, None
    if not prompt:
        raise invalid("prompt", "prompt is empty; send text or a list of token ids")
    if all(isinstance(item, int) for item in prompt):
        return None, tuple(item for item in prompt if isinstance(item, int))
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0], None
    if len(prompt) == 1 and isinstance(prompt[0], list):
        return None, tuple(prompt[0])
    raise unsupported(
        "prompt",
        f"a batch of {len(prompt)} prompts is not supported; send one prompt per request "
        "(requests run concurrently and share cached prefixes)",
        code=UNSUPPORTED_VALUE,
    )


def _chat_messages(
    messages: list[WireChatMessage], sources: MediaSources
) -> tuple[ChatMessage, ...]:
    check_answers(messages)
    return tuple(
        _with_reasoning(i, message, _chat_message(i, message, sources))
        for i, message in enumerate(messages)
    )


def _with_reasoning(index: int, wire: WireChatMessage, message: ChatMessage) -> ChatMessage:
    """An assistant turn's ``reasoning_content`` as the ``<think>`` block the model wrote, so the
    chat path treats it as all reasoning: stripped from earlier turns, kept in a final prefill."""
    reasoning = wire.reasoning_content
    if not reasoning:
        return message
    if wire.role != "assistant":
        where = f"messages[{index}].reasoning_content"
        raise invalid(where, f"{where}: only assistant messages carry reasoning")
    content = f"<think>\n{reasoning}\n</think>\n\n{message.content}"
    return msgspec.structs.replace(message, content=content)


def _chat_message(index: int, message: WireChatMessage, sources: MediaSources) -> ChatMessage:
    where = f"messages[{index}]"
    for field, value in (
        ("name", message.name),
        ("function_call", message.function_call),
        ("audio", message.audio),
    ):
        if value is not None:
            raise unsupported(f"{where}.{field}", f"{where}.{field} is not supported")
    calls, call_id = tool_fields(where, message)
    content = message.content
    if isinstance(content, str):
        return ChatMessage(message.role, content, calls, call_id)
    if content is None and calls:
        return ChatMessage(message.role, "", calls, call_id)  # a reply that only calls tools
    if content is None:
        raise invalid(f"{where}.content", f"{where}.content is missing; send text")
    pieces: list[str] = []
    images: list[ImagePart] = []
    videos: list[VideoPart] = []
    for j, part in enumerate(content):
        if part.type == "image_url" and part.image_url is not None:
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            images.append(image_part(url, f"{where}.content[{j}]", sources))
            pieces.append(IMAGE_PLACEHOLDER)
        elif part.type == "video_url" and part.video_url is not None:
            url = part.video_url if isinstance(part.video_url, str) else part.video_url.url
            videos.append(video_part(url, f"{where}.content[{j}]", sources))
            pieces.append(VIDEO_PLACEHOLDER)
        elif part.type == "text" and part.text is not None:
            # Text parts join with newlines, as vLLM renders them for string-content templates.
            text = part.text
            media = (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)
            pieces.append(f"\n{text}" if pieces and pieces[-1] not in media else text)
        else:
            raise unsupported(
                f"{where}.content[{j}]",
                f"{where}.content[{j}] is a {part.type!r} part; only text, image_url and "
                "video_url parts are supported",
                code=UNSUPPORTED_VALUE,
            )
    return ChatMessage(message.role, "".join(pieces), calls, call_id, tuple(images), tuple(videos))


def _chat_max_tokens(request: ChatCompletionRequest) -> int | None:
    """``max_completion_tokens`` (current) or ``max_tokens`` (deprecated); None: the rest."""
    legacy = None if request.max_tokens is msgspec.UNSET else request.max_tokens
    current = request.max_completion_tokens
    if current is not None and legacy is not None and current != legacy:
        raise invalid(
            "max_tokens",
            f"max_tokens ({legacy}) and max_completion_tokens ({current}) disagree; send one",
        )
    chosen = current if current is not None else legacy
    if chosen is not None and chosen < 1:
        name = "max_completion_tokens" if current is not None else "max_tokens"
        raise invalid(name, f"{name} must be at least 1 (got {chosen})")
    return chosen


def _refuse_choices(n: int | None, best_of: int | None) -> None:
    if n not in (None, 1):
        raise unsupported(
            "n",
            f"n={n}: one choice per request is supported; send {n} requests instead "
            "(they share the cached prompt)",
            code=UNSUPPORTED_VALUE,
        )
    if best_of not in (None, 1):
        raise unsupported("best_of", "best_of is not supported", code=UNSUPPORTED_VALUE)
