"""Replica fingerprints sent and evaluated as the collector does (shared by the
replica, coverage and sample tests)."""

from __future__ import annotations

from typing import Any

from trainwarden.collector.health.evaluator import evaluate
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.store.db import write

from ..helpers import batch, step


def checked(n: int, fp: str, group: str = "0-3", ts: float | None = None) -> dict[str, Any]:
    s = step(n)
    s.update(fingerprint=fp, replica_group=group)
    if ts is not None:
        s["ts"] = ts
    return s


def send(engine, rank: int, steps: list[dict[str, Any]], at: float, world: int = 4) -> None:
    body = batch(rank=rank, world_size=world, steps=steps)
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=at)


def evaluated(engine, now: float) -> None:
    with write(engine) as conn:
        evaluate(conn, now=now, settings=HealthSettings())
