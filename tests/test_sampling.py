"""TokenSampler on crafted logits: each processor and filter does exactly its job, and no more.

Filters are checked twice: exactly, on the set of tokens ``truncate`` leaves finite, and end to end,
by sampling under many seeds and checking that only (and, where the kept set is small and not too
skewed, every one of) the allowed tokens come out.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest

from runtime.errors import InvalidRequest
from runtime.host.validation import validate_sampling
from runtime.messages import Sampling
from runtime.text.sampling import SampleResult, TokenSampler, sequence_breaker_ids

SEEDS = range(300)


def no_text(token_id: int) -> str:
    return f"<{token_id}>"


def sampler(vocab: int = 8, decode: object = no_text, **fields: object) -> TokenSampler:
    sampling = Sampling(**fields)  # type: ignore[arg-type]
    validate_sampling(sampling)
    return TokenSampler(sampling, vocab, decode)  # type: ignore[arg-type]


def logits_for(probs: Sequence[float]) -> mx.array:
    return mx.array([math.log(p) for p in probs], dtype=mx.float32)


def log_softmax(values: Sequence[float]) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def kept(s: TokenSampler, logits: mx.array, rng: random.Random | None = None) -> set[int]:
    """Tokens that survive the truncation filters (finite log-probability)."""
    lp = s.process(logits, [])
    lp = lp - mx.logsumexp(lp, keepdims=True)
    out = s.truncate(lp, rng or random.Random(0)).tolist()
    assert isinstance(out, list)
    return {i for i, v in enumerate(out) if v != -math.inf}


def drawn(s: TokenSampler, logits: mx.array, history: Sequence[int] = ()) -> set[int]:
    return {s.sample(logits, history, random.Random(seed)).token for seed in SEEDS}


def processed(s: TokenSampler, logits: Sequence[float], history: Sequence[int]) -> list[float]:
    out = s.process(mx.array(logits, dtype=mx.float32), history).tolist()
    assert isinstance(out, list)
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------- truncation filters


def test_min_p_removes_every_token_under_the_threshold() -> None:
    probs = [0.30, 0.25, 0.2, 0.07, 0.06, 0.05, 0.04, 0.03]
    s = sampler(temperature=1.0, min_p=0.2)  # threshold 0.2 * 0.30 = 0.06
    logits = logits_for(probs)
    assert kept(s, logits) == {0, 1, 2, 3, 4}
    assert drawn(s, logits) == {0, 1, 2, 3, 4}
    assert kept(sampler(temperature=1.0, min_p=0.5), logits) == {0, 1, 2}


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    rng = np.random.default_rng(7)
    values = rng.normal(size=64).astype(np.float32)
    logits = mx.array(values)
    for k in (1, 5, 17):
        s = sampler(vocab=64, temperature=1.0, top_k=k)
        expected = set(np.argsort(-values)[:k].tolist())
        assert kept(s, logits) == expected
    s = sampler(vocab=64, temperature=1.0, top_k=3)
    assert drawn(s, logits * 0.1) == set(np.argsort(-values)[:3].tolist())


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = [0.05, 0.4, 0.05, 0.3, 0.2]
    logits = logits_for(probs)
    assert kept(sampler(vocab=5, temperature=1.0, top_p=0.35), logits) == {1}
    assert kept(sampler(vocab=5, temperature=1.0, top_p=0.65), logits) == {1, 3}
    assert kept(sampler(vocab=5, temperature=1.0, top_p=0.75), logits) == {1, 3, 4}
    assert kept(sampler(vocab=5, temperature=1.0, top_p=0.92), logits) == {0, 1, 2, 3, 4}
    assert drawn(sampler(vocab=5, temperature=1.0, top_p=0.75), logits) == {1, 3, 4}


def test_top_n_sigma_keeps_exactly_the_tokens_within_n_sigma() -> None:
    values = [4.0, 3.5, 3.1, 2.0, 1.0, 0.5, -1.0, -3.0]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))  # population std
    logits = mx.array(values)
    for n in (0.25, 0.5, 1.0, 1.5):
        expected = {i for i, v in enumerate(values) if v >= max(values) - n * std}
        s = sampler(temperature=1.0, top_n_sigma=n)
        assert kept(s, logits) == expected, n
    # n = 0.5: max - 0.5 * 2.15 = 2.93 keeps {0, 1, 2}; n = 1.5 also keeps 3 and 4.
    assert kept(sampler(temperature=1.0, top_n_sigma=0.5), logits) == {0, 1, 2}
    assert kept(sampler(temperature=1.0, top_n_sigma=1.5), logits) == {0, 1, 2, 3, 4}
    assert drawn(sampler(temperature=1.0, top_n_sigma=0.5), logits) == {0, 1, 2}


def test_top_n_sigma_ignores_tokens_an_earlier_filter_removed() -> None:
    values = [4.0, 3.5, 2.0, -30.0, -30.0, -30.0, -30.0, -30.0]
    # After top-k=3 the std is over [4, 3.5, 2] (0.85): 1 sigma keeps 4 and 3.5 only. Over the whole
    # vocabulary the std would be ~15 and every token would stay.
    s = sampler(temperature=1.0, top_k=3, top_n_sigma=1.0)
    assert kept(s, mx.array(values)) == {0, 1}


def typical_reference(probs: Sequence[float], mass: float) -> set[int]:
    """Locally typical sampling as Hugging Face's ``TypicalLogitsWarper`` computes it (numpy):
    order by |-log p - H|, keep the shortest prefix whose probability reaches ``mass``."""
    p = np.asarray(probs, dtype=np.float64) / sum(probs)
    entropy = -(p * np.log(p)).sum()
    order = np.argsort(np.abs(-np.log(p) - entropy), kind="stable")
    cumulative = np.cumsum(p[order])
    last = int((cumulative < mass).sum())  # the index where the mass is reached
    return {int(i) for i in order[: last + 1]}


def test_typical_p_keeps_the_tokens_nearest_the_entropy_up_to_its_mass() -> None:
    probs = [0.35, 0.15, 0.15, 0.15, 0.1, 0.05, 0.03, 0.02]
    logits = logits_for(probs)
    for mass in (0.1, 0.25, 0.4, 0.5, 0.7, 0.92, 0.97, 0.99):  # none on a sum's boundary
        expected = typical_reference(probs, mass)
        assert kept(sampler(temperature=1.0, typical_p=mass), logits) == expected, mass
    # The entropy is 1.78 nats; -log p is 1.90 for the 0.15s, 2.30 for 0.1 and 1.05 for the most
    # likely token, which typical sampling therefore drops first (top-p would keep it first).
    assert kept(sampler(temperature=1.0, typical_p=0.5), logits) == {1, 2, 3, 4}
    assert drawn(sampler(temperature=1.0, typical_p=0.5), logits) == {1, 2, 3, 4}
    assert kept(sampler(temperature=1.0, typical_p=1.0), logits) == set(range(8))  # off


def test_typical_p_measures_the_entropy_over_what_earlier_filters_kept() -> None:
    probs = [0.5, 0.3, 0.15, 0.03, 0.01, 0.005, 0.003, 0.002]
    # top-k 3 leaves [0.5, 0.3, 0.15], renormalised: typical-p then works on those alone.
    survivors = [p / 0.95 for p in probs[:3]]
    s = sampler(temperature=1.0, top_k=3, typical_p=0.5)
    assert kept(s, logits_for(probs)) == typical_reference(survivors, 0.5)


def test_filters_hold_on_huge_logits() -> None:
    values = mx.array([300.0, 299.0, 250.0, -300.0, 0.0, 0.0, 0.0, 0.0])  # exp() overflows float32
    # p1 / p0 = e**-1 = 0.37: min-p 0.3 keeps both, top-p 0.9 needs both (0.73 + 0.27).
    for fields in (
        {"min_p": 0.3},
        {"top_p": 0.9},
        {"top_n_sigma": 0.1},
        {"top_k": 2},
        {"typical_p": 0.99},
    ):
        s = sampler(temperature=1.0, **fields)
        assert drawn(s, values) == {0, 1}, fields


def test_xtc_removes_the_top_choices_when_triggered() -> None:
    probs = [0.4, 0.3, 0.2, 0.05, 0.05]
    logits = logits_for(probs)
    # 0.4, 0.3 and 0.2 reach 0.15: all but the least probable of them (token 2) go.
    s = sampler(vocab=5, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.15)
    assert kept(s, logits) == {2, 3, 4}
    assert drawn(s, logits) == {2, 3, 4}
    # Only one token reaches 0.35: nothing is removed.
    s = sampler(vocab=5, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.35)
    assert kept(s, logits) == {0, 1, 2, 3, 4}


def test_xtc_never_acts_at_probability_zero_and_sometimes_at_one_half() -> None:
    probs = [0.4, 0.3, 0.2, 0.05, 0.05]
    logits = logits_for(probs)
    off = sampler(vocab=5, temperature=1.0, xtc_probability=0.0, xtc_threshold=0.15)
    assert all(kept(off, logits, random.Random(seed)) == {0, 1, 2, 3, 4} for seed in SEEDS)
    half = sampler(vocab=5, temperature=1.0, xtc_probability=0.5, xtc_threshold=0.15)
    outcomes = [kept(half, logits, random.Random(seed)) == {2, 3, 4} for seed in range(100)]
    assert 25 < sum(outcomes) < 75


def test_filters_are_skipped_by_greedy_and_temperature_is_applied_last() -> None:
    logits = logits_for([0.4, 0.3, 0.2, 0.05, 0.05])
    s = sampler(vocab=5, temperature=0.0, xtc_probability=1.0, xtc_threshold=0.15, top_k=3)
    rng = random.Random(3)
    state = rng.getstate()
    assert s.sample(logits, [], rng).token == 0
    assert rng.getstate() == state  # greedy draws nothing
    # A very low temperature sharpens the survivors of XTC onto its best remaining token.
    cold = sampler(vocab=5, temperature=1e-3, xtc_probability=1.0, xtc_threshold=0.15)
    assert drawn(cold, logits) == {2}


# --------------------------------------------------------------------------- logits processors


def test_repetition_penalty_changes_only_tokens_in_the_window() -> None:
    logits = [2.0, -2.0, 3.0, -1.0, 0.5, 1.0]
    s = sampler(vocab=6, repetition_penalty=2.0, penalty_context=3)
    # The window is the last 3 tokens: [2, 3, 3]; tokens 0 and 1 appear only before it.
    out = processed(s, logits, [0, 1, 2, 3, 3])
    assert out == pytest.approx([2.0, -2.0, 1.5, -2.0, 0.5, 1.0])


def test_presence_penalty_subtracts_once_per_distinct_token() -> None:
    logits = [2.0, -2.0, 3.0, -1.0, 0.5, 1.0]
    s = sampler(vocab=6, presence_penalty=0.5, penalty_context=3)
    out = processed(s, logits, [0, 1, 2, 3, 3])
    assert out == pytest.approx([2.0, -2.0, 2.5, -1.5, 0.5, 1.0])


def test_frequency_penalty_subtracts_per_occurrence() -> None:
    logits = [2.0, -2.0, 3.0, -1.0, 0.5, 1.0]
    s = sampler(vocab=6, frequency_penalty=0.5, penalty_context=4)
    out = processed(s, logits, [0, 1, 2, 3, 3, 3])  # window [2, 3, 3, 3]
    assert out == pytest.approx([2.0, -2.0, 2.5, -2.5, 0.5, 1.0])
    negative = sampler(vocab=6, frequency_penalty=-1.0, penalty_context=4)
    assert processed(negative, logits, [0, 1, 2, 3, 3, 3])[3] == pytest.approx(2.0)


def test_penalties_compose_in_order_and_context_zero_turns_them_off() -> None:
    logits = [2.0, -2.0, 3.0, -1.0]
    fields = {"repetition_penalty": 2.0, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    s = sampler(vocab=4, penalty_context=8, **fields)
    # token 2: 3 / 2 - 0.5 - 0.25 = 0.75; token 3 (twice): -1 * 2 - 0.5 - 0.5 = -3.0
    assert processed(s, logits, [2, 3, 3]) == pytest.approx([2.0, -2.0, 0.75, -3.0])
    off = sampler(vocab=4, penalty_context=0, **fields)
    assert processed(off, logits, [2, 3, 3]) == logits


def test_logit_bias_adds_exactly_the_bias() -> None:
    logits = [1.0, 2.0, 3.0, 0.0]
    s = sampler(vocab=4, logit_bias={0: 5.0, 2: -100.0})
    assert processed(s, logits, [1, 2]) == pytest.approx([6.0, 2.0, -97.0, 0.0])
    assert s.sample(mx.array(logits), [], random.Random(0)).token == 0
    assert drawn(sampler(vocab=4, temperature=1.0, logit_bias={2: -100.0}), mx.array(logits)) == {
        0,
        1,
        3,
    }


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="outside the model's vocabulary of 4"):
        sampler(vocab=4, logit_bias={4: 1.0})


def test_greedy_takes_the_argmax_after_the_processors() -> None:
    logits = mx.array([3.0, 2.9, 0.0, 0.0])
    assert sampler(vocab=4).sample(logits, [0, 0], random.Random(0)).token == 0
    penalised = sampler(vocab=4, repetition_penalty=1.1)
    assert penalised.sample(logits, [0, 0], random.Random(0)).token == 1
    biased = sampler(vocab=4, logit_bias={3: 3.5})
    assert biased.sample(logits, [], random.Random(0)).token == 3


GREEDY = {
    "plain": {},
    "penalty": {"repetition_penalty": 1.1},
    "bias": {"logit_bias": {3: 3.5}},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
}
ROWS = {
    "tie": [1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 0.0, 0.0],
    "last": [0.0] * 7 + [1.0],
    "equal": [0.5] * 8,
    "masked": [-math.inf, -math.inf, 1.0, -math.inf, 1.0, 0.0, 0.0, 0.0],
    "nan": [1.0, math.nan, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0],
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
@pytest.mark.parametrize("fields", GREEDY.values(), ids=GREEDY.keys())
def test_a_greedy_draw_on_computed_logits_picks_what_mlx_picks(
    fields: dict[str, object], row: list[float]
) -> None:
    """``computed=True`` (logits of a backend that is not pipelined) may pick on the host: the
    same token, logprobs and array to feed, ties and NaN included."""
    s = sampler(**fields)
    logits = mx.array(row, dtype=mx.float32)
    on_host = s.draw(logits, [0, 2], random.Random(0), computed=True)
    on_device = s.draw(logits, [0, 2], random.Random(0))
    on_host.start()
    assert repr(on_host.read()) == repr(on_device.read())  # repr: a NaN logprob equals itself
    assert on_host.token.item() == on_device.token.item()


def test_a_greedy_draw_on_computed_logits_of_a_real_vocabulary_is_the_argmax() -> None:
    logits = np.random.default_rng(0).standard_normal(49152).astype(np.float32)
    s = sampler(vocab=49152)
    draw = s.draw(mx.array(logits), [], random.Random(0), computed=True)
    expected = s.sample(mx.array(logits), [], random.Random(0)).token
    assert draw.read().token == int(np.argmax(logits)) == expected
    with pytest.raises(ValueError, match=r"shape \(49152,\)"):
        s.draw(mx.array(logits[:8]), [], random.Random(0), computed=True)


# --------------------------------------------------------------------------- DRY


def dry(decode: object = no_text, **fields: object) -> TokenSampler:
    base = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2}
    return sampler(vocab=12, decode=decode, **{**base, **fields})


def test_dry_penalises_the_token_that_extends_a_repeated_ngram() -> None:
    s = dry()
    # Suffix [1, 2] occurred before, followed by 3: a match of length 2 = allowed: 0.8 * 1.75**0.
    assert s.dry_penalties([1, 2, 3, 4, 1, 2]) == pytest.approx({3: 0.8})
    # Suffix [1, 2, 3] occurred, followed by 4: length 3 -> 0.8 * 1.75.
    assert s.dry_penalties([5, 1, 2, 3, 4, 6, 1, 2, 3]) == pytest.approx({4: 0.8 * 1.75})
    # Length 4 -> 0.8 * 1.75**2; and the logits change by exactly that amount, nowhere else.
    history = [9, 1, 2, 3, 7, 4, 8, 1, 2, 3, 7]
    assert s.dry_penalties(history) == pytest.approx({4: 0.8 * 1.75**2})
    out = processed(s, [0.0] * 12, history)
    assert out == pytest.approx([0.0] * 4 + [-0.8 * 1.75**2] + [0.0] * 7)


def test_dry_takes_the_longest_match_per_token_and_ignores_short_ones() -> None:
    s = dry()
    # Last token 2 occurred after 1 (then 5) and after 7 (then 6): the suffix [7, 2] matches once.
    assert s.dry_penalties([1, 2, 5, 7, 2, 6, 7, 2]) == pytest.approx({6: 0.8})
    # Only the last token repeats (length 1 < 2): no penalty.
    assert s.dry_penalties([1, 2, 7, 3, 2]) == {}
    # allowed_length 1 penalises single-token repeats too.
    assert dry(dry_allowed_length=1).dry_penalties([1, 2, 7, 3, 2]) == pytest.approx({7: 0.8})
    # Two occurrences lead to 4: the longer (3) one counts.
    assert dry().dry_penalties([1, 2, 3, 4, 9, 2, 3, 4, 1, 2, 3]) == pytest.approx({4: 0.8 * 1.75})


def test_dry_stops_at_sequence_breakers() -> None:
    def decode(token_id: int) -> str:
        return {10: "\n", 11: "a:b"}.get(token_id, f"w{token_id}")

    s = dry(decode=decode, dry_sequence_breakers=("\n", ":"))
    assert s.dry_penalties([1, 8, 2, 3, 1, 8, 2]) == pytest.approx({3: 0.8 * 1.75})
    # The same pattern across a breaker ("\n") matches only the last token: no penalty.
    assert s.dry_penalties([1, 10, 2, 3, 1, 10, 2]) == {}
    # A token whose text contains a breaker (":" inside "a:b") breaks too.
    assert s.dry_penalties([1, 11, 2, 3, 1, 11, 2]) == {}
    # When the last token is a breaker nothing is penalised.
    assert s.dry_penalties([4, 5, 10, 6, 4, 5, 10]) == {}
    # A breaker is never the penalised token, so the model can always break a loop.
    assert s.dry_penalties([1, 2, 10, 5, 1, 2]) == {}
    # With no breakers configured the same history is penalised.
    plain = dry(decode=decode, dry_sequence_breakers=())
    assert plain.dry_penalties([1, 10, 2, 3, 1, 10, 2]) == pytest.approx({3: 0.8 * 1.75})


def test_dry_only_looks_inside_the_penalty_window() -> None:
    history = [1, 2, 3, 0, 0, 0, 0, 0, 1, 2]
    assert processed(dry(penalty_context=10), [0.0] * 12, history)[3] == pytest.approx(-0.8)
    assert processed(dry(penalty_context=5), [0.0] * 12, history)[3] == 0.0


def test_dry_penalty_stays_finite_on_long_repeats() -> None:
    s = dry(dry_base=1000.0, penalty_context=400)
    history = [1, 2, 3, 4] * 100
    penalties = s.dry_penalties(history)
    assert set(penalties) == {1} and math.isfinite(penalties[1])
    assert math.isfinite(processed(s, [0.0] * 12, history)[1])


def test_sequence_breaker_ids_scans_the_vocabulary_once() -> None:
    calls: list[int] = []

    def decode(token_id: int) -> str:
        calls.append(token_id)
        if token_id == 5:
            raise IndexError("padding row")
        return "x\ny" if token_id == 3 else "z"

    assert sequence_breaker_ids(decode, 8, ("\n",)) == {3}
    assert sequence_breaker_ids(decode, 8, ("\n",)) == {3}
    assert len(calls) == 8
    dry(decode=decode, dry_multiplier=0.0)  # DRY off: no scan at all
    assert len(calls) == 8


# --------------------------------------------------------------------------- seeds and logprobs


def run(s: TokenSampler, seed: int, steps: int = 24) -> list[int]:
    rng = random.Random(seed)
    logits = mx.zeros((s.vocab_size,))
    history: list[int] = []
    for _ in range(steps):
        history.append(s.sample(logits, history, rng).token)
    return history


def test_same_seed_same_tokens_different_seeds_differ() -> None:
    s = sampler(vocab=100, temperature=1.0, top_k=50, xtc_probability=0.5, frequency_penalty=0.1)
    assert run(s, 1) == run(s, 1)
    assert run(s, 1) != run(s, 2)
    assert len({tuple(run(s, seed)) for seed in range(10)}) == 10


def test_logprobs_are_the_log_softmax_of_the_processed_logits() -> None:
    values = [1.0, 3.0, 2.5, -1.0, 0.0, 2.0, 0.5, 2.9]
    history = [1, 1]
    fields = {"logprobs": True, "top_logprobs": 3, "presence_penalty": 1.0, "logit_bias": {4: 1.0}}
    # presence: token 1 -> 2.0; bias: token 4 -> 1.0
    adjusted = [1.0, 2.0, 2.5, -1.0, 1.0, 2.0, 0.5, 2.9]
    expected = log_softmax(adjusted)
    order = sorted(range(8), key=lambda t: (-expected[t], t))
    for temperature in (0.0, 0.7):
        s = sampler(temperature=temperature, top_k=2, **fields)
        for seed in range(20):
            result = s.sample(mx.array(values), history, random.Random(seed))
            assert result.logprob == pytest.approx(expected[result.token], abs=1e-5)
            assert [t for t, _ in result.top_logprobs] == order[:3]  # 7, 2, then 1 (id breaks tie)
            assert [v for _, v in result.top_logprobs] == pytest.approx(
                [expected[t] for t in order[:3]], abs=1e-5
            )
    assert order[:3] == [7, 2, 1]


def test_top_logprobs_are_the_true_top_k_in_order() -> None:
    rng = np.random.default_rng(3)
    values = rng.normal(scale=3.0, size=1000).astype(np.float32)
    expected = log_softmax(values.tolist())
    s = sampler(vocab=1000, temperature=1.0, logprobs=True, top_logprobs=20)
    result = s.sample(mx.array(values), [], random.Random(0))
    top = np.argsort(-expected)[:20].tolist()
    assert [t for t, _ in result.top_logprobs] == top
    assert [v for _, v in result.top_logprobs] == pytest.approx(expected[top].tolist(), abs=1e-4)


def test_logprobs_only_when_asked() -> None:
    for temperature in (0.0, 1.0):
        result = sampler(temperature=temperature).sample(mx.zeros((8,)), [], random.Random(0))
        assert result == SampleResult(token=result.token, logprob=None, top_logprobs=())
    only = sampler(temperature=0.0, logprobs=True).sample(mx.zeros((8,)), [], random.Random(0))
    assert only.logprob == pytest.approx(math.log(1 / 8)) and only.top_logprobs == ()


def test_wrong_logits_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        sampler().sample(mx.zeros((1, 8)), [], random.Random(0))


# --------------------------------------------------------------------------- validation

NAN = float("nan")
INF = float("inf")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"temperature": NAN}, "temperature must be a finite number"),
        ({"temperature": INF}, "temperature must be a finite number"),
        ({"temperature": -0.1}, "temperature must be 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": NAN}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"typical_p": 0.0}, "typical_p must be"),
        ({"typical_p": 1.5}, "typical_p must be"),
        ({"top_k": -1}, "top_k must be 0"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"top_n_sigma": -0.5}, "top_n_sigma must be 0"),
        ({"top_n_sigma": NAN}, "top_n_sigma must be a finite number"),
        ({"xtc_probability": -0.1}, "xtc_probability"),
        ({"xtc_probability": 1.1}, "xtc_probability"),
        ({"xtc_probability": NAN}, "xtc_probability"),
        ({"xtc_threshold": 0.6}, r"xtc_threshold must be in \[0, 0.5\]"),
        ({"xtc_threshold": -0.01}, "xtc_threshold"),
        ({"dry_multiplier": -1.0}, "dry_multiplier"),
        ({"dry_multiplier": INF}, "dry_multiplier"),
        ({"dry_multiplier": 0.8, "dry_base": 1.0}, "dry_base must be greater than 1"),
        ({"dry_multiplier": 0.8, "dry_base": 0.5}, "dry_base must be greater than 1"),
        ({"dry_base": NAN}, "dry_base must be a finite number"),
        ({"dry_allowed_length": 0}, "dry_allowed_length must be 1 or more"),
        ({"dry_sequence_breakers": ("\n", "")}, "non-empty strings"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be above 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": NAN}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"frequency_penalty": NAN}, "frequency_penalty"),
        ({"penalty_context": -1}, "penalty_context must be 0"),
        ({"logit_bias": {3: NAN}}, r"logit_bias\[3\] must be a finite number"),
        ({"logit_bias": {3: INF}}, r"logit_bias\[3\]"),
        ({"logit_bias": {3: 100.5}}, r"logit_bias\[3\] must be in \[-100, 100\]"),
        ({"logit_bias": {3: -101.0}}, r"logit_bias\[3\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be 0 to 20"),
        ({"top_logprobs": -1}, "top_logprobs must be 0 to 20"),
        ({"top_logprobs": 5}, "top_logprobs=5 needs logprobs=true"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_validation_refuses_each_bad_value(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as raised:
        validate_sampling(Sampling(**fields))  # type: ignore[arg-type]
    assert raised.value.code == "invalid_request"


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"temperature": 0.7, "top_p": 1.0, "min_p": 1.0, "top_k": 40, "top_n_sigma": 1.0},
        {"xtc_probability": 1.0, "xtc_threshold": 0.5},
        {"xtc_probability": 0.0, "xtc_threshold": 0.0},
        {"dry_multiplier": 0.8, "dry_base": 1.01, "dry_allowed_length": 1},
        {"dry_multiplier": 0.0, "dry_base": 0.5},  # DRY off: its base does not matter
        {"repetition_penalty": 0.5, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"penalty_context": 0, "logit_bias": {0: -100.0, 7: 100, 9: 0.0}},
        {"logprobs": True, "top_logprobs": 20, "seed": -3},
        {"logprobs": True, "top_logprobs": 0},
    ],
)
def test_validation_accepts_values_at_the_edges(fields: dict[str, object]) -> None:
    validate_sampling(Sampling(**fields))  # type: ignore[arg-type]
