"""The host API's typed keywords (runtime/host/options.py) against ``Request``: a request field
added without its keyword fails here, and the keywords reach the engine."""

from __future__ import annotations

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
