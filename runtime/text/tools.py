"""Tools in the chat prompt: the template's own tool rendering, or a documented fallback.

A chat template *supports tools* when its Jinja text uses the ``tools`` variable (Qwen 2.5/3, Llama
3.1; not Gemma 3's). Then the tools go to ``apply_chat_template(..., tools=[...])`` and tool calls
and ``tool`` messages pass in the Hugging Face chat format. Otherwise the fallback, in the Hermes
format ``runtime.text.tool_calls`` parses: the tools listed in a system-prompt section
(``tools_section``), an assistant's calls appended as ``<tool_call>`` blocks, and consecutive
``tool`` messages made one user message of ``<tool_response>`` blocks, so templates that insist on
alternation (Gemma 3's) accept the conversation. See docs/structured.md, "In the prompt".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Final

from runtime.errors import InvalidRequest
from runtime.messages import ChatMessage, Tool, ToolCall

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "Conversation",
    "call_block",
    "conversation",
    "template_supports_tools",
    "tools_json",
    "tools_section",
    "validate_tools",
]

CALL_OPEN: Final = "<tool_call>"
CALL_CLOSE: Final = "</tool_call>"
RESPONSE_OPEN: Final = "<tool_response>"
RESPONSE_CLOSE: Final = "</tool_response>"
# OpenAI's rule for function names; it also keeps names safe inside the tags and the grammar.
FUNCTION_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_USES_TOOLS: Final = re.compile(r"\btools\b")

Conversation = list[dict[str, Any]]


def template_supports_tools(tokenizer: object) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself (see the module docstring).

    Hugging Face keeps named templates in a dict; with tools it picks ``tool_use`` when present.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and _USES_TOOLS.search(template) is not None


def validate_tools(tools: Sequence[Tool]) -> None:
    """Raises ``InvalidRequest`` for a tool the prompt or a constraint could not use."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Tool):
            raise InvalidRequest(f"tools[{i}] must be a Tool (got {type(tool).__name__})")
        if FUNCTION_NAME.fullmatch(tool.name) is None:
            raise InvalidRequest(
                f"tools[{i}].name {tool.name!r} must be 1 to 64 letters, digits, '_' or '-'"
            )
        if tool.name in seen:
            raise InvalidRequest(f"tools[{i}].name {tool.name!r} names two tools; rename one")
        seen.add(tool.name)
        try:
            parameters = json.loads(tool.parameters)
        except ValueError as error:
            raise InvalidRequest(
                f"tools[{i}].parameters is not JSON text ({error}); send a JSON Schema object"
            ) from None
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"tools[{i}].parameters must be a JSON Schema object")


def tool_json(tool: Tool) -> dict[str, Any]:
    """The OpenAI form of a tool, as templates (and the fallback section) show it."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = json.loads(tool.parameters)
    return {"type": "function", "function": function}


def tools_section(tools: Sequence[Tool], *, parallel: bool) -> str:
    """The fallback system-prompt section: the functions' schemas and the call format."""
    listed = "\n".join(json.dumps(tool_json(tool), ensure_ascii=False) for tool in tools)
    how_many = (
        "You may make several calls in one reply, one block per call."
        if parallel
        else "Make at most one call per reply."
    )
    return (
        "# Tools\n\n"
        "You may call functions to help with the user's request. The functions, one JSON "
        f"object per line:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments between "
        f"{CALL_OPEN} and {CALL_CLOSE} tags:\n"
        f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
        f"{CALL_CLOSE}\n{how_many} A function's result comes back in a {RESPONSE_OPEN} block."
    )


def call_block(call: ToolCall) -> str:
    """One call as the fallback format (and the Hermes format) writes it."""
    arguments = _arguments(call)
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def conversation(
    messages: Sequence[ChatMessage], tools: Sequence[Tool], *, native: bool, parallel: bool
) -> Conversation:
    """The messages as ``apply_chat_template`` takes them (roles as given: the caller renames
    ``developer``); ``native``: the template renders tools (pass ``tools_json(tools)`` along),
    else the fallback format described above."""
    if native:
        return [_native_message(m) for m in messages]
    # A conversation that never involved tools renders as it always did (``tool`` role kept).
    uses_tools = bool(tools) or any(m.tool_calls for m in messages)
    converted: Conversation = []
    for i, m in enumerate(messages):
        if m.role == "tool" and uses_tools:
            block = f"{RESPONSE_OPEN}\n{m.content}\n{RESPONSE_CLOSE}"
            if i > 0 and messages[i - 1].role == "tool":  # one user turn for a run of results
                converted[-1]["content"] += "\n" + block
            else:
                converted.append({"role": "user", "content": block})
            continue
        content = m.content
        if m.tool_calls:
            blocks = "\n".join(call_block(call) for call in m.tool_calls)
            content = f"{content}\n{blocks}" if content else blocks
        converted.append({"role": m.role, "content": content})
    if tools:
        section = tools_section(tools, parallel=parallel)
        if converted and converted[0]["role"] in ("system", "developer"):
            converted[0]["content"] = f"{converted[0]['content']}\n\n{section}"
        else:
            converted.insert(0, {"role": "system", "content": section})
    return converted


def tools_json(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [tool_json(tool) for tool in tools]


def _native_message(m: ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call)},
            }
            for call in m.tool_calls
        ]
    if m.tool_call_id is not None:
        entry["tool_call_id"] = m.tool_call_id
    return entry


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as a value: templates serialize them (``tojson``) themselves."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        raise InvalidRequest(
            f"tool call {call.id!r} has arguments that are not JSON text; send a JSON object"
        ) from None
