"""Tools on the wire → the runtime's ``Tool`` list, chat messages' tool fields and the constraint.

``tools`` (function tools only), ``tool_choice`` and ``parallel_tool_calls`` become a ``ToolSetup``:
which tools the prompt shows, whether the output is parsed for calls, and, for ``required`` or a
named function, the grammar that makes the output call blocks whose arguments follow the function's
JSON Schema (runtime/text/tool_calls.py). The defaults and rules are OpenAI's. Bad input is a 400
naming the field: ``invalid_tools``, ``invalid_schema`` (a schema the grammar engine cannot read) or
``unknown_tool``.

Each ``tool_choice`` and what it does: docs/structured.md, "tool_choice" and "Refusals".
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal, TypeVar

import msgspec

from runtime.errors import InvalidSchema, MlxRuntimeError
from runtime.messages import ChatOptions, GrammarConstraint, JsonSchemaConstraint, Tool, ToolCall
from runtime.server.errors import HttpError
from runtime.server.schema import ChatCompletionRequest, PrewarmRequest, WireChatMessage
from runtime.text.tool_calls import tool_call_grammar
from runtime.text.tools import FUNCTION_NAME

INVALID_TOOLS: Final = "invalid_tools"
UNKNOWN_TOOL: Final = "unknown_tool"
_NO_ARGUMENTS: Final = '{"type": "object", "properties": {}}'

Choice = Literal["none", "auto", "required"]
_T = TypeVar("_T")


class ToolSetup(msgspec.Struct, frozen=True, kw_only=True):
    """One request's tools: ``chat_tools`` go into the prompt, ``names`` are parsed for in the
    output (empty: calls are not parsed), ``constraint`` forces calls (or None)."""

    tools: tuple[Tool, ...]
    choice: Choice
    function: str | None  # the one function a named tool_choice forces
    parallel: bool

    @property
    def chat_tools(self) -> tuple[Tool, ...]:
        return () if self.choice == "none" else self.tools

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool.name for tool in self.chat_tools)

    @property
    def ends_on_repeat(self) -> bool:
        """Several forced calls: a repeated one ends the reply (module docstring)."""
        return self.choice == "required" and self.function is None and self.parallel

    @property
    def constraint(self) -> GrammarConstraint | None:
        if self.choice != "required" and self.function is None:
            return None
        # A named function is called once (as vLLM does): a small model left free to repeat
        # the call block does so until max_tokens.
        parallel = self.parallel and self.function is None
        return tool_call_grammar(self.tools, only=self.function, parallel=parallel)


class _Function(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class _FunctionTool(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: _Function


class _CalledFunction(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class _AssistantCall(msgspec.Struct, frozen=True):
    id: str
    function: _CalledFunction
    type: Literal["function"] = "function"


class _ChosenName(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class _NamedChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: _ChosenName


def tool_setup(request: ChatCompletionRequest | PrewarmRequest) -> ToolSetup | None:
    """The request's tools, or None when it has none and no tool_choice; raises ``HttpError``.

    A chat prewarm takes the same fields, so it renders the prompt its chat request will."""
    if request.tools is None and request.tool_choice in (None, "none"):
        return None
    tools = _tools(request.tools)
    choice, function = _choice(request.tool_choice, tools)
    return ToolSetup(
        tools=tools,
        choice=choice,
        function=function,
        parallel=request.parallel_tool_calls is not False,
    )


def chat_options(setup: ToolSetup | None) -> ChatOptions:
    """How the server renders a chat prompt: tools added, no history window."""
    if setup is None:
        return ChatOptions()
    return ChatOptions(tools=setup.chat_tools, parallel_tool_calls=setup.parallel)


def tool_fields(where: str, message: WireChatMessage) -> tuple[tuple[ToolCall, ...], str | None]:
    """An assistant message's calls and a tool message's call id, checked."""
    calls: tuple[ToolCall, ...] = ()
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise _bad(f"{where}.tool_calls", f"{where}.tool_calls is for assistant messages")
        wire = _convert(f"{where}.tool_calls", message.tool_calls, list[_AssistantCall])
        calls = tuple(_call(f"{where}.tool_calls[{i}]", c) for i, c in enumerate(wire))
    if message.role == "tool" and message.tool_call_id is None:
        raise _bad(
            f"{where}.tool_call_id",
            f"{where} is a tool message without tool_call_id; name the call it answers",
        )
    if message.role != "tool" and message.tool_call_id is not None:
        raise _bad(f"{where}.tool_call_id", f"{where}.tool_call_id is for tool messages")
    return calls, message.tool_call_id


def check_answers(messages: list[WireChatMessage]) -> None:
    """Each tool message answers a call made by an earlier assistant message (as OpenAI checks)."""
    made: set[str] = set()
    for i, message in enumerate(messages):
        if isinstance(message.tool_calls, list):
            made.update(str(c.get("id")) for c in message.tool_calls if isinstance(c, dict))
        if message.role == "tool" and message.tool_call_id not in made:
            raise _bad(
                f"messages[{i}].tool_call_id",
                f"messages[{i}] answers tool call {message.tool_call_id!r}, which no earlier "
                "assistant message made; send the assistant message with its tool_calls first",
            )


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    wire = _convert("tools", value, list[_FunctionTool])
    tools: list[Tool] = []
    for i, tool in enumerate(wire):
        name = tool.function.name
        if FUNCTION_NAME.fullmatch(name) is None:
            raise _bad(
                f"tools[{i}].function.name",
                f"tools[{i}].function.name {name!r} must be 1 to 64 letters, digits, '_' or '-'",
            )
        if any(t.name == name for t in tools):
            raise _bad(f"tools[{i}].function.name", f"two tools are named {name!r}; rename one")
        tools.append(
            Tool(
                name=name,
                description=tool.function.description,
                parameters=_parameters(f"tools[{i}].function.parameters", tool.function),
            )
        )
    return tuple(tools)


def _parameters(where: str, function: _Function) -> str:
    schema = function.parameters
    if schema is None:
        return _NO_ARGUMENTS
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        got = schema.get("type") if isinstance(schema, dict) else type(schema).__name__
        raise HttpError(
            400,
            f"{where}: a function's parameters must be a JSON Schema of type object (got "
            f'{got!r}); wrap a single value as {{"type": "object", "properties": {{...}}}}',
            code=InvalidSchema.code,
            param=where,
        )
    text = json.dumps(schema)
    # The grammar engine reads the schema now, so a bad one is refused before any work.
    from runtime.text.constraints import grammar_of

    try:  # strict: the schema must be enforceable in full, as OpenAI's strict functions are
        grammar_of(JsonSchemaConstraint(schema=text, strict=function.strict is True))
    except MlxRuntimeError as error:
        raise HttpError(400, f"{where}: {error.message}", code=error.code, param=where) from None
    return text


def _choice(value: Any, tools: tuple[Tool, ...]) -> tuple[Choice, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise _bad("tool_choice", f'tool_choice "{value}" needs tools; send the tools')
        return value, None
    if isinstance(value, str):
        raise _bad(
            "tool_choice",
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
            f'"function": {{"name": ...}}}} (got {value!r})',
        )
    name = _convert("tool_choice", value, _NamedChoice).function.name
    if all(tool.name != name for tool in tools):
        known = ", ".join(tool.name for tool in tools) or "none"
        raise HttpError(
            400,
            f"tool_choice names function {name!r}, which is not among the tools ({known})",
            code=UNKNOWN_TOOL,
            param="tool_choice",
        )
    return "required", name


def _call(where: str, call: _AssistantCall) -> ToolCall:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise _bad(
            f"{where}.function.arguments",
            f"{where}.function.arguments must be a JSON object's text, as the model returned it",
        )
    return ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)


def _convert(where: str, value: Any, kind: type[_T]) -> _T:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as error:
        detail = str(error).replace("`$", f"`{where}")
        raise _bad(where, f"{where} is malformed: {detail}") from None


def _bad(param: str, message: str) -> HttpError:
    return HttpError(400, message, code=INVALID_TOOLS, param=param)
