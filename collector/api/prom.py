"""Prometheus metrics of the collector itself and of the runs it holds (``GET /metrics``).

Each app has its own registry (as prometheus/client_python recommends for tests), so
two apps in one process never share counters.

``serve --workers N`` (:func:`share_between_processes`, in each worker before its app is
built): every worker's counters, histograms and gauges go to files in one folder, and a
scrape, whichever worker answers it, adds up all of them (prometheus_client's multiprocess
mode): the request counters are the collector's, not the answering worker's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values as prom_values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import Engine, func, select

from trainwarden.collector.api.thread_cpu import ThreadCpuCollector
from trainwarden.collector.read.queries import LOST_AFTER_S
from trainwarden.collector.store import models as m

_shared_dir: str | None = None


def share_between_processes(path: str) -> None:
    """This process is one of ``serve --workers``: the metrics built from now on keep their
    values in ``path``, shared by every worker (call before the app is built)."""
    global _shared_dir
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    prom_values.ValueClass = prom_values.MultiProcessValue()
    _shared_dir = path


class CollectorMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.shared_dir = _shared_dir  # serve --workers: the folder every worker writes
        # Told of each ingest request refused 503, with its sender header (or None).
        self.on_busy: Callable[[str | None], None] | None = None
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
        # The children every ingest request counts into, looked up once (a request a
        # node a second: ``labels`` costs more than ``inc``).
        self.ingest_ok = self.ingest_requests.labels("ok")
        self.ingest_steps = self.ingest_records.labels("step")
        self.ingest_events = self.ingest_records.labels("event")
        self.ingest_seconds = Histogram(
            "trainwarden_ingest_seconds",
            "Time from an ingest batch being queued to its commit.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.ingest_queue_rows = Gauge(
            "trainwarden_ingest_queue_rows",
            "Records waiting for the group-commit writer.",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.ingest_in_flight = Gauge(
            "trainwarden_ingest_in_flight",
            "Ingest requests in progress (past this many, TRAINWARDEN_MAX_INFLIGHT_INGEST, "
            "new ones are answered 503).",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.ingest_lag_seconds = Gauge(
            "trainwarden_ingest_lag_seconds",
            "Age of the oldest ingest request not yet committed, plus the event loop's "
            "lateness (added to the rank-health thresholds).",
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.ingest_flush_requests = Histogram(
            "trainwarden_ingest_flush_requests",
            "Requests stored per group-commit transaction.",
            buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000),
            registry=self.registry,
        )
        self.ingest_flush_seconds = Histogram(
            "trainwarden_ingest_flush_seconds",
            "Duration of one group-commit transaction.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.alert_pass_seconds = Histogram(
            "trainwarden_alert_evaluation_seconds",
            "Duration of one pass of the alert engine (every rule over every live run).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.alert_interval_seconds = Gauge(
            "trainwarden_alert_interval_seconds",
            "Seconds between full passes of the alert engine: the configured interval, or more "
            "when a pass costs over its share of a core (very large runs).",
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.health_pass_seconds = Histogram(
            "trainwarden_health_evaluation_seconds",
            "Duration of one pass of the rank-health evaluator (every live run's ranks); its "
            "count is the passes done.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.alert_notifications = Counter(
            "trainwarden_alert_notifications",
            "Notifications handed to the notifiers, by status (firing, resolved).",
            ["status"],
            registry=self.registry,
        )
        self.runs = _RunsCollector(engine)
        self.registry.register(self.runs)
        if self.shared_dir is None:  # one process: its threads are the collector's
            self.registry.register(ThreadCpuCollector())

    def exposition(self) -> bytes:
        """What ``GET /metrics`` answers: this app's registry, or with ``serve --workers``
        every worker's values added up (gauges: the live workers' sum, or their largest
        for the lag and the alert interval) and the runs' gauges read from the database."""
        if self.shared_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.shared_dir)
        registry.register(self.runs)
        return generate_latest(registry)

    def busy(self, sender: str | None = None) -> None:
        """An ingest request was refused (503): counted, and told to ``on_busy``."""
        self.ingest_requests.labels("busy").inc()
        if self.on_busy is not None:
            self.on_busy(sender)

    def on_flush(self, requests: int, _rows: int, seconds: float) -> None:
        self.ingest_flush_requests.observe(requests)
        self.ingest_flush_seconds.observe(seconds)


class _RunsCollector(Collector):
    """Gauges read from the database at scrape time: one query per running run."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        g = GaugeMetricFamily
        return {
            "runs": g("trainwarden_runs", "Runs by status.", labels=["status"]),
            "last_step": g(
                "trainwarden_run_last_step", "Last step reported, per running run.", labels=["run"]
            ),
            "mfu": g(
                "trainwarden_run_mfu", "Run MFU at the latest rolled-up step.", labels=["run"]
            ),
            "step_time": g(
                "trainwarden_run_step_time_seconds",
                "Step time across ranks at the latest step.",
                labels=["run", "stat"],
            ),
            "tokens": g(
                "trainwarden_run_tokens_per_second",
                "Run throughput at the latest step.",
                labels=["run"],
            ),
            "exposed": g(
                "trainwarden_run_exposed_comm_ratio",
                "Exposed communication / step time, mean over ranks, at the latest step.",
                labels=["run"],
            ),
            "ranks": g("trainwarden_run_ranks", "Ranks by state.", labels=["run", "state"]),
            "queue": g("trainwarden_rollup_queue_depth", "Steps waiting for their first rollup."),
            "alerts": g(
                "trainwarden_alerts",
                "Open alerts by run, state (pending, firing) and severity.",
                labels=["run", "state", "severity"],
            ),
        }

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families().values())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        f = self._families()
        s, q = m.step_stats.c, m.rollup_queue.c
        try:
            with self._engine.connect() as conn:
                by_status: dict[str, int] = dict(
                    conn.execute(
                        select(m.runs.c.status, func.count()).group_by(m.runs.c.status)
                    ).all()
                )
                if by_status.get("running"):  # running, but not heard from: lost (as shown)
                    lost = conn.execute(
                        select(func.count()).where(
                            m.runs.c.status == "running",
                            m.runs.c.updated_at < time.time() - LOST_AFTER_S,
                        )
                    ).scalar_one()
                    if lost:
                        by_status["running"] -= lost
                        by_status["lost"] = lost
                for status, count in by_status.items():
                    f["runs"].add_metric([status], count)
                running = conn.execute(
                    select(m.runs.c.id, m.runs.c.name).where(m.runs.c.status == "running")
                ).all()
                for run_id, name in running:
                    self._run(conn, run_id, name, f, s)
                waiting = conn.execute(
                    select(func.count()).where(q.rolled_n.is_(None))
                ).scalar_one()
                f["queue"].add_metric([], waiting)
                a = m.alerts.c
                for run, state, severity, count in conn.execute(
                    select(m.runs.c.name, a.state, a.severity, func.count())
                    .join(m.runs, m.runs.c.id == a.run_id)
                    .where(a.state.in_(("pending", "firing")))
                    .group_by(m.runs.c.name, a.state, a.severity)
                ):
                    f["alerts"].add_metric([run, state, severity], count)
        except Exception:  # a scrape during a database outage still returns the counters
            return
        yield from f.values()

    @staticmethod
    def _run(conn: Any, run_id: int, name: str, f: dict[str, GaugeMetricFamily], s: Any) -> None:
        last = conn.execute(
            select(func.max(s.step)).where(s.run_id == run_id, s.metric == "step_time")
        ).scalar_one_or_none()
        for state, count in conn.execute(
            select(m.ranks.c.state, func.count())
            .where(m.ranks.c.run_id == run_id)
            .group_by(m.ranks.c.state)
        ):
            f["ranks"].add_metric([name, state], count)
        if last is None:
            return
        f["last_step"].add_metric([name], last)
        rows = conn.execute(
            select(s.metric, s.median, s.p99, s.max, s.mean, s.total).where(
                s.run_id == run_id, s.step == last
            )
        ).all()
        stats = {row.metric: row for row in rows}
        if (row := stats.get("mfu")) is not None and row.total is not None:
            f["mfu"].add_metric([name], row.total)
        if (row := stats.get("step_time")) is not None:
            f["step_time"].add_metric([name, "p50"], row.median)
            if row.p99 is not None:  # none in rows rolled up before migration 0014
                f["step_time"].add_metric([name, "p99"], row.p99)
            f["step_time"].add_metric([name, "max"], row.max)
        if (row := stats.get("tokens_per_s")) is not None and row.total is not None:
            f["tokens"].add_metric([name], row.total)
        if (row := stats.get("exposed_comm_frac")) is not None and row.mean is not None:
            f["exposed"].add_metric([name], row.mean)
