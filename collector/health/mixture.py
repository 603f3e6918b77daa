"""Mixture drift: the realized share of each data source against the declared mixture.

A run declares its mixture with ``tw.init(data_mixture={"web": 0.7, "code": 0.2, ...})``
(sent in its ``attempt_start`` event, checked at ingest: weights >= 0 summing to 1) and
its steps say how many tokens they drew from each source (``s.data_source(name,
tokens)``, table ``source_tokens``). Over the run's newest 200 steps (all ranks:
read/mixture.py), once at least :data:`MIN_STEPS` of them reported sources, a source
whose share is off its declared weight by more than its tolerance (a fifth of the
weight, at least one point: ``read.mixture.tolerance``) is a ``data_mixture_drift``
event, at most one per source and window of steps. A source the mixture does not declare
counts against a weight of 0.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from trainwarden.collector.read.mixture import WINDOW_STEPS, declared, realized, shares, tolerance

MIN_STEPS = 50
"""A window needs this many steps with sources before it is compared."""


def drift(conn: Connection, *, run_id: int, now: float) -> list[dict[str, Any]]:
    mixture = declared(conn, run_id, now=now)
    if not mixture:
        return []
    tokens, window, steps = realized(conn, run_id)
    if window is None or steps < MIN_STEPS:
        return []
    real = shares(tokens)
    if not real:
        return []
    gaps = {
        source: real.get(source, 0.0) - mixture.get(source, 0.0)
        for source in set(real) | set(mixture)
    }
    out = []
    for source, gap in sorted(gaps.items(), key=lambda kv: (-abs(kv[1]), kv[0])):
        want, got = mixture.get(source, 0.0), real.get(source, 0.0)
        allowed = tolerance(want)
        if abs(gap) <= allowed:
            continue
        out.append(
            {
                "rank": None,
                "kind": "data_mixture_drift",
                "severity": "warning",
                "step": window[1],
                "uid": f"mixture:{run_id}:{source}:{window[1] // WINDOW_STEPS}",
                "data": {
                    "source": source,
                    "declared": mixture,
                    "realized": {s: round(v, 4) for s, v in sorted(real.items())},
                    "tokens": dict(sorted(tokens.items())),
                    "window": window,
                    "tolerance": round(allowed, 4),
                    "reason": f"source {source} gave {got:.1%} of the tokens of steps "
                    f"{window[0]}-{window[1]}, declared {want:.1%} (tolerance "
                    f"{allowed:.1%})",
                },
            }
        )
    return out
