"""User metrics: the scalars a trainer logs with ``s.metric(name, value)``.

A step row keeps them in ``rank_steps.metrics`` (JSON, JSONB on PostgreSQL) as
``{name: value}``; a non-finite value is stored as ``null`` and marked in the row's
``issues`` under ``user.<name>`` (as ``loss`` is: SQLite and JSON cannot hold NaN).
The rollup worker keeps each across ranks in ``step_stats`` as metric ``user.<name>``,
which is what ``/series?metric=user.<name>`` reads. The names follow the agent's rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from trainwarden.agent.values import MAX_USER_METRICS, USER_METRIC_NAME

PREFIX = "user."
"""Series name of a user metric: ``user.<name>``."""
_name = re.compile(USER_METRIC_NAME).match


def bad_name(names: Iterable[str]) -> str | None:
    """Why the first bad user metric name of ``names`` is refused, else ``None``."""
    for name in names:
        if not _name(name):
            return (
                f"user metric name {name!r} must match {USER_METRIC_NAME} "
                "(lower case, digits, '_' and '.'; at most 32 characters)"
            )
    return None


def check(metrics: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming what is wrong with one step's user metrics."""
    if len(metrics) > MAX_USER_METRICS:
        raise ValueError(f"{len(metrics)} user metrics: at most {MAX_USER_METRICS} a step")
    if (why := bad_name(metrics)) is not None:
        raise ValueError(why)


def check_column(values: list[dict[str, Any] | None]) -> None:
    """:func:`check` on a columnar batch's ``metrics`` column (one dict per row): each
    distinct name is checked once; an error names the first row at fault."""
    rows = [d for d in values if d]
    if not rows:
        return
    if max(map(len, rows)) > MAX_USER_METRICS or bad_name(set().union(*rows)) is not None:
        for i, metrics in enumerate(values):
            try:
                check(metrics or {})
            except ValueError as exc:
                raise ValueError(f"steps row {i}: metrics: {exc}") from None


def is_user(metric: str) -> bool:
    return metric.startswith(PREFIX)


def field(metric: str) -> str:
    """The key in ``rank_steps.metrics`` of the series ``user.<name>``."""
    return metric[len(PREFIX) :]


def value_of(name: str, row: Mapping[str, Any]) -> float | None:
    """User metric ``name`` of a ``rank_steps`` row; None where the step has none, or a
    non-finite value (stored as null)."""
    found = (row.get("metrics") or {}).get(name)
    return None if found is None else float(found)
