"""Pipelined decoding on real (tiny) MLX models, against the step-by-step loop it replaced.

The reference feeds each token with ``prefill``, reads ``logits`` and samples with
``TokenSampler.sample``: what every decode step did before steps were built on unread draws. The
runtime must give the same tokens (greedy and seeded, with penalties) and the same logprobs. A
sequence that ends on a stop token leaves an entry the next turn reuses whole (on a model that
always trims, the stop token was fed ahead and is part of it; elsewhere it never is), and one
cancelled with a step queued leaves an entry keyed by exactly what it holds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from runtime.backends.mlx.backend import MlxBackend
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancelled,
    Finished,
    FinishReason,
    ModelSpec,
    Sampling,
    TokenLogprob,
    TokensEmitted,
)
from runtime.testing.tiny_models import TinyModelKind, tiny_model_path
from runtime.text.sampling import TokenSampler
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


KINDS: tuple[TinyModelKind, ...] = ("llama", "sliding", "hybrid")
PROMPT = "Once upon a time, in a land far away, there lived"
N = 40  # past the sliding window (32) of the sliding model
SAMPLINGS = {
    "greedy": Sampling(),
    "seeded": Sampling(temperature=0.9, top_p=0.9, seed=11),
    "penalised": Sampling(temperature=0.8, seed=5, repetition_penalty=1.3, presence_penalty=0.3),
    "logprobs": Sampling(logprobs=True, top_logprobs=4),
}


def reference(
    backend: MlxBackend, prompt: Sequence[int], n: int, sampling: Sampling
) -> list[TokenLogprob]:
    """The step-by-step loop: feed a token, read the logits, sample; ``n`` tokens. The prompt is
    prefilled a token at a time, as the runtime's spec here has it (its chunking, and so its
    floats, then match whatever snapshots it takes)."""
    state = backend.new_state()
    for token in prompt:
        backend.prefill(state, [token])
    sampler = TokenSampler(sampling, backend.info.vocab_size, lambda t: backend.decode([t]))
    rng = random.Random(sampling.seed)
    history, out = list(prompt), []
    for _ in range(n):
        picked = sampler.sample(backend.logits(state), history, rng)
        out.append(
            TokenLogprob(token=picked.token, logprob=picked.logprob or 0.0, top=picked.top_logprobs)
        )
        history.append(picked.token)
        backend.prefill(state, [picked.token])
    return out


def spec(kind: TinyModelKind) -> ModelSpec:
    path = str(tiny_model_path(kind))
    return ModelSpec(name=kind, backend="mlx", path=path, prefill_chunk_tokens=1)


@pytest.mark.parametrize("kind", KINDS)
async def test_pipelined_decoding_gives_the_step_by_step_tokens(kind: TinyModelKind) -> None:
    backend = MlxBackend.load(spec(kind))
    prompt = backend.encode(PROMPT)
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec(kind))
        for name, sampling in SAMPLINGS.items():
            want = reference(backend, prompt, N, sampling)
            async with rt.generate(
                kind, prompt_tokens=prompt, max_tokens=N, sampling=sampling
            ) as s:
                got = [e async for e in s if isinstance(e, TokensEmitted)]
            assert [t for e in got for t in e.token_ids] == [w.token for w in want], name
            if sampling.logprobs:
                assert [lp for e in got for lp in e.logprobs] == want, name
    backend.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_entries_left_with_unshown_tokens_are_reused_exactly(kind: TinyModelKind) -> None:
    backend = MlxBackend.load(spec(kind))
    prompt = backend.encode(PROMPT)
    greedy = [t.token for t in reference(backend, prompt, N, Sampling())]
    stop_token = greedy[10]  # ends the first run, unshown
    fed_ahead = kind == "llama"  # only a model that always trims builds a step on it before reading
    more = backend.encode(" and then")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec(kind))
        # 1. A stop token: the next turn reuses the whole entry, with or without it.
        done = await rt.complete(
            kind, prompt_tokens=prompt, max_tokens=N, stop_token_ids=(stop_token,)
        )
        assert isinstance(done.terminal, Finished) and done.terminal.reason is FinishReason.STOP
        shown = list(done.token_ids)
        assert shown == greedy[: greedy.index(stop_token)]
        for follow in (prompt + shown + [stop_token] + more, prompt + shown + more):
            again = await rt.complete(kind, prompt_tokens=follow, max_tokens=8)
            assert list(again.token_ids) == [
                t.token for t in reference(backend, follow, 8, Sampling())
            ]
            assert again.started is not None
            kept = fed_ahead and stop_token in follow  # the stop token, fed ahead, prefixes it
            assert again.started.cached_tokens == len(prompt) + len(shown) + kept
        # 2. A cancel while a token computes and the next is queued.
        await rt.reset(kind)
        async with rt.generate(kind, prompt_tokens=prompt, max_tokens=N, request_id="c") as s:
            cut: list[int] = []
            async for event in s:
                if isinstance(event, TokensEmitted):
                    cut += event.token_ids
                    if len(cut) >= 6 and len(cut) - len(event.token_ids) < 6:
                        assert await rt.cancel("c")
                elif isinstance(event, Cancelled):
                    break
        assert cut == greedy[: len(cut)]
        follow = prompt + cut + more
        again = await rt.complete(kind, prompt_tokens=follow, max_tokens=8)
        assert list(again.token_ids) == [t.token for t in reference(backend, follow, 8, Sampling())]
    backend.close()
