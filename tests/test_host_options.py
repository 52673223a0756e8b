"""The hand lists of ``Request``'s fields against ``Request``: the host API's typed keywords
(runtime/host/options.py) and the HTTP translation (runtime/server/translate.py). A request field
added without its keyword, or without its wire field, fails here; the keywords reach the engine."""

from __future__ import annotations

import ast
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import pytest

from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.host.options import EXTRAS, GenerateOptions, PrewarmOptions
from runtime.messages import GENERATE_ONLY, PREWARM_ONLY, Finished, Request
from runtime.testing.harness import sim_spec

POSITIONAL = {"model", "prompt"}


def _members(hint: Any) -> set[Any]:
    """A type's union members, a list or a ``Sequence`` read as the tuple it is held as."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    held: set[Any] = set()
    for member in members:
        origin = typing.get_origin(member)
        if origin in (list, Sequence):
            held.add(tuple[typing.get_args(member)[0], ...])  # type: ignore[valid-type]
        else:
            held.add(member)
    return held


@pytest.mark.parametrize(
    ("options", "other_kinds", "extras"),
    [
        (GenerateOptions, PREWARM_ONLY, EXTRAS),
        (PrewarmOptions, GENERATE_ONLY, {"request_id"}),
    ],
)
def test_the_keywords_are_requests_fields_and_the_documented_extras(
    options: type, other_kinds: tuple[str, ...], extras: set[str]
) -> None:
    fields = set(Request.__struct_fields__) - POSITIONAL - set(other_kinds)
    assert set(typing.get_type_hints(options)) == fields | set(extras)


@pytest.mark.parametrize("options", [GenerateOptions, PrewarmOptions])
def test_each_keyword_takes_what_its_field_holds(options: type) -> None:
    request = typing.get_type_hints(Request)
    for name, hint in typing.get_type_hints(options).items():
        if name not in request:
            continue
        wanted, given = _members(request[name]), _members(hint)
        # A keyword may also take None for "the default" (``chat``, ``sampling``), nothing else.
        assert wanted <= given <= wanted | {type(None)}, (name, hint, request[name])


@pytest.mark.anyio
async def test_ignore_eos_given_as_a_keyword_reaches_the_engine() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=16 << 20)) as rt:
        await rt.load_model(sim_spec("m", eos_every=1))  # EOS is always the next token
        ended = await rt.complete("m", prompt_tokens=[5, 6, 7], max_tokens=4)
        ran_on = await rt.complete("m", prompt_tokens=[5, 6, 7], max_tokens=4, ignore_eos=True)
    assert isinstance(ended.terminal, Finished) and ended.terminal.reason == "stop"
    assert ended.token_ids == ()
    assert isinstance(ran_on.terminal, Finished) and ran_on.terminal.reason == "length"
    assert len(ran_on.token_ids) == 4


def _keywords_in(function: str, module: pathlib.Path) -> set[str]:
    """The ``Request`` fields a function of the HTTP translation sets: the keywords of its
    ``RuntimeRequest(...)`` calls and of its ``msgspec.structs.replace(...)`` calls."""
    tree = ast.parse(module.read_text())
    (found,) = (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    names: set[str] = set()
    for node in ast.walk(found):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "RuntimeRequest",
            "msgspec.structs.replace",
        ):
            names |= {k.arg for k in node.keywords if k.arg is not None}
    return names & set(Request.__struct_fields__)


def test_the_http_translation_sets_every_request_field() -> None:
    """A request field the HTTP server never sets is one its clients cannot send: adding a field
    to ``Request`` fails here until translate.py maps a wire field to it (or the field is the
    other kind's)."""
    translate = pathlib.Path(__file__).parent.parent / "runtime" / "server" / "translate.py"
    fields = set(Request.__struct_fields__)
    generate = _keywords_in("_call", translate) | _keywords_in("chat_call", translate)
    assert generate == fields - set(PREWARM_ONLY)
    prewarm = fields - set(GENERATE_ONLY)
    assert _keywords_in("prewarm_call", translate) == prewarm
