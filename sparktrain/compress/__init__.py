"""Gradient compression: spec strings -> compressors, and their ring/tree wiring.

See :mod:`sparktrain.compress.base` for the protocol and the spec grammar,
:mod:`sparktrain.compress.collective` for the ring/tree paths and byte accounting.
"""

from sparktrain.compress.base import (
    FORMS,
    BucketState,
    Compressor,
    Ctx,
    Payload,
    build,
    decode_message,
    encode_message,
    parse_spec,
    register,
    validate_spec,
)

__all__ = [
    "FORMS",
    "BucketState",
    "Compressor",
    "Ctx",
    "Payload",
    "build",
    "decode_message",
    "encode_message",
    "parse_spec",
    "register",
    "validate_spec",
]
