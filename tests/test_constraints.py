"""The grammar engine's wrapper on a real tokenizer (the tiny llama's): masks, completion, dead
ends, release, and the sampler's refusal to draw a constrained token ahead of the last one."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest

from runtime.errors import ConstraintDeadEnd
from runtime.messages import JsonSchemaConstraint, RegexConstraint, Sampling
from runtime.testing.tiny_models import load_tiny_model
from runtime.text.constraints import ConstraintEngine, TokenMatcher, live_matchers
from runtime.text.sampling import TokenSampler

Engine = tuple[ConstraintEngine, Any]  # the engine and the Hugging Face tokenizer it reads


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    _, tokenizer = load_tiny_model("llama")
    made = ConstraintEngine(tokenizer, [tokenizer.eos_token_id])
    yield made, tokenizer
    made.close()


def allowed_tokens(matcher: TokenMatcher, vocab: int) -> set[int]:
    masked = matcher.apply(mx.zeros((vocab,)))
    return {i for i, v in enumerate(masked.tolist()) if v == 0.0}


def test_the_mask_allows_exactly_the_tokens_that_continue_the_regex(engine: Engine) -> None:
    constraint_engine, tokenizer = engine
    matcher = constraint_engine.matcher(RegexConstraint(pattern="[0-9]+x"))
    vocab = len(tokenizer.vocab)
    allowed = allowed_tokens(matcher, vocab)
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all(t and t[0].isdigit() for t in texts)
    digit = next(t for t in allowed if tokenizer.decode([t]) == "7")
    assert matcher.accept(digit) is False  # more is needed: "x"
    x = tokenizer.encode("x", add_special_tokens=False)
    assert len(x) == 1 and matcher.accept(x[0]) in (True, False)
    matcher.release()


def test_a_forbidden_token_is_a_typed_dead_end_and_release_is_idempotent(engine: Engine) -> None:
    constraint_engine, tokenizer = engine
    before = live_matchers()
    matcher = constraint_engine.matcher(
        JsonSchemaConstraint(schema=json.dumps({"type": "integer"}))
    )
    assert live_matchers() == before + 1
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    with pytest.raises(ConstraintDeadEnd, match="cannot continue after token"):
        matcher.accept(letter)
    matcher.release()
    matcher.release()
    assert live_matchers() == before and matcher.released


def test_an_eos_before_the_grammar_may_end_is_a_dead_end_not_a_stop(engine: Engine) -> None:
    constraint_engine, tokenizer = engine
    matcher = constraint_engine.matcher(RegexConstraint(pattern="[0-9]{2}"))
    one = next(t for t in range(len(tokenizer.vocab)) if tokenizer.decode([t]) == "1")
    assert matcher.accept(one) is False
    with pytest.raises(ConstraintDeadEnd):
        matcher.accept(tokenizer.eos_token_id)
    matcher.release()


def test_a_constrained_sampler_reads_every_token_before_the_next(engine: Engine) -> None:
    constraint_engine, tokenizer = engine
    vocab = len(tokenizer.vocab)
    matcher = constraint_engine.matcher(RegexConstraint(pattern="ab"))
    sampler = TokenSampler(Sampling(), vocab, str, matcher)
    assert sampler.needs_read_history  # so the engine never builds a step ahead of its read
    logits = mx.zeros((vocab,))
    draw = sampler.draw(logits, [], random.Random(0))
    token = draw.read().token
    assert tokenizer.decode([token]) in ("a", "ab")
    with pytest.raises(ValueError, match="read the fed one first"):
        sampler.draw(logits, [token], random.Random(0), fed=draw.token)
    matcher.release()
