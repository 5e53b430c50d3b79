"""Credentials out of what a run records: URIs such as ``mlflow_tracking_uri`` may carry
a user name and password (``https://user:token@host/``) or a token in the query
(``?token=...``); the config dict and the summary travel to TensorBoard, MLflow
parameters, ``summary.json`` and the log, none of which should hold them.

Only the recorded copies are redacted: the clients themselves (MLflow's, pyarrow's) are
given the URI as configured. Standard library only, so that :mod:`sparktrain.result`
(the bottom of the house) can use it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

HIDDEN = "***"
"""What stands in for a secret query value."""

# "scheme://userinfo@": userinfo holds no "/", "?", "#" (RFC 3986), and in free text no
# white space or quote either; greedy up to the last "@", as urllib.parse splits it
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s'\"<>]*@")
# a query or fragment parameter whose name says it holds a secret
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&;#](?:[^=&;#\s'\"<>]*?)"
    r"(?:token|secret|passw|pwd|key|auth|signature|sig|credential|session)"
    r"[^=&;#\s'\"<>]*=)[^&;#\s'\"<>]*",
    re.IGNORECASE,
)


def redact_text(text: str) -> str:
    """``text`` with the userinfo of every ``scheme://user:password@host`` dropped and the
    value of every secret-looking query parameter (``token``, ``password``, ``key``,
    ``sig``, ...) replaced by ``***``; anything else is left as it is.

    >>> redact_text("https://me:s3cret@mlflow.example.com:5000/?token=abc&x=1")
    'https://mlflow.example.com:5000/?token=***&x=1'
    """
    if "@" not in text and "=" not in text:  # the common case: nothing to look for
        return text
    text = _USERINFO.sub(r"\g<scheme>", text)
    return _SECRET_PARAM.sub(rf"\g<name>{HIDDEN}", text)


def redact_values(value: Any) -> Any:
    """A copy of ``value`` (a config dict, a summary, a list) with :func:`redact_text`
    applied to every string in it, keys included; other values are kept as they are."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {
            redact_text(k) if isinstance(k, str) else k: redact_values(v) for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_values(v) for v in value]
    if isinstance(value, tuple):
        return tuple(redact_values(v) for v in value)
    return value
