"""The tokenizers the GGUF importer writes, as the runtime loads them (mlx-lm's ``load_tokenizer``
of the converted directory): lossless round trips, SmolLM's digit splitting, special tokens as
single ids, BOS as each file asks, and chat prompts through the runtime's ``prepare_chat``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from runtime.backends.mlx.gguf.convert import ConvertedModel
from runtime.messages import ChatMessage, ChatOptions
from runtime.text.chat import prepare_chat

pytestmark = pytest.mark.real_model

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"
GEMMA_BOS = 2

CORPUS = [
    "",
    "a",
    " ",
    "Hello, world!",
    "def area(r):\n\tif r < 0:\n\t\traise ValueError(r)\n    return 3.14159 * r ** 2\n",
    "    indented with spaces\n\tand a tab\n",
    "naïve café résumé Ångström façade",
    "日本語のテキストと中文\uff0c한국어도",  # with a fullwidth comma
    "emoji 🎉🚀 and a family 👩‍👩‍👧 and flags 🇫🇷",
    "digits 0 7 42 12345 3.14159 1,000,000 2024-01-31 99999999999999999999",
    "  leading and trailing  ",
    "whitespace     runs\t\t\tof   both",
    "\n\nnewlines\n\n\n",
    "windows\r\nline\r\nends",
    "maths: αβγ ∑∫ √2 ≠ ∞ ½",
    "\u00a0no-break space and a zero\u200bwidth one",
    'json: {"key": [1, 2, {"nested": null}]}',
]


@pytest.fixture(scope="module")
def tokenizers(converted_gguf: Callable[[str, str], ConvertedModel]) -> Callable[[str], Any]:
    """``tokenizers(name)``: the known model's tokenizer, loaded once from its conversion."""
    loaded: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in loaded:
            path = converted_gguf(name, "float32").path
            config = json.loads((path / "config.json").read_text())
            loaded[name] = load_tokenizer(path, eos_token_ids=config["eos_token_id"])
        return loaded[name]

    return get


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_decodes_what_it_encodes(tokenizers: Callable[[str], Any], text: str) -> None:
    tokenizer = tokenizers(SMOL)

    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", CORPUS)
def test_gemma_decodes_what_it_encodes_after_its_bos(
    tokenizers: Callable[[str], Any], text: str
) -> None:
    tokenizer = tokenizers(GEMMA)

    ids = tokenizer.encode(text)

    assert ids[0] == GEMMA_BOS and GEMMA_BOS not in ids[1:]
    assert tokenizer.decode(ids[1:]) == text


# Bytes SmolLM2's vocabulary has no token for (see the test below): 6 control characters, the
# lead bytes of code points U+40000 to U+BFFFF (unassigned planes), bytes no UTF-8 text holds.
SMOL_MISSING_BYTES = {4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)}


def test_smollm2_drops_the_bytes_its_vocabulary_lacks(tokenizers: Callable[[str], Any]) -> None:
    tokenizer = tokenizers(SMOL)
    byte_tokens = bytes_to_unicode()  # byte-level BPE writes byte b as the character byte_tokens[b]
    vocab = tokenizer.get_vocab()

    missing = {b for b in range(256) if byte_tokens[b] not in vocab}

    assert missing == SMOL_MISSING_BYTES
    assert tokenizer.encode("\x04") == []  # dropped: byte-level BPE has no unknown token
    assert tokenizer.decode(tokenizer.encode("\U00040000")) == "\ufffd" * 3


# Any text SmolLM2's vocabulary can spell (UTF-8: no surrogates; none of the bytes it lacks).
@given(
    text=st.text(
        st.characters(
            codec="utf-8",
            max_codepoint=0x3FFFF,
            exclude_characters="".join(chr(b) for b in SMOL_MISSING_BYTES if b < 0x80),
        )
    )
)
def test_smollm2_round_trips_any_text(tokenizers: Callable[[str], Any], text: str) -> None:
    tokenizer = tokenizers(SMOL)

    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("number", ["12345", "99999999999999999999", "3.14159"])
def test_smollm2_splits_every_digit(tokenizers: Callable[[str], Any], number: str) -> None:
    tokenizer = tokenizers(SMOL)

    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(number)]

    assert pieces == list(number)


@pytest.mark.parametrize(
    ("name", "special"),
    [
        (SMOL, "<|im_start|>"),
        (SMOL, "<|im_end|>"),
        (GEMMA, "<start_of_turn>"),
        (GEMMA, "<end_of_turn>"),
    ],
)
def test_turn_markers_are_single_ids(
    tokenizers: Callable[[str], Any], name: str, special: str
) -> None:
    tokenizer = tokenizers(name)
    special_id = tokenizer.convert_tokens_to_ids(special)

    ids = tokenizer.encode(f"before{special}after", add_special_tokens=False)

    assert tokenizer.encode(special, add_special_tokens=False) == [special_id]
    assert ids.count(special_id) == 1
    assert tokenizer.decode(ids) == f"before{special}after"


def test_gemma_adds_bos_once_and_smollm2_adds_none(tokenizers: Callable[[str], Any]) -> None:
    gemma, smol = tokenizers(GEMMA), tokenizers(SMOL)

    assert gemma.bos_token_id == GEMMA_BOS
    assert gemma.encode("") == [GEMMA_BOS]
    assert gemma.encode("Hello there").count(GEMMA_BOS) == 1
    smol_ids = smol.encode("Hello there")
    assert smol_ids == smol.encode("Hello there", add_special_tokens=False)
    assert smol.bos_token_id not in smol_ids and smol.encode("") == []


@pytest.mark.parametrize(
    ("name", "ends"), [(SMOL, {"<|im_end|>"}), (GEMMA, {"<eos>", "<end_of_turn>"})]
)
def test_generation_ends_on_the_turn_end_tokens(
    tokenizers: Callable[[str], Any], name: str, ends: set[str]
) -> None:
    tokenizer = tokenizers(name)

    assert {tokenizer.decode([i]) for i in tokenizer.eos_token_ids} == ends


def test_smollm2_chat_prompt_keeps_its_markers_as_single_ids(
    tokenizers: Callable[[str], Any],
) -> None:
    tokenizer = tokenizers(SMOL)
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    messages = [
        ChatMessage(role="system", content="You are terse."),
        ChatMessage(role="user", content="Name a colour: <b>one</b>"),
    ]

    prompt = prepare_chat(tokenizer, messages, ChatOptions(), max_tokens=8, context_length=8192)

    assert prompt.text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nName a colour: <b>one</b><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt.tokens.count(start) == 3 and prompt.tokens.count(end) == 2
    assert tokenizer.decode(list(prompt.tokens)) == prompt.text


def test_gemma_is_a_base_model_prompted_as_plain_text(tokenizers: Callable[[str], Any]) -> None:
    tokenizer = tokenizers(GEMMA)
    messages = [ChatMessage(role="user", content="Q: What is 2 + 2?")]

    prompt = prepare_chat(tokenizer, messages, ChatOptions(), max_tokens=8, context_length=8192)

    assert not tokenizer.has_chat_template
    assert prompt.text == "user: Q: What is 2 + 2?\nassistant: "
    assert prompt.tokens[0] == GEMMA_BOS and prompt.tokens.count(GEMMA_BOS) == 1
