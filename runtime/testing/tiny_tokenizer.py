"""The tiny test models' tokenizer: a byte-level BPE trained in-process on a fixed corpus.

Deterministic and offline (see ``runtime.testing.tiny_models`` for the models that use it): the
same corpus and vocabulary size always give the same ids, and special tokens take ids 0..4.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

VOCAB_SIZE: Final = 512
MAX_POSITION_EMBEDDINGS: Final = 2048

BOS: Final = "<s>"
EOS: Final = "</s>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
PAD: Final = "<pad>"
# Order fixes the ids: the trainer assigns special tokens ids 0..4 in this order.
SPECIAL_TOKENS: Final[tuple[str, ...]] = (BOS, EOS, IM_START, IM_END, PAD)

CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Fixed training text for the tokenizer.  Mixed prose, chat-ish and code so common
# English words and Python/JSON punctuation get merges; changing it changes every id.
_CORPUS: Final = r'''
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with
a single step. All that glitters is not gold. The early bird catches the worm, but the
second mouse gets the cheese. Hello, world! How are you today? I am fine, thank you.
What is the weather like in the city? It is sunny and warm, with a light breeze from
the west. Please write a short story about a robot who learns to paint. Once upon a
time, there was a small robot named Pixel. Pixel lived in a workshop full of brushes
and colors. Every morning the robot watched the sun rise and tried to paint it.
The first paintings were only gray lines, but the robot kept trying, day after day.
One day a child visited the workshop and said: "Your sky is beautiful." The robot was
happy, and it painted the child a picture of the sea.
You are a helpful assistant. Answer the question as clearly as you can. Explain the
answer step by step, and keep the reply short. The user asked about the history of the
printing press, the causes of the weather, and the rules of chess. In chess, each
player starts with sixteen pieces: one king, one queen, two rooks, two knights, two
bishops and eight pawns. The goal of the game is to checkmate the other king.
Water boils at one hundred degrees at sea level. The capital of France is Paris. The
capital of Japan is Tokyo. There are seven days in a week and twelve months in a year.
An actor receives messages, updates its own state, and sends messages to other actors.
The runtime schedules requests, batches tokens, and streams the results back to the
caller. Memory is limited, so the cache keeps the most recent keys and values.

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle if line.strip()]


async def fetch_all(client, urls):
    results = []
    for url in urls:
        response = await client.get(url)
        if response.status == 200:
            results.append(response.json())
    return results


def f(x):
    return x * x + 2 * x + 1


for i in range(10):
    print(f"value {i} = {f(i)}")

if __name__ == "__main__":
    print("Hello, world!")

{"name": "tiny", "version": 1, "layers": [1, 2, 3], "enabled": true, "ratio": 0.5}
SELECT id, name, email FROM users WHERE active = 1 ORDER BY name LIMIT 10;
x = [1, 2, 3, 4, 5]; y = {"a": 1, "b": 2}; z = (x, y) # a tuple of a list and a dict
const add = (a, b) => a + b; let total = 0; for (const v of values) { total += v; }
fn main() { let mut count = 0; while count < 10 { count += 1; } println!("{}", count); }
1 + 1 = 2, 2 * 3 = 6, 10 / 4 = 2.5, 7 % 3 = 1, 2 ** 8 = 256, 100 - 42 = 58.
'''


def train_tiny_tokenizer() -> Any:
    """Train the byte-level BPE tokenizer (a ``tokenizers.Tokenizer``) on ``_CORPUS``.

    Deterministic: the BPE trainer breaks count ties by pair order, and the whole
    256-byte alphabet is seeded so any UTF-8 text round-trips.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # A ByteLevel decoder is what makes mlx-lm pick its BPEStreamingDetokenizer.
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        # The corpus is fixed, so this only fires if the corpus or VOCAB_SIZE is edited
        # into a combination where the trainer runs out of merges.
        raise RuntimeError(f"tokenizer vocab {tok.get_vocab_size()} != {VOCAB_SIZE}")
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, special
    return tok


def unprintable_ids(tok: Any) -> list[int]:
    """Ids of special tokens and tokens that do not decode to printable text on their own.

    Byte-level BPE keeps all 256 bytes as tokens, and half of them are UTF-8 fragments;
    a random model emits them often, which turns every continuation into U+FFFD soup.
    """
    bad = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        printable = "\ufffd" not in text and all(ch.isprintable() or ch in "\n\t" for ch in text)
        if i < len(SPECIAL_TOKENS) or not printable:
            bad.append(i)
    return bad


def write_tokenizer(directory: Path, tok: Any) -> None:
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END, EOS],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(directory / "tokenizer_config.json", tokenizer_config)
    write_json(
        directory / "special_tokens_map.json",
        {
            "bos_token": BOS,
            "eos_token": IM_END,
            "pad_token": PAD,
            "additional_special_tokens": [IM_START, IM_END, EOS],
        },
    )
    write_json(
        directory / "generation_config.json",
        {
            "bos_token_id": SPECIAL_TOKENS.index(BOS),
            "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(EOS)],
            "pad_token_id": SPECIAL_TOKENS.index(PAD),
            "do_sample": False,
        },
    )


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
