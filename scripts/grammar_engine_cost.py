"""What a grammar engine costs per generated token: llguidance vs outlines-core on this CPU.

For each tokenizer (SmolLM2's 49k vocabulary, Gemma 3's 262k) and each engine: the one-off cost
(tokenizer import, schema compile) and the per-token cost (compute the allowed-token bitmask, then
advance the state by one token) over the tokens of a JSON document valid under a small schema, as
the model's own tokenizer splits it. The ``runtime`` engine is llguidance as the runtime drives it
(``TokenMatcher``: mask on a worker thread, applied to a logits row in MLX, token accepted).
xgrammar is not measured: its wheel requires torch and triton
(docs/structured.md). Not a test; the numbers go into docs/structured.md.

    PYTHONPATH=. LD_PRELOAD=... .venv/bin/python scripts/grammar_engine_cost.py --rounds 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from runtime.backends.model_source import prepare_model
from runtime.messages import ModelSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "active": {"type": "boolean"},
        "kind": {"enum": ["person", "robot", "other"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "active", "kind", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace, Countess of Lovelace",
    "age": 36,
    "active": True,
    "kind": "person",
    "tags": ["mathematics", "poetry", "analytical engine", "notes"],
    "address": {"city": "London", "zip": "W1J 7NT"},
}

Step = Callable[[int], None]  # compute the mask, then advance by the given token


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def llguidance_engine(hf_tokenizer: Any) -> tuple[float, Callable[[], tuple[float, Step]]]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    started = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
    import_s = time.perf_counter() - started

    def start() -> tuple[float, Step]:
        began = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        compile_s = time.perf_counter() - began
        assert not matcher.is_error(), matcher.get_error()
        mask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)

        def step(token: int) -> None:
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            assert mask[0, token // 32] >> (token % 32) & 1, "document token masked out"
            assert matcher.consume_token(token), matcher.get_error()

        return compile_s, step

    return import_s, start


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (byte-level BPE vocabularies spell tokens in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [256 + n for n in range(256 - len(printable))]
    others = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(c) for b, c in zip(others, shifted, strict=True)},
    }


def token_bytes(hf_tokenizer: Any) -> dict[bytes, list[int]]:
    """Each token's bytes: byte-level BPE (GPT-2 alphabet) or SentencePiece (▁, <0xNN>)."""
    unicode_to_byte = {u: b for b, u in gpt2_byte_alphabet().items()}
    vocab: dict[str, int] = hf_tokenizer.get_vocab()
    byte_level = any(token.startswith("Ġ") for token in vocab)
    special = set(hf_tokenizer.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for token, token_id in vocab.items():
        if token_id in special:
            continue
        if byte_level:
            if not all(ch in unicode_to_byte for ch in token):
                continue
            raw = bytes(unicode_to_byte[ch] for ch in token)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            raw = bytes([int(token[3:5], 16)])
        else:
            raw = token.replace("▁", " ").encode()
        out.setdefault(raw, []).append(token_id)
    return out


def outlines_engine(hf_tokenizer: Any) -> tuple[float, Callable[[], tuple[float, Step]]]:
    import outlines_core

    started = time.perf_counter()
    vocabulary = outlines_core.Vocabulary(hf_tokenizer.eos_token_id, token_bytes(hf_tokenizer))
    import_s = time.perf_counter() - started
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))

    def start() -> tuple[float, Step]:
        began = time.perf_counter()
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
        compile_s = time.perf_counter() - began
        words = (len(hf_tokenizer) + 31) // 32
        mask = np.zeros(words, dtype=np.int32)

        def step(token: int) -> None:
            guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            assert mask[token // 32] >> (token % 32) & 1, "document token masked out"
            guide.advance(token, return_tokens=False)

        return compile_s, step

    return import_s, start


def runtime_matcher(hf_tokenizer: Any) -> tuple[float, Callable[[], tuple[float, Step]]]:
    """The runtime's own path (runtime.text.constraints): the mask computed on the worker thread
    after each token, applied to a logits row with MLX, then the token accepted."""
    import mlx.core as mx

    from runtime.messages import JsonSchemaConstraint
    from runtime.text.constraints import ConstraintEngine

    started = time.perf_counter()
    engine = ConstraintEngine(hf_tokenizer, [hf_tokenizer.eos_token_id])
    engine.matcher(JsonSchemaConstraint(schema="{}")).release()  # waits for the import
    import_s = time.perf_counter() - started
    logits = mx.zeros((len(hf_tokenizer),))

    def start() -> tuple[float, Step]:
        began = time.perf_counter()
        matcher = engine.matcher(JsonSchemaConstraint(schema=json.dumps(SCHEMA), strict=False))
        compile_s = time.perf_counter() - began

        def step(token: int) -> None:
            masked = matcher.apply(logits)
            mx.eval(masked)
            assert masked[token].item() == 0.0, "document token masked out"
            if matcher.accept(token):
                matcher.release()

        return compile_s, step

    return import_s, start


def measure(model: str, rounds: int, engines: list[str]) -> None:
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(
        str(prepare_model(ModelSpec(name="m", path=model)).path)
    )
    # Compact, as the runtime constrains JSON (no whitespace between tokens).
    document = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = hf_tokenizer.encode(document, add_special_tokens=False)
    print(f"{model}: vocabulary {len(hf_tokenizer)}, document {len(tokens)} tokens")
    makers = {
        "llguidance": llguidance_engine,
        "outlines-core": outlines_engine,
        "runtime": runtime_matcher,
    }
    for name in engines:
        import_s, start = makers[name](hf_tokenizer)
        compiles: list[float] = []
        per_token_us: list[float] = []
        refused: str | None = None
        for _ in range(rounds):
            compile_s, step = start()
            compiles.append(compile_s)
            for index, token in enumerate(tokens):
                began = time.perf_counter()
                try:
                    step(token)
                except AssertionError as exc:  # the engine's vocabulary disagrees with the model's
                    refused = f"token {index} ({token}) of the document: {exc}"
                    break
                per_token_us.append((time.perf_counter() - began) * 1e6)
        if refused is not None:
            print(f"  {name:14s} REFUSED a valid document: {refused}")
        print(
            f"  {name:14s} tokenizer import {import_s * 1e3:8.1f} ms | schema compile "
            f"first {compiles[0] * 1e3:8.1f} ms, median {statistics.median(compiles) * 1e3:8.1f} "
            f"ms | per token mean {statistics.fmean(per_token_us):7.1f} us, "
            f"p50 {percentile(per_token_us, 0.5):7.1f} us, "
            f"p99 {percentile(per_token_us, 0.99):7.1f} us"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--engines", nargs="+", default=["llguidance", "outlines-core"])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    for model in args.models:
        measure(model, args.rounds, args.engines)


if __name__ == "__main__":
    main()
