"""The compression spec grammar: a spec string cut into stages, and the option readers a
compressor's factory uses on its stage.

Spec grammar
------------
``config.compression`` is a spec string::

    spec    := "none" | ["delta" "+"] base ["+" "ef" [":" ef-opts]] | "delta" ["+ef"...]
    base    := name [":" arg ("," arg)*]
    arg     := value | key "=" value | flag

    name        positional    options                              notes
    ----------  ------------  -----------------------------------  ------------------------
    fp16                      -                                    summable
    bf16                      -                                    summable
    int8                      chunk=N (1024), stochastic           per-chunk fp32 scales
    topk        ratio         ratio=R, sampled, sample=S (0.01),   fp32 values + u16/i32 idx
                              warmup=S (0 = off)
    randomk     ratio         ratio=R                              shared seed: summable
    sign                      chunk=N (0: one scale per bucket)    1 bit/value + fp32 scales
    powersgd    rank          rank=R (1), warm (on) / cold         summable factors
    delta                     -                                    prefix: delta+<base>
    ef                        reset=N (0 = never), momentum=M,     suffix: <base>+ef
                              nesterov=0|1, mask=0|1, local_clip=C

Examples: ``none``, ``fp16``, ``int8:chunk=256,stochastic+ef``, ``topk:0.01+ef``,
``topk:0.01,sampled+ef:reset=500``, ``randomk:0.05+ef``, ``sign+ef``,
``powersgd:2+ef``, ``delta+int8``, ``topk:0.01+ef:momentum=0.9`` (DGC momentum
correction, see :mod:`sparktrain.compress.feedback`). Whitespace is ignored; names
are case-insensitive.

Deep Gradient Compression's remedies for top-k, each switchable on its own:
``+ef:momentum=M`` (momentum correction; the optimizer's momentum must be 0), with
momentum factor masking on by default for sparse compressors (``mask=0`` turns it off;
``mask=1`` on a dense compressor is refused), ``+ef:local_clip=C`` (each rank clips its
own gradient to L2 norm ``C / sqrt(world)`` before it enters momentum and residual,
see :mod:`sparktrain.compress.feedback`) and ``topk:R,warmup=S`` (sparsity warm-up: the
keep ratio decays from 25 % to ``R`` over the first ``S`` steps, see
:mod:`sparktrain.compress.topk`). E.g.
``topk:0.01,warmup=200+ef:momentum=0.9,local_clip=1``.

:func:`parse` checks the grammar against the names it is given; the registry
(:mod:`sparktrain.compress.registry`) gives it the registered ones and turns the stages
into a :class:`~sparktrain.compress.base.Compressor`. Every error is a
:class:`~sparktrain.errors.ConfigError` naming the allowed forms.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sparktrain.errors import ConfigError, did_you_mean

WRAPPERS = ("delta", "ef")
"""Stage names that wrap the core compressor: ``delta+`` in front, ``+ef`` at the end."""
FORMS = (
    "none, fp16, bf16, int8[:chunk=N,stochastic], topk:R[,sampled][,sample=S][,warmup=S], "
    "randomk:R, "
    "sign[:chunk=N], powersgd:R[,cold], optionally prefixed by delta+ and/or suffixed by "
    "+ef[:reset=N][,momentum=M][,nesterov=1][,mask=0|1][,local_clip=C] "
    "(e.g. topk:0.01+ef, int8+ef, powersgd:2+ef, delta+int8)"
)
EF_OPTIONS = ("reset", "momentum", "nesterov", "mask", "local_clip")
"""The options of the ``+ef`` suffix (:mod:`sparktrain.compress.feedback`)."""
# bare words that are flags, never the positional argument (a ratio or a rank)
_FLAGS = ("stochastic", "sampled", "exact", "cold", "warm")


@dataclass(frozen=True)
class Stage:
    """One ``name:args`` element of a spec."""

    name: str
    args: tuple[str, ...] = ()
    options: tuple[tuple[str, str], ...] = ()

    def option(self, key: str, default: str | None = None) -> str | None:
        for k, v in self.options:
            if k == key:
                return v
        return default


def _parse_stage(text: str, spec: str) -> Stage:
    name, _, rest = text.partition(":")
    name = name.strip().lower()
    if not name:
        raise ConfigError(f"compression={spec!r}: empty element; allowed values: {FORMS}")
    args: list[str] = []
    options: list[tuple[str, str]] = []
    if rest.strip():
        for item in rest.split(","):
            item = item.strip()
            if not item:
                raise ConfigError(f"compression={spec!r}: empty option in {text!r}")
            key, eq, value = item.partition("=")
            if eq:
                options.append((key.strip().lower(), value.strip()))
            else:
                args.append(item.lower())
    return Stage(name, tuple(args), tuple(options))


def parse(spec: str, known: Collection[str]) -> list[Stage]:
    """Split and check ``spec`` whose core compressor must be one of ``known``; raises
    ConfigError naming the known compressors and the allowed forms."""
    if not isinstance(spec, str):
        raise ConfigError(f"compression must be a string spec; allowed values: {FORMS}")
    text = "".join(spec.split())
    if text.lower() == "none":
        return []
    stages = [_parse_stage(part, spec) for part in text.split("+")]
    names = [s.name for s in stages]
    for s in stages:
        if s.name not in known and s.name not in WRAPPERS:
            raise ConfigError(
                f"compression={spec!r}: unknown compressor {s.name!r} (registered: "
                f"{', '.join(sorted(known))}).{did_you_mean(s.name, [*known, *WRAPPERS])} The "
                f"allowed values: {FORMS}"
            )
    core = [n for n in names if n not in WRAPPERS]
    ok = (
        len(core) <= 1
        and names.count("delta") <= 1
        and names.count("ef") <= 1
        and ("delta" not in names or names[0] == "delta")
        and ("ef" not in names or names[-1] == "ef")
        and (core or "delta" in names)
    )
    if not ok:
        raise ConfigError(
            f"compression={spec!r}: use at most one compressor, delta+ only in front and "
            f"+ef only at the end; allowed values: {FORMS}"
        )
    return stages


# ---------------------------------------------------------------------- option readers
def fail(stage: Stage, detail: str) -> ConfigError:
    """The error for a stage whose arguments are wrong."""
    return ConfigError(f"compression {stage.name}: {detail}; allowed values: {FORMS}")


def check_options(
    stage: Stage, positional: int, keys: tuple[str, ...], flags: tuple[str, ...]
) -> None:
    """Refuse more than ``positional`` bare arguments (besides ``flags``) and options
    other than ``keys``."""
    plain = [a for a in stage.args if a not in flags]
    if len(plain) > positional:
        raise fail(stage, f"unexpected argument(s) {plain[positional:]}")
    for k, v in stage.options:
        if k not in keys:
            hint = ""
            if k in EF_OPTIONS and stage.name != "ef":  # a common slip: put it after +ef
                hint = f"; {k}= is an error-feedback option: write it after +ef, e.g. +ef:{k}={v}"
            raise fail(stage, f"unknown option {k!r} (known: {', '.join(keys) or 'none'}){hint}")


def positional(stage: Stage, flags: tuple[str, ...] = ()) -> str | None:
    """The first bare argument that is not a flag, if any."""
    plain = [a for a in stage.args if a not in flags]
    return plain[0] if plain else None


def float_option(stage: Stage, key: str, default: float | None, low: float, high: float) -> float:
    """Option ``key`` (``ratio`` and ``rank`` also positionally) as a float in
    ``(low, high]``; ``default=None`` makes it required."""
    raw = stage.option(key)
    if raw is None and key in ("ratio", "rank") and positional(stage, _FLAGS) is not None:
        raw = positional(stage, _FLAGS)
    if raw is None:
        if default is None:
            raise fail(stage, f"needs {key}, e.g. {stage.name}:0.01")
        return default
    try:
        value = float(raw)
    except ValueError:
        raise fail(stage, f"{key}={raw!r} is not a number") from None
    if not (low < value <= high):
        raise fail(stage, f"{key}={raw} must be in ({low}, {high}]")
    return value


def int_option(stage: Stage, key: str, default: int, low: int) -> int:
    """Option ``key`` (``rank`` also positionally) as an int ``>= low``."""
    raw = stage.option(key)
    if raw is None and key == "rank" and positional(stage, _FLAGS) is not None:
        raw = positional(stage, _FLAGS)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise fail(stage, f"{key}={raw!r} is not an integer") from None
    if value < low:
        raise fail(stage, f"{key}={value} must be >= {low}")
    return value
