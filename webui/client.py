"""How the UI reads data: through the collector's query layer, never its own SQL."""

from __future__ import annotations

from typing import Protocol

from sqlalchemy import Engine

from trainwarden.collector import queries
from trainwarden.collector.schemas import (
    EventOut,
    FlaggedStep,
    GpuSample,
    RunDetail,
    RunSummary,
    Series,
)


class Client(Protocol):
    def list_runs(self) -> list[RunSummary]: ...

    def get_run(self, run: str) -> RunDetail: ...

    def series(self, run: str, metric: str, *, last: int | None = None) -> Series: ...

    def flags(self, run: str) -> list[FlaggedStep]: ...

    def events(self, run: str) -> list[EventOut]: ...

    def gpu(self, run: str, *, since: float) -> list[GpuSample]: ...


class LocalClient:
    """Reads in-process from the collector's database (the UI runs inside ``serve``)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def list_runs(self) -> list[RunSummary]:
        with self._engine.connect() as conn:
            return queries.list_runs(conn)

    def get_run(self, run: str) -> RunDetail:
        with self._engine.connect() as conn:
            return queries.get_run(conn, run=run)

    def series(self, run: str, metric: str, *, last: int | None = None) -> Series:
        with self._engine.connect() as conn:
            return queries.series(conn, run=run, metric=metric, last=last)

    def flags(self, run: str) -> list[FlaggedStep]:
        with self._engine.connect() as conn:
            return queries.flagged_steps(conn, run=run)

    def events(self, run: str) -> list[EventOut]:
        with self._engine.connect() as conn:
            return queries.events(conn, run=run, limit=100_000)

    def gpu(self, run: str, *, since: float) -> list[GpuSample]:
        with self._engine.connect() as conn:
            return queries.gpu_samples(conn, run=run, since=since)
