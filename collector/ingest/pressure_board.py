"""Collectors on one database tell each other of their ingest pressure.

A collector that refuses a request (503) still counts its ranks as alive, and allows for
its own delay before it calls a rank dead (``limits.Pressure``). With several collectors
on one PostgreSQL (``serve --workers N``, or collectors behind a load balancer) the
health and alert passes are led by whichever collector takes the advisory lock first,
while the requests of a node go to one of the others: each collector's pressure must be
known to all. Each collector process writes its own to ``collector_pressure`` twice a
second while it has something to say (it fell behind, or refused ranks, in the last
``Pressure.memory_s``), deletes its row once it has not and when it stops, and reads the
others' into ``Pressure.elsewhere``; until a collector reads news again, what it read
grows older, and its leader allows for that age as for a delay (``Pressure.lag_s``). A
crashed collector's row is read until it is older than ``memory_s`` and deleted a day
later by another collector.

Refused ranks are written as runs of consecutive ranks refused at the same time (a node's
ranks come in one request): ``[first, last, at]``, ``at`` rounded down to 10 ms, so that
a rank is never taken as heard from later than it was.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Engine, delete, select
from sqlalchemy.dialects.postgresql import insert

from trainwarden.collector.ingest.limits import Elsewhere, Pressure
from trainwarden.collector.loops import Loop
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

log = logging.getLogger(__name__)

INTERVAL_S = 0.5
LAG_FRESH_S = 3.0  # another collector's delay and news count while its row is this recent
STALE_S = 86_400.0  # a row not replaced for this long (its collector crashed) is deleted


def collector_name() -> str:
    """This process among the collectors on the database: its host, pid and a nonce (a
    restarted worker may get a pid again)."""
    return f"{socket.gethostname()[:100]}:{os.getpid()}:{secrets.token_hex(4)}"


def encode(heard: Mapping[str, Mapping[int, float]]) -> dict[str, list[list[float]]]:
    """``{run: {rank: refused at}}`` as ``{run: [[first, last, at], ...]}``."""
    out: dict[str, list[list[float]]] = {}
    for run, ranks in heard.items():
        spans: list[list[float]] = []
        for rank in sorted(ranks):
            at = math.floor(ranks[rank] * 100) / 100
            if spans and spans[-1][1] == rank - 1 and spans[-1][2] == at:
                spans[-1][1] = rank
            else:
                spans.append([rank, rank, at])
        out[run] = spans
    return out


def decode(spans: Iterable[Sequence[Any]], into: dict[int, float]) -> None:
    """Add ``[first, last, at]`` spans to ``into`` (rank -> the latest time heard);
    anything malformed is skipped."""
    for span in spans:
        if len(span) != 3 or not all(isinstance(v, (int, float)) for v in span):
            continue
        first, last, at = int(span[0]), int(span[1]), float(span[2])
        for rank in range(first, min(last, first + 65_535) + 1):
            if at > into.get(rank, float("-inf")):
                into[rank] = at


def gathered(rows: Iterable[Any], now: float) -> Elsewhere:
    """The other collectors' rows as one ``Elsewhere``: the latest time any fell behind,
    every refused rank at the latest time any collector refused it, and of the rows of
    the last ``LAG_FRESH_S`` (their collectors still saying), the largest delay and when
    the oldest was written."""
    behind_at, lag, said_at = float("-inf"), 0.0, float("inf")
    heard: dict[str, dict[int, float]] = {}
    for row in rows:
        if row.behind_at is not None:
            behind_at = max(behind_at, row.behind_at)
        if row.updated_at >= now - LAG_FRESH_S:  # an older row's collector stopped saying
            lag = max(lag, row.lag_s)
            said_at = min(said_at, row.updated_at)
        if isinstance(row.heard, dict):
            for run, spans in row.heard.items():
                if isinstance(spans, list):
                    decode(spans, heard.setdefault(str(run), {}))
    return Elsewhere(behind_at=behind_at, lag_s=lag, heard=heard, said_at=said_at)


class PressureBoard:
    """Shares ``pressure`` with the other collectors on ``engine`` (PostgreSQL) from a
    thread of its own: ``start``, ``stop`` (which deletes this collector's row)."""

    def __init__(
        self,
        engine: Engine,
        pressure: Pressure,
        *,
        name: str | None = None,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.engine = engine
        self.pressure = pressure
        self.name = name or collector_name()
        self._written = False  # this collector's row is in the table
        self._pruned_at = float("-inf")
        self._lock = threading.Lock()  # exchange (the loop) and leave (stop) take turns
        self._loop = Loop("trainwarden-pressure", interval_s, self.exchange)
        self._started = False

    def start(self) -> None:
        self._loop.start()
        self._started = True

    def stop(self) -> None:
        if self._started:
            self._loop.stop()
        try:
            self.leave()
        except Exception:  # the database is gone: the row goes stale instead
            log.warning("could not delete this collector's pressure row", exc_info=True)

    def exchange(self) -> None:
        """Write what this collector has to say (or delete what it said, once it has
        nothing), and read what the others said into ``pressure.elsewhere``."""
        behind_at, lag, heard = self.pressure.own()
        now = time.time()
        t = m.collector_pressure.c
        with self._lock, write(self.engine) as conn:
            if behind_at is not None or heard:
                row = {
                    "behind_at": behind_at,
                    "lag_s": lag,
                    "heard": encode(heard),
                    "updated_at": now,
                }
                conn.execute(
                    insert(m.collector_pressure)
                    .values(collector=self.name, **row)
                    .on_conflict_do_update(index_elements=["collector"], set_=row)
                )
                self._written = True
            elif self._written:
                conn.execute(delete(m.collector_pressure).where(t.collector == self.name))
                self._written = False
            if now - self._pruned_at > 3600:
                conn.execute(delete(m.collector_pressure).where(t.updated_at < now - STALE_S))
                self._pruned_at = now
            rows = conn.execute(
                select(t.behind_at, t.lag_s, t.heard, t.updated_at).where(
                    t.collector != self.name, t.updated_at >= now - self.pressure.memory_s
                )
            ).all()
        self.pressure.elsewhere = gathered(rows, now)

    def leave(self) -> None:
        """Delete this collector's row: it is stopping."""
        with self._lock, write(self.engine) as conn:
            conn.execute(
                delete(m.collector_pressure).where(m.collector_pressure.c.collector == self.name)
            )
            self._written = False
