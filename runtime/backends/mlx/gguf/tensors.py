"""GGUF tensors as MLX arrays: dense in a chosen float dtype, or kept quantized.

llama.cpp's Q4_0, Q4_1 and Q8_0 blocks are affine quantization with one scale (and bias) per 32
weights, which is MLX's own format at group size 32: those are repacked bit for bit, not
requantized. Every other type (K-quants, Q5_0, IQ*) is dequantized by the ``gguf`` package
(llama.cpp's reader) and, when quantized weights are wanted, quantized again by MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

if TYPE_CHECKING:
    import mlx.core as mx
    from gguf.gguf_reader import ReaderTensor

GROUP = 32  # weights per block in Q4_0, Q4_1 and Q8_0
NATIVE_TYPES = frozenset({QT.Q4_0, QT.Q4_1, QT.Q8_0})
FLOAT_TYPES = frozenset({QT.F32, QT.F16, QT.BF16})
REQUANT_BITS = 8  # measured: 8-bit costs no NLL on Gemma 3 270M, 4-bit does (2.07 -> 2.50)
REQUANT_GROUP = 64


def dense(tensor: ReaderTensor) -> np.ndarray:
    """The tensor's values as float32, in its logical (rows, columns) shape."""
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(values, dtype=np.float32).reshape(shape)


def affine_triple(tensor: ReaderTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 / Q8_0 matrix as MLX's packed ``(weight, scales, biases)``, exactly.

    Q4 blocks store weight j in the low nibble of byte j and weight j + 16 in the high nibble;
    MLX packs consecutive weights from the low bits of each uint32 up.
    """
    kind = tensor.tensor_type
    rows = int(tensor.shape[-1])
    cols = int(tensor.shape[0])
    per_block = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q8_0: 34}[kind]
    blocks = np.ascontiguousarray(tensor.data).reshape(rows, cols // GROUP, per_block)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == QT.Q8_0:
        signed = blocks[..., 2:].copy().view(np.int8)
        q = (signed.astype(np.int16) + 128).astype(np.uint32)
        bias = (scale * np.float16(-128)).astype(np.float16)
        bits = 8
    else:
        packed = blocks[..., 4:] if kind == QT.Q4_1 else blocks[..., 2:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.uint32)
        if kind == QT.Q4_1:
            bias = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        else:
            bias = (scale * np.float16(-8)).astype(np.float16)
        bits = 4
    per_word = 32 // bits
    q = q.reshape(rows, cols // per_word, per_word)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    weight = np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)
    return weight, scale, bias


def bits_of(tensor: ReaderTensor) -> int:
    """Bits per weight MLX keeps for a natively repacked tensor."""
    return 8 if tensor.tensor_type == QT.Q8_0 else 4


def quantize_dense(values: np.ndarray, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """MLX's own affine quantization of a dequantized matrix (``REQUANT_BITS``)."""
    import mlx.core as mx

    weight, scales, biases = mx.quantize(
        mx.array(values).astype(dtype), group_size=REQUANT_GROUP, bits=REQUANT_BITS
    )
    return weight, scales, biases
