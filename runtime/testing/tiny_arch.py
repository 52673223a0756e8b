"""A tiny random-weight mlx-lm model directory from a config dict, for any ``model_type``.

``runtime.testing.tiny_models`` builds three hand-made kinds; a test that needs one more
architecture (a cache kind only that architecture makes) writes its config here instead. The
weights are drawn like ``tiny_models``' (so greedy output depends on the prompt) and the output
rows of special and unprintable tokens are zeroed (so greedy text never ends early on EOS). The
directory is named by a hash of the config and the seed under ``tiny_models.cache_root()``, so a
changed config is a new build, and it is installed by rename, so readers never see half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

from runtime.testing.tiny_models import _init_weights, cache_root
from runtime.testing.tiny_tokenizer import (
    BOS,
    EOS,
    IM_END,
    SPECIAL_TOKENS,
    train_tiny_tokenizer,
    unprintable_ids,
    write_json,
    write_tokenizer,
)

__all__ = ["TINY_EOS_IDS", "tiny_arch_path"]

TINY_EOS_IDS = [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(EOS)]
_DONE = "tiny_arch_stamp.json"
_VERSION = 1  # bump on any change to what gets written


def tiny_arch_path(name: str, config: dict[str, Any], seed: int = 0) -> Path:
    """The directory of a tiny ``config`` model (built on first use); ``name`` only labels it.

    ``config`` is config.json as mlx-lm reads it (``model_type`` and the ``ModelArgs`` fields);
    ``eos_token_id`` and ``bos_token_id`` of the tiny tokenizer are added when absent.
    """
    full = {"eos_token_id": TINY_EOS_IDS, "bos_token_id": SPECIAL_TOKENS.index(BOS), **config}
    digest = hashlib.sha256(
        json.dumps([_VERSION, seed, full], sort_keys=True).encode()
    ).hexdigest()[:12]
    directory = cache_root() / f"arch-{name}-{digest}"
    if (directory / _DONE).is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        os.chmod(tmp, 0o755)
        tokenizer = train_tiny_tokenizer()
        write_tokenizer(tmp, tokenizer)
        _write_weights(tmp, full, seed, unprintable_ids(tokenizer))
        write_json(tmp / _DONE, {"version": _VERSION, "seed": seed})
        try:
            os.rename(tmp, directory)
        except OSError:  # another builder installed the same build first
            if not (directory / _DONE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _write_weights(directory: Path, config: dict[str, Any], seed: int, suppress: list[int]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes, save_config, save_model

    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _init_weights(model, seed)
    # Zero the output rows of special and unprintable tokens (see tiny_models._write_model).
    params = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    rows = mx.array(suppress)
    heads = []
    for name, value in params:
        if name.endswith("lm_head.weight"):
            value[rows] = 0.0
            heads.append((name, value))
    model.update(tree_unflatten(heads))
    mx.eval(model.parameters())
    save_model(directory, model)
    save_config(dict(config), config_path=directory / "config.json")
