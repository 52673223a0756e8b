"""One request value (docs/design.md, "One request value"): the HTTP server and the host API
build the same ``Request``, ``submit`` sends one as it is, and a field the request's kind does not
use is refused by name, never dropped."""

from __future__ import annotations

import msgspec
import pytest

from runtime.backends.simulated import greedy_continuation
from runtime.errors import InvalidRequest
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Finished, Request, Sampling
from runtime.server.schema import CompletionRequest
from runtime.server.translate import completion_call
from runtime.testing.harness import sim_spec

pytestmark = pytest.mark.anyio

PROMPT = (5, 6, 7, 8)


def test_the_server_and_the_host_api_build_the_same_request() -> None:
    body = CompletionRequest(
        model="m", prompt=list(PROMPT), max_tokens=3, temperature=0.5, stop=["zz"], seed=3
    )
    from_http = completion_call(body).request
    by_hand = Request(
        model="m",
        prompt_tokens=PROMPT,
        max_tokens=3,
        sampling=Sampling(temperature=0.5, seed=3),
        stop=("zz",),
        anonymous=True,  # no session: the server cannot tell its clients apart
    )
    assert from_http == by_hand
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(from_http), type=Request) == from_http


async def test_submit_sends_a_request_as_it_is_and_generate_builds_the_same_one() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=16 << 20)) as rt:
        await rt.load_model(sim_spec("m"))
        by_keywords = await rt.complete("m", prompt_tokens=list(PROMPT), max_tokens=5)
        async with rt.submit(Request(model="m", prompt_tokens=PROMPT, max_tokens=5)) as stream:
            events = [event async for event in stream]
        assert isinstance(events[-1], Finished)
        assert by_keywords.token_ids == tuple(greedy_continuation(PROMPT, 5))
        submitted = [t for e in events for t in getattr(e, "token_ids", ())]
        assert tuple(submitted) == by_keywords.token_ids
        warmed = await rt.submit_prewarm(Request(model="m", prompt_tokens=(*PROMPT, 9)))
        assert isinstance(warmed, Finished)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sampling", Sampling(temperature=0.7)),
        ("stop", ("x",)),
        ("supersede", True),
        ("stall_timeout_s", 5.0),
        ("reuse_prefix", False),
        ("keep_alive_s", 10.0),
    ],
)
async def test_a_prewarm_refuses_a_field_only_a_generate_uses(field: str, value: object) -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=16 << 20)) as rt:
        await rt.load_model(sim_spec("m"))
        asked = msgspec.structs.replace(Request(model="m", prompt_tokens=PROMPT), **{field: value})
        with pytest.raises(InvalidRequest, match=f"{field} has no effect on a prewarm"):
            await rt.submit_prewarm(asked)


async def test_a_generate_refuses_keep_on_disk_and_an_unknown_keyword() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=16 << 20)) as rt:
        await rt.load_model(sim_spec("m"))
        with pytest.raises(InvalidRequest, match="keep_on_disk has no effect on a generate"):
            rt.submit(Request(model="m", prompt_tokens=PROMPT, keep_on_disk=True))
        with pytest.raises(TypeError, match="max_tokns"):
            rt.generate("m", prompt_tokens=PROMPT, max_tokns=3)  # type: ignore[call-arg]
