"""Gradient compression: spec strings -> compressors, and their ring/tree wiring.

See :mod:`sparktrain.compress.base` for the protocol and the wire message,
:mod:`sparktrain.compress.spec` for the spec grammar, :mod:`sparktrain.compress.registry`
for names -> compressors, :mod:`sparktrain.compress.collective` for the ring/tree paths and
byte accounting.
"""

from sparktrain.compress.base import (
    BucketState,
    Compressor,
    Ctx,
    Payload,
    decode_message,
    encode_message,
)
from sparktrain.compress.registry import build, parse_spec, register, validate_spec
from sparktrain.compress.spec import FORMS

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
