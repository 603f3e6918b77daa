"""A run's data mixture: the declared weights and the realized shares of its newest steps.

Declared with ``tw.init(data_mixture={"web": 0.7, ...})`` (in the run's ``attempt_start``
events, checked at ingest); realized from what the steps reported with
``s.data_source(name, tokens)`` (table ``source_tokens``) over the newest
:data:`WINDOW_STEPS` steps. The drift check (collector/health/mixture.py) and the run
page's Data panel (read/data.py) both read it here.
"""

from __future__ import annotations

import time

from sqlalchemy import Connection, func, select

from trainwarden.collector.store import models as m

WINDOW_STEPS = 200
"""The steps the realized shares are taken over (the newest)."""
ABS_TOLERANCE = 0.01
REL_TOLERANCE = 0.2
_DECLARED_TTL_S = 30.0
_MAX_CACHED = 10_000
_declared: dict[int, tuple[float, dict[str, float] | None]] = {}


def tolerance(weight: float) -> float:
    """How far a source's realized share may be from its declared ``weight``: a fifth of
    the weight, at least one point (a source declared at 2 % that stops is off by 2 points,
    past its 1; one declared at 70 % may move 14)."""
    return max(ABS_TOLERANCE, REL_TOLERANCE * weight)


def declared(conn: Connection, run_id: int, *, now: float | None = None) -> dict[str, float] | None:
    """The weights the run's newest ``attempt_start`` carrying a mixture declared (kept
    :data:`_DECLARED_TTL_S` per run: the drift check asks every second)."""
    now = time.time() if now is None else now
    cached = _declared.get(run_id)
    if cached is not None and now - cached[0] < _DECLARED_TTL_S:
        return cached[1]
    e = m.events.c
    mixture = None
    for data in conn.execute(
        select(e.data)
        .where(e.run_id == run_id, e.kind == "attempt_start")
        .order_by(e.ts.desc())
        .limit(64)
    ).scalars():
        if isinstance(data, dict) and isinstance(data.get("data_mixture"), dict):
            mixture = {str(k): float(v) for k, v in data["data_mixture"].items()}
            break
    if len(_declared) >= _MAX_CACHED:
        _declared.clear()
    _declared[run_id] = (now, mixture)
    return mixture


def forget() -> None:
    """Drop the cached declarations (a test's fresh database reuses run ids)."""
    _declared.clear()


def realized(conn: Connection, run_id: int) -> tuple[dict[str, int], list[int] | None, int]:
    """Tokens by source over the newest :data:`WINDOW_STEPS` steps, the window's
    ``[first, last]`` step and how many steps in it reported sources."""
    t = m.source_tokens.c
    last = conn.execute(select(func.max(t.step)).where(t.run_id == run_id)).scalar()
    if last is None:
        return {}, None, 0
    low = last - WINDOW_STEPS + 1
    tokens = {
        source: int(total)
        for source, total in conn.execute(
            select(t.source, func.sum(t.tokens))
            .where(t.run_id == run_id, t.step >= low)
            .group_by(t.source)
        )
    }
    steps = conn.execute(
        select(func.count(func.distinct(t.step))).where(t.run_id == run_id, t.step >= low)
    ).scalar_one()
    return tokens, [max(low, 0), int(last)], int(steps)


def shares(tokens: dict[str, int]) -> dict[str, float]:
    total = sum(tokens.values())
    return {s: n / total for s, n in tokens.items()} if total else {}
