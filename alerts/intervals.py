"""Lengths of time in rule files: a duration (``"90s"``, ``"5m"``, ``"1h"``), a step
count (``"50 steps"``) or, where a rule watches heartbeats, a number of heartbeat
intervals (``"3 beats"``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import PlainSerializer, PlainValidator

Unit = Literal["s", "steps", "beats"]

_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d)")
_COUNT = re.compile(r"(\d+(?:\.\d+)?) *(step|steps|beat|beats)")
_SAY = {
    "s": "a duration ('90s', '5m', '1h')",
    "steps": "a step count ('50 steps')",
    "beats": "a number of heartbeat intervals ('3 beats')",
}


@dataclass(frozen=True)
class Interval:
    """``value`` seconds, steps or heartbeat intervals."""

    value: float
    unit: Unit

    @property
    def seconds(self) -> float | None:
        return self.value if self.unit == "s" else None

    @property
    def steps(self) -> int | None:
        return int(self.value) if self.unit == "steps" else None

    def __str__(self) -> str:
        if self.unit == "s":
            for unit in ("d", "h", "m"):
                if self.value and self.value % _SECONDS[unit] == 0:
                    return f"{self.value / _SECONDS[unit]:g}{unit}"
            return f"{self.value:g}s"
        return f"{self.value:g} {self.unit}"


ZERO = Interval(0.0, "s")


def parse_interval(value: Any, units: tuple[Unit, ...] = ("s", "steps")) -> Interval:
    """``value`` from a rule file as an :class:`Interval` in one of ``units``."""
    if isinstance(value, Interval):
        found: Interval | None = value
    elif value == 0 and not isinstance(value, bool):
        found = ZERO  # "for: 0" needs no unit
    elif isinstance(value, str):
        text = value.strip()
        if m := _DURATION.fullmatch(text):
            found = Interval(float(m[1]) * _SECONDS[m[2]], "s")
        elif m := _COUNT.fullmatch(text):
            count = float(m[1])
            unit: Unit = "steps" if m[2].startswith("step") else "beats"
            found = Interval(count, unit) if unit == "beats" or count.is_integer() else None
        else:
            found = None
    else:
        found = None
    if found is None or found.unit not in units:
        said = " or ".join(_SAY[u] for u in units)
        raise ValueError(f"{value!r} is not {said}")
    return found


def _in(*units: Unit) -> PlainValidator:
    return PlainValidator(lambda value: parse_interval(value, units))


Span = Annotated[Interval, _in("s", "steps"), PlainSerializer(str)]
"""A duration or a step count: ``for``, ``keep_firing_for`` and windows over steps."""
Duration = Annotated[Interval, _in("s"), PlainSerializer(str)]
"""A duration only: what is measured in wall-clock time (GPU samples, heartbeats)."""
After = Annotated[Interval, _in("s", "steps", "beats"), PlainSerializer(str)]
"""How long a signal may be absent: a duration, steps or heartbeat intervals."""
