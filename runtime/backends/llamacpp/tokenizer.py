"""The tokenizer of a llama.cpp model: the GGUF's own vocabulary, as Hugging Face files.

One source of truth for tokens on both backends: the tokenizer the GGUF importer writes
(``runtime.backends.mlx.gguf.tokenizer``) from the file's metadata, loaded as mlx-lm's
``TokenizerWrapper``. So chat rendering (the GGUF's template, through ``runtime.text.chat``),
grammar constraints (llguidance reads a Hugging Face tokenizer), stop strings and the prefix cache
see the same ids on llama.cpp as on MLX. tests/test_llamacpp_tokens.py proves those ids equal
llama.cpp's own ``llama_tokenize`` on a varied corpus. Only the tokenizer files are written
(no weights), once per file, in the conversion cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.backends.mlx.gguf.convert import file_sha256, read_metadata
from runtime.backends.mlx.gguf.tokenizer import write_tokenizer
from runtime.errors import ModelLoadFailed

TOKENIZER_VERSION = 1  # bump when the files written here change
_FACTS = "tokenizer_facts.json"  # written last: marks the directory complete


def tokenizer_dir(gguf: Path, cache_dir: Path, sha256: str | None = None) -> Path:
    """The directory holding ``gguf``'s tokenizer files, written on first use.

    Raises ``ModelLoadFailed`` when the file is not GGUF, ``UnsupportedModelFormat`` for a
    tokenizer kind the importer cannot build.
    """
    key = sha256 or file_sha256(gguf)
    target = cache_dir / f"{key[:16]}-tokenizer-v{TOKENIZER_VERSION}"
    if (target / _FACTS).is_file():
        return target
    _, meta = read_metadata(gguf)
    cache_dir.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{target.name}."))
    try:
        facts = write_tokenizer(meta, building)
        (building / _FACTS).write_text(json.dumps(facts))
        try:
            os.replace(building, target)
        except OSError:
            if not (target / _FACTS).is_file():  # not a lost race with another loader
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def load_tokenizer(directory: Path) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's tokenizer wrapper over the files in ``directory``, and the facts the importer
    returned (``eos_token_id``: a list, ``bos_token_id``)."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    try:
        facts = json.loads((directory / _FACTS).read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadFailed(
            f"the tokenizer files at {directory} are damaged ({exc}); delete that directory and "
            "load the model again"
        ) from exc
    wrapper = mlx_load_tokenizer(  # type: ignore[no-untyped-call]
        directory, eos_token_ids=facts.get("eos_token_id")
    )
    return wrapper, dict(facts)


def direct_decoder(wrapper: Any) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own ``decode`` of ``wrapper`` (mlx-lm's over a Hugging Face fast
    tokenizer), where it gives what ``wrapper.decode`` gives: with no clean-up of spaces, the
    Hugging Face layer adds nothing but its Python between. The incremental detokenizer decodes
    twice per token on the compute thread: 0.6-1.1 us a call so, 3.9-4.5 through the layers
    (SmolLM2, Gemma 3). None where it might differ."""
    fast = getattr(wrapper, "_tokenizer", None)
    rust: Any = getattr(fast, "_tokenizer", None)
    if getattr(fast, "clean_up_tokenization_spaces", True) is not False or not hasattr(
        rust, "decode"
    ):
        return None

    def decode(token_ids: list[int]) -> str:
        return str(rust.decode(token_ids, skip_special_tokens=False))

    return decode
