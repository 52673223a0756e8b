"""Reuse where a prompt really diverges, on every untrimmable cache kind (tiny MLX models).

A cache that cannot be trimmed is reused only at the points its prefill snapshotted
(actors/engine/checkpoints.py, docs/reuse.md). Two placements are checked here, each with the
exact count of tokens prefilled and the greedy output equal to a cold run (a second load of the
model, reset before each run):

* a constant-size recurrent state (the generic tiny mamba2 of ``runtime.testing.arch_models``:
  every layer an ``ArraysCache``)
  checkpoints every 64 tokens, not every ``checkpoint_every_tokens`` (512), so an edit at token
  ~100 of a 300-token prompt reuses the 64 before it;
* a long prompt re-sent with its last line changed re-processes only that line (and the chat
  template's tail): the start of each of the last lines is a point, on sliding-window (gemma3
  window 32), hybrid (qwen3_next) and pure-recurrent (mamba2) caches, as raw text and as chat.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, ChatOptions, ModelLoaded, ModelSpec, ReusePath
from runtime.testing.arch_models import arch_model_path
from runtime.testing.harness import common_prefix_length, engine_stats
from runtime.testing.tiny_models import tiny_model_path
from runtime.text.chat import prepare_chat
from tests.loop_checks import LoopBackend, on_uvloop
from tests.test_mlx_checkpoints import cold, run

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


MAX_TOKENS = 4
KINDS = ("sliding", "hybrid", "mamba2")

# Notes of ~400 tokens on the tiny tokenizer: past the sliding window (32) many times over.
NOTES = "\n".join(
    f"Note {i}: the keeper climbed the tower, trimmed the wicks and wrote the weather down."
    for i in range(16)
)
ASKED = "Q: When did the keeper climb the tower every evening?"
CHANGED = "Q: Why did he trim the wicks of the lamp so often?"


@pytest.fixture(scope="module")
def paths() -> dict[str, Path]:
    return {
        "sliding": tiny_model_path("sliding"),
        "hybrid": tiny_model_path("hybrid"),
        "mamba2": arch_model_path("mamba2"),
    }


async def start(rt: Runtime, path: Path) -> ModelLoaded:
    loaded = await rt.load_model(ModelSpec(name="warm", backend="mlx", path=str(path)))
    await rt.load_model(ModelSpec(name="cold", backend="mlx", path=str(path)))
    assert loaded.reuse_path == "checkpoint"
    return loaded


async def test_an_edit_near_the_start_of_a_recurrent_prompt_reuses_the_multiple_of_64_below(
    paths: dict[str, Path],
) -> None:
    rng = random.Random(1)
    first = [rng.randrange(5, 500) for _ in range(300)]
    second = first[:100] + [rng.randrange(5, 500) for _ in range(200)]
    assert common_prefix_length(first, second) == 100
    async with Runtime(RuntimeConfig(kv_budget_bytes=512 << 20)) as rt:
        loaded = await start(rt, paths["mamba2"])
        original = await run(rt, "warm", prompt_tokens=first)
        before = engine_stats(rt, loaded).counters["prefilled_tokens"]
        edited = await run(rt, "warm", prompt_tokens=second)

        assert edited.started is not None
        assert (edited.started.path, edited.started.cached_tokens) == (ReusePath.CHECKPOINT, 64)
        assert engine_stats(rt, loaded).counters["prefilled_tokens"] - before == 300 - 64
        assert edited.token_ids == await cold(rt, prompt_tokens=second)
        assert edited.token_ids != original.token_ids  # the output follows the prompt


def line_starts(tokenizer: Any, tokens: tuple[int, ...] | list[int]) -> list[int]:
    """Token counts at which a line begins (just after a token holding a newline)."""
    return [i + 1 for i, t in enumerate(tokens) if "\n" in tokenizer.decode([t])]


@pytest.mark.parametrize("form", ["text", "chat"])
@pytest.mark.parametrize("kind", KINDS)
async def test_a_long_prompt_resent_with_its_last_line_changed_reprocesses_only_that_line(
    paths: dict[str, Path], kind: str, form: str
) -> None:
    tokenizer = load_tokenizer(paths[kind])
    if form == "text":
        requests = [{"prompt": f"{NOTES}\n{line}"} for line in (ASKED, CHANGED)]
        first, second = (tokenizer.encode(r["prompt"]) for r in requests)
    else:
        requests = [
            {"messages": [ChatMessage("user", f"{NOTES}\n{line}")]} for line in (ASKED, CHANGED)
        ]
        first, second = (
            prepare_chat(tokenizer, r["messages"], ChatOptions(), MAX_TOKENS, 2048).tokens
            for r in requests
        )
    shared = common_prefix_length(first, second)
    # The last line of the notes ends within the shared tokens; the question's line begins after.
    last_line = max(p for p in line_starts(tokenizer, first) if p <= shared)
    assert len(first) > 300 and shared - last_line < 8 and len(second) - last_line < 40
    async with Runtime(RuntimeConfig(kv_budget_bytes=512 << 20)) as rt:
        loaded = await start(rt, paths[kind])
        await run(rt, "warm", **requests[0])
        before = engine_stats(rt, loaded).counters["prefilled_tokens"]
        resent = await run(rt, "warm", **requests[1])

        assert resent.started is not None
        assert resent.started.path is ReusePath.CHECKPOINT
        assert resent.started.cached_tokens == last_line
        assert (
            engine_stats(rt, loaded).counters["prefilled_tokens"] - before
            == len(second) - last_line
        )
        assert resent.token_ids == await cold(rt, **requests[1])
