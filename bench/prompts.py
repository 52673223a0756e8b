"""Prompt text made of ordinary English words, sized in tokens with the model's tokenizer."""

from __future__ import annotations

import random
from typing import Any

_WORD_TEXT = (
    "the a of and to in is it that was for on are with as his they be at one have this from "
    "by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air "
    "well also play small end put home read hand port large spell add even land here must big "
    "high such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should country "
    "found answer school grow study still learn plant cover food sun four between state keep eye "
    "never last let thought city tree cross farm hard start might story saw far sea draw left late"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


def make_text(tokenizer: Any, target_tokens: int, seed: int) -> str:
    """Sentences of random common words whose encoding is at least ``target_tokens`` long."""
    rng = random.Random(seed)
    parts: list[str] = []
    count = 0
    while count < target_tokens:
        # Grow in sentence-sized steps, then re-count exactly: BPE merges cross word boundaries.
        for _ in range(4):
            sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
            parts.append(sentence.capitalize() + ".")
        count = len(encode(tokenizer, " ".join(parts)))
    words = " ".join(parts).split(" ")
    # Trim whole words back toward the target (never below it).
    while len(words) > 1 and len(encode(tokenizer, " ".join(words[:-1]))) >= target_tokens:
        words.pop()
    return " ".join(words)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (the tiny tokenizer adds none anyway)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
