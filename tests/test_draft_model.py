"""Speculative decoding with a draft model: a second model's greedy tokens are the drafts.

The draft model's state follows the sequence (``Backend.draft`` then ``Backend.rewind`` leave it as
if only the accepted tokens had run), greedy output is token-for-token the output without
speculation on every target cache kind, the target as its own draft accepts every draft, an
incompatible pair is refused at load naming the difference, and the draft state is priced in the
KV reservation and dropped on every way a sequence ends. The sampling distribution under the
acceptance rule is checked in test_speculative.py (``test_judged_drafts_keep_the_sampling_...``
with the drafts a draft model made).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from actors.engine.draft_model import check_pair
from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.simulated import RealClock, SimulatedBackend
from runtime.errors import DraftModelIncompatible
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Cancelled, Failed, Finished, ModelSpec, Sampling, TokensEmitted
from runtime.testing.harness import sim_spec
from runtime.testing.tiny_models import TinyModelKind, tiny_model_path
from tests.loop_checks import LoopBackend, on_uvloop


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n" * 3
# Shifts the target's argmax now and then, so the raw draft is rejected as well as accepted.
SHIFTED = {40: 3.0, 41: 2.0}


def spec(kind: TinyModelKind, draft: Path | str, **options: Any) -> ModelSpec:
    # The target drafting for itself costs as much as it saves: a low cost makes the policy draft.
    options = {"draft_model": str(draft), "draft_cost": 0.01, **options}
    return ModelSpec(name=kind, backend="mlx", path=str(tiny_model_path(kind)), options=options)


def _counters(rt: Runtime, name: str) -> dict[str, int]:
    return next(s.counters for a, s in rt.stats().actors.items() if a.startswith(f"engine:{name}"))


def _gauges(rt: Runtime, name: str) -> dict[str, int]:
    return next(s.gauges for a, s in rt.stats().actors.items() if a.startswith(f"engine:{name}"))


def _llama() -> MlxBackend:
    return MlxBackend.load(ModelSpec(name="l", backend="mlx", path=str(tiny_model_path("llama"))))


def _prompt() -> list[int]:
    backend = _llama()
    try:
        return backend.encode(PROMPT)
    finally:
        backend.close()


# ---------------------------------------------------------------------------- the backend


def test_a_drafting_pass_rewound_leaves_the_state_as_if_only_the_kept_tokens_ran() -> None:
    backend = _llama()
    prompt = backend.encode(PROMPT)
    state = backend.new_state()
    backend.prefill(state, prompt[:-3])
    drafts = backend.draft(state, prompt[-3:], 5)
    reference = backend.new_state()
    backend.prefill(reference, prompt)
    plain = []
    for _ in range(5):  # the draft is the greedy continuation
        plain.append(int(mx.argmax(backend.logits(reference)).item()))
        backend.prefill(reference, plain[-1:])
    assert drafts == plain
    with pytest.raises(ValueError, match="verify"):
        backend.rewind(state, 2)  # fewer than the catch-up tokens it fed
    backend.rewind(state, 3 + 2)  # the catch-up and two drafts
    assert state.length == len(prompt) + 2
    again = backend.new_state()
    backend.prefill(again, [*prompt, *plain[:2]])
    assert mx.allclose(backend.logits(state), backend.logits(again), atol=1e-4)
    assert backend.draft(state, [plain[2]], 2) == plain[3:5]  # and it drafts on from there
    backend.close()


# ---------------------------------------------------------------------------- the engine


@pytest.mark.anyio
async def test_the_target_drafting_for_itself_is_exact_and_accepts_every_draft() -> None:
    prompt = _prompt()
    llama = tiny_model_path("llama")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec("llama", llama))
        plain = await rt.complete(
            "llama", prompt_tokens=prompt, max_tokens=60, sampling=Sampling(speculative=0)
        )
        fast = await rt.complete("llama", prompt_tokens=prompt, max_tokens=60)  # 8: the default
        assert list(fast.token_ids) == list(plain.token_ids)
        assert isinstance(fast.terminal, Finished)
        usage = fast.terminal.usage
        assert usage.drafted_tokens > 0
        assert usage.accepted_tokens == usage.drafted_tokens
        assert _gauges(rt, "llama")["draft_states"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["llama", "sliding", "hybrid"])
async def test_greedy_output_with_a_draft_model_is_unchanged(kind: TinyModelKind) -> None:
    """Every target cache kind, drafted for by the full-attention llama (the same tokenizer)."""
    prompt = _prompt()
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec(kind, tiny_model_path("llama")))
        for bias in ({}, SHIFTED):
            plain = await rt.complete(
                kind,
                prompt_tokens=prompt,
                max_tokens=60,
                sampling=Sampling(logit_bias=bias, speculative=0),
            )
            fast = await rt.complete(
                kind, prompt_tokens=prompt, max_tokens=60, sampling=Sampling(logit_bias=bias)
            )
            assert list(fast.token_ids) == list(plain.token_ids), bias
        counters = _counters(rt, kind)
        assert counters["drafted_tokens"] > 0
        if kind == "llama":  # its own weights: drafts both accepted and (shifted) rejected
            assert 0 < counters["accepted_tokens"] < counters["drafted_tokens"]


# ---------------------------------------------------------------------------- configuration


def _copy_of_llama(tmp_path: Path) -> Path:
    copy = tmp_path / "draft"
    shutil.copytree(tiny_model_path("llama"), copy)
    return copy


def _edit_json(path: Path, edit: Any) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _swap_two_tokens(data: dict[str, Any]) -> None:
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[100]], vocab[by_id[101]] = 101, 100


@pytest.mark.anyio
async def test_an_incompatible_pair_is_refused_at_load_naming_the_difference(
    tmp_path: Path,
) -> None:
    swapped = _copy_of_llama(tmp_path / "swapped")
    _edit_json(swapped / "tokenizer.json", _swap_two_tokens)
    eos = _copy_of_llama(tmp_path / "eos")
    for name in ("config.json", "generation_config.json"):
        _edit_json(eos / name, lambda d: d.update(eos_token_id=[3, 4]))
    cases = [
        (swapped, "token id 100 is"),
        (eos, "end-of-sequence token ids differ"),
        (tiny_model_path("sliding"), "sliding-window or recurrent"),
    ]
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        for draft, said in cases:
            with pytest.raises(DraftModelIncompatible, match=said) as raised:
                await rt.load_model(spec("llama", draft))
            assert raised.value.code == "draft_model_incompatible"


def test_a_vocabulary_of_another_size_is_named() -> None:
    llama = _llama()
    simulated = SimulatedBackend.load(sim_spec("s"), RealClock())
    said = r"vocabulary sizes differ \('s' 257, draft 512"
    with pytest.raises(DraftModelIncompatible, match=said):
        check_pair("s", simulated, "l", llama)
    llama.close()


# ---------------------------------------------------------------------------- pricing, release


def _drafting(**options: Any) -> ModelSpec:
    """A simulated model drafting for itself (the default simulated model is its draft)."""
    return sim_spec("m", context_length=512, draft_model="m", draft_cost=0.01, **options)


@pytest.mark.anyio
async def test_the_draft_state_is_priced_and_dropped_on_every_ending() -> None:
    prompt = list(b"the quick brown fox jumps over the lazy dog; " * 2)
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt:
        await rt.load_model(_drafting(decode_s_per_token=0.002))
        done = await rt.complete("m", prompt_tokens=prompt, max_tokens=40)
        assert isinstance(done.terminal, Finished)
        assert done.terminal.usage.accepted_tokens == done.terminal.usage.drafted_tokens > 0
        assert _gauges(rt, "m")["draft_states"] == 0
        got = 0
        async with rt.generate("m", prompt_tokens=prompt, max_tokens=400, request_id="r") as s:
            async for event in s:
                if isinstance(event, TokensEmitted):
                    got += len(event.token_ids)
                    if got >= 10:
                        await rt.cancel("r")
                elif isinstance(event, Cancelled):
                    break
        assert _gauges(rt, "m")["draft_states"] == 0
    # Twice the KV of a request that does not speculate: over the budget, it is refused.
    tokens = len(prompt) + 100
    budget = int(1.5 * tokens * 1024)
    async with Runtime(RuntimeConfig(kv_budget_bytes=budget)) as rt:
        await rt.load_model(_drafting())
        plain = await rt.complete(
            "m", prompt_tokens=prompt, max_tokens=100, sampling=Sampling(speculative=0)
        )
        assert isinstance(plain.terminal, Finished)
        fast = await rt.complete("m", prompt_tokens=prompt, max_tokens=100)
        assert isinstance(fast.terminal, Failed)
        assert fast.terminal.code == "kv_request_too_large"


def test_draft_model_on_the_command_line_is_the_model_option() -> None:
    import argparse

    from runtime.cli.flags import add_ctx_size, add_draft_model, model_options

    parser = argparse.ArgumentParser()
    add_ctx_size(parser)
    add_draft_model(parser)
    args = parser.parse_args(["--draft-model", "smollm2-135m-instruct"])
    assert model_options(args) == ["draft_model=smollm2-135m-instruct"]


def test_a_draft_that_costs_as_much_as_the_target_never_pays() -> None:
    from actors.engine.draft_model import DRAFTS_WITH_MODEL, DraftModel, DraftSource, default_drafts
    from actors.engine.drafting import Speculation
    from runtime.backends.options import decode_options

    backend = SimulatedBackend.load(sim_spec("s"), RealClock())
    dear = Speculation(8, source=DraftSource(DraftModel(backend, cost=1.0)))
    cheap = Speculation(8, source=DraftSource(DraftModel(backend, cost=0.05)))
    assert dear.size(8) == 0  # a pass would cost more than the tokens it brings
    assert cheap.size(8) > 0
    assert cheap.expects_drafts([1, 2, 3], 8) and not dear.expects_drafts([1, 2, 3], 8)
    named = sim_spec("m", draft_model="m")
    assert default_drafts(named, decode_options(named)) == DRAFTS_WITH_MODEL
    said = sim_spec("m", draft_model="m", speculative=3)
    assert default_drafts(said, decode_options(said)) == 3
