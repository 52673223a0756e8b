"""The wire form: messages as msgpack bytes (what a multi-host transport would send), decoded
into the closed union of every message type.
"""

from __future__ import annotations

import msgspec

from runtime.errors import MalformedMessage
from runtime.messages.unions import AnyMessage
from runtime.messages.vocabulary import Message

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyMessage] = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    """Serialize a message with msgpack (the wire form a multi-host transport would use)."""
    return _encoder.encode(message)


def decode(data: bytes) -> AnyMessage:
    """Inverse of ``encode``; raises ``MalformedMessage`` on anything not in the vocabulary.

    Decodes into the closed union of every message type.
    """
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as error:  # ValidationError included: a tag or field is wrong
        raise MalformedMessage(
            f"the bytes are not a runtime message ({error}); send what messages.encode made"
        ) from error
