from __future__ import annotations

import pytest

from trainwarden.collector.rollups.aggregate import aggregate
from trainwarden.collector.store.models import metadata, rank_steps

# Every table: runs' CASCADE does not reach rank_steps (no foreign key since migration 0015).
ALL_TABLES = ", ".join(t.name for t in metadata.sorted_tables)


def row(
    rank: int,
    *,
    loss: float | None,
    duration: float = 1.0,
    tokens: int | None = 10,
    issues: dict | None = None,
    **telemetry: float,
) -> dict:
    """A rank_steps row as the database returns it: every column, most of them empty."""
    base: dict = dict.fromkeys(c.name for c in rank_steps.columns)
    base.update(
        rank=rank,
        ts=100.0 + rank,
        duration_s=duration,
        data_wait_s=0.0,
        tokens=tokens,
        loss=loss,
        issues=issues,
    )
    return {**base, **telemetry}


def by_metric(rows: list[dict]) -> dict[str, dict]:
    return {r["metric"]: r for r in aggregate(7, 3, rows)}


def test_min_median_max_and_argmax_across_ranks() -> None:
    stats = by_metric([row(0, loss=1.0), row(1, loss=3.0), row(2, loss=2.0, duration=4.0)])
    loss = stats["loss"]
    assert (loss["min"], loss["median"], loss["max"], loss["n"]) == (1.0, 2.0, 3.0, 3)
    assert loss["argmax_rank"] == 1 and loss["ts"] == 100.0
    assert stats["step_time"]["total"] == 4.0 and stats["step_time"]["argmax_rank"] == 2
    assert stats["tokens"]["total"] == 30
    assert stats["tokens_per_s"]["total"] == 30 / 4.0


def test_missing_and_non_finite_values_are_counted_not_aggregated() -> None:
    stats = by_metric(
        [
            row(0, loss=None, issues={"loss": "nan"}),
            row(1, loss=2.0),
            row(2, loss=None, tokens=None),
        ]
    )
    loss = stats["loss"]
    assert (loss["n"], loss["nonfinite"], loss["min"], loss["max"]) == (1, 1, 2.0, 2.0)
    assert stats["tokens"]["n"] == 2


def test_a_metric_no_rank_reports_has_no_row() -> None:
    stats = by_metric([row(0, loss=None)])
    assert "loss" not in stats and "mfu" not in stats
    assert stats["step_time"]["n"] == 1


def test_run_mfu_is_all_flops_over_the_slowest_rank_and_all_peaks() -> None:
    stats = by_metric(
        [
            row(0, loss=1.0, duration=1.0, flops=4e12, peak_flops=10e12, mfu=0.4),
            row(1, loss=1.0, duration=2.0, flops=4e12, peak_flops=10e12, mfu=0.2),
        ]
    )
    assert stats["mfu"]["total"] == 8e12 / (2.0 * 20e12)
    assert (stats["mfu"]["min"], stats["mfu"]["max"]) == (0.2, 0.4)


def test_breakdown_parts_average_over_ranks() -> None:
    stats = by_metric(
        [
            row(0, loss=1.0, duration=1.0, compute_s=0.7, exposed_comm_s=0.3),
            row(1, loss=1.0, duration=1.0, compute_s=0.9, exposed_comm_s=0.1),
        ]
    )
    assert stats["compute"]["total"] == 0.8
    assert stats["exposed_comm"]["total"] == 0.2
    assert stats["exposed_comm_frac"]["max"] == 0.3


def test_postgres_rolls_up_in_sql_exactly_as_python_does(pg_url: str) -> None:
    """The SQL rollup (PostgreSQL) and the Python one (SQLite) agree on awkward data:
    missing values, non-finite losses, zero durations, ties, ranks without FLOPs."""
    import random

    from sqlalchemy import text

    from trainwarden.collector.ingest.batches import ingest
    from trainwarden.collector.ingest.schemas import IngestBatch
    from trainwarden.collector.rollups.worker import _aggregate_here, _aggregate_in_db
    from trainwarden.collector.store.db import make_engine, write

    from ..helpers import batch

    rng = random.Random(11)
    engine = make_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {ALL_TABLES} RESTART IDENTITY CASCADE"))
    for rank in range(7):
        steps = []
        for i in range(12):
            row: dict = {
                "step": i,
                "ts": 1_700_000_000.0 + i,
                "duration_s": rng.choice([0.0, 0.5, 0.5, rng.random()]),
            }
            if rng.random() < 0.8:
                row["tokens"] = rng.choice([0, 100, 4096])
            if rng.random() < 0.8:
                row["loss"] = rng.choice([2.0, rng.random(), "nan", "inf"])
            if rng.random() < 0.7:
                row.update(flops=rng.random() * 1e12, peak_flops=rng.choice([1e14, 2e14]))
            for col in (
                "compute_s",
                "exposed_comm_s",
                "data_wait_s",
                "grad_norm",
                "mfu",
                "rss_bytes",
            ):
                if rng.random() < 0.7:
                    row[col] = (
                        rng.choice([0.1, rng.random()])
                        if col != "rss_bytes"
                        else rng.randrange(1 << 30)
                    )
            # User metrics: some ranks send some names, a value may be null or non-finite.
            user = {
                name: rng.choice([1.0, 0.25, rng.random(), None, "nan", "-inf"])
                for name in ("lr", "moe.aux", "eval.acc")
                if rng.random() < 0.6
            }
            if user and rank != 3:  # rank 3 sends none
                row["metrics"] = user
            steps.append(row)
        with write(engine) as conn:
            ingest(
                conn, batch=IngestBatch.model_validate(batch(rank=rank, world_size=7, steps=steps))
            )
    keys = [(1, i) for i in range(12)]
    with engine.connect() as conn:
        here, seen_here = _aggregate_here(conn, keys)
        there, seen_there = _aggregate_in_db(conn, keys)
    with engine.begin() as conn:  # leave the session database empty, as the fixtures do
        conn.execute(text(f"TRUNCATE {ALL_TABLES} RESTART IDENTITY CASCADE"))
    engine.dispose()
    key = lambda s: (s["step"], s["metric"])  # noqa: E731
    assert seen_here == seen_there
    assert len(here) == len(there) > 12 * 10
    assert {s["metric"] for s in there if s["metric"].startswith("user.")} == {
        "user.lr",
        "user.moe.aux",
        "user.eval.acc",
    }
    for a, b in zip(sorted(here, key=key), sorted(there, key=key), strict=True):
        assert a.keys() == b.keys()
        for name in a:
            if isinstance(a[name], float) or isinstance(b[name], float):
                assert a[name] == pytest.approx(b[name], rel=1e-9), (a["metric"], a["step"], name)
            else:
                assert a[name] == b[name], (a["metric"], a["step"], name)


def test_p99_interpolates_between_the_closest_ranks_as_percentile_cont_does() -> None:
    stats = by_metric([row(rank, loss=float(rank)) for rank in range(100)])
    loss = stats["loss"]
    assert loss["median"] == 49.5 and loss["p99"] == pytest.approx(98.01)  # 99 x 0.99 = 98.01
    assert by_metric([row(0, loss=5.0)])["loss"]["p99"] == 5.0  # one rank: its value


def test_postgres_sessions_run_without_jit_whatever_the_server_default(pg_url: str) -> None:
    """The collector's PostgreSQL connections turn the JIT compiler off (a rollup pass of
    several steps spent half its time compiling its plan), also where the database asks
    for it: pooled, reused and in write transactions."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from trainwarden.collector.store.db import make_engine, write

    name = make_url(pg_url).database
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'ALTER DATABASE "{name}" SET jit = on'))
    try:
        plain = create_engine(pg_url)
        with plain.connect() as conn:
            assert conn.execute(text("SHOW jit")).scalar() == "on"  # what the server says
        plain.dispose()
        engine = make_engine(pg_url)
        for _ in range(3):  # the same pooled connection, again after a rollback
            with engine.connect() as conn:
                assert conn.execute(text("SHOW jit")).scalar() == "off"
                conn.rollback()
            with write(engine) as conn:
                assert conn.execute(text("SHOW jit")).scalar() == "off"
        engine.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" RESET jit'))
        admin.dispose()
