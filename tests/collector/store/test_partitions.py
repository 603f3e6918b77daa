"""Day partitions of the raw per-rank tables, ``db prune``, and migration 0006 on old data."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sqlalchemy import func, select, text

from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.read.series import series
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import make_engine, upgrade, write
from trainwarden.collector.store.partitions import DAY_S, day_of, list_partitions, parse_age, prune

from ...helpers import new_database
from ..helpers import batch

NOW = 1_763_700_000.0  # 2025-11-21 04:40 UTC


def send(engine, rank: int, steps: list[tuple[int, float]], *, gpu_at: float | None = None) -> None:  # type: ignore[no-untyped-def]
    body = batch(
        rank=rank, steps=[{"step": s, "ts": ts, "duration_s": 0.5, "loss": 2.0} for s, ts in steps]
    )
    if gpu_at is not None:
        body["gpu"] = [{"ts": gpu_at, "temp_c": 60.0}]
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=NOW)


def count(engine, table) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def seed(engine) -> None:  # type: ignore[no-untyped-def]
    """Steps 0-1 twenty days ago, 2-3 ten days ago, 4-5 today, on two ranks."""
    for rank in range(2):
        days = [NOW - 20 * DAY_S, NOW - 20 * DAY_S, NOW - 10 * DAY_S, NOW - 10 * DAY_S, NOW, NOW]
        send(engine, rank, [(i, ts + i) for i, ts in enumerate(days)], gpu_at=NOW - 20 * DAY_S)
    body = batch(
        events=[{"id": "old-xid", "kind": "xid", "ts": NOW - 20 * DAY_S, "data": {"code": 79}}]
    )
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=NOW)
    for rank in range(2):
        send(engine, rank, [], gpu_at=NOW)
    flush(engine, now=NOW + 1, grace_s=0)


def test_prune_drops_old_raw_days_and_keeps_rollups_and_events(engine) -> None:  # type: ignore[no-untyped-def]
    seed(engine)
    assert count(engine, m.rank_steps) == 12 and count(engine, m.gpu_samples) == 4
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            days = [day for _name, day in list_partitions(conn, "rank_steps")]
        assert {
            int((NOW - 20 * DAY_S) // DAY_S),
            int((NOW - 10 * DAY_S) // DAY_S),
            int(NOW // DAY_S),
        } <= set(days)

    dry = prune(engine, keep_raw_s=parse_age("14d"), now=NOW, dry_run=True)
    assert count(engine, m.rank_steps) == 12  # a dry run changes nothing
    assert "would" in dry.summary()

    result = prune(engine, keep_raw_s=parse_age("14d"), now=NOW)
    with engine.connect() as conn:
        kept = (
            conn.execute(select(m.rank_steps.c.step).distinct().order_by(m.rank_steps.c.step))
            .scalars()
            .all()
        )
        assert kept == [2, 3, 4, 5]  # twenty days old: gone; ten days: kept
        assert count(engine, m.gpu_samples) == 2
        # The run's overview still has every step: rollups are not raw data.
        loss = series(conn, run="r1", metric="loss")
        assert loss.step == [0, 1, 2, 3, 4, 5] and loss.n == [2] * 6
    assert count(engine, m.events) == 1  # events are kept, however old
    if engine.dialect.name == "postgresql":
        old = {"rank_steps_p20251101", "gpu_samples_p20251101"}  # twenty days before NOW
        assert old <= set(result.dropped)
        assert not any(
            name >= "rank_steps_p20251107" for name in result.dropped if name.startswith("rank")
        )
    else:
        assert result.deleted_rows == 4 + 2

    # A late record for a pruned day is stored again (its partition comes back).
    send(engine, 0, [(0, NOW - 20 * DAY_S)])
    assert count(engine, m.rank_steps) == 9


def test_a_step_run_again_on_a_later_day_replaces_the_earlier_row(engine) -> None:  # type: ignore[no-untyped-def]
    send(engine, 0, [(0, NOW - DAY_S), (1, NOW - DAY_S + 1)])
    send(engine, 0, [(1, NOW + 5)])  # a rollback ran step 1 again, the next day
    with engine.connect() as conn:
        rows = conn.execute(
            select(m.rank_steps.c.step, m.rank_steps.c.ts).order_by(m.rank_steps.c.step)
        ).all()
    assert [tuple(r) for r in rows] == [(0, NOW - DAY_S), (1, NOW + 5)]
    send(engine, 0, [(1, NOW - DAY_S + 1)])  # the old execution replayed late: ignored
    assert count(engine, m.rank_steps) == 2
    # The replaced execution is kept (once), with its day, and goes with its day's raw data.
    with engine.connect() as conn:
        kept = conn.execute(
            select(m.replaced_steps.c.step, m.replaced_steps.c.ts, m.replaced_steps.c.day)
        ).all()
    assert [tuple(r) for r in kept] == [(1, NOW - DAY_S + 1, day_of(NOW - DAY_S + 1))]
    result = prune(engine, keep_raw_s=DAY_S, now=NOW + 2 * DAY_S)
    assert result.replaced_rows == 1 and "1 replaced step executions" in result.summary()
    assert count(engine, m.replaced_steps) == 0


def test_keep_raw_parsing_and_limits() -> None:
    assert (
        parse_age("14d") == 14 * DAY_S
        and parse_age("36h") == 36 * 3600
        and parse_age("2w") == 14 * DAY_S
    )
    with pytest.raises(ValueError, match="not an age"):
        parse_age("5 parsecs")


def test_db_prune_command(db_url: str) -> None:
    cmd = [sys.executable, "-m", "trainwarden.collector.cli", "db", "prune", "--db", db_url]
    ok = subprocess.run(
        [*cmd, "--keep-raw", "14d", "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    assert (
        "raw per-rank data before" in ok.stdout
        and "rollups, events, alerts and actions are kept" in ok.stdout
    )
    bad = subprocess.run(
        [*cmd, "--keep-raw", "fortnight"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--keep-raw" in bad.stderr and "not an age" in bad.stderr
    short = subprocess.run([*cmd, "--keep-raw", "2h"], capture_output=True, text=True, timeout=60)
    assert short.returncode == 2 and "at least 1d" in short.stderr


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request: pytest.FixtureRequest, tmp_path):  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'old.db'}"
        return
    with new_database(request.getfixturevalue("pg_server"), "tw_mig", migrate=False) as url:
        yield url


def test_migration_0006_keeps_existing_rows(fresh_url: str) -> None:
    engine = make_engine(fresh_url)
    upgrade(engine, "0005")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (name, created_at, updated_at, world_size, status) "
                "VALUES ('old', 0, 0, 1, 'running')"
            )
        )
        for step, ts in ((0, NOW - 3 * DAY_S), (1, NOW)):
            conn.execute(
                text(
                    "INSERT INTO rank_steps "
                    "(run_id, step, rank, ts, recv_ts, duration_s, loss, flags) "
                    "VALUES (1, :s, 0, :ts, :ts, 0.5, 1.5, :f)"
                ),
                {"s": step, "ts": ts, "f": '["loss_spike"]' if step else None},
            )
        conn.execute(
            text(
                "INSERT INTO gpu_samples (run_id, rank, ts, recv_ts, temp_c, simulated) "
                "VALUES (1, 0, :ts, :ts, 70, 0)"
            ),
            {"ts": NOW},
        )
    upgrade(engine)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT step, day, loss FROM rank_steps ORDER BY step")).all()
        assert [tuple(r) for r in rows] == [
            (0, int((NOW - 3 * DAY_S) // DAY_S), 1.5),
            (1, int(NOW // DAY_S), 1.5),
        ]
        assert conn.execute(text("SELECT day, temp_c FROM gpu_samples")).one() == (
            int(NOW // DAY_S),
            70.0,
        )
        flagged = (
            conn.execute(text("SELECT step FROM rank_steps WHERE flags IS NOT NULL"))
            .scalars()
            .all()
        )
        assert flagged == [1]
        if engine.dialect.name == "postgresql":
            assert len(list_partitions(conn, "rank_steps")) == 2
    engine.dispose()


def test_the_rollup_worker_makes_todays_and_tomorrows_partitions(pg_url: str) -> None:
    """PostgreSQL only (SQLite has no partitions)."""
    import time

    from trainwarden.collector.rollups.worker import rollup_loop
    from trainwarden.collector.store.partitions import day_of, partition_name

    engine = make_engine(pg_url)
    today = day_of(time.time())
    wanted = {
        partition_name(t, d) for t in ("rank_steps", "gpu_samples") for d in (today, today + 1)
    }
    with engine.begin() as conn:  # start from none of them
        for name in wanted:
            conn.execute(text(f"DROP TABLE IF EXISTS {name}"))
    loop = rollup_loop(engine, interval_s=0.05)
    loop.start()
    try:
        deadline = time.monotonic() + 10
        have: set[str] = set()
        while time.monotonic() < deadline and not wanted <= have:
            time.sleep(0.05)
            with engine.connect() as conn:
                have = {
                    n for t in ("rank_steps", "gpu_samples") for n, _ in list_partitions(conn, t)
                }
        assert wanted <= have
    finally:
        loop.stop()
        engine.dispose()
