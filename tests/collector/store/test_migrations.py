from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from trainwarden.collector.store.models import metadata
from trainwarden.collector.store.partitions import include_name


def test_migrations_build_exactly_the_models_schema(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        assert (
            compare_metadata(
                MigrationContext.configure(conn, opts={"include_name": include_name}), metadata
            )
            == []
        )


def _downgrade(engine, revision: str) -> None:  # type: ignore[no-untyped-def]
    import os

    from alembic import command
    from alembic.config import Config

    import trainwarden.migrations as migrations

    config = Config()
    config.set_main_option("script_location", os.path.dirname(migrations.__file__))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def test_0022_keeps_one_of_each_replaced_execution(db_url: str) -> None:
    # Before 0022 a replaced execution could be kept twice; the migration leaves one.
    # (PostgreSQL's test database is shared and at the latest schema: back to 0021 first,
    # and at the latest again whatever happens.)
    from sqlalchemy import func, insert, select

    from trainwarden.collector.store import models as m
    from trainwarden.collector.store.db import make_engine, upgrade

    engine = make_engine(db_url)
    try:
        upgrade(engine, "0021")
        _downgrade(engine, "0021")
        row = {
            "run_id": 1,
            "rank": 0,
            "step": 5,
            "day": 1,
            "ts": 10.0,
            "replaced_at": 20.0,
            "loss": 9.0,
        }
        with engine.begin() as conn:
            conn.execute(
                insert(m.replaced_steps), [row, row, {**row, "rank": 1}, {**row, "ts": 11.0}]
            )
        upgrade(engine)
        with engine.connect() as conn:
            r = m.replaced_steps.c
            kept = conn.execute(
                select(r.rank, r.ts, func.count()).group_by(r.rank, r.ts).order_by(r.rank, r.ts)
            ).all()
        assert [tuple(k) for k in kept] == [(0, 10.0, 1), (0, 11.0, 1), (1, 10.0, 1)]
    finally:
        upgrade(engine)
        engine.dispose()


def test_0029_carries_each_buckets_maxima_over_in_rank_order(db_url: str) -> None:
    # rank_buckets (a row a rank and bucket) becomes bucket_maxima (a row a bucket, its
    # ranks in order): every stored maximum is carried over, to the last bit.
    from sqlalchemy import select, text

    from trainwarden.collector.store import models as m
    from trainwarden.collector.store.db import make_engine, upgrade

    engine = make_engine(db_url)
    try:
        upgrade(engine, "0028")
        _downgrade(engine, "0028")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO runs (id, name, created_at, updated_at, world_size) "
                    "VALUES (1, 'r', 0, 0, 4)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO rank_buckets (run_id, metric, level, bucket, rank, max) "
                    "VALUES (1, :metric, :level, :bucket, :rank, :max)"
                ),
                [
                    {"metric": "loss", "level": 16, "bucket": 0, "rank": 2, "max": 0.1 + 0.2},
                    {"metric": "loss", "level": 16, "bucket": 0, "rank": 0, "max": 1e-300},
                    {"metric": "loss", "level": 16, "bucket": 1, "rank": 3, "max": 2.0},
                    {"metric": "step_time", "level": 64, "bucket": 0, "rank": 1, "max": 7.5},
                ],
            )
        upgrade(engine)
        with engine.connect() as conn:
            k = m.bucket_maxima.c
            found = conn.execute(
                select(k.metric, k.level, k.bucket, k.ranks, k.maxima).order_by(
                    k.metric, k.level, k.bucket
                )
            ).all()
            conn.execute(text("DELETE FROM runs WHERE id = 1"))
            conn.commit()
        assert [tuple(row) for row in found] == [
            ("loss", 16, 0, [0, 2], [1e-300, 0.1 + 0.2]),
            ("loss", 16, 1, [3], [2.0]),
            ("step_time", 64, 0, [1], [7.5]),
        ]
    finally:
        upgrade(engine)
        engine.dispose()


def test_0030_a_runs_events_of_one_kind_are_found_by_their_index(pg_url: str) -> None:
    """The evaluators' reads of one kind of a run's events (here the newest ``collectives``
    ring's time, as the hang check asks every pass) go through (run_id, kind, ts): among
    20,000 ``rank_state`` events, the plan reads the three rings' entries, not the run."""
    from sqlalchemy import func, select, text

    from trainwarden.collector.store import models as m
    from trainwarden.collector.store.db import make_engine

    engine = make_engine(pg_url)
    e = m.events.c
    try:
        with engine.begin() as conn:
            run_id = conn.execute(
                text(
                    "INSERT INTO runs (name, created_at, updated_at, world_size) "
                    "VALUES ('events-by-kind', 0, 0, 8) RETURNING id"
                )
            ).scalar_one()
            conn.execute(
                text(
                    "INSERT INTO events (uid, run_id, rank, ts, recv_ts, kind, severity) "
                    "SELECT 'ek-' || g, :r, g % 8, g, g, "
                    "CASE WHEN g IN (5000, 12000, 17000) THEN 'collectives' ELSE 'rank_state' END,"
                    " 'info' FROM generate_series(1, 20000) g"
                ),
                {"r": run_id},
            )
            conn.execute(text("ANALYZE events"))
            newest = select(func.max(e.ts)).where(e.run_id == run_id, e.kind == "collectives")
            compiled = newest.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True})
            plan = "\n".join(
                conn.execute(text(f"EXPLAIN (ANALYZE, COSTS OFF) {compiled}")).scalars()
            )
            found = conn.execute(newest).scalar()
            conn.rollback()
    finally:
        engine.dispose()
    assert "ix_events_run_id_kind_ts" in plan, plan
    assert "Rows Removed by Filter" not in plan, plan
    assert found == 17000.0
