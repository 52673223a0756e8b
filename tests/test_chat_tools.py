"""Tools in the chat prompt: the fallback format on templates without tools (the tiny models',
SmolLM2's, a template-less one), the template's own rendering when it has one, and a round trip's
second prompt continuing the first prompt and the call the model made."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import InvalidRequest
from runtime.messages import ChatMessage, ChatOptions, ModelSpec, Tool, ToolCall
from runtime.testing.tiny_models import tiny_model_path
from runtime.text.chat import prepare_chat
from runtime.text.tools import call_block, template_supports_tools, tools_section

WEATHER = Tool(
    name="get_weather",
    description="The weather in a city",
    parameters='{"type": "object", "properties": {"city": {"type": "string"}}}',
)
CALL = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
ASK = ChatMessage("user", "Weather in Paris?")
CALLED = ChatMessage("assistant", "", (CALL,))
RESULT = ChatMessage("tool", '{"temperature": 21}', (), "call_1")
BAD = ToolCall(id="call_2", name="get_weather", arguments="city=Paris")
# A Hermes-style template that renders tools itself (the shape of Qwen 2.5's, much shortened).
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %} (answers {{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok() -> Any:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tiny_model_path("llama"))


@pytest.fixture(scope="module")
def native() -> Any:
    from transformers import PreTrainedTokenizerFast

    from runtime.testing.tiny_tokenizer import IM_END, train_tiny_tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_tokenizer(), eos_token=IM_END, chat_template=NATIVE_TEMPLATE
    )


def prepare(tokenizer: Any, messages: list[ChatMessage], **options: Any) -> str:
    return prepare_chat(tokenizer, messages, ChatOptions(**options), 16, 4096).text


def test_a_template_without_tools_gets_the_fallback_section_and_blocks(tok: Any) -> None:
    assert not template_supports_tools(tok)
    text = prepare(tok, [ASK, CALLED, RESULT, RESULT], tools=(WEATHER,))
    block = f"<tool_response>\n{RESULT.content}\n</tool_response>"
    expected = [
        {"role": "system", "content": tools_section([WEATHER], parallel=True)},
        {"role": "user", "content": ASK.content},
        {"role": "assistant", "content": call_block(CALL)},
        {"role": "user", "content": f"{block}\n{block}"},  # one user turn: roles alternate
    ]
    assert text == tok.apply_chat_template(expected, add_generation_prompt=True, tokenize=False)
    assert '"name": "get_weather"' in text and '"description": "The weather in a city"' in text


def test_the_section_joins_a_leading_system_message_and_says_how_many_calls(tok: Any) -> None:
    system = ChatMessage("developer", "Be brief.")
    text = prepare(tok, [system, ASK], tools=(WEATHER,), parallel_tool_calls=False)
    section = tools_section([WEATHER], parallel=False)
    assert "Make at most one call per reply." in section
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{section}<|im_end|>\n")


def test_a_template_less_tokenizer_gets_the_fallback_in_its_line_format() -> None:
    class Plain:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(c) for c in text]

    text = prepare(Plain(), [ASK, CALLED, RESULT], tools=(WEATHER,))
    assert text.startswith("system: # Tools")
    assert text.endswith(
        f"user: {ASK.content}\nassistant: {call_block(CALL)}\n"
        f"user: <tool_response>\n{RESULT.content}\n</tool_response>\nassistant: "
    )


def test_a_template_with_tools_renders_them_and_the_calls_itself(native: Any) -> None:
    assert template_supports_tools(native)
    assert template_supports_tools(
        type("Named", (), {"chat_template": {"tool_use": "{{ tools }}"}})()
    )
    text = prepare(native, [ASK, CALLED, RESULT], tools=(WEATHER,))
    assert "# Tools" not in text  # no fallback section
    listed = json.loads(text.split("<tools>")[1].split("</tools>")[0])
    assert listed["function"]["parameters"] == json.loads(WEATHER.parameters)
    # Arguments reach the template as a value (templates serialize them), the call id too.
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "(answers call_1)" in text


def test_the_second_prompt_of_a_round_trip_continues_the_first_and_the_call(tok: Any) -> None:
    first = prepare(tok, [ASK], tools=(WEATHER,))
    second = prepare(tok, [ASK, CALLED, RESULT], tools=(WEATHER,))
    # What the model wrote (the fallback's own format) is what the history renders: reused.
    assert second.startswith(first + call_block(CALL) + "<|im_end|>")


def test_tool_fields_on_the_wrong_messages_and_bad_tools_are_refused(tok: Any) -> None:
    for messages, tools, words in (
        ([ChatMessage("user", "x", (CALL,))], (), "tool_calls is for assistant messages"),
        ([ChatMessage("user", "x", (), "call_1")], (), "tool_call_id is for tool messages"),
        ([ASK], (Tool(name="get weather"),), "must be 1 to 64 letters"),
        ([ASK], (WEATHER, WEATHER), "names two tools"),
        ([ASK], (Tool(name="f", parameters="{"),), "is not JSON text"),
        ([ASK], (Tool(name="f", parameters="[]"),), "must be a JSON Schema object"),
        ([ASK, ChatMessage("assistant", "", (BAD,)), RESULT], (), "arguments that are not JSON"),
        ([ASK, CALLED], (), "assistant message with tool_calls and nothing after it"),
    ):
        with pytest.raises(InvalidRequest, match=words):
            prepare(tok, messages, tools=tools)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_the_real_models_templates_take_the_fallback(
    name: str, real_gguf: Callable[[str], Path]
) -> None:
    from mlx_lm.utils import load_tokenizer

    from runtime.backends.model_source import prepare_model

    real_gguf(name)  # skips (or fails under CI) like every real-model test
    tokenizer = load_tokenizer(prepare_model(ModelSpec(name=name, path=name)).path)
    assert not template_supports_tools(tokenizer)  # SmolLM2's template has none, Gemma's GGUF none
    first = prepare(tokenizer, [ASK], tools=(WEATHER,))
    second = prepare(tokenizer, [ASK, CALLED, RESULT], tools=(WEATHER,))
    assert "<tools>" in first and second.startswith(first + call_block(CALL))
