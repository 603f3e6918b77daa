"""Database URLs, engines and migrations.

SQLite (the embedded default) and PostgreSQL share one schema. On SQLite the engine
runs in WAL mode, and ingest transactions start with ``BEGIN IMMEDIATE`` so two
concurrent writers queue on the lock instead of failing on a stale snapshot.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

IMMEDIATE = {"tw_immediate": True}
"""Execution options for a write transaction (``BEGIN IMMEDIATE`` on SQLite)."""


class DatabaseError(RuntimeError):
    """The database URL is wrong or the database cannot be reached."""


def default_db_path() -> Path:
    """The embedded default: an SQLite file in the per-user data directory."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "trainwarden" / "trainwarden.db"


def default_db_url() -> str:
    return f"sqlite:///{default_db_path()}"


def masked(url: str) -> str:
    """The URL with its password replaced by ``***``, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def is_sqlite(engine: Engine | Connection) -> bool:
    return engine.dialect.name == "sqlite"


def json_loads(data: str | bytes) -> Any:
    """The JSON columns' parser: orjson (a quarter of the standard library's time: the
    alert engine reads every open alert's labels and annotations on each pass, 16,384
    of them when a large job has died), the standard library for what orjson refuses
    (NaN written by SQLite's serializer, integers past 64 bits)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


IDLE_IN_TRANSACTION_S = 120.0
"""PostgreSQL ends a collector's session that sits this long inside a transaction without
a statement (``idle_in_transaction_session_timeout``): a collector hung in the middle of a
pass (stopped, deadlocked) would otherwise hold its rows' locks and the pass's advisory
lock, and no other collector could take over the rollups, health or alerts. No pass
waits that long between two statements."""


def make_engine(url: str, *, idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S) -> Engine:
    """An engine for ``url``; for SQLite, creates the file's folder and sets WAL mode; for
    PostgreSQL, each session ends after ``idle_in_transaction_s`` idle in a transaction."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseError(
            f"database URL {url!r} is not valid: use sqlite:///PATH or "
            "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB"
        ) from None
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3 is what we ship
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed,
            connect_args={"check_same_thread": False, "timeout": 30},
            json_deserializer=json_loads,
        )
        _sqlite_setup(engine)
        return engine
    if parsed.get_backend_name() != "postgresql":
        raise DatabaseError(f"database {masked(url)} is not supported: use SQLite or PostgreSQL")
    engine = create_engine(
        parsed, pool_pre_ping=True, pool_size=10, max_overflow=10, json_deserializer=json_loads
    )
    _postgres_setup(engine, idle_in_transaction_s)
    return engine


def _postgres_setup(engine: Engine, idle_in_transaction_s: float) -> None:
    """Each connection runs without PostgreSQL's JIT compiler (on by default since 12),
    and ends after ``idle_in_transaction_s`` idle inside a transaction.

    The planner compiles a query whose estimated cost passes ``jit_above_cost``, and it
    cannot estimate set-returning functions: the user-metric rollup (until 2026-11-27
    ``jsonb_each_text`` over the steps' rows) was estimated at 100 rows a rank. Rolling
    up one step stays under the threshold; a pass that rolls up several (a collector
    catching up) compiles, inlines and optimizes its plan first: at 16,384 ranks,
    0.2-0.4 s of compiling in a 0.4-0.55 s query (pg_stat_statements: 809 of 1,618 ms
    over 4 calls). None of the collector's queries runs long enough to earn a compile."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True  # a SET outside any transaction: it stays
        try:
            with dbapi_connection.cursor() as cursor:
                cursor.execute("SET jit = off")
                ms = max(1, round(idle_in_transaction_s * 1000))
                cursor.execute(f"SET idle_in_transaction_session_timeout = {ms}")
        finally:
            dbapi_connection.autocommit = autocommit


def _sqlite_setup(engine: Engine) -> None:
    # pysqlite's own transaction handling is off so that we control BEGIN (the recipe
    # from SQLAlchemy's SQLite documentation).
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # type: ignore[no-untyped-def]
        immediate = conn.get_execution_options().get("tw_immediate")
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def fetch_rows(conn: Connection, query: Any) -> list[tuple[Any, ...]]:
    """All rows of a Core ``query`` as plain tuples, in the caller's transaction.

    On PostgreSQL they come in binary: the health loop, the alert engine and ingest read
    a step's or a run's rank rows this way (16,384 and more a step), and psycopg turns
    binary numbers into Python ones in half the time it parses their text (a step's
    11 columns at 32,768 rows: 2.3 -> 1.2 us a row with the tuple made into a dict).
    Only for plain columns and expressions: SQLAlchemy's result processing is skipped."""
    if is_sqlite(conn):
        return [tuple(row) for row in conn.execute(query)]
    compiled = query.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    cursor: Any = conn.connection.dbapi_connection.cursor(binary=True)  # type: ignore[union-attr]
    try:
        cursor.execute(str(compiled), compiled.params)
        return cursor.fetchall()
    finally:
        cursor.close()


def check_connection(engine: Engine) -> None:
    """Raise :class:`DatabaseError` with one clear line if the database does not answer."""
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise DatabaseError(
            f"cannot connect to database {engine.url.render_as_string(hide_password=True)}: "
            f"{reason}"
        ) from None


@contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """A write transaction: committed on success, rolled back on error."""
    with engine.connect().execution_options(**IMMEDIATE) as conn, conn.begin():
        yield conn


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Create or upgrade the schema with the Alembic migrations shipped in the package."""
    from alembic import command
    from alembic.config import Config

    import trainwarden.migrations as migrations

    config = Config()
    config.set_main_option("script_location", os.path.dirname(migrations.__file__))
    config.set_main_option(
        "sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%")
    )
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def leads(conn: Connection, key: int) -> bool:
    """Whether this transaction runs a single-leader pass (alerts, actions, health,
    incidents): always on SQLite (one process owns the file); on PostgreSQL when it took
    the advisory lock ``key``, which the commit releases. Another collector skips its pass."""
    if is_sqlite(conn):
        return True
    return bool(conn.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": key}).scalar())
