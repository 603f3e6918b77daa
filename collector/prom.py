"""Prometheus metrics of the collector itself and of the runs it holds (``GET /metrics``).

Each app has its own registry (as prometheus/client_python recommends for tests), so
two apps in one process never share counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine, func, select

from . import models as m


class CollectorMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.ingest_requests = Counter(
            "trainwarden_ingest_requests",
            "Ingest requests by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.ingest_records = Counter(
            "trainwarden_ingest_records",
            "Records stored by ingest, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.ingest_seconds = Histogram(
            "trainwarden_ingest_seconds",
            "Time to validate and store one ingest batch.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.registry.register(_RunsCollector(engine))


class _RunsCollector(Collector):
    """Gauges read from the database at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily("trainwarden_runs", "Runs by status.", labels=["status"]),
            GaugeMetricFamily(
                "trainwarden_run_last_step", "Last step reported per running run.", labels=["run"]
            ),
        )

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        runs, last_step = self._families()
        try:
            with self._engine.connect() as conn:
                for status, count in conn.execute(
                    select(m.runs.c.status, func.count()).group_by(m.runs.c.status)
                ):
                    runs.add_metric([status], count)
                for name, step in conn.execute(
                    select(m.runs.c.name, m.runs.c.last_step).where(m.runs.c.status == "running")
                ):
                    if step is not None:
                        last_step.add_metric([name], step)
        except Exception:  # a scrape during a database outage still returns the counters
            return
        yield runs
        yield last_step
