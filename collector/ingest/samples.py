"""Writing sample digests: on a step where the trainer called ``s.samples(ids)``, each
rank's digest of its sample ids and their count (``sample_digests``). A later execution
of the step (a replay after a rollback, a restart) replaces digest and count; the first
execution's digest stays in ``first_digest``. With a dataset size the row also holds the
step's epoch and its ids (``kept``, little-endian int64) for the coverage check.

``s.data_source(name, tokens)``: the tokens a rank's step drew from each source
(``source_tokens``), replaced by a later execution of the step."""

from __future__ import annotations

import sys
from array import array
from typing import Any

from sqlalchemy import Connection

from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import upsert_rows

_KEY = ("run_id", "step", "rank")


def _later(table: Any, new: Any) -> Any:
    return table.c.ts < new.ts


def _overwrite(table: Any, new: Any) -> dict[str, Any]:
    return {name: new[name] for name in ("ts", "recv_ts", "digest", "count", "epoch", "kept")}


def _overwrite_tokens(table: Any, new: Any) -> dict[str, Any]:
    return {"ts": new.ts, "tokens": new.tokens}


def pack(ids: list[int]) -> bytes:
    """Ids as little-endian int64 (:func:`unpack` reads them back)."""
    packed = array("q", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes) -> array:
    ids = array("q")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def digests_of(run_id: int, steps: dict[str, list[Any]], now: float) -> list[dict[str, Any]]:
    """The rows of a request's step columns that carry a sample digest."""
    digests = steps.get("samples_digest")
    if not digests or not any(digests):
        return []
    none = [None] * len(digests)
    counts = steps.get("samples_count") or none
    epochs = steps.get("samples_epoch") or none
    kept: list[Any] = steps.get("samples_kept") or none
    return [
        {
            "run_id": run_id,
            "step": steps["step"][i],
            "rank": steps["rank"][i],
            "ts": steps["ts"][i],
            "recv_ts": now,
            "digest": digest,
            "count": counts[i] or 0,
            "first_digest": digest,
            "epoch": epochs[i],
            "kept": None if kept[i] is None else pack(kept[i]),
        }
        for i, digest in enumerate(digests)
        if digest is not None
    ]


def write_digests(conn: Connection, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    latest: dict[tuple[int, int, int], dict[str, Any]] = {}
    for row in rows:  # the same step twice in one flush: its later execution
        key = (row["run_id"], row["step"], row["rank"])
        if key not in latest:
            latest[key] = row
        elif row["ts"] >= latest[key]["ts"]:
            latest[key] = {**row, "first_digest": latest[key]["first_digest"]}
        else:
            latest[key] = {**latest[key], "first_digest": row["digest"]}
    upsert_rows(
        conn, m.sample_digests, list(latest.values()), key=_KEY, set_=_overwrite, where=_later
    )


def sources_of(run_id: int, steps: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The ``source_tokens`` rows of a request's step columns."""
    sources = steps.get("data_sources")
    if not sources or not any(sources):
        return []
    return [
        {
            "run_id": run_id,
            "step": steps["step"][i],
            "rank": steps["rank"][i],
            "source": name,
            "ts": steps["ts"][i],
            "tokens": tokens,
        }
        for i, given in enumerate(sources)
        if given
        for name, tokens in given.items()
    ]


def write_sources(conn: Connection, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    latest: dict[tuple[int, int, int, str], dict[str, Any]] = {}
    for row in rows:  # the same step twice in one flush: its later execution
        key = (row["run_id"], row["step"], row["rank"], row["source"])
        if key not in latest or row["ts"] >= latest[key]["ts"]:
            latest[key] = row
    upsert_rows(
        conn,
        m.source_tokens,
        list(latest.values()),
        key=("run_id", "step", "rank", "source"),
        set_=_overwrite_tokens,
        where=_later,
    )
