"""The tokenizer a GGUF file describes, written as Hugging Face tokenizer files.

The builders are transformers' own GGUF tokenizer converters (byte-level BPE from the file's
merges; SentencePiece-style vocabularies with merges recovered from the pieces), fed from the
``gguf`` reader's metadata, so no torch is needed. What they leave out is added here: the
pre-tokenizer of SmolLM's "smollm" vocabulary (every digit its own piece, as in its
tokenizer.json), the chat template, and BOS/EOS with the file's add-BOS choice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.errors import UnsupportedModelFormat

GEMMA_TURN_END = "<end_of_turn>"


def _tokenizer_dict(meta: Mapping[str, Any]) -> dict[str, Any]:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    return {
        name: meta[f"tokenizer.{key}"]
        for key, name in renames.items()
        if f"tokenizer.{key}" in meta
    }


def write_tokenizer(meta: Mapping[str, Any], directory: Path) -> dict[str, Any]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``.

    Returns facts the model config needs (``bos_token_id``, ``eos_token_id`` as a list).
    Raises ``UnsupportedModelFormat`` for a tokenizer kind transformers cannot build.
    """
    from tokenizers import pre_tokenizers, processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        add_gguf_special_tokens,
        select_tokenizer_builder,
        set_split_regex,
    )

    architecture = str(meta["general.architecture"])
    spec = _tokenizer_dict(meta)
    if "tokens" not in spec:
        raise UnsupportedModelFormat("the GGUF file has no tokenizer vocabulary")
    try:
        builder = select_tokenizer_builder(architecture, spec.get("tokenizer_type"))
    except ValueError as exc:
        raise UnsupportedModelFormat(f"the GGUF tokenizer cannot be built: {exc}") from exc
    tokenizer = builder(spec)
    tokenizer = add_gguf_special_tokens(tokenizer, spec)  # type: ignore[no-untyped-call]
    tokenizer = set_split_regex(tokenizer, spec)  # type: ignore[no-untyped-call]
    if spec.get("pre_tokenizer_type") == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tokens: list[str] = list(spec["tokens"])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        # tokenizer.json's post-processor is what adds BOS when a fast tokenizer encodes.
        bos_token = tokens[int(bos)]
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A",
            pair=f"{bos_token} $A {bos_token} $B",
            special_tokens=[(bos_token, int(bos))],
        )
    eos_ids = [int(meta["tokenizer.ggml.eos_token_id"])]
    for extra in _turn_end_ids(meta, tokens):
        if extra not in eos_ids:
            eos_ids.append(extra)
    tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        # The tokenizer.json is complete: load it as it is, not through a model-specific class
        # that would rebuild its normalizer or pre-tokenizer from a vocabulary.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[int(bos)] if bos is not None else None,
        "eos_token": tokens[eos_ids[0]],
        "add_bos_token": add_bos,
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    for key, name in (("unknown_token_id", "unk_token"), ("padding_token_id", "pad_token")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[name] = tokens[int(token_id)]
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {"bos_token_id": None if bos is None else int(bos), "eos_token_id": eos_ids}


def _turn_end_ids(meta: Mapping[str, Any], tokens: list[str]) -> list[int]:
    """Ids that end a turn besides EOS: the file's EOT token, and Gemma's ``<end_of_turn>``."""
    ids: list[int] = []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        ids.append(int(eot))
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    if gemma and GEMMA_TURN_END in tokens:
        ids.append(tokens.index(GEMMA_TURN_END))
    return ids
