"""Tiny GGUF files of llama.cpp's recurrent and hybrid architectures, for the llama.cpp tests.

No recurrent or hybrid GGUF can be fetched here (no model hub), so these are written with the
``gguf`` library: seeded random float32 weights in the tensor names and shapes llama.cpp's own
loader asks for (``src/models/mamba.cpp``, ``src/models/lfm2.cpp`` of the llama.cpp that
llama-cpp-python 0.3.36 vendors), and SmolLM2's tokenizer metadata copied whole, so the
runtime's tokenizer conversion and chat template work as on a real file.

- ``mamba``: every layer a Mamba-1 block; llama.cpp's memory is recurrent only
  (``llama_model_is_recurrent``), one fixed-size state per sequence.
- ``lfm2``: LFM2's short-convolution layers between full-attention ones; llama.cpp's memory is
  hybrid (``llama_model_is_hybrid``): a KV cache for the attention layers beside a recurrent
  state (the convolution's last tokens) for the others.
- ``lfm2-swa``: the same with a 32-token attention window: llama.cpp's hybrid memory with a
  sliding-window cache (``llama_memory_hybrid_iswa``).

The output projection is scaled up so greedy picks are far apart (no near-ties for the kernels'
summation order to flip). About 27 MB each (most of it the 49,152-row embedding and output
projection), written in well under a second once the tokenizer is read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 49152  # SmolLM2's
EMBED = 64
CONTEXT = 2048  # the training context the files claim
WINDOW = 32  # lfm2-swa's attention window


@functools.cache
def _tokenizer_fields(source: Path) -> tuple[tuple[str, Any, Any, Any], ...]:
    """Every ``tokenizer.*`` key of ``source``: (key, value, type, array element type)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype is GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), vtype, sub))
    return tuple(fields)


class _Weights:
    """Seeded random tensors, float32."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def normal(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def linear(self, out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        """A ``{inp, out}`` llama.cpp matrix (numpy ``(out, inp)``), unit-variance outputs."""
        return self.normal(out, inp, scale=gain / np.sqrt(inp))

    @staticmethod
    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)


Meta = dict[str, int | float | list[int]]


def _write(path: Path, arch: str, meta: Meta, tensors: dict[str, np.ndarray], tokens: Path) -> Path:
    from gguf import GGUFValueType, GGUFWriter

    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    for key, value in meta.items():
        full = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    writer.add_file_type(0)  # all float32
    for key, value, vtype, sub in _tokenizer_fields(tokens):
        if vtype is GGUFValueType.ARRAY:
            writer.add_key_value(key, list(value), vtype, sub)
        else:
            writer.add_key_value(key, value, vtype)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_mamba(path: Path, tokens: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """A Mamba-1 model (``LLM_ARCH_MAMBA``): recurrent state only; ``tokens``: the GGUF file
    whose tokenizer it takes."""
    w = _Weights(seed)
    d_inner, d_state, d_conv, dt_rank = 2 * EMBED, 16, 4, 4  # llama.cpp takes expansion 2 only
    tensors = {
        "token_embd.weight": w.normal(VOCAB, EMBED),
        "output_norm.weight": w.ones(EMBED),
        "output.weight": w.linear(VOCAB, EMBED, gain=24.0),
    }
    for i in range(layers):
        blk = f"blk.{i}"
        # A = -exp(A_log) with S4D-real's A_log = log(1..d_state), as the converter writes it.
        a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
        tensors |= {
            f"{blk}.attn_norm.weight": w.ones(EMBED),
            f"{blk}.ssm_in.weight": w.linear(2 * d_inner, EMBED),
            f"{blk}.ssm_conv1d.weight": w.normal(d_inner, d_conv, scale=0.5),
            f"{blk}.ssm_conv1d.bias": w.normal(d_inner, scale=0.1),
            f"{blk}.ssm_x.weight": w.linear(dt_rank + 2 * d_state, d_inner),
            f"{blk}.ssm_dt.weight": w.linear(d_inner, dt_rank),
            f"{blk}.ssm_dt.bias": w.normal(d_inner, scale=0.5),
            f"{blk}.ssm_a": a,
            f"{blk}.ssm_d": w.ones(d_inner),
            f"{blk}.ssm_out.weight": w.linear(EMBED, d_inner),
        }
    meta: Meta = {
        "context_length": CONTEXT,
        "embedding_length": EMBED,
        "block_count": layers,
        "feed_forward_length": 0,
        "attention.head_count": 0,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "ssm.conv_kernel": d_conv,
        "ssm.inner_size": d_inner,
        "ssm.state_size": d_state,
        "ssm.time_step_rank": dt_rank,
        "vocab_size": VOCAB,
    }
    return _write(path, "mamba", meta, tensors, tokens)


def write_lfm2(path: Path, tokens: Path, *, seed: int = 0, window: int = 0) -> Path:
    """An LFM2 model (``LLM_ARCH_LFM2``): short-convolution layers 0 and 2, attention 1 and 3;
    with ``window`` its attention layers see only that many tokens (llama.cpp's hybrid memory
    then holds a sliding-window cache beside the recurrent state)."""
    w = _Weights(seed)
    heads, head_dim, ffn, l_cache = 4, EMBED // 4, 128, 3
    kv_heads = [0, heads, 0, heads]  # 0: a convolution layer (llama.cpp's is_recr)
    tensors = {
        "token_embd.weight": w.normal(VOCAB, EMBED),
        "token_embd_norm.weight": w.ones(EMBED),  # LFM2's output norm, under this name
        "output.weight": w.linear(VOCAB, EMBED, gain=24.0),
    }
    for i, kv in enumerate(kv_heads):
        blk = f"blk.{i}"
        tensors |= {
            f"{blk}.attn_norm.weight": w.ones(EMBED),
            f"{blk}.ffn_norm.weight": w.ones(EMBED),
            f"{blk}.ffn_gate.weight": w.linear(ffn, EMBED),
            f"{blk}.ffn_up.weight": w.linear(ffn, EMBED),
            f"{blk}.ffn_down.weight": w.linear(EMBED, ffn),
        }
        if kv:
            tensors |= {
                f"{blk}.attn_q_norm.weight": w.ones(head_dim),
                f"{blk}.attn_k_norm.weight": w.ones(head_dim),
                f"{blk}.attn_q.weight": w.linear(EMBED, EMBED),
                f"{blk}.attn_k.weight": w.linear(kv * head_dim, EMBED),
                f"{blk}.attn_v.weight": w.linear(kv * head_dim, EMBED),
                f"{blk}.attn_output.weight": w.linear(EMBED, EMBED),
            }
        else:
            tensors |= {
                f"{blk}.shortconv.conv.weight": w.normal(EMBED, l_cache, scale=0.5),
                f"{blk}.shortconv.in_proj.weight": w.linear(3 * EMBED, EMBED),
                f"{blk}.shortconv.out_proj.weight": w.linear(EMBED, EMBED),
            }
    meta: Meta = {
        "context_length": CONTEXT,
        "embedding_length": EMBED,
        "block_count": len(kv_heads),
        "feed_forward_length": ffn,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 10000.0,
        "shortconv.l_cache": l_cache,
        "vocab_size": VOCAB,
    }
    if window:
        meta["attention.sliding_window"] = window
    return _write(path, "lfm2", meta, tensors, tokens)


WRITERS: dict[str, Callable[[Path, Path], Path]] = {
    "mamba": write_mamba,
    "lfm2": write_lfm2,
    "lfm2-swa": functools.partial(write_lfm2, window=WINDOW),
}


def tiny_gguf(arch: str, directory: Path, tokens: Path) -> Path:
    """``directory/tiny-{arch}.gguf`` with ``tokens``' tokenizer, written once (seeded weights:
    the same bytes every time, so the runtime's tokenizer cache keys it the same)."""
    path = directory / f"tiny-{arch}.gguf"
    if not path.is_file():
        WRITERS[arch](path, tokens)
    return path
