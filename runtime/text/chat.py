"""Chat prompt preparation: the one path from chat messages to prompt tokens.

Generate and prewarm both call ``prepare_chat``, so a warmup caches exactly the tokens the request
that follows it will send. It runs on the engine's compute thread with the model's tokenizer (an
mlx-lm ``TokenizerWrapper`` or anything with ``encode`` and, optionally, ``apply_chat_template``).
The steps: validate, strip earlier reasoning, render with the chat template (or the fallback
format), window the history (only with ``history_budget_tokens``), check the context, and locate
the message ends, where the engine checkpoints a cache that cannot be trimmed.

Each step's rules: docs/chat.md, "Steps" and "message_ends".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Final, Protocol

import msgspec

from runtime.errors import ContextLengthExceeded, InvalidRequest
from runtime.messages import ChatMessage, ChatOptions
from runtime.text import tools as tool_prompt
from runtime.text.reasoning import ends_inside_reasoning

__all__ = [
    "ChatMessage",
    "ChatOptions",
    "ChatTokenizer",
    "has_chat_template",
    "PreparedPrompt",
    "prepare_chat",
    "strip_reasoning",
]

ROLES: Final[frozenset[str]] = frozenset(("system", "developer", "user", "assistant", "tool"))
INSTRUCTION_ROLES: Final[frozenset[str]] = frozenset(("system", "developer"))
# Message ends located per prompt: edits land near the end, and each end costs a template render.
MESSAGE_ENDS: Final = 16
# apply_chat_template's own parameters: the renderer sets these, a template variable cannot.
RENDERER_KWARGS: Final = frozenset(
    (
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    )
)

# A closed block; reasoning before a lone closing tag (templates that open it in the generation
# prompt); an opening tag never closed (a turn cut off by max_tokens).
_CLOSED_REASONING: Final = re.compile(r"<(think|thinking)>.*?</\1>", re.DOTALL)
_UNOPENED_REASONING: Final = re.compile(r"\A(?:(?!<think(?:ing)?>).)*?</think(?:ing)?>", re.DOTALL)
_UNCLOSED_REASONING: Final = re.compile(r"<think(?:ing)?>.*\Z", re.DOTALL)


class PreparedPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt ready to prefill.

    ``instructions_tokens`` is how many leading ``tokens`` render the leading system/developer
    messages alone (0 when there are none or they are not a token prefix); the runtime pins that
    prefix in the prefix cache. ``message_ends`` are the token counts, ascending, at which each of
    the latest ``MESSAGE_ENDS`` messages but the final one ends (a message whose end is not a
    token boundary of the prompt is left out). ``dropped_turns`` counts the turns the history
    window removed. ``reasoning_open``: the prompt ends inside a reasoning block its template (or
    a final assistant prefill) opened, so the output starts as reasoning (reasoning.py).
    """

    tokens: tuple[int, ...]
    text: str
    instructions_tokens: int
    dropped_turns: int
    message_ends: tuple[int, ...] = ()
    reasoning_open: bool = False


class ChatTokenizer(Protocol):
    """What ``prepare_chat`` needs; ``apply_chat_template`` is used when the tokenizer has one."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def prepare_chat(
    tokenizer: ChatTokenizer,
    messages: Sequence[ChatMessage],
    options: ChatOptions,
    max_tokens: int,
    context_length: int,
    *,
    reply_may_shrink: bool = False,
) -> PreparedPrompt:
    """Template, tokenize, window and check ``messages``; see the module docstring.
    ``reply_may_shrink``: ``max_tokens`` only plans the window; the check asks for room for one
    token (the engine's, which knows what the request sent, does the rest).

    Raises ``InvalidRequest`` for malformed messages or options (or a template that rejects the
    messages) and ``ContextLengthExceeded`` when the prompt plus ``max_tokens`` cannot fit.
    """
    _validate(messages, options, max_tokens, context_length)
    renderer = _Renderer(tokenizer, options)
    msgs = messages if options.keep_reasoning else _strip_earlier_reasoning(messages)
    if options.history_budget_tokens is None:
        kept, dropped = msgs, 0
        text, tokens = renderer.prompt(kept)
    else:
        budget = min(options.history_budget_tokens, context_length - max_tokens)
        kept, text, tokens, dropped = _window(renderer, msgs, budget)
    over = len(tokens) + max_tokens - context_length
    after = f" after dropping {dropped} earlier turns" if dropped else ""
    if reply_may_shrink and len(tokens) >= context_length:
        raise ContextLengthExceeded(
            f"the prompt is {len(tokens)} tokens{after}: it fills the context length of "
            f"{context_length} and leaves no room for a reply; shorten the messages"
        )
    if over > 0 and not reply_may_shrink:
        raise ContextLengthExceeded(
            f"the prompt is {len(tokens)} tokens{after} and max_tokens is {max_tokens}: {over} "
            f"tokens over the context length of {context_length}; shorten the messages or lower "
            "max_tokens"
        )
    return PreparedPrompt(
        tokens=tuple(tokens),
        text=text,
        instructions_tokens=_instructions_tokens(renderer, msgs, tokens),
        dropped_turns=dropped,
        message_ends=_message_ends(renderer, kept, text, tokens),
        reasoning_open=ends_inside_reasoning(text),
    )


def _validate(
    messages: Sequence[ChatMessage], options: ChatOptions, max_tokens: int, context_length: int
) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequest("messages must be a non-empty list of chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, ChatMessage):
            raise InvalidRequest(f"messages[{i}] must be a ChatMessage (got {type(m).__name__})")
        if m.role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role {m.role!r} is not one of {', '.join(sorted(ROLES))}"
            )
        if not isinstance(m.content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string (got {type(m.content).__name__})"
            )
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequest(f"messages[{i}].tool_calls is for assistant messages only")
        if m.tool_call_id is not None and m.role != "tool":
            raise InvalidRequest(f"messages[{i}].tool_call_id is for tool messages only")
    last = messages[-1]
    if options.add_generation_prompt and last.role == "assistant" and last.tool_calls:
        # A final assistant message is continued as a prefill, and a call cannot be continued.
        raise InvalidRequest(
            f"messages[{len(messages) - 1}] is an assistant message with tool_calls and nothing "
            "after it; send the tool results (role tool) after it"
        )
    tool_prompt.validate_tools(options.tools)
    template_kwargs(options)
    if max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1 (got {max_tokens})")
    if context_length < 1:
        raise InvalidRequest(f"context_length must be at least 1 (got {context_length})")
    budget = options.history_budget_tokens
    if budget is not None and budget < 1:
        raise InvalidRequest(f"history_budget_tokens must be at least 1 or None (got {budget})")


def strip_reasoning(content: str) -> str:
    """``content`` without its reasoning blocks, and without the blank lines they leave."""
    answer = _UNOPENED_REASONING.sub("", content, count=1)
    answer = _CLOSED_REASONING.sub("", answer)
    answer = _UNCLOSED_REASONING.sub("", answer)
    return content if answer == content else answer.strip()


def _strip_earlier_reasoning(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    last = len(messages) - 1
    return [
        msgspec.structs.replace(m, content=strip_reasoning(m.content))
        if m.role == "assistant" and i != last
        else m
        for i, m in enumerate(messages)
    ]


class _Renderer:
    """Renders messages with the tokenizer's template (or the fallback format) and tokenizes.

    Tools, assistant tool calls and tool messages go through ``runtime.text.tools``: to the
    template when it renders tools itself, else in the fallback format it documents.
    """

    def __init__(self, tokenizer: ChatTokenizer, options: ChatOptions) -> None:
        self._tokenizer = tokenizer
        self._add_generation_prompt = options.add_generation_prompt
        self._templated = has_chat_template(tokenizer)
        self._native_tools = self._templated and tool_prompt.template_supports_tools(tokenizer)
        self._tools = options.tools
        self._parallel_tool_calls = options.parallel_tool_calls
        self._template_kwargs = template_kwargs(options)

    def prompt(self, messages: Sequence[ChatMessage]) -> tuple[str, list[int]]:
        """The full prompt: a final assistant message is continued, not closed."""
        if self._add_generation_prompt and messages[-1].role == "assistant":
            text = self.render(messages[:-1], generation_prompt=True) + messages[-1].content
        else:
            text = self.render(messages, generation_prompt=self._add_generation_prompt)
        return text, self.encode(text)

    def render(self, messages: Sequence[ChatMessage], *, generation_prompt: bool) -> str:
        conversation = tool_prompt.conversation(
            messages,
            self._tools,
            native=self._native_tools,
            parallel=self._parallel_tool_calls,
        )
        if not self._templated:
            lines = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
            return lines + ("assistant: " if generation_prompt else "")
        for entry in conversation:
            if entry["role"] == "developer":
                entry["role"] = "system"  # the role templates know
        extra: dict[str, Any] = dict(self._template_kwargs)
        if self._native_tools and self._tools:
            extra["tools"] = tool_prompt.tools_json(self._tools)
        templated: Any = self._tokenizer  # has_chat_template checked apply_chat_template
        try:
            text = templated.apply_chat_template(
                conversation, add_generation_prompt=generation_prompt, tokenize=False, **extra
            )
        # Templates are user-written Jinja: they raise TemplateError, ValueError, TypeError...
        except Exception as e:
            raise InvalidRequest(f"the model's chat template rejected the messages: {e}") from e
        if not isinstance(text, str):
            raise InvalidRequest("the model's chat template did not render to a string")
        return text

    def encode(self, text: str) -> list[int]:
        # The template already wrote BOS and friends; the fallback format relies on the tokenizer.
        if self._templated:
            return self.encode_continuation(text)
        return [int(t) for t in self._tokenizer.encode(text)]

    def encode_continuation(self, text: str) -> list[int]:
        """Text that follows other text in the prompt: no BOS of its own."""
        return [int(t) for t in self._tokenizer.encode(text, add_special_tokens=False)]


def template_kwargs(options: ChatOptions) -> dict[str, Any]:
    """``options.template_kwargs`` as keyword arguments for the template; raises
    ``InvalidRequest`` for text that is not a JSON object, or a key the renderer sets itself."""
    text = options.template_kwargs
    if text is None:
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError as error:
        raise InvalidRequest(f"chat_template_kwargs is not JSON ({error})") from None
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be a JSON object of template variables")
    taken = sorted(RENDERER_KWARGS.intersection(kwargs))
    if taken:
        raise InvalidRequest(
            f"chat_template_kwargs must not set {', '.join(taken)}: the server sets it from the "
            "request (send tools, messages and the other fields as themselves)"
        )
    return kwargs


def has_chat_template(tokenizer: object) -> bool:
    """Whether ``tokenizer`` has a chat template (else messages get the fallback format)."""
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        return False
    has = getattr(tokenizer, "has_chat_template", None)  # TokenizerWrapper's flag
    if has is not None:
        return bool(has)
    return getattr(tokenizer, "chat_template", None) is not None  # a bare Hugging Face tokenizer


def _turns(messages: Sequence[ChatMessage]) -> list[list[int]]:
    """Indices of the droppable messages, grouped into turns (each starts at a user message)."""
    turns: list[list[int]] = []
    for i, m in enumerate(messages):
        if m.role in INSTRUCTION_ROLES:
            continue
        if m.role == "user" or not turns:
            turns.append([])
        turns[-1].append(i)
    return turns


def _window(
    renderer: _Renderer, messages: Sequence[ChatMessage], budget: int
) -> tuple[list[ChatMessage], str, list[int], int]:
    """The messages without the fewest oldest turns that makes them fit ``budget`` tokens, their
    prompt text and tokens, and how many turns were dropped.

    When even the latest turn alone does not fit, returns that smallest prompt; the caller's
    context check decides whether it is refused.
    """
    turns = _turns(messages)
    tried: dict[int, tuple[list[ChatMessage], str, list[int]]] = {}

    def without_oldest(drop: int) -> tuple[list[ChatMessage], str, list[int]]:
        if drop not in tried:
            gone = {i for turn in turns[:drop] for i in turn}
            kept = [m for i, m in enumerate(messages) if i not in gone]
            tried[drop] = (kept, *renderer.prompt(kept))
        return tried[drop]

    most = max(len(turns) - 1, 0)
    if len(without_oldest(0)[2]) <= budget:
        return (*without_oldest(0), 0)
    if len(without_oldest(most)[2]) > budget:
        return (*without_oldest(most), most)
    # Fewer messages never render to more tokens, so the fitting drop counts are a suffix range.
    fits, overflows = most, 0
    while fits - overflows > 1:
        middle = (fits + overflows) // 2
        if len(without_oldest(middle)[2]) <= budget:
            fits = middle
        else:
            overflows = middle
    return (*without_oldest(fits), fits)


def _instructions_tokens(
    renderer: _Renderer, messages: Sequence[ChatMessage], tokens: list[int]
) -> int:
    count = 0
    while count < len(messages) and messages[count].role in INSTRUCTION_ROLES:
        count += 1
    if count == 0:
        return 0
    try:
        prefix = renderer.encode(renderer.render(messages[:count], generation_prompt=False))
    except InvalidRequest:
        return 0  # some templates refuse a conversation without a user message
    if len(prefix) <= len(tokens) and tokens[: len(prefix)] == prefix:
        return len(prefix)
    return 0


def _message_ends(
    renderer: _Renderer, messages: Sequence[ChatMessage], text: str, tokens: list[int]
) -> tuple[int, ...]:
    """Token counts at which the latest ``MESSAGE_ENDS`` messages but the final one end.

    Each end is where the closed rendering of the messages up to it stops, when that rendering
    is a text prefix of the prompt and its tokens are the prompt's up to there. Only the text
    since the previous end is tokenized (its tokens must continue the prompt's), so a long
    conversation is tokenized about once, not once per message.
    """
    ends: list[int] = []
    rendered = ""
    for count in range(max(1, len(messages) - MESSAGE_ENDS), len(messages)):
        try:
            prefix = renderer.render(messages[:count], generation_prompt=False)
        except InvalidRequest:
            continue  # some templates refuse a conversation that ends here
        if len(prefix) <= len(rendered) or not text.startswith(prefix):
            continue  # the template renders these messages differently when more follow
        start = ends[-1] if ends else 0
        if rendered:
            piece = renderer.encode_continuation(prefix[len(rendered) :])
        else:
            piece = renderer.encode(prefix)
        end = start + len(piece)
        if end < len(tokens) and tokens[start:end] == piece:
            ends.append(end)
            rendered = prefix
    return tuple(ends)
