"""Incremental detokenization: never half a character, and the pieces add up to the whole."""

from __future__ import annotations

from functools import cache
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from runtime.testing.tiny_models import tiny_model_path
from runtime.text.detokenizer import IncrementalDetokenizer


@cache
def tokenizer() -> Any:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tiny_model_path("llama"))


def pieces_for(text: str) -> tuple[list[str], str]:
    tok = tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(lambda t: tok.decode(list(t)))
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, tok.decode(ids)


@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40))
def test_pieces_concatenate_to_the_full_decode_and_never_split_a_character(text: str) -> None:
    pieces, whole = pieces_for(text)
    assert "".join(pieces) == whole
    assert all("\ufffd" not in piece for piece in pieces[:-1])


def test_a_multibyte_character_split_across_tokens_comes_out_whole() -> None:
    pieces, whole = pieces_for("naïve café 😀 日本語")
    assert "".join(pieces) == whole == "naïve café 😀 日本語"
    assert "\ufffd" not in "".join(pieces)
    assert any(len(p.encode()) > 1 for p in pieces if p)  # some piece carried a multi-byte char
