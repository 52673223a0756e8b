"""Tests of the offline tiny-model factory: loadable by mlx-lm, right cache kinds, deterministic."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from runtime.testing.tiny_models import (
    FACTORY_VERSION,
    SLIDING_WINDOW,
    STAMP_FILE,
    TINY_MODEL_KINDS,
    TinyModelKind,
    build_tiny_model,
    load_tiny_model,
    tiny_model_path,
)

pytestmark = pytest.mark.mlx

ROUND_TRIP_TEXT = "Hello, world! def f(x): return x"
PROMPTS = ("Hello, world!", "The capital of France is", "def fibonacci(n):")


def _greedy_ids(model: Any, tokenizer: Any, prompt: str | list[int], n: int = 8) -> list[int]:
    from mlx_lm import stream_generate

    # No sampler given: stream_generate defaults to argmax, i.e. greedy decoding.
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=n)]


def _cache_types(model: Any) -> list[str]:
    from mlx_lm.models.cache import make_prompt_cache

    return [type(c).__name__ for c in make_prompt_cache(model)]


@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_mlx_lm_load_returns_working_model_and_tokenizer(kind: TinyModelKind) -> None:
    from mlx_lm import load
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

    path = tiny_model_path(kind)
    assert path.name == f"{kind}-v{FACTORY_VERSION}-seed0"
    loaded = load(str(path))  # typed as a 2- or 3-tuple (return_config)
    model, tokenizer = loaded[0], loaded[1]
    assert isinstance(tokenizer, TokenizerWrapper)
    assert tokenizer.eos_token_ids == {
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("</s>"),
    }
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)
    assert model.args.vocab_size == len(tokenizer.vocab)


def test_llama_cache_is_all_kv() -> None:
    model, _ = load_tiny_model("llama")
    assert set(_cache_types(model)) == {"KVCache"}


def test_sliding_cache_mixes_rotating_window_and_full_kv() -> None:
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    model, _ = load_tiny_model("sliding")
    caches = make_prompt_cache(model)
    rotating = [c for c in caches if isinstance(c, RotatingKVCache)]
    full = [c for c in caches if type(c) is KVCache]
    assert rotating
    assert full
    assert all(c.max_size == SLIDING_WINDOW for c in rotating)


def test_hybrid_cache_mixes_recurrent_state_and_kv() -> None:
    from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

    model, _ = load_tiny_model("hybrid")
    caches = make_prompt_cache(model)
    assert any(isinstance(c, ArraysCache) for c in caches)  # MambaCache subclasses it too
    assert any(type(c) is KVCache for c in caches)


@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_greedy_generation_is_deterministic_and_not_degenerate(kind: TinyModelKind) -> None:
    from mlx_lm import generate

    model, tokenizer = load_tiny_model(kind)
    outputs = []
    for prompt in PROMPTS:
        first = _greedy_ids(model, tokenizer, prompt)
        assert first == _greedy_ids(model, tokenizer, prompt)
        assert len(first) == 8
        assert len(set(first)) > 1, f"{kind}: greedy output is one repeated token {first}"
        # Special tokens get zero logits at build time, so greedy never stops early.
        assert not set(first) & tokenizer.eos_token_ids
        outputs.append(tuple(first))
    assert len(set(outputs)) == len(PROMPTS), "continuations should depend on the prompt"
    text = generate(model, tokenizer, PROMPTS[0], max_tokens=8)
    # mlx-lm's BPEStreamingDetokenizer drops one leading space of the whole generation.
    assert text == tokenizer.decode(list(outputs[0])).removeprefix(" ")
    assert "\ufffd" not in text


@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_prompt_longer_than_sliding_window_generates(kind: TinyModelKind) -> None:
    model, tokenizer = load_tiny_model(kind)
    prompt = tokenizer.encode(" ".join(["the quick brown fox"] * 20))
    assert len(prompt) > 2 * SLIDING_WINDOW
    ids = _greedy_ids(model, tokenizer, prompt)
    assert ids == _greedy_ids(model, tokenizer, prompt)


@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_tokenizer_round_trips_and_renders_chat(kind: TinyModelKind) -> None:
    _, tokenizer = load_tiny_model(kind)
    ids = tokenizer.encode(ROUND_TRIP_TEXT)
    assert len(ids) < len(ROUND_TRIP_TEXT), "BPE merges should compress the text"
    assert tokenizer.decode(ids) == ROUND_TRIP_TEXT

    detok = tokenizer.detokenizer
    detok.reset()
    for token in ids:
        detok.add_token(token)
    detok.finalize()
    assert detok.text == ROUND_TRIP_TEXT

    # Any UTF-8 survives: the full byte alphabet is in the vocabulary.
    unicode_text = "naïve café — 日本語 🙂"
    assert tokenizer.decode(tokenizer.encode(unicode_text)) == unicode_text

    messages = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(chat_ids) == rendered


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_build_is_idempotent_and_deterministic(tmp_path: Path) -> None:
    first = build_tiny_model("hybrid", tmp_path / "a")
    stamp = first / STAMP_FILE
    before = stamp.stat().st_mtime_ns
    assert build_tiny_model("hybrid", tmp_path / "a") == first
    assert stamp.stat().st_mtime_ns == before, "a stamped directory must not be rebuilt"
    # Same seed in another directory: byte-identical files, weights included.
    assert _files(first) == _files(build_tiny_model("hybrid", tmp_path / "b"))
    other_seed = build_tiny_model("hybrid", tmp_path / "c", seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (
        first / "model.safetensors"
    ).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dirs leaked"


def test_build_replaces_stale_directory(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "junk.txt").write_text("half-written leftovers")
    (target / STAMP_FILE).write_text('{"factory_version": -1}')
    build_tiny_model("llama", target)
    assert not (target / "junk.txt").exists()
    assert (target / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_concurrent_builds_in_separate_processes(tmp_path: Path) -> None:
    target = tmp_path / "shared"
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from runtime.testing.tiny_models import build_tiny_model
        build_tiny_model("sliding", Path({str(target)!r}))
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    assert [p.wait(timeout=100) for p in procs] == [0, 0]
    reference = build_tiny_model("sliding", tmp_path / "reference")
    assert _files(target) == _files(reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference", "shared"]


def test_unknown_kind_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        build_tiny_model("gpt2", tmp_path / "x")  # type: ignore[arg-type]
