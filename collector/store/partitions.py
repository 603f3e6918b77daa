"""Day partitions of the per-rank raw tables, and ``trainwarden db prune``.

On PostgreSQL ``rank_steps`` and ``gpu_samples`` are partitioned by ``day`` (the UTC day
of each record's own timestamp), one partition a day, named ``<table>_pYYYYMMDD``.
Partitions are created ahead of need (today and tomorrow, by the rollup worker on each
pass) and on demand for a day a batch brings; pruning drops whole partitions, which
is instant and leaves no bloat. On SQLite there are no partitions: pruning deletes rows.

Pruning keeps everything that is not per-rank raw data: runs, ranks, the cross-rank
rollups (``step_stats``), the per-rank bucket maxima behind heatmaps, events, alerts
and actions. A pruned run still draws its overview; only raw per-rank rows go.
"""

from __future__ import annotations

import datetime as dt
import re
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, delete, func, select, text

from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import is_sqlite

DAY_S = 86400
TABLES = ("rank_steps", "gpu_samples")
# One advisory lock key for partition DDL, so two collectors never race on it.
DDL_LOCK = 0x7477_7061  # "twpa"

_created: weakref.WeakKeyDictionary[Engine, set[tuple[str, int]]] = weakref.WeakKeyDictionary()


def day_of(ts: float) -> int:
    return int(ts // DAY_S)


def partition_name(table: str, day: int) -> str:
    date = dt.datetime.fromtimestamp(day * DAY_S, tz=dt.timezone.utc)
    return f"{table}_p{date:%Y%m%d}"


def is_partition(name: str | None) -> bool:
    """Whether a table name is one of the day partitions (which the models do not list)."""
    return bool(name) and re.fullmatch(rf"({'|'.join(TABLES)})_p\d{{8}}", name or "") is not None


def include_name(name: str | None, type_: str, _parent: object) -> bool:
    """Alembic ``include_name`` hook: schema comparisons skip the day partitions."""
    return not (type_ == "table" and is_partition(name))


def ensure_partitions(engine: Engine, days: Iterable[int], tables: Iterable[str] = TABLES) -> None:
    """Create the day partitions that do not exist yet (PostgreSQL; a no-op on SQLite).

    Runs in its own short transaction: creating a partition locks the parent table,
    which must not be held for the length of an ingest transaction."""
    if is_sqlite(engine):
        return
    done = _created.setdefault(engine, set())
    wanted = sorted({(t, d) for t in tables for d in days} - done)
    if not wanted:
        return
    with engine.connect() as conn, conn.begin():
        conn.execute(text("SET LOCAL lock_timeout = '10s'"))
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": DDL_LOCK})
        for table, day in wanted:
            conn.execute(
                text(
                    f"CREATE TABLE IF NOT EXISTS {partition_name(table, day)} "
                    f"PARTITION OF {table} FOR VALUES FROM ({day}) TO ({day + 1})"
                )
            )
    done.update(wanted)


def ensure_ahead(engine: Engine, now: float | None = None) -> None:
    """Today's and tomorrow's partitions, so the ingest path rarely creates one."""
    today = day_of(time.time() if now is None else now)
    ensure_partitions(engine, (today, today + 1))


def forget_partitions(engine: Engine) -> None:
    """Forget what this process created (after a prune, or a failed insert)."""
    _created.pop(engine, None)


def list_partitions(conn: Connection, table: str) -> list[tuple[str, int]]:
    """(name, day) of each day partition of ``table``, oldest first."""
    rows = conn.execute(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = :t"
        ),
        {"t": table},
    ).scalars()
    out = []
    for name in rows:
        match = re.fullmatch(rf"{table}_p(\d{{8}})", name)
        if match:
            date = dt.datetime.strptime(match[1], "%Y%m%d").replace(tzinfo=dt.timezone.utc)
            out.append((name, day_of(date.timestamp())))
    return sorted(out, key=lambda item: item[1])


@dataclass
class PruneResult:
    cutoff_day: int
    dropped: list[str]  # partitions dropped (PostgreSQL)
    deleted_rows: int  # rows deleted (SQLite)
    dry_run: bool
    replaced_rows: int = 0  # replaced executions of steps deleted (both; not partitioned)

    def summary(self) -> str:
        cutoff = dt.datetime.fromtimestamp(self.cutoff_day * DAY_S, tz=dt.timezone.utc)
        verb = "would drop" if self.dry_run else "dropped"
        head = f"raw per-rank data before {cutoff:%Y-%m-%d} (UTC): "
        deleting = "would delete" if self.dry_run else "deleted"
        replaced = (
            f"; {deleting} {self.replaced_rows:,} replaced step executions"
            if self.replaced_rows
            else ""
        )
        if self.dropped or not self.deleted_rows:
            names = ", ".join(self.dropped) if self.dropped else "nothing"
            return head + f"{verb} {len(self.dropped)} partitions ({names})" + replaced
        return head + f"{deleting} {self.deleted_rows:,} rows" + replaced


def prune(
    engine: Engine, *, keep_raw_s: float, now: float | None = None, dry_run: bool = False
) -> PruneResult:
    """Drop per-rank raw data older than ``keep_raw_s`` (whole days: a day goes once all
    of it is older). Rollups, bucket maxima, events, runs and ranks stay."""
    if keep_raw_s < DAY_S:
        raise ValueError("--keep-raw must be at least 1d: raw data is kept in whole days")
    now = time.time() if now is None else now
    cutoff = day_of(now - keep_raw_s)  # days < cutoff are entirely older than the limit
    with engine.connect() as conn, conn.begin():
        old = m.replaced_steps.c.day < cutoff
        if dry_run:
            replaced = conn.execute(
                select(func.count()).select_from(m.replaced_steps).where(old)
            ).scalar_one()
        else:
            replaced = conn.execute(delete(m.replaced_steps).where(old)).rowcount
    if is_sqlite(engine):
        deleted = 0
        with engine.connect() as conn, conn.begin():
            for raw in (m.rank_steps, m.gpu_samples):
                if dry_run:
                    deleted += conn.execute(
                        text(f"SELECT count(*) FROM {raw.name} WHERE day < :d"), {"d": cutoff}
                    ).scalar_one()
                else:
                    deleted += conn.execute(delete(raw).where(raw.c.day < cutoff)).rowcount
        return PruneResult(cutoff, [], deleted, dry_run, replaced)
    dropped = []
    with engine.connect() as conn, conn.begin():
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": DDL_LOCK})
        for table in TABLES:
            for name, day in list_partitions(conn, table):
                if day < cutoff:
                    dropped.append(name)
                    if not dry_run:
                        conn.execute(text(f"DROP TABLE {name}"))
    forget_partitions(engine)
    return PruneResult(cutoff, dropped, 0, dry_run, replaced)


def parse_age(value: str) -> float:
    """``14d``, ``36h``, ``2w`` → seconds, for ``--keep-raw``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([hdw])\s*", value)
    if not match:
        raise ValueError(f"{value!r} is not an age: use a number with h, d or w (e.g. 14d)")
    return float(match[1]) * {"h": 3600, "d": DAY_S, "w": 7 * DAY_S}[match[2]]
