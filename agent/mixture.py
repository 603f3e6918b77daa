"""A data mixture: the share of tokens each source should give (``tw.init(data_mixture=
{"web": 0.7, "code": 0.2, "math": 0.1})``) and the tokens a step drew from each
(``s.data_source(name, tokens)``). The collector compares the realized shares over a
window of steps with the declared ones (collector/health/mixture.py)."""

from __future__ import annotations

import math
import re
from typing import Any

SOURCE_NAME = r"^[a-z][a-z0-9_.-]{0,31}$"
"""What a data source may be called; the collector checks the same."""
MAX_SOURCES = 32
"""Sources in a mixture, and in one step, at most."""
SUM_TOLERANCE = 1e-6
"""How far a mixture's weights may sum from 1."""
_name = re.compile(SOURCE_NAME).match


def check_source(name: Any, count: int) -> str:
    """Raise ``ValueError`` naming a bad source ``name`` (``count``: those the step has)."""
    if not isinstance(name, str) or not _name(name):
        raise ValueError(
            f"data source name {name!r:.40} must match {SOURCE_NAME} "
            "(lower case, digits, '_', '.' and '-'; at most 32 characters)"
        )
    if count >= MAX_SOURCES:
        raise ValueError(f"data source {name!r} is one too many: at most {MAX_SOURCES} a step")
    return name


def check_tokens(name: str, tokens: Any) -> int:
    """A step's tokens from one source: a whole number >= 0 (an int, a numpy int or a
    0-d CPU tensor; a CUDA tensor would make the step wait for the GPU)."""
    if getattr(tokens, "is_cuda", False):
        raise ValueError(
            f"s.data_source({name!r}, tokens): give an int, not a CUDA tensor (reading it "
            "would wait for the GPU)"
        )
    try:
        value = int(tokens)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"s.data_source({name!r}, tokens): tokens must be a whole number, got "
            f"{type(tokens).__name__}"
        ) from None
    if value < 0 or value != tokens:
        raise ValueError(f"s.data_source({name!r}, tokens): {tokens!r:.40} is not a count >= 0")
    return value


def check_mixture(mixture: Any) -> dict[str, float] | None:
    """``tw.init(data_mixture=...)``: a mapping of source names to weights >= 0 that sum
    to 1. Raises ``ValueError`` saying what is wrong."""
    if mixture is None:
        return None
    if not isinstance(mixture, dict) or not mixture:
        raise ValueError(
            'data_mixture must be a mapping of sources to weights, e.g. {"web": 0.7, '
            f'"code": 0.3}}, got {mixture!r:.60}'
        )
    if len(mixture) > MAX_SOURCES:
        raise ValueError(f"data_mixture has {len(mixture)} sources, at most {MAX_SOURCES}")
    out: dict[str, float] = {}
    for i, (name, weight) in enumerate(mixture.items()):
        check_source(name, i)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"data_mixture[{name!r}] must be a number, got {weight!r:.40}")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"data_mixture[{name!r}] must be a weight >= 0, got {weight!r}")
        out[name] = float(weight)
    total = sum(out.values())
    if abs(total - 1) > SUM_TOLERANCE:
        raise ValueError(f"data_mixture's weights must sum to 1, they sum to {total:.6g}")
    return out
