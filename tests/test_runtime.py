"""The host API on the production transport (real compute threads), on asyncio and uvloop."""

from __future__ import annotations

import anyio
import pytest

from runtime.backends.loader import make_backend_loader
from runtime.backends.simulated import greedy_continuation
from runtime.errors import (
    DuplicateRequestId,
    InvalidRequest,
    ModelAlreadyLoaded,
    ModelLoadFailed,
    ModelNotLoaded,
)
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import engine_address
from runtime.messages import (
    Cancelled,
    ChatMessage,
    ChatOptions,
    Failed,
    Finished,
    FinishReason,
    ModelSpec,
    ReusePath,
    Sampling,
    Started,
    TokensEmitted,
)
from runtime.testing.faults import Fault, FaultKind, FaultPlan, FaultPoint
from runtime.testing.harness import ModelOption, engine_stats, sim_spec, wait_until
from runtime.text.coalesce import CoalescePolicy

pytestmark = pytest.mark.anyio

CHUNK = 8


def sim_model(name: str = "m", **options: ModelOption) -> ModelSpec:
    return sim_spec(name, chunk=CHUNK, **options)


def config(**overrides: object) -> RuntimeConfig:
    return RuntimeConfig(**{"kv_budget_bytes": 64 << 20, **overrides})  # type: ignore[arg-type]


def expected(prompt: str, n: int) -> str:
    return bytes(greedy_continuation(list(prompt.encode()), n)).decode()


async def test_complete_matches_the_cold_reference() -> None:
    async with Runtime(config()) as rt:
        loaded = await rt.load_model(sim_model())
        assert loaded.reuse_path == "trim"
        result = await rt.complete("m", "hello world", max_tokens=6)
        assert result.text == expected("hello world", 6)
        assert isinstance(result.terminal, Finished)
        assert result.terminal.reason is FinishReason.LENGTH
        assert result.usage.completion_tokens == 6
        assert result.usage.prompt_tokens == 11


async def test_turn_two_reuses_the_first_turn_and_matches_cold() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        first = await rt.complete("m", "system: be brief. user: hi", max_tokens=4)
        second_prompt = "system: be brief. user: hi" + first.text + " user: more"
        second = await rt.complete("m", second_prompt, max_tokens=4)
        assert second.text == expected(second_prompt, 4)
        assert second.started is not None and second.started.path is ReusePath.EXACT
        # The first turn's prompt and its reply except the last sampled token were cached.
        assert second.started.cached_tokens == 26 + 4 - 1
        assert second.usage.cached_prompt_tokens == 29


async def test_non_trimmable_model_reuses_whole_checkpoints_only() -> None:
    async with Runtime(config()) as rt:
        loaded = await rt.load_model(sim_model(trimmable=False))
        assert loaded.reuse_path == "checkpoint"
        first = await rt.complete("m", "abcdefgh", max_tokens=3)
        extended = await rt.complete("m", "abcdefgh" + first.text + "ij", max_tokens=3)
        assert extended.started is not None and extended.started.path is ReusePath.CHECKPOINT
        assert extended.started.cached_tokens == 8 + 3 - 1
        assert extended.text == expected("abcdefgh" + first.text + "ij", 3)
        diverged = await rt.complete("m", "abcdXfgh", max_tokens=3)
        assert diverged.started is not None and diverged.started.path is ReusePath.MISS
        assert diverged.text == expected("abcdXfgh", 3)


async def test_breaking_out_mid_prefill_stops_the_engine_within_one_chunk() -> None:
    spec = sim_model(prefill_s_per_token=0.002)  # 400 tokens: 0.8 s if it ran to the end
    async with Runtime(config()) as rt:
        loaded = await rt.load_model(spec)
        async with rt.generate("m", "x" * 400, max_tokens=4) as stream:
            async for event in stream:
                assert isinstance(event, Started)
                break
        with anyio.fail_after(5):
            short = await rt.complete("m", "hi", max_tokens=1)
        assert isinstance(short.terminal, Finished)
        engine = engine_stats(rt, loaded).counters
        aborted_prefill = engine["prefilled_tokens"] - 2
        assert aborted_prefill <= 2 * CHUNK  # the chunk running at the cancel, at most one more
        assert engine["cancelled"] == 1


async def test_cancel_by_id_ends_quietly_with_usage_so_far() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model(decode_s_per_token=0.005))
        async with rt.generate("m", "count", max_tokens=200, request_id="r") as stream:
            seen = 0
            async for event in stream:
                if isinstance(event, TokensEmitted):
                    seen += 1
                    if seen == 3:
                        assert await rt.cancel("r")
                if isinstance(event, Cancelled):
                    assert event.reason == "cancelled"
                    assert event.usage.completion_tokens >= 3
                    break
            else:
                pytest.fail("no Cancelled event")
        assert not await rt.cancel("r")  # finished: a counted no-op


async def test_duplicate_live_id_is_refused_and_finished_ids_are_reusable() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model(decode_s_per_token=0.01))
        async with rt.generate("m", "one", max_tokens=50, request_id="same") as first:
            await first.__anext__()
            with pytest.raises(DuplicateRequestId):
                async with rt.generate("m", "two", request_id="same") as second:
                    await second.__anext__()
        reused = await rt.complete("m", "three", max_tokens=2, request_id="same")
        assert isinstance(reused.terminal, Finished)


async def test_bad_input_is_refused_before_any_work() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        for kwargs in (
            {"max_tokens": 0},
            {"sampling": Sampling(temperature=float("nan"))},
            {"sampling": Sampling(top_p=1.5)},
        ):
            with pytest.raises(InvalidRequest) as raised:
                rt.generate("m", "x", **kwargs)  # type: ignore[arg-type]
            assert raised.value.code == "invalid_request"
        with pytest.raises(InvalidRequest):
            rt.generate("m", "")
        with pytest.raises(InvalidRequest, match="pass token ids as prompt_tokens"):
            rt.generate("m", [104, 105])  # type: ignore[arg-type]
        with pytest.raises(ModelNotLoaded):
            await rt.complete("nope", "x")
        with pytest.raises(ModelAlreadyLoaded):
            await rt.load_model(sim_model())
        with pytest.raises(ModelLoadFailed):
            await rt.load_model(sim_model("broken", fail_load=True))
        assert rt.stats().actors["router"].counters.get("accepted_generate", 0) == 0


async def test_context_overflow_fails_with_a_clear_error() -> None:
    async with Runtime(config(strict_max_tokens=True)) as rt:
        await rt.load_model(sim_model(context_length=16))
        result = await rt.complete("m", "0123456789", max_tokens=10)
        assert isinstance(result.terminal, Failed)
        assert result.terminal.code == "context_length_exceeded"
        assert "context of 16 tokens" in result.terminal.message


async def test_prewarm_then_generate_reuses_all_but_the_last_token() -> None:
    async with Runtime(config()) as rt:
        loaded = await rt.load_model(sim_model())
        warm = await rt.prewarm("m", "a system prompt and a question")
        assert isinstance(warm, Finished) and warm.reason is FinishReason.PREWARMED
        again = await rt.prewarm("m", "a system prompt and a question")
        assert isinstance(again, Finished)  # already warm: a cheap no-op
        engine = engine_stats(rt, loaded).counters
        assert engine["prewarms_already_warm"] == 1
        result = await rt.complete("m", "a system prompt and a question", max_tokens=3)
        assert result.started is not None and result.started.path is ReusePath.EXACT
        assert result.started.cached_tokens == 29
        assert result.text == expected("a system prompt and a question", 3)


async def test_generate_supersedes_a_diverging_prewarm_and_adopts_an_extended_one() -> None:
    slow = sim_model(prefill_s_per_token=0.002)
    async with Runtime(config()) as rt, anyio.create_task_group() as tg:
        loaded = await rt.load_model(slow)
        outcomes: dict[str, object] = {}

        async def warm(key: str, prompt: str) -> None:
            outcomes[key] = await rt.prewarm("m", prompt, session="s")

        def prefilled() -> int:
            return engine_stats(rt, loaded).counters.get("prefilled_tokens", 0)

        tg.start_soon(warm, "diverged", "z" * 200)
        await wait_until(rt, lambda: prefilled() > 0)  # the warmup is prefilling
        await rt.complete("m", "y" * 20, max_tokens=1, session="s")
        before = prefilled()
        tg.start_soon(warm, "extended", "w" * 200)
        await wait_until(rt, lambda: prefilled() > before)
        result = await rt.complete("m", "w" * 200 + "?", max_tokens=2, session="s")
    diverged, extended = outcomes["diverged"], outcomes["extended"]
    assert isinstance(diverged, Cancelled) and diverged.reason == "superseded"
    assert isinstance(extended, Finished) and extended.reason is FinishReason.ADOPTED
    assert result.started is not None and result.started.path is ReusePath.ADOPTED
    assert result.text == expected("w" * 200 + "?", 2)


async def test_unload_drains_in_flight_requests_and_frees_all_kv() -> None:
    async with Runtime(config()) as rt:
        loaded = await rt.load_model(sim_model(decode_s_per_token=0.005))
        async with rt.generate("m", "long reply", max_tokens=500) as stream:
            await stream.__anext__()
            unloaded = await rt.unload_model("m")
            ends = [e async for e in stream if isinstance(e, Cancelled)]
        assert unloaded.epoch == 1
        assert [e.reason for e in ends] == ["model_unloaded"]
        stats = rt.stats()
        assert stats.actors["kv"].gauges["reserved"] == 0
        assert engine_address("m", loaded.epoch) not in stats.actors
        with pytest.raises(ModelNotLoaded):
            await rt.complete("m", "x")
        reloaded = await rt.load_model(sim_model())
        assert reloaded.epoch == 2  # epochs only grow


async def test_reset_drops_cached_prefixes_and_namespaces_never_share() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        await rt.complete("m", "shared prefix one", max_tokens=2, namespace="a")
        other = await rt.complete("m", "shared prefix one", max_tokens=2, namespace="b")
        assert other.started is not None and other.started.path is ReusePath.MISS
        same = await rt.complete("m", "shared prefix one", max_tokens=2, namespace="a")
        assert same.started is not None and same.started.cached_tokens > 0
        await rt.reset("m", namespace="a")
        after = await rt.complete("m", "shared prefix one", max_tokens=2, namespace="a")
        assert after.started is not None and after.started.path is ReusePath.MISS


async def test_kv_refusals_carry_stable_codes() -> None:
    async with Runtime(config(kv_budget_bytes=10_000, reservation_timeout_s=0.05)) as rt:
        await rt.load_model(sim_model(bytes_per_token=100, decode_s_per_token=0.01))
        too_big = await rt.complete("m", "x" * 50, max_tokens=60)
        assert isinstance(too_big.terminal, Failed)
        assert too_big.terminal.code == "kv_request_too_large"
        assert not too_big.terminal.retryable
        async with rt.generate("m", "y" * 10, max_tokens=80) as hog:  # holds 9,000 bytes
            await hog.__anext__()
            starved = await rt.complete("m", "z" * 10, max_tokens=20)
        assert isinstance(starved.terminal, Failed)
        assert starved.terminal.code == "kv_budget_exhausted" and starved.terminal.retryable


async def test_backend_fault_fails_one_request_and_the_runtime_goes_on() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model(fail_prefill_call=1))
        broken = await rt.complete("m", "first", max_tokens=2)
        assert isinstance(broken.terminal, Failed)
        assert broken.terminal.code == "backend_error" and broken.terminal.retryable
        fine = await rt.complete("m", "second", max_tokens=2)
        assert fine.text == expected("second", 2)
        assert (
            rt.stats().actors["kv"].gauges["reserved"]
            == rt.stats().actors["prefix"].gauges["bytes"]
        )


async def test_an_engine_crash_fails_its_live_requests_once_and_the_model_reloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actors.engine.outcomes import StepOutcomes

    original = StepOutcomes.prefill_advanced
    crashes = []

    def crash_once(self: StepOutcomes, seq: object, ctx: object) -> None:
        if not crashes:
            crashes.append(seq)
            raise RuntimeError("injected bug")
        original(self, seq, ctx)  # type: ignore[arg-type]

    monkeypatch.setattr(StepOutcomes, "prefill_advanced", crash_once)
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        broken = await rt.complete("m", "first", max_tokens=2)
        assert isinstance(broken.terminal, Failed)
        assert broken.terminal.code == "engine_crashed" and broken.terminal.retryable
        await wait_until(rt, lambda: model_reloaded(rt))
        assert engine_address("m", 2) in rt.stats().actors  # a new epoch, its model reloaded
        fine = await rt.complete("m", "second", max_tokens=2)
        assert fine.text == expected("second", 2)
        assert rt.stats().actors["router"].counters["terminal_failed"] == 1
        assert (
            rt.stats().actors["kv"].gauges["reserved"]
            == rt.stats().actors["prefix"].gauges["bytes"]
        )


def model_reloaded(rt: Runtime) -> bool:
    """The router heard an engine give up, and no model is restarting any more."""
    router = rt.stats().actors["router"]
    return router.counters.get("engines_failed") == 1 and router.gauges["models_restarting"] == 0


async def test_a_stuck_compute_thread_is_abandoned_and_the_model_reloads() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG))
    loader = plan.wrap_loader(make_backend_loader())
    try:
        # Leaving the runtime must not wait for the stuck thread (it hangs until released).
        with anyio.fail_after(10):
            async with Runtime(config(step_timeout_s=0.2), load_backend=loader) as rt:
                await rt.load_model(sim_model())
                stuck = await rt.complete("m", "first", max_tokens=2)
                assert isinstance(stuck.terminal, Failed)
                assert stuck.terminal.code == "step_timeout" and stuck.terminal.retryable
                await wait_until(rt, lambda: model_reloaded(rt))
                fine = await rt.complete("m", "second", max_tokens=2)
                assert fine.text == expected("second", 2)
        assert [i.kind for i in plan.injected] == [FaultKind.HANG]
    finally:
        plan.release_hangs()


async def test_stop_strings_end_the_reply_and_are_never_emitted() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        full = expected("stop here", 12)
        stop = full[5:8]  # a stop string that straddles token boundaries
        result = await rt.complete("m", "stop here", max_tokens=12, stop=[stop, "never"])
        assert isinstance(result.terminal, Finished)
        assert result.terminal.reason is FinishReason.STOP and result.terminal.stop == stop
        assert result.text == full[: full.index(stop)]
        assert result.usage.completion_tokens == full.index(stop) + len(stop)
        with pytest.raises(InvalidRequest):
            rt.generate("m", "x", stop=[""])


async def test_coalescing_merges_token_events_by_size_and_flushes_by_age() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())

        async def count_events(policy: CoalescePolicy, **kwargs: object) -> tuple[int, str]:
            async with rt.generate("m", "a reply", coalesce=policy, **kwargs) as stream:  # type: ignore[arg-type]
                texts = [e.text async for e in stream if isinstance(e, TokensEmitted)]
            return len(texts), "".join(texts)

        per_token = await count_events(CoalescePolicy(enabled=False), max_tokens=200)
        merged = await count_events(CoalescePolicy(max_chars=32, max_age_s=60), max_tokens=200)
        assert per_token == (200, expected("a reply", 200))
        # The first token at once (the time to first token), 6 full chunks of 32, then the rest.
        assert merged == (8, expected("a reply", 200))

    async with Runtime(config()) as rt:
        await rt.load_model(sim_model(decode_s_per_token=0.1))
        # Each token waits far longer than the age limit for a successor: it goes out alone.
        aged = await count_events_on(rt, CoalescePolicy(max_chars=1000, max_age_s=0.005))
        assert aged == 4


async def count_events_on(rt: Runtime, policy: CoalescePolicy) -> int:
    async with rt.generate("m", "slow", max_tokens=4, coalesce=policy) as stream:
        return len([e async for e in stream if isinstance(e, TokensEmitted)])


async def test_sampling_fields_reach_the_sampler_end_to_end() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        greedy = await rt.complete("m", "bias me", max_tokens=6)
        assert greedy.text == expected("bias me", 6)
        biased = await rt.complete(
            "m", "bias me", max_tokens=6, sampling=Sampling(logit_bias={ord("Q"): 50.0})
        )
        assert biased.text == "Q" * 6  # the bias beats the model's peak every step
        plain = await rt.complete("m", "x", max_tokens=30)
        assert len(set(plain.token_ids)) < 30  # 30 tokens over 27 letters: greedy repeats
        penalised = await rt.complete(
            "m", "x", max_tokens=30, sampling=Sampling(repetition_penalty=50.0)
        )
        seen = [ord("x"), *penalised.token_ids]
        assert len(set(seen)) == len(seen)  # every repeat was pushed below a fresh token
        seeded = Sampling(temperature=1.0, seed=7)
        first = await rt.complete("m", "seeded", max_tokens=12, sampling=seeded)
        again = await rt.complete("m", "seeded", max_tokens=12, sampling=seeded)
        other = await rt.complete(
            "m", "seeded", max_tokens=12, sampling=Sampling(temperature=1.0, seed=8)
        )
        assert first.text == again.text != other.text
        bad = await rt.complete("m", "x", sampling=Sampling(logit_bias={10_000: 1.0}))
        assert isinstance(bad.terminal, Failed) and bad.terminal.code == "invalid_request"


async def test_logprobs_come_one_event_per_token() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        sampling = Sampling(logprobs=True, top_logprobs=3)
        async with rt.generate("m", "probe", max_tokens=5, sampling=sampling) as stream:
            events = [e async for e in stream if isinstance(e, TokensEmitted)]
        assert len(events) == 5
        for event in events:
            [entry] = event.logprobs
            assert entry.token == event.token_ids[0]
            assert entry.top[0][0] == entry.token  # greedy picks the top one
            assert len(entry.top) == 3 and entry.logprob == entry.top[0][1] < 0


async def test_chat_messages_use_one_preparation_path_for_prewarm_and_generate() -> None:
    chat = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi"),
        ChatMessage(role="assistant", content="<think>greet back</think>Hello."),
        ChatMessage(role="user", content="Again?"),
    ]
    rendered = "system: Be brief.\nuser: Hi\nassistant: Hello.\nuser: Again?\nassistant: "
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        warm = await rt.prewarm("m", messages=chat)
        assert isinstance(warm, Finished) and warm.reason is FinishReason.PREWARMED
        result = await rt.complete("m", messages=chat, max_tokens=4)
        assert result.started is not None and result.started.path is ReusePath.EXACT
        assert result.started.cached_tokens == len(rendered) - 1  # the warmup's exact key
        assert result.text == expected(rendered, 4)  # earlier reasoning was stripped
        windowed = await rt.complete(
            "m", messages=chat, max_tokens=4, chat=ChatOptions(history_budget_tokens=40)
        )
        assert windowed.started is not None and windowed.started.dropped_turns == 1
        with pytest.raises(InvalidRequest):
            rt.generate("m", "text", messages=chat)


async def test_without_max_tokens_a_request_gets_the_rest_of_the_context() -> None:
    async with Runtime(config(default_max_tokens=1000)) as rt:
        await rt.load_model(sim_model(context_length=40))
        result = await rt.complete("m", "0123456789")
        assert result.usage.completion_tokens == 30
        assert isinstance(result.terminal, Finished)
        assert result.terminal.reason is FinishReason.LENGTH
    async with Runtime(config(default_max_tokens=5)) as rt:
        await rt.load_model(sim_model(context_length=40))
        capped = await rt.complete("m", "0123456789")
        assert capped.usage.completion_tokens == 5


async def test_a_superseding_keystroke_aborts_the_sessions_older_generate() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model(prefill_s_per_token=0.002))
        async with rt.generate("m", "def f" * 60, max_tokens=4, session="editor") as stale:
            assert isinstance(await stale.__anext__(), Started)
            fresh = await rt.complete(
                "m", "def f" * 60 + "(", max_tokens=2, session="editor", supersede=True
            )
            ends = [e async for e in stale if isinstance(e, Cancelled)]
        assert [e.reason for e in ends] == ["superseded"]
        assert fresh.text == expected("def f" * 60 + "(", 2)
        other = await rt.complete("m", "x", max_tokens=1, session="other", supersede=True)
        assert isinstance(other.terminal, Finished)  # other sessions are untouched


async def test_only_a_superseded_prefill_counts_as_an_aborted_prefill() -> None:
    async with Runtime(config()) as rt:
        loaded = await rt.load_model(sim_model(prefill_s_per_token=0.002))
        async with rt.generate("m", "def f" * 60, max_tokens=4, session="editor") as stale:
            assert isinstance(await stale.__anext__(), Started)  # restored: its prefill runs
            await rt.complete(
                "m", "def f" * 60 + "(", max_tokens=2, session="editor", supersede=True
            )
            assert [e async for e in stale if isinstance(e, TokensEmitted)] == []
        assert engine_stats(rt, loaded).counters["prefills_aborted"] == 1
        async with rt.generate("m", "x = 1", max_tokens=1000, session="editor") as decoding:
            async for event in decoding:
                if isinstance(event, TokensEmitted):
                    break  # its prefill is done: it now decodes
            await rt.complete("m", "x = 2", max_tokens=1, session="editor", supersede=True)
        assert engine_stats(rt, loaded).counters["prefills_aborted"] == 1  # a decode, not a prefill
        assert engine_stats(rt, loaded).counters["generates_superseded"] == 2


async def test_chat_without_max_tokens_fits_and_prewarm_renders_like_its_generate() -> None:
    chat = [ChatMessage(role="user", content=f"turn {i}") for i in range(6)]
    options = ChatOptions(history_budget_tokens=60)
    async with Runtime(config(default_max_tokens=1000)) as rt:
        await rt.load_model(sim_model(context_length=120))
        result = await rt.complete("m", messages=[ChatMessage(role="user", content="hi")])
        assert isinstance(result.terminal, Finished)  # the reply gets the rest of the context
        await rt.prewarm("m", messages=chat, chat=options, max_tokens=20)
        hot = await rt.complete("m", messages=chat, chat=options, max_tokens=20)
        assert hot.started is not None and hot.started.dropped_turns > 0
        assert hot.started.cached_tokens == hot.started.prompt_tokens - 1


async def test_prompts_admitted_while_others_tokenize_are_tokenized_too() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        results: list[object] = []

        async def one(prompt: str) -> None:
            results.append(await rt.complete("m", prompt, max_tokens=3))

        async with anyio.create_task_group() as tg:
            for prompt in ("a b c", "d e f", "g h i", "j k l"):
                tg.start_soon(one, prompt)
        assert len(results) == 4
        assert all(isinstance(r.terminal, Finished) for r in results)  # type: ignore[attr-defined]


async def test_leaving_the_runtime_never_waits_for_pending_deadlines() -> None:
    with anyio.fail_after(10):  # the reservation deadline below is 30 s
        async with Runtime(config(kv_budget_bytes=10_000)) as rt:
            await rt.load_model(sim_model(bytes_per_token=100, decode_s_per_token=0.005))
            async with rt.generate("m", "y" * 10, max_tokens=60) as hog:
                assert isinstance(await hog.__anext__(), Started)  # it holds 7,000 bytes now
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: drain(hog))
                    queued = await rt.complete("m", "z" * 10, max_tokens=30)  # waits for it
            assert isinstance(queued.terminal, Finished)


async def drain(stream: object) -> None:
    async for _ in stream:  # type: ignore[attr-defined]
        pass


# --------------------------------------------------------------------------- deadlines and stalls


def kv_matches_the_prefix_cache(rt: Runtime) -> bool:
    """Every reserved byte belongs to a cached prefix entry, and no expired request's engine
    still holds its sequence."""
    actors = rt.stats().actors
    router_gauges = actors["router"].gauges
    return (
        actors["kv"].gauges["reserved"] == actors["prefix"].gauges["bytes"]
        and router_gauges["expired_awaiting_engine"] == 0
    )


async def test_a_deadline_ends_a_generate_with_request_timeout_and_frees_its_kv() -> None:
    spec = sim_model(prefill_s_per_token=0.002)  # 400 tokens: 0.8 s if it ran to the end
    async with Runtime(config()) as rt:
        await rt.load_model(spec)
        result = await rt.complete("m", "x" * 400, max_tokens=4, timeout_s=0.05)
        terminal = result.terminal
        assert isinstance(terminal, Failed)
        assert (terminal.code, terminal.retryable) == ("request_timeout", True)
        assert result.token_ids == () and terminal.usage.completion_tokens == 0
        await wait_until(rt, lambda: kv_matches_the_prefix_cache(rt))


async def test_a_stalled_stream_fails_stream_stalled_with_the_tokens_it_showed() -> None:
    async with Runtime(config(stall_timeout_s=0.03)) as rt:
        await rt.load_model(sim_model(decode_s_per_token=0.3))  # a token every 0.3 s
        result = await rt.complete("m", "hi", max_tokens=5)
        terminal = result.terminal
        assert isinstance(terminal, Failed) and terminal.code == "stream_stalled"
        assert terminal.usage.completion_tokens == len(result.token_ids) >= 1
        assert result.text == expected("hi", len(result.token_ids))
        await wait_until(rt, lambda: kv_matches_the_prefix_cache(rt))


async def test_timeouts_that_are_not_positive_seconds_are_refused_before_any_work() -> None:
    async with Runtime(config()) as rt:
        await rt.load_model(sim_model())
        for kwargs in ({"timeout_s": 0}, {"timeout_s": -1.0}, {"stall_timeout_s": float("inf")}):
            with pytest.raises(InvalidRequest, match=next(iter(kwargs))):
                rt.generate("m", "x", **kwargs)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="timeout_s"):
            await rt.prewarm("m", "x", timeout_s=float("nan"))
