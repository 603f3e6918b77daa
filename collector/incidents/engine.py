"""The incident engine inside ``serve``: groups alerts and actions into incidents on a
timer (``incidents.group``) and posts each closed incident's post-mortem."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy import Engine, select, update

from trainwarden.collector.incidents.grouping import PassResult, group
from trainwarden.collector.incidents.posting import post_report
from trainwarden.collector.incidents.postmortem import report_of
from trainwarden.collector.incidents.store import ADVISORY_LOCK_KEY, IncidentSettings
from trainwarden.collector.loops import Loop
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import leads, write

log = logging.getLogger(__name__)


class IncidentEngine:
    """Groups alerts and actions into incidents every ``settings.interval_s``, and posts
    the report of each incident it sees closed (when ``settings.post_url`` is set)."""

    def __init__(
        self, engine: Engine, settings: IncidentSettings, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.clock = clock
        self.started_at = clock()
        self._loop = Loop("trainwarden-incidents", settings.interval_s, self.run_once)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def run_once(self, now: float | None = None) -> PassResult:
        now = self.clock() if now is None else now
        with write(self.engine) as conn:
            if not leads(conn, ADVISORY_LOCK_KEY):
                return PassResult([], 0, [])
            result = group(conn, now=now, cooldown_s=self.settings.cooldown_s)
        if self.settings.post_url:
            self._post_closed()
        return result

    def _post_closed(self) -> None:
        """Post the report of each incident closed since this engine started (by it or by
        an operator) and not posted yet; the outcome is kept on the incident."""
        inc = m.incidents.c
        with self.engine.connect() as conn:
            due = conn.execute(
                select(inc.id, m.runs.c.name)
                .join(m.runs, m.runs.c.id == inc.run_id)
                .where(
                    inc.state == "closed", inc.posted_at.is_(None), inc.closed_at >= self.started_at
                )
            ).all()
        for incident_id, run in due:
            with self.engine.connect() as conn:
                report = report_of(
                    conn,
                    run=run,
                    incident_id=incident_id,
                    price_per_gpu_hour=self.settings.price_per_gpu_hour,
                )
            outcome = post_report(
                report, self.settings.post_url or "", kind=self.settings.post_kind
            )
            if not outcome.ok:
                log.warning(
                    "posting the report of incident %s failed: %s", incident_id, outcome.describe()
                )
            with write(self.engine) as conn:
                conn.execute(
                    update(m.incidents)
                    .where(inc.id == incident_id)
                    .values(posted_at=self.clock(), post_status=outcome.describe()[:300])
                )
