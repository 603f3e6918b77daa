"""Bulk writes shared by ingest, the rollup worker and the health evaluator: upserts by
key, and on PostgreSQL binary COPY into a temporary staging table merged with one
``INSERT ... ON CONFLICT`` (executemany on SQLite)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from sqlalchemy import (
    JSON,
    BigInteger,
    Connection,
    Float,
    Integer,
    LargeBinary,
    select,
)
from sqlalchemy import column as sql_column
from sqlalchemy import table as sql_table
from sqlalchemy.dialects import postgresql, sqlite

from trainwarden.collector.store.db import is_sqlite


def dialect_insert(conn: Connection, table: Any) -> Any:
    return (sqlite.insert if is_sqlite(conn) else postgresql.insert)(table)


@functools.lru_cache(maxsize=64)
def _upsert_stmt(dialect: str, table: Any, columns: tuple[str, ...], key: tuple[str, ...]) -> Any:
    stmt = (sqlite.insert if dialect == "sqlite" else postgresql.insert)(table)
    return stmt.on_conflict_do_update(
        index_elements=list(key), set_={c: stmt.excluded[c] for c in columns if c not in key}
    )


def upsert(conn: Connection, table: Any, rows: list[dict[str, Any]], *, key: list[str]) -> None:
    """Insert ``rows``; on a key conflict, overwrite every other column."""
    if not rows:
        return
    conn.execute(_upsert_stmt(conn.dialect.name, table, tuple(rows[0]), tuple(key)), rows)


def _pg_type(column: Any, dialect: Any) -> str:
    """The PostgreSQL type binary COPY sends a column's values as."""
    kind = column.type.dialect_impl(dialect)  # a variant's PostgreSQL type (JSONB)
    if isinstance(kind, BigInteger):
        return "int8"
    if isinstance(kind, Integer):
        return "int4"
    if isinstance(kind, Float):
        return "float8"
    if isinstance(kind, JSON):
        return "jsonb" if isinstance(kind, postgresql.JSONB) else "json"
    if isinstance(kind, LargeBinary):
        return "bytea"
    return "text"


def _json_dumps(value: Any) -> bytes | str:
    """JSON for COPY: orjson (3-4x faster than json: a user metrics object a row adds up),
    json for what orjson refuses (an integer past 64 bits)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value)


def _stage(
    conn: Connection, table: Any, columns: tuple[str, ...], rows: Iterable[Sequence[Any]]
) -> str:
    """Binary-COPY ``rows`` (values in ``columns`` order) into this session's temporary
    staging copy of ``table`` (emptied at commit); returns its name."""
    name = f"tw_stage_{table.name}"
    # With its columns' compression (PostgreSQL 14+): a value compressed in the stage is
    # moved to the table as it is, so the stage must compress as the table does (lz4 for
    # sample_digests.kept, migration 0028), or it is pglz's cost that is paid.
    like = (
        f"{table.name} INCLUDING COMPRESSION"
        if (conn.dialect.server_version_info or (0,)) >= (14,)
        else table.name
    )
    conn.exec_driver_sql(
        f"CREATE TEMP TABLE IF NOT EXISTS {name} (LIKE {like}) ON COMMIT DELETE ROWS"
    )
    copy_rows(conn, table, name, columns, rows)
    return name


def copy_rows(
    conn: Connection, table: Any, into: str, columns: tuple[str, ...], rows: Iterable[Sequence[Any]]
) -> None:
    """Binary-COPY ``rows`` (values in ``columns`` order, of ``table``'s types) into ``into``."""
    from psycopg.types.json import set_json_dumps  # PostgreSQL only

    cursor: Any = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    set_json_dumps(_json_dumps, context=cursor)
    try:
        with cursor.copy(f"COPY {into} ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(_pg_types(table, columns, conn.dialect))
            for row in rows:
                copy.write_row(row)
    finally:
        cursor.close()


@functools.lru_cache(maxsize=64)
def _pg_types(table: Any, columns: tuple[str, ...], dialect: Any) -> list[str]:
    return [_pg_type(table.c[c], dialect) for c in columns]


@functools.lru_cache(maxsize=64)
def _upsert_sql(
    table: Any,
    columns: tuple[str, ...],
    key: tuple[str, ...],
    set_: Any,
    where: Any,
    stage: str | None,
    dialect: Any,
) -> Any:
    """The upsert statement, built once: from the staging table (as SQL text: nothing
    left for SQLAlchemy to do a flush) on PostgreSQL, of parameters on SQLite."""
    if stage is None:
        stmt: Any = sqlite.insert(table)
    else:
        staged = sql_table(stage, *(sql_column(c) for c in columns))
        source = select(*(staged.c[c] for c in columns)).order_by(*(staged.c[k] for k in key))
        stmt = postgresql.insert(table).from_select(list(columns), source)
    if set_ is None:
        stmt = stmt.on_conflict_do_nothing(index_elements=list(key))
    else:
        stmt = stmt.on_conflict_do_update(
            index_elements=list(key),
            set_=set_(table, stmt.excluded),
            where=None if where is None else where(table, stmt.excluded),
        )
    if stage is None:
        return stmt
    return str(stmt.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))


def upsert_rows(
    conn: Connection,
    table: Any,
    rows: list[dict[str, Any]],
    *,
    key: tuple[str, ...],
    set_: Any = None,
    where: Any = None,
) -> None:
    """Insert ``rows`` (all with the same keys). On a key conflict: do nothing when
    ``set_`` is None, else apply ``set_(table, excluded)`` where ``where(table,
    excluded)`` holds. Rows are written in key order, so concurrent writers lock
    rows in the same order and cannot deadlock. ``set_`` and ``where``: module-level
    functions (the statement is built once for each)."""
    if rows:
        names = tuple(rows[0])
        cols = {c: [row[c] for row in rows] for c in names}
        upsert_columns(conn, table, cols, key=key, set_=set_, where=where)


def upsert_columns(
    conn: Connection,
    table: Any,
    cols: dict[str, list[Any]],
    *,
    key: tuple[str, ...],
    set_: Any = None,
    where: Any = None,
) -> None:
    """:func:`upsert_rows` of rows given column-wise (lists of one length)."""
    names = tuple(cols)
    if not names or not cols[names[0]]:
        return
    rows = zip(*cols.values(), strict=True)
    if is_sqlite(conn):
        stmt = _upsert_sql(table, names, key, set_, where, None, conn.dialect)
        at = [names.index(k) for k in key]
        ordered = sorted(rows, key=lambda row: tuple(row[i] for i in at))
        conn.execute(stmt, [dict(zip(names, row, strict=True)) for row in ordered])
        return
    stage = _stage(conn, table, names, rows)
    conn.exec_driver_sql(_upsert_sql(table, names, key, set_, where, stage, conn.dialect))
    # Emptied at commit, and now: a second upsert in this transaction must not see these.
    conn.exec_driver_sql(f"DELETE FROM {stage}")
