"""Per-layer compression policies: which spec each parameter gets.

``config.compression`` is either one spec string for the whole model or a table that
maps parameter-name glob patterns (:mod:`fnmatch`, case-sensitive) to specs::

    compression = {"fc3.*" = "fp16", "*" = "int8+ef"}

Patterns are tried in the table's order and the first match wins, so specific patterns
go first and ``"*"`` last; a parameter no pattern matches is sent uncompressed
(``"none"``). :func:`resolve_policy` does the matching; :func:`group_by_spec` turns the
result into groups of parameters that can share buckets (one compressor per bucket);
:func:`describe_policy` says in one line per spec who got what, for logs and summaries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase

from sparktrain.errors import ConfigError

NONE = "none"


def resolve_policy(compression: str | Mapping[str, str], names: Sequence[str]) -> list[str]:
    """The spec for each name in ``names``, in the same order.

    A plain string applies to every name. A mapping is matched pattern by pattern in
    its iteration order (first match wins); unmatched names get ``"none"``. Specs are
    returned as written (they are validated by :class:`~sparktrain.config.TrainConfig`).
    """
    if isinstance(compression, str):
        return [compression] * len(names)
    if not isinstance(compression, Mapping):
        raise ConfigError(
            f"compression must be a spec string or a table of 'pattern = spec', "
            f"got {type(compression).__name__}"
        )
    table = list(compression.items())
    for pattern, spec in table:
        if not isinstance(pattern, str) or not isinstance(spec, str):
            raise ConfigError(
                f"compression table entry {pattern!r} = {spec!r}: patterns and specs are strings"
            )
    out = []
    for name in names:
        for pattern, spec in table:
            if fnmatchcase(name, pattern):
                out.append(spec)
                break
        else:
            out.append(NONE)
    return out


def group_by_spec(specs: Sequence[str]) -> dict[str, list[int]]:
    """Indices of the parameters that share each spec, specs in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec, []).append(i)
    return groups


def unused_patterns(compression: str | Mapping[str, str], names: Sequence[str]) -> list[str]:
    """Patterns of a table that no parameter reaches (shadowed or misspelt): worth a
    warning, since a typo silently leaves a layer uncompressed."""
    if isinstance(compression, str):
        return []
    reached = set()
    table = list(compression)
    for name in names:
        for pattern in table:
            if fnmatchcase(name, pattern):
                reached.add(pattern)
                break
    return [p for p in table if p not in reached]


def describe_policy(
    compression: str | Mapping[str, str],
    names: Sequence[str],
    numels: Sequence[int] | None = None,
) -> str:
    """One line per spec: the parameters it covers (and their element share if
    ``numels`` is given), e.g. ``int8+ef: fc1.weight, fc1.bias, fc2.weight (93.1 %)``."""
    specs = resolve_policy(compression, names)
    if numels is not None and len(numels) != len(names):
        raise ConfigError(f"{len(numels)} sizes for {len(names)} parameter names")
    total = sum(numels) if numels is not None else 0
    lines = []
    for spec, idx in group_by_spec(specs).items():
        line = f"{spec}: {', '.join(names[i] for i in idx)}"
        if numels is not None and total:
            share = 100.0 * sum(numels[i] for i in idx) / total
            line += f" ({share:.1f} %)"
        lines.append(line)
    unused = unused_patterns(compression, names)
    if unused:
        lines.append(f"patterns matching no parameter: {', '.join(unused)}")
    return "\n".join(lines)
