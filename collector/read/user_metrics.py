"""Which user metrics (``user.<name>``) and extras (``lr``) a run has rolled up: reads of
``step_stats``."""

from __future__ import annotations

from sqlalchemy import Connection, select, text

from trainwarden.agent import metric_catalog as catalog
from trainwarden.collector.ingest.user_metrics import is_user
from trainwarden.collector.store import models as m

# Every metric name a run has in step_stats, one index probe per name (a loose index
# scan: a DISTINCT would read a row per step and metric).
_NAMES = text(
    "WITH RECURSIVE found(metric) AS ("
    " SELECT min(metric) FROM step_stats WHERE run_id = :run"
    " UNION ALL"
    " SELECT (SELECT min(metric) FROM step_stats WHERE run_id = :run AND metric > found.metric)"
    " FROM found WHERE found.metric IS NOT NULL"
    ") SELECT metric FROM found WHERE metric IS NOT NULL"
)


def names(conn: Connection, *, run_id: int) -> list[str]:
    """The run's user metrics as series names (``user.<name>``), sorted; a metric is
    listed once a step of it is rolled up."""
    found = conn.execute(_NAMES, {"run": run_id}).scalars()
    return sorted(name for name in found if is_user(name))


def offered(conn: Connection, *, run_id: int) -> list[str]:
    """The series a metric picker offers: the catalog's extras the run has rolled up
    (``lr``), in the catalog's order, then its user metrics, sorted."""
    found = set(conn.execute(_NAMES, {"run": run_id}).scalars())
    return [n for n in catalog.EXTRAS if n in found] + sorted(n for n in found if is_user(n))


def has(conn: Connection, *, run_id: int, metric: str) -> bool:
    """Whether ``metric`` (``user.<name>``) has a rolled-up step in this run."""
    if not is_user(metric):
        return False
    s = m.step_stats.c
    query = select(s.step).where(s.run_id == run_id, s.metric == metric).limit(1)
    return conn.execute(query).first() is not None
