"""Deterministic, offline factory for tiny mlx-lm model directories used in tests.

Tests need real mlx-lm checkpoints of each cache kind the engine handles, small enough to run
hundreds of times on a CPU and built without a download: random weights from a fixed seed and a
byte-level BPE tokenizer trained in process (``tiny_tokenizer``). Kinds: ``llama`` (full attention),
``sliding`` (Gemma 3 text, rotating + full caches), ``hybrid`` (Qwen3-Next, linear + full
attention). Greedy decoding never emits a special or unprintable token, so outputs run to
``max_tokens``. Bump ``FACTORY_VERSION`` whenever the output changes, so stale caches go unused.

Shapes, files, the cache root and the API: docs/design.md, "Tiny models".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, cast, get_args

from runtime.testing.tiny_tokenizer import (
    BOS,
    EOS,
    IM_END,
    MAX_POSITION_EMBEDDINGS,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    train_tiny_tokenizer,
    unprintable_ids,
    write_json,
    write_tokenizer,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "FACTORY_VERSION",
    "SLIDING_WINDOW",
    "SPECIAL_TOKENS",
    "STAMP_FILE",
    "TINY_MODEL_KINDS",
    "VOCAB_SIZE",
    "TinyModelKind",
    "build_directory",
    "build_tiny_model",
    "cache_root",
    "load_tiny_model",
    "tiny_model_config",
    "tiny_model_path",
    "train_tiny_tokenizer",
]

TinyModelKind = Literal["llama", "sliding", "hybrid"]
TINY_MODEL_KINDS: Final[tuple[TinyModelKind, ...]] = get_args(TinyModelKind)

# Part of the cache key and the stamp: bump on any change to what gets written.
FACTORY_VERSION: Final = 1

SLIDING_WINDOW: Final = 32
STAMP_FILE: Final = "tiny_model_stamp.json"

# Shapes shared by all kinds: small enough that a full test run stays quick on 2 CPU
# cores, large enough that heads/GQA/rope code paths are all non-trivial.
_HIDDEN: Final = 128
_LAYERS: Final = 4
_HEADS: Final = 4
_KV_HEADS: Final = 2
_HEAD_DIM: Final = 32
_INTERMEDIATE: Final = 256


def _common_config(eos_ids: list[int], bos_id: int) -> dict[str, Any]:
    return {
        "hidden_size": _HIDDEN,
        "num_hidden_layers": _LAYERS,
        "intermediate_size": _INTERMEDIATE,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        # mlx_lm.load reads eos ids from config.json (not generation_config.json).
        "eos_token_id": eos_ids,
        "bos_token_id": bos_id,
        "torch_dtype": "float32",
    }


def tiny_model_config(kind: TinyModelKind) -> dict[str, Any]:
    """The config.json content (before ModelArgs normalization) for ``kind``."""
    _check_kind(kind)
    eos_ids = [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(EOS)]
    cfg = _common_config(eos_ids, SPECIAL_TOKENS.index(BOS))
    if kind == "llama":
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    elif kind == "sliding":
        cfg.update(
            model_type="gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            sliding_window=SLIDING_WINDOW,
            # Layer i is full attention iff (i + 1) % pattern == 0: S, F, S, F.
            sliding_window_pattern=2,
            query_pre_attn_scalar=_HEAD_DIM,
            rope_local_base_freq=10000.0,
        )
    else:
        cfg.update(
            model_type="qwen3_next",
            architectures=["Qwen3NextForCausalLM"],
            # Layer i is full attention iff (i + 1) % interval == 0: L, F, L, F.
            full_attention_interval=2,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            partial_rotary_factor=0.25,
            # num_experts=0 keeps every MLP dense; it also makes sanitize() a no-op, so
            # the weights we save load back bit-for-bit (no "+1" norm shift).
            num_experts=0,
            num_experts_per_tok=0,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=0,
            moe_intermediate_size=0,
            mlp_only_layers=[],
            norm_topk_prob=False,
            attention_bias=False,
        )
    return cfg


def _check_kind(kind: str) -> None:
    if kind not in TINY_MODEL_KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_MODEL_KINDS}")


# ----------------------------------------------------------------------------- weights


def _model_classes(kind: TinyModelKind) -> tuple[Any, Any]:
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{tiny_model_config(kind)['model_type']}")
    return module.Model, module.ModelArgs


def _init_weights(model: Any, seed: int) -> None:
    """Re-draw every random parameter from explicit keys derived from ``seed``.

    Explicit keys (never ``mx.random.seed``) keep the build from reseeding the caller's
    global MLX RNG, and make the weights independent of whatever that RNG did before.

    mlx's default init (uniform +-1/sqrt(fan_in)) leaves the residual stream dominated by
    the current token's embedding, so greedy decoding collapses into a short cycle that
    ignores the prompt.  Larger N(0, 1.5^2/fan_in) projections and a unit-variance
    embedding give attention/recurrence real influence.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    # tree_flatten is typed list-or-dict (its destination argument); ours is a list.
    params = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(params))
    new: list[tuple[str, Any]] = []
    for (name, value), key in zip(params, keys, strict=True):
        shape, f32 = value.shape, mx.float32
        if name.endswith("A_log"):
            # Gated-delta decay, drawn like Qwen3NextGatedDeltaNet.__init__ does.
            new.append((name, mx.log(mx.random.uniform(1.0, 16.0, shape, f32, key=key))))
        elif value.ndim == 3:
            # Depthwise conv1d (out, kernel, 1): fan_in is the kernel width.
            bound = 1.0 / shape[1] ** 0.5
            new.append((name, mx.random.uniform(-bound, bound, shape, f32, key=key)))
        elif value.ndim == 2 and "embed_tokens" in name:
            new.append((name, mx.random.normal(shape, f32, key=key)))
        elif value.ndim == 2:
            std = 1.5 / shape[1] ** 0.5
            new.append((name, std * mx.random.normal(shape, f32, key=key)))
        else:
            # Norm weights and dt_bias: constant inits (ones), already deterministic.
            new.append((name, value.astype(f32)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def _write_model(kind: TinyModelKind, directory: Path, seed: int, suppress: list[int]) -> None:
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    config = tiny_model_config(kind)
    model_cls, args_cls = _model_classes(kind)
    args = args_cls.from_dict(config)
    model = model_cls(args)
    _init_weights(model, seed)
    # Zero the output rows of special and non-printable tokens: their logits become 0
    # while printable tokens draw random +-logits, so greedy text is valid UTF-8 and
    # never stops early on EOS (tests wanting EOS use stop tokens / logits processors).
    rows = mx.array(suppress)
    head = model.lm_head.weight
    head[rows] = 0.0
    model.lm_head.weight = head
    mx.eval(model.parameters())
    save_model(directory, model)
    # Persist every ModelArgs field (defaults included) next to the extras, so the
    # checkpoint does not depend on mlx-lm's defaults staying the same.
    full = {**dataclasses.asdict(args), **config}
    save_config(full, config_path=directory / "config.json")


# ------------------------------------------------------------------------ build / cache


def _stamp(kind: TinyModelKind, seed: int) -> dict[str, Any]:
    return {"factory_version": FACTORY_VERSION, "kind": kind, "seed": seed}


def _has_stamp(directory: Path, stamp: dict[str, Any]) -> bool:
    try:
        found = json.loads((directory / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(found == stamp)


# Serializes builds inside one process: concurrent threads would otherwise race on the
# same temp-then-rename dance and duplicate the (cheap but pointless) work.
_BUILD_LOCK = threading.Lock()


def build_tiny_model(kind: TinyModelKind, directory: Path, seed: int = 0) -> Path:
    """Write an mlx-lm model directory for ``kind`` at ``directory`` and return it.

    Idempotent and safe under concurrent callers: an existing directory with a matching
    stamp is returned as is; otherwise the model is built in a temporary sibling and
    renamed into place.
    """
    _check_kind(kind)

    def write(tmp: Path, tok: Any) -> None:
        _write_model(kind, tmp, seed, unprintable_ids(tok))

    return build_directory(Path(directory), _stamp(kind, seed), write)


def build_directory(
    directory: Path, stamp: dict[str, Any], write_model: Callable[[Path, Any], None]
) -> Path:
    """Write the tiny tokenizer and ``write_model(tmp, tokenizer)``'s weights and config into a
    temporary sibling of ``directory``, stamp it, and rename it into place; an existing directory
    holding ``stamp`` is returned untouched (shared with ``runtime.testing.arch_models``)."""
    if _has_stamp(directory, stamp):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _BUILD_LOCK:
        if _has_stamp(directory, stamp):
            return directory
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            # mkdtemp makes it 0700; a shared cache dir should be readable like any other.
            # (Reading the umask would need os.umask(), which is racy across threads.)
            os.chmod(tmp, 0o755)
            tok = _tokenizer()
            write_tokenizer(tmp, tok)
            write_model(tmp, tok)
            # Stamp last: its presence means every other file is complete.
            write_json(tmp / STAMP_FILE, stamp)
            _install(tmp, directory, lambda: _has_stamp(directory, stamp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


_TOKENIZER: list[Any] = []


def _tokenizer() -> Any:
    """The trained tiny tokenizer, trained once per process (callers hold ``_BUILD_LOCK``)."""
    if not _TOKENIZER:
        _TOKENIZER.append(train_tiny_tokenizer())
    return _TOKENIZER[0]


def _install(tmp: Path, directory: Path, is_valid: Callable[[], bool]) -> None:
    """Atomically move ``tmp`` to ``directory``, tolerating a concurrent winner."""
    for _ in range(5):
        try:
            # rename(2) onto a missing or empty directory is atomic; onto a non-empty
            # one it fails, which is how we notice another builder got there first.
            os.rename(tmp, directory)
            return
        except OSError:
            if is_valid():
                return  # another process installed an equivalent build; drop ours
            # A stale or foreign directory is in the way: move it aside (atomic), then
            # retry.  Deleting in place could expose a half-deleted dir to readers.
            trash = directory.with_name(f".{directory.name}.stale-{uuid.uuid4().hex}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(directory, trash)
            shutil.rmtree(trash, ignore_errors=True)
    raise RuntimeError(f"could not install tiny model at {directory}")


def cache_root() -> Path:
    """Directory under which ``tiny_model_path`` keeps its builds."""
    env = os.environ.get("MLXRT_TINY_MODELS")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mlx-actor-runtime" / "tiny-models"


_LOADED: dict[tuple[Path, str, int], tuple[Any, Any]] = {}
_LOAD_LOCK = threading.Lock()


def tiny_model_path(kind: TinyModelKind, seed: int = 0) -> Path:
    """Path of the cached tiny model for ``kind`` under ``cache_root()``, built on first use.

    Not memoized beyond the stamp check (one small file read), so a changed
    ``$MLXRT_TINY_MODELS`` or a deleted cache entry is picked up immediately.
    """
    _check_kind(kind)
    return build_tiny_model(kind, cache_root() / f"{kind}-v{FACTORY_VERSION}-seed{seed}", seed)


def load_tiny_model(kind: TinyModelKind, seed: int = 0) -> tuple[Any, Any]:
    """``mlx_lm.load(tiny_model_path(kind, seed))``, memoized per process.

    The returned model and TokenizerWrapper are shared between callers: treat them as
    read-only (make a fresh prompt cache per generation; never update the weights).
    """
    from mlx_lm import load

    path = tiny_model_path(kind, seed)
    key = (path, kind, seed)
    # Held across the load so concurrent first callers share one copy, not race two.
    with _LOAD_LOCK:
        hit = _LOADED.get(key)
        if hit is None:
            loaded = load(str(path))  # typed as a 2- or 3-tuple (return_config)
            hit = _LOADED[key] = (loaded[0], loaded[1])
        return hit
