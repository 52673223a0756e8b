"""How close the KV price of an image prompt is to the cache it really fills, per tiny VLM.

For each tiny VLM family and 1 or 4 images: the prompt's tokens and soft tokens, the price the
engine reserves (``ModelInfo.kv_bytes``) and the bytes of the cache's arrays after the prefill.
Not a test (tests/test_vision.py holds each within 10%); the figures go into docs/models.md.

    PYTHONPATH=. LD_PRELOAD=... .venv/bin/python scripts/vision_kv_price.py
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.vision.media import is_media
from runtime.messages import ChatMessage, ChatOptions, ImagePart, ModelSpec
from runtime.testing.tiny_vlms import TINY_VLM_KINDS, tiny_vlm_path
from runtime.text.chat import prepare_chat


def png(seed: int) -> bytes:
    pixels = (np.random.RandomState(seed).rand(40, 50, 3) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def main() -> None:
    for kind in TINY_VLM_KINDS:
        backend = MlxBackend.load(ModelSpec(name=kind, path=str(tiny_vlm_path(kind))))
        for count in (1, 4):
            images = tuple(ImagePart(data=png(i)) for i in range(count))
            messages = (ChatMessage(role="user", content="Compare these.", images=images),)
            prepared = prepare_chat(
                backend.chat_tokenizer, backend.prepare_media(messages), ChatOptions(), 8, 2048
            )
            state = backend.new_state()
            backend.prefill(state, prepared.tokens)
            real = backend.state_nbytes(state)
            priced = backend.info.kv_bytes(len(prepared.tokens))
            soft = sum(1 for t in prepared.tokens if is_media(t))
            print(
                f"{kind}: {count} image(s), {len(prepared.tokens)} tokens ({soft} soft), "
                f"priced {priced} B, real {real} B, {priced / real:.3f}x"
            )
        backend.close()


if __name__ == "__main__":
    main()
