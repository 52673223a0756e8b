"""Tests of chat prompt preparation against the tiny model's real tokenizer (ChatML template)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from runtime.errors import ContextLengthExceeded, InvalidRequest
from runtime.testing.tiny_models import tiny_model_path
from runtime.text.chat import MESSAGE_ENDS, ChatMessage, ChatOptions, PreparedPrompt, prepare_chat

BIG_CONTEXT = 2048
DEFAULT = ChatOptions()


@pytest.fixture(scope="module")
def tok() -> Any:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tiny_model_path("llama"))


def system(content: str) -> ChatMessage:
    return ChatMessage("system", content)


def user(content: str) -> ChatMessage:
    return ChatMessage("user", content)


def bot(content: str) -> ChatMessage:
    return ChatMessage("assistant", content)


def reference(tok: Any, messages: list[ChatMessage], generation_prompt: bool = True) -> str:
    """The template rendered directly, bypassing runtime.text.chat."""
    dicts = [{"role": m.role, "content": m.content} for m in messages]
    text = tok.apply_chat_template(dicts, add_generation_prompt=generation_prompt, tokenize=False)
    assert isinstance(text, str)
    return text


def prepare(
    tok: Any,
    messages: list[ChatMessage],
    options: ChatOptions = DEFAULT,
    max_tokens: int = 16,
    context_length: int = BIG_CONTEXT,
) -> PreparedPrompt:
    return prepare_chat(tok, messages, options, max_tokens, context_length)


# --------------------------------------------------------------------------- rendering


def test_rendering_matches_the_chat_template(tok: Any) -> None:
    messages = [system("Be brief."), user("Hello"), bot("Hi there."), user("The capital?")]
    prepared = prepare(tok, messages)
    assert prepared.text == reference(tok, messages)
    assert prepared.text.endswith(
        "<|im_start|>user\nThe capital?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert list(prepared.tokens) == tok.encode(prepared.text, add_special_tokens=False)
    assert prepared.dropped_turns == 0


def test_developer_is_rendered_as_system(tok: Any) -> None:
    prepared = prepare(tok, [ChatMessage("developer", "Rules."), user("Hi")])
    assert prepared.text == reference(tok, [system("Rules."), user("Hi")])


def test_final_assistant_message_is_continued_as_a_prefill(tok: Any) -> None:
    prepared = prepare(tok, [user("Count"), bot("One, two,")])
    assert prepared.text == reference(tok, [user("Count")]) + "One, two,"


def test_without_generation_prompt_every_message_is_a_closed_turn(tok: Any) -> None:
    messages = [user("Count"), bot("One, two.")]
    options = ChatOptions(add_generation_prompt=False)
    prepared = prepare(tok, messages, options)
    assert prepared.text == reference(tok, messages, generation_prompt=False)
    assert prepared.text.endswith("One, two.<|im_end|>\n")


# --------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    ("earlier", "stripped"),
    [
        ("<think>add 2 and 2</think>\n\nIt is 4.", "It is 4."),
        ("<thinking>add 2 and 2</thinking>It is 4.", "It is 4."),
        ("add 2 and 2</think>\nIt is 4.", "It is 4."),  # template opened <think> itself
        ("It is<think>hmm</think> 4.", "It is 4."),
        ("It is 4.<think>cut off by max_tok", "It is 4."),
    ],
)
def test_reasoning_is_stripped_from_earlier_assistant_turns(
    tok: Any, earlier: str, stripped: str
) -> None:
    prefill = "<think>Now 3 and 3"
    prepared = prepare(tok, [user("2+2?"), bot(earlier), user("3+3?"), bot(prefill)])
    assert prepared.text == reference(tok, [user("2+2?"), bot(stripped), user("3+3?")]) + prefill


def test_keep_reasoning_keeps_every_turn_as_sent(tok: Any) -> None:
    messages = [user("2+2?"), bot("<think>add</think>It is 4."), user("3+3?")]
    prepared = prepare(tok, messages, ChatOptions(keep_reasoning=True))
    assert prepared.text == reference(tok, messages)
    assert "<think>add</think>" in prepared.text


# --------------------------------------------------------------------------- instructions prefix


def test_instructions_tokens_is_the_token_prefix_of_the_system_messages(tok: Any) -> None:
    instructions = [system("Be brief."), ChatMessage("developer", "Answer in English.")]
    prepared = prepare(tok, [*instructions, user("Hello"), bot("Hi."), user("Why?")])
    alone = tok.encode(
        reference(
            tok, [system("Be brief."), system("Answer in English.")], generation_prompt=False
        ),
        add_special_tokens=False,
    )
    assert prepared.instructions_tokens == len(alone) > 0
    assert list(prepared.tokens[: prepared.instructions_tokens]) == alone
    # The next request of the session shares exactly that prefix, and diverges right after it.
    other = prepare(tok, [*instructions, user("Goodbye")])
    n = prepared.instructions_tokens
    assert other.instructions_tokens == n and other.tokens[:n] == prepared.tokens[:n]
    assert other.tokens[n:] != prepared.tokens[n:]


def test_instructions_tokens_changes_with_the_system_message(tok: Any) -> None:
    short = prepare(tok, [system("Be brief."), user("Hello")])
    long = prepare(tok, [system("Be brief and answer in plain English, please."), user("Hello")])
    assert long.instructions_tokens > short.instructions_tokens > 0


def test_instructions_tokens_is_zero_without_leading_system_messages(tok: Any) -> None:
    assert prepare(tok, [user("Hello")]).instructions_tokens == 0
    assert prepare(tok, [user("Hello"), system("Late rule."), user("Hi")]).instructions_tokens == 0


class _SystemAloneDiffers:
    """A template that renders a system-only conversation differently (not a token prefix)."""

    has_chat_template = True

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool
    ) -> str:
        body = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return ("ONLY" if all(m["role"] == "system" for m in messages) else "") + body + "[bot]"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * add_special_tokens + [ord(c) for c in text]


def test_instructions_tokens_is_zero_when_not_a_prefix() -> None:
    prepared = prepare_chat(_SystemAloneDiffers(), [system("S"), user("U")], DEFAULT, 4, 100)
    assert prepared.text == "[system]S[user]U[bot]"
    assert prepared.tokens == tuple(map(ord, prepared.text))  # the template wrote any BOS
    assert prepared.instructions_tokens == 0


# --------------------------------------------------------------------------- message ends


def test_message_ends_are_the_token_counts_of_each_earlier_message_closed(tok: Any) -> None:
    messages = [system("Be brief."), user("Hello there"), bot("Hi."), user("What is 2 + 2?")]
    prepared = prepare(tok, messages)
    closed = [
        tok.encode(reference(tok, messages[:count], generation_prompt=False))
        for count in range(1, len(messages))
    ]
    assert prepared.message_ends == tuple(len(prefix) for prefix in closed)
    assert all(list(prepared.tokens[: len(prefix)]) == prefix for prefix in closed)
    assert prepared.message_ends[0] == prepared.instructions_tokens
    # Editing the last message keeps every token up to the end of the one before it.
    edited = prepare(tok, [*messages[:-1], user("What is 3 + 3?")])
    end = prepared.message_ends[-1]
    assert edited.tokens[:end] == prepared.tokens[:end]
    assert edited.message_ends == prepared.message_ends


def test_message_ends_cover_the_latest_messages_only(tok: Any) -> None:
    messages = conversation(12)
    prepared = prepare(tok, messages)
    assert len(messages) - 1 > MESSAGE_ENDS == len(prepared.message_ends)
    first = len(messages) - MESSAGE_ENDS
    closed = tok.encode(reference(tok, messages[:first], generation_prompt=False))
    assert prepared.message_ends[0] == len(closed)
    assert list(prepared.message_ends) == sorted(prepared.message_ends)


class _SystemAloneMarked:
    """A template that marks a system-only conversation, so its rendering is no prompt prefix."""

    has_chat_template = True

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool
    ) -> str:
        body = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        marked = "ONLY" if all(m["role"] == "system" for m in messages) else ""
        return marked + body + ("[bot]" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * add_special_tokens + [ord(c) for c in text]


def test_message_ends_leave_out_a_rendering_that_is_not_a_prefix() -> None:
    messages = [system("S"), user("U"), bot("B"), user("V")]
    prepared = prepare_chat(_SystemAloneMarked(), messages, DEFAULT, 4, 100)
    assert prepared.text == "[system]S[user]U[assistant]B[user]V[bot]"
    assert prepared.message_ends == (len("[system]S[user]U"), len("[system]S[user]U[assistant]B"))


# --------------------------------------------------------------------------- history window

SYSTEM = system("You are a helpful assistant.")


def conversation(turns: int) -> list[ChatMessage]:
    messages = [SYSTEM]
    for i in range(turns):
        messages += [user(f"Question {i}: the quick brown fox?"), bot(f"Answer {i}: it jumps.")]
        if i % 2:
            messages.append(ChatMessage("tool", f"result {i}"))
    return [*messages, user("Last question: why?")]


def test_window_keeps_system_and_the_newest_turns_that_fit(tok: Any) -> None:
    messages = conversation(8)
    full = len(prepare(tok, messages).tokens)
    budget = full * 6 // 10
    prepared = prepare(tok, messages, ChatOptions(history_budget_tokens=budget))

    assert 0 < prepared.dropped_turns < 8
    assert len(prepared.tokens) <= budget
    kept = prepared.text
    assert kept.startswith(reference(tok, [SYSTEM], generation_prompt=False))
    assert "Last question: why?" in kept
    newest_dropped, oldest_kept = prepared.dropped_turns - 1, prepared.dropped_turns
    assert f"Question {newest_dropped}:" not in kept and f"Answer {newest_dropped}:" not in kept
    assert f"Question {oldest_kept}:" in kept
    # Whole turns go: the kept history starts at a user message, never at an orphan reply/result.
    assert kept.index(f"Question {oldest_kept}:") < kept.index(f"Answer {oldest_kept}:")
    # The fewest turns were dropped: keeping one more would not fit.
    one_more = [SYSTEM, *messages[1:]]
    while f"Question {newest_dropped}:" not in one_more[1].content:
        one_more.pop(1)
    assert len(tok.encode(reference(tok, one_more), add_special_tokens=False)) > budget
    # The pinned instructions prefix survives the window.
    assert (
        prepared.tokens[: prepared.instructions_tokens]
        == prepare(tok, messages).tokens[: prepared.instructions_tokens]
    )


def test_window_budget_is_capped_by_context_minus_max_tokens(tok: Any) -> None:
    messages = conversation(8)
    full = len(prepare(tok, messages).tokens)
    options = ChatOptions(history_budget_tokens=BIG_CONTEXT)
    context = full  # with max_tokens=40, the context leaves room for full - 40 prompt tokens
    prepared = prepare(tok, messages, options, max_tokens=40, context_length=context)
    assert prepared.dropped_turns > 0
    assert len(prepared.tokens) <= context - 40


def test_window_that_fits_drops_nothing(tok: Any) -> None:
    messages = conversation(3)
    prepared = prepare(tok, messages, ChatOptions(history_budget_tokens=BIG_CONTEXT))
    assert prepared.dropped_turns == 0
    assert prepared.text == reference(tok, messages)


def test_window_never_drops_the_latest_user_turn(tok: Any) -> None:
    messages = conversation(4)
    latest = [SYSTEM, user("Last question: why?")]
    prepared = prepare(tok, messages, ChatOptions(history_budget_tokens=1))
    # Over the history budget but inside the context: sent, with every earlier turn dropped.
    assert prepared.dropped_turns == 4
    assert prepared.text == reference(tok, latest)


def test_window_raises_when_the_latest_turn_cannot_fit_the_context(tok: Any) -> None:
    messages = conversation(4)
    smallest = len(prepare(tok, [SYSTEM, user("Last question: why?")]).tokens)
    options = ChatOptions(history_budget_tokens=BIG_CONTEXT)
    with pytest.raises(ContextLengthExceeded, match=r"\b3 tokens over the context length of "):
        prepare(tok, messages, options, max_tokens=10, context_length=smallest + 7)


# --------------------------------------------------------------------------- no window


def test_without_a_window_nothing_is_dropped(tok: Any) -> None:
    messages = conversation(8)
    prepared = prepare(tok, messages)
    exact = len(prepared.tokens) + 16
    again = prepare(tok, messages, max_tokens=16, context_length=exact)
    assert again.dropped_turns == 0 and again.text == reference(tok, messages)


def test_without_a_window_a_prompt_too_long_raises(tok: Any) -> None:
    messages = conversation(8)
    length = len(prepare(tok, messages).tokens)
    with pytest.raises(ContextLengthExceeded, match=rf"is {length} tokens .* 5 tokens over"):
        prepare(tok, messages, max_tokens=16, context_length=length + 11)


# --------------------------------------------------------------------------- invalid input


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty"),
        ([ChatMessage("wizard", "hi")], r"messages\[0\]\.role 'wizard' is not one of"),  # type: ignore[arg-type]
        ([user("hi"), ChatMessage("user", 7)], r"messages\[1\]\.content must be a string"),  # type: ignore[arg-type]
        ([{"role": "user", "content": "hi"}], r"messages\[0\] must be a ChatMessage"),
        ("hello", "non-empty list"),
    ],
)
def test_invalid_messages_are_refused(tok: Any, messages: Any, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        prepare(tok, messages)


@pytest.mark.parametrize(
    ("options", "max_tokens", "context_length", "match"),
    [
        (DEFAULT, 0, BIG_CONTEXT, "max_tokens must be at least 1"),
        (DEFAULT, 16, 0, "context_length must be at least 1"),
        (ChatOptions(history_budget_tokens=0), 16, BIG_CONTEXT, "history_budget_tokens"),
    ],
)
def test_invalid_limits_are_refused(
    tok: Any, options: ChatOptions, max_tokens: int, context_length: int, match: str
) -> None:
    with pytest.raises(InvalidRequest, match=match):
        prepare(tok, [user("hi")], options, max_tokens, context_length)


def test_decoding_a_message_refuses_unknown_roles_and_fields() -> None:
    decode = msgspec.json.Decoder(list[ChatMessage]).decode
    assert decode(b'[{"role": "tool", "content": "42"}]') == [ChatMessage("tool", "42")]
    with pytest.raises(msgspec.ValidationError):
        decode(b'[{"role": "wizard", "content": "hi"}]')
    with pytest.raises(msgspec.ValidationError):
        decode(b'[{"role": "user", "content": "hi", "name": "x"}]')


class _RejectingTemplate:
    has_chat_template = True

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise ValueError("Conversation roles must alternate user/assistant")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("never reached")


def test_a_template_that_rejects_the_messages_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match=r"chat template rejected .* must alternate"):
        prepare_chat(_RejectingTemplate(), [user("a"), user("b")], DEFAULT, 4, 100)


# --------------------------------------------------------------------------- no template

BOS_ID = 1


class _PlainTokenizer:
    """No chat template: its ``apply_chat_template`` must not be called. One token per char."""

    has_chat_template = False

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise AssertionError("a template-less tokenizer's apply_chat_template was called")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BOS_ID] * add_special_tokens + [ord(c) for c in text]


class _BareEncoder:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_template_less_tokenizer_gets_the_fallback_format() -> None:
    messages = [system("S"), ChatMessage("developer", "D"), user("hi"), bot("yo"), user("go")]
    prepared = prepare_chat(_PlainTokenizer(), messages, DEFAULT, 4, 100)
    text = "system: S\ndeveloper: D\nuser: hi\nassistant: yo\nuser: go\nassistant: "
    assert prepared.text == text
    assert prepared.tokens == (BOS_ID, *map(ord, text))
    assert prepared.instructions_tokens == 1 + len("system: S\ndeveloper: D\n")
    lines = ("system: S\n", "developer: D\n", "user: hi\n", "assistant: yo\n")
    # The first piece is tokenized as the prompt is (BOS first), the later ones without a BOS.
    assert prepared.message_ends == tuple(1 + len("".join(lines[:n])) for n in range(1, 5))


def test_template_less_fallback_continues_a_prefill_and_windows() -> None:
    messages = [system("S"), user("old"), bot("reply"), user("new"), bot("Sure")]
    options = ChatOptions(history_budget_tokens=len("system: S\nuser: new\nassistant: Sure"))
    prepared = prepare_chat(_BareEncoder(), messages, options, 4, 100)
    assert prepared.text == "system: S\nuser: new\nassistant: Sure"
    assert prepared.dropped_turns == 1
