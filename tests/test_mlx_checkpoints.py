"""Checkpoints past the anchors, on the real MLX backend (tiny sliding-window and hybrid models).

A cache that cannot be trimmed is reused only at the checkpoints its prefill snapshotted. With
the default options (``checkpoint_every_tokens`` 512) these models' snapshots are cheap (one
32-token window, or a 38 KiB recurrent state: the full-attention KV of ~32-38 tokens), so they
checkpoint every 64 tokens, and at the end of every chat message. Each test checks the reuse
count against that rule and the greedy output against a cold run of the same prompt (a second
load of the model, reset before each run); one checks the snapshots' bytes in the KV budget.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from mlx_lm.utils import load_tokenizer

from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.host.streams import Completion
from runtime.messages import ChatMessage, ChatOptions, Finished, ModelSpec, ReusePath
from runtime.testing.harness import common_prefix_length, wait_until
from runtime.testing.tiny_models import TinyModelKind, tiny_model_path
from runtime.text.chat import prepare_chat
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


KINDS: tuple[TinyModelKind, ...] = ("sliding", "hybrid")
SPACING = 64  # what CheckpointPolicy.spacing gives both layouts (tests/test_checkpoints.py)
MAX_TOKENS = 4
# A 32-token window of both sliding layers (1 KiB a token), or the recurrent state (measured).
SNAPSHOT_BYTES = {"sliding": 32 * 1024, "hybrid": 38912}


def config() -> RuntimeConfig:
    return RuntimeConfig(kv_budget_bytes=512 << 20)


def spec(kind: TinyModelKind, name: str) -> ModelSpec:
    return ModelSpec(name=name, backend="mlx", path=str(tiny_model_path(kind)))


def long_prompt(n: int, seed: int) -> list[int]:
    """Random tokens, none of which ends a line (so no line-start points: plan_checkpoints)."""
    rng = random.Random(seed)
    decode = load_tokenizer(tiny_model_path("llama")).decode  # every kind's tokenizer is one
    ids = [t for t in range(5, 500) if "\n" not in decode([t])]
    return [rng.choice(ids) for _ in range(n)]


async def start(rt: Runtime, kind: TinyModelKind) -> None:
    await rt.load_model(spec(kind, "warm"))
    await rt.load_model(spec(kind, "cold"))


async def run(rt: Runtime, model: str, **request: object) -> Completion:
    result = await rt.complete(model, max_tokens=MAX_TOKENS, **request)
    assert isinstance(result.terminal, Finished), result.terminal
    assert result.started is not None
    return result


async def cold(rt: Runtime, **request: object) -> tuple[int, ...]:
    await rt.reset("cold")
    result = await run(rt, "cold", **request)
    assert result.started is not None and result.started.cached_tokens == 0
    return result.token_ids


def deepest_checkpoint(points: Sequence[int], shared: int) -> int:
    return max((p for p in points if p <= shared), default=0)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_prompt_diverging_after_hundreds_of_tokens_reuses_the_checkpoint_below(
    kind: TinyModelKind,
) -> None:
    first = long_prompt(300, seed=1)
    second = first[:265] + long_prompt(40, seed=2)
    assert common_prefix_length(first, second) == 265
    async with Runtime(config()) as rt:
        await start(rt, kind)
        await run(rt, "warm", prompt_tokens=first)
        reused = await run(rt, "warm", prompt_tokens=second)

        assert reused.started is not None
        assert reused.started.path is ReusePath.CHECKPOINT
        # The multiple of 64 at or below the divergence (with a 512 spacing it would be 0).
        assert reused.started.cached_tokens == 265 // SPACING * SPACING == 256
        assert reused.token_ids == await cold(rt, prompt_tokens=second)


@pytest.mark.parametrize("kind", KINDS)
async def test_editing_the_last_chat_message_reuses_every_message_before_it(
    kind: TinyModelKind,
) -> None:
    story = "the keeper climbed the tower every evening and trimmed the wicks of the lamp " * 3
    history = [
        ChatMessage("system", "You answer questions about lighthouses in one short line."),
        ChatMessage("user", f"Read this: {story}"),
        ChatMessage("assistant", f"I read it. In short: {story}"),
    ]
    asked = [*history, ChatMessage("user", "When did he climb the tower?")]
    edited = [*history, ChatMessage("user", "Why did he trim the wicks?")]
    tokenizer = load_tokenizer(tiny_model_path(kind))
    first = prepare_chat(tokenizer, asked, ChatOptions(), MAX_TOKENS, 2048)
    second = prepare_chat(tokenizer, edited, ChatOptions(), MAX_TOKENS, 2048)
    shared = common_prefix_length(first.tokens, second.tokens)
    end = first.message_ends[-1]  # where the assistant's message ends
    assert len(first.message_ends) == 3 and end <= shared < end + 8
    assert end > 2 * 32  # past two windows: the state at the end has wrapped
    async with Runtime(config()) as rt:
        await start(rt, kind)
        await run(rt, "warm", messages=asked)
        reused = await run(rt, "warm", messages=edited)

        assert reused.started is not None
        assert reused.started.path is ReusePath.CHECKPOINT
        # The edited message's header ends a line: the state after it is a line-start point.
        header = next(i for i in range(end, shared) if "\n" in tokenizer.decode([first.tokens[i]]))
        periodic = range(SPACING, shared + 1, SPACING)
        points = [*periodic, end, header + 1]
        assert reused.started.cached_tokens == deepest_checkpoint(points, shared) == header + 1
        assert reused.token_ids == await cold(rt, messages=edited)


@pytest.mark.parametrize("kind", KINDS)
async def test_the_snapshots_bytes_are_part_of_the_entry_and_of_the_kv_budget(
    kind: TinyModelKind,
) -> None:
    prompt = long_prompt(700, seed=3)
    async with Runtime(config()) as rt:
        await start(rt, kind)
        await run(rt, "warm", prompt_tokens=prompt)
        await settled(rt)

        stats = rt.stats().actors
        engine = next(s for address, s in stats.items() if address.startswith("engine:warm#"))
        # Every 64 tokens, the end of the prompt and 512 before the end (the random
        # tokens may add the last word boundary): one window or one recurrent state each.
        points = engine.gauges["entry_points"]
        assert len(prompt) // SPACING + 2 <= points <= len(prompt) // SPACING + 3
        assert engine.gauges["entry_point_bytes"] == points * SNAPSHOT_BYTES[kind]
        assert engine.counters.get("snapshots_refused", 0) == 0
        # The keeper holds exactly the entry's bytes, its points included; nothing else is left.
        entry_bytes = engine.gauges["entry_bytes"]
        assert stats["prefix"].gauges["bytes"] == entry_bytes
        assert stats["kv"].gauges["reserved"] == entry_bytes


async def settled(rt: Runtime) -> None:
    """Wait until the keeper holds only the prefix cache's bytes: the engine sends its releases
    before the terminal event, but the keeper handles its own mailbox, so the host may see the
    terminal a turn of the event loop before the last release lands."""
    await wait_until(
        rt,
        lambda: (
            rt.stats().actors["kv"].gauges["reserved"]
            == rt.stats().actors["prefix"].gauges["bytes"]
        ),
        what="the keeper holding only the prefix cache's bytes",
    )
