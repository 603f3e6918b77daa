"""How the UI reads data: through the collector's query layer, never its own SQL.

Alerts, silences, actions, incidents and notes are read and changed through the same
service functions the API's routes call (``collector/alerting/service.py`` and its
siblings), in-process: an acknowledgement from the page is the same code path (checks,
refusals, audit trail) as ``POST /api/v1/alerts/{id}/ack``, with the same check that
the session may change things and the same record of who did.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from fastapi import HTTPException
from pydantic import ValidationError
from sqlalchemy import Engine

from trainwarden.collector.actions import service as actions
from trainwarden.collector.actions.commands import CommandBoard
from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.actions.schemas import ActionOut, ByIn, CheckpointOut
from trainwarden.collector.alerting import service as alerting
from trainwarden.collector.alerting.schemas import AckIn, AlertOut, SilenceIn, SilenceOut
from trainwarden.collector.api import auth
from trainwarden.collector.health import hang
from trainwarden.collector.incidents import notes
from trainwarden.collector.incidents import store as incidents
from trainwarden.collector.incidents.schemas import CloseIn, IncidentOut, NoteIn, NoteOut, RetitleIn
from trainwarden.collector.incidents.timeline import timeline
from trainwarden.collector.read import data as data_view
from trainwarden.collector.read import economics, identity, queries, replicas, series
from trainwarden.collector.read import nodes as node_records
from trainwarden.collector.read import preflight as preflight_results
from trainwarden.collector.read import user_metrics as user_metric_reads
from trainwarden.collector.read.schemas import (
    EventOut,
    FlaggedStep,
    GpuSample,
    Heatmap,
    RankSeries,
    ReplacedSeries,
    RunDetail,
    RunSummary,
    Series,
)
from trainwarden.collector.settings import Settings
from trainwarden.collector.store.db import write
from trainwarden.collector.store.errors import DomainError


class Refused(Exception):
    """The collector refused a change (bad input, wrong state, unknown id); the message
    says why, in the API's words."""


class Client(Protocol):
    def list_runs(self) -> list[RunSummary]: ...

    def get_run(self, run: str) -> RunDetail: ...

    def series(
        self,
        run: str,
        metric: str,
        *,
        last: int | None = None,
        points: int | None = None,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> Series: ...

    def heatmap(
        self,
        run: str,
        metric: str,
        *,
        buckets: int = 200,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> Heatmap: ...

    def extra_metrics(self, run: str) -> list[str]: ...

    def nodes(self, days: float = 7.0) -> list[dict[str, Any]]: ...

    def preflight(self, run: str) -> dict[str, Any]: ...

    def node(self, name: str, days: float = 90.0) -> dict[str, Any]: ...

    def rank_series(
        self,
        run: str,
        rank: int,
        metric: str,
        *,
        from_step: int | None = None,
        to_step: int | None = None,
        last: int | None = None,
    ) -> RankSeries: ...

    def flags(self, run: str) -> list[FlaggedStep]: ...

    def replaced(
        self,
        run: str,
        metric: str,
        *,
        points: int | None = None,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> ReplacedSeries: ...

    def events(self, run: str, *, kind: str | None = None) -> list[EventOut]: ...

    def gpu(
        self, run: str, *, since: float | None = None, rank: int | None = None, limit: int = 10_000
    ) -> list[GpuSample]: ...

    def checkpoints(self, run: str) -> list[CheckpointOut]: ...

    def alerts(
        self, *, run: str | None = None, states: list[str] | None = None, limit: int = 200
    ) -> list[AlertOut]: ...

    def alert(self, alert_id: int) -> AlertOut: ...

    def silences(self) -> list[SilenceOut]: ...

    def actions(self, *, run: str | None = None, limit: int = 100) -> list[ActionOut]: ...

    def ack(self, alert_id: int, *, by: str, comment: str = "") -> AlertOut: ...

    def silence(
        self, *, matchers: list[dict[str, Any]], duration_s: float, by: str, comment: str
    ) -> SilenceOut: ...

    def end_silence(self, silence_id: int) -> SilenceOut: ...

    def decide(self, action_id: int, *, approve: bool, by: str, reason: str = "") -> ActionOut: ...

    def incidents(self, run: str, *, merged: bool = False) -> list[IncidentOut]: ...

    def timeline(self, run: str, *, incident: int | None = None) -> dict[str, Any]: ...

    def notes(self, run: str) -> list[NoteOut]: ...

    def add_note(
        self, run: str, *, author: str, text: str, incident: int | None = None
    ) -> NoteOut: ...

    def close_incident(
        self, incident_id: int, *, by: str, summary: str | None = None
    ) -> IncidentOut: ...

    def retitle_incident(self, incident_id: int, *, by: str, title: str) -> IncidentOut: ...

    def attempts(self, run: str) -> list[dict[str, Any]]: ...

    def identity(self, run: str) -> dict[str, Any]: ...

    def economics(self, run: str) -> dict[str, Any]: ...

    def diff(self, run: str, other: str) -> dict[str, Any]: ...

    def collectives(self, run: str) -> dict[str, Any]: ...

    def request_collectives(self, run: str, *, by: str) -> dict[str, Any]: ...

    def replicas(self, run: str) -> list[dict[str, Any]]: ...

    def data(self, run: str) -> dict[str, Any]: ...


def may_change() -> bool:
    """Whether this request's session may change things: the rule every change here
    applies (``auth.check_admin``; with auth off, anyone may). Pages show a button that
    changes something only where it would not be refused."""
    try:
        auth.check_admin()
    except HTTPException:
        return False
    return True


@contextmanager
def _refusals() -> Iterator[None]:
    """The collector's refusals (HTTP 403/404/409/422 in the API) as :class:`Refused`."""
    try:
        yield
    except HTTPException as exc:  # auth.check_admin: a session that may only read
        raise Refused(str(exc.detail)) from None
    except DomainError as exc:
        raise Refused(str(exc)) from None
    except ValidationError as exc:
        raise Refused(
            "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}"
                for e in exc.errors()[:3]
            )
        ) from None


class LocalClient:
    """Reads in-process from the collector's database (the UI runs inside ``serve``)."""

    def __init__(
        self,
        engine: Engine,
        *,
        policy: ActionPolicy | None = None,
        settings: Settings | None = None,
        commands: CommandBoard | None = None,
    ) -> None:
        self._engine = engine
        self._policy = policy or ActionPolicy()
        self._settings = settings or Settings()
        self._commands = commands  # told of a request at once (else at its next refresh)

    def list_runs(self) -> list[RunSummary]:
        with self._engine.connect() as conn:
            return queries.list_runs(conn)

    def get_run(self, run: str) -> RunDetail:
        with self._engine.connect() as conn:
            return queries.get_run(conn, run=run)

    def series(
        self,
        run: str,
        metric: str,
        *,
        last: int | None = None,
        points: int | None = None,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> Series:
        """Per step across ranks; ``points`` downsamples on the server, keeping spikes."""
        with self._engine.connect() as conn:
            return series.series(
                conn,
                run=run,
                metric=metric,
                last=last,
                points=points,
                from_step=from_step,
                to_step=to_step,
            )

    def heatmap(
        self,
        run: str,
        metric: str,
        *,
        buckets: int = 200,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> Heatmap:
        with self._engine.connect() as conn:
            return series.heatmap(
                conn, run=run, metric=metric, buckets=buckets, from_step=from_step, to_step=to_step
            )

    def preflight(self, run: str) -> dict[str, Any]:
        """The newest attempt's preflight, judged (``GET /runs/{run}/preflight``)."""
        with self._engine.connect() as conn:
            return preflight_results.results(conn, run=run)

    def nodes(self, days: float = 7.0) -> list[dict[str, Any]]:
        """Each node with findings in the last ``days`` that still count (``GET /nodes``)."""
        with self._engine.connect() as conn:
            return node_records.nodes(conn, now=time.time(), days=days)

    def node(self, name: str, days: float = 90.0) -> dict[str, Any]:
        """One node's record across runs (``GET /nodes/{node}``)."""
        with self._engine.connect() as conn:
            return node_records.record(conn, name, now=time.time(), days=days)

    def extra_metrics(self, run: str) -> list[str]:
        """The metrics a picker offers, once rolled up: the catalog's extras the run has
        (``lr``), then its user metrics (``user.<name>``)."""
        with self._engine.connect() as conn:
            return user_metric_reads.offered(conn, run_id=queries.run_id_of(conn, run))

    def rank_series(
        self,
        run: str,
        rank: int,
        metric: str,
        *,
        from_step: int | None = None,
        to_step: int | None = None,
        last: int | None = None,
    ) -> RankSeries:
        with self._engine.connect() as conn:
            return series.rank_series(
                conn,
                run=run,
                metric=metric,
                rank=rank,
                from_step=from_step,
                to_step=to_step,
                last=last,
            )

    def flags(self, run: str) -> list[FlaggedStep]:
        with self._engine.connect() as conn:
            return queries.flagged_steps(conn, run=run)

    def replaced(
        self,
        run: str,
        metric: str,
        *,
        points: int | None = None,
        from_step: int | None = None,
        to_step: int | None = None,
    ) -> ReplacedSeries:
        """Executions of steps that a rollback or restart ran again (the spike it left)."""
        with self._engine.connect() as conn:
            return series.replaced_series(
                conn, run=run, metric=metric, points=points, from_step=from_step, to_step=to_step
            )

    def events(self, run: str, *, kind: str | None = None) -> list[EventOut]:
        with self._engine.connect() as conn:
            return queries.events(conn, run=run, kind=kind, limit=100_000)

    def gpu(
        self, run: str, *, since: float | None = None, rank: int | None = None, limit: int = 10_000
    ) -> list[GpuSample]:
        with self._engine.connect() as conn:
            return queries.gpu_samples(conn, run=run, since=since, rank=rank, limit=limit)

    def checkpoints(self, run: str) -> list[CheckpointOut]:
        with self._engine.connect() as conn:
            return actions.list_checkpoints(conn, run=run, policy=self._policy)

    # -- alerts, silences, actions -----------------------------------------------------
    # A change checks, as the API does, that the session may change things (with auth
    # on), and records who made it as the API does (auth.acting).

    def alerts(
        self, *, run: str | None = None, states: list[str] | None = None, limit: int = 200
    ) -> list[AlertOut]:
        with self._engine.connect() as conn:
            return alerting.list_alerts(conn, run=run, states=states or None, limit=limit)

    def alert(self, alert_id: int) -> AlertOut:
        with _refusals(), self._engine.connect() as conn:
            return alerting.get_alert(conn, alert_id=alert_id)

    def silences(self) -> list[SilenceOut]:
        with self._engine.connect() as conn:
            return alerting.list_silences(conn, now=time.time())

    def actions(self, *, run: str | None = None, limit: int = 100) -> list[ActionOut]:
        with self._engine.connect() as conn:
            return actions.list_actions(conn, run=run, limit=limit)

    def ack(self, alert_id: int, *, by: str, comment: str = "") -> AlertOut:
        with _refusals():
            body = AckIn(by=by, comment=comment)
            auth.check_admin()
            with write(self._engine) as conn:
                return alerting.ack_alert(
                    conn,
                    alert_id=alert_id,
                    by=auth.acting(body.by),
                    comment=body.comment,
                    now=time.time(),
                )

    def silence(
        self, *, matchers: list[dict[str, Any]], duration_s: float, by: str, comment: str
    ) -> SilenceOut:
        with _refusals():
            body = SilenceIn.model_validate(
                dict(matchers=matchers, duration_s=duration_s, created_by=by, comment=comment)
            )
            auth.check_admin()
            with write(self._engine) as conn:
                return alerting.create_silence(
                    conn, body=body, by=auth.acting(body.created_by), now=time.time()
                )

    def end_silence(self, silence_id: int) -> SilenceOut:
        with _refusals():
            auth.check_admin()
            with write(self._engine) as conn:
                return alerting.expire_silence(conn, silence_id=silence_id, now=time.time())

    def decide(self, action_id: int, *, approve: bool, by: str, reason: str = "") -> ActionOut:
        with _refusals():
            body = ByIn(by=by, reason=reason)
            auth.check_admin()
            with write(self._engine) as conn:
                return actions.decide(
                    conn,
                    action_id=action_id,
                    state="approved" if approve else "cancelled",
                    by=auth.acting(body.by),
                    reason=body.reason,
                    now=time.time(),
                )

    # -- incidents, the logbook, timelines ------------------------------------------

    def incidents(self, run: str, *, merged: bool = False) -> list[IncidentOut]:
        """Raises ``NotFound`` for an unknown run."""
        with self._engine.connect() as conn:
            found = incidents.list_incidents(conn, run=run, merged=merged)
        return [IncidentOut(**i) for i in found]

    def timeline(self, run: str, *, incident: int | None = None) -> dict[str, Any]:
        """Raises ``NotFound`` for an unknown run, or an incident not of this run."""
        with self._engine.connect() as conn:
            return timeline(
                conn,
                run=run,
                incident_id=incident,
                now=time.time(),
                price_per_gpu_hour=self._settings.price_per_gpu_hour,
                base_url=self._settings.external_url or "",
            )

    def notes(self, run: str) -> list[NoteOut]:
        with self._engine.connect() as conn:
            return [NoteOut(**n) for n in notes.list_notes(conn, run=run)]

    def add_note(self, run: str, *, author: str, text: str, incident: int | None = None) -> NoteOut:
        with _refusals():
            body = NoteIn(author=author, text=text, incident=incident)
            auth.check_admin()
            with write(self._engine) as conn:
                note = notes.add_note(
                    conn,
                    run=run,
                    author=auth.acting(body.author),
                    text=body.text,
                    at=body.at,
                    step=body.step,
                    incident_id=body.incident,
                    now=time.time(),
                )
            return NoteOut(**note)

    def close_incident(
        self, incident_id: int, *, by: str, summary: str | None = None
    ) -> IncidentOut:
        with _refusals():
            body = CloseIn(by=by, summary=summary)
            auth.check_admin()
            with write(self._engine) as conn:
                incidents.close_incident(
                    conn,
                    incident_id=incident_id,
                    by=auth.acting(body.by),
                    summary=body.summary,
                    now=time.time(),
                )
                return IncidentOut(**incidents.get_incident(conn, incident_id=incident_id))

    def retitle_incident(self, incident_id: int, *, by: str, title: str) -> IncidentOut:
        with _refusals():
            body = RetitleIn(by=by, title=title)
            auth.check_admin()
            with write(self._engine) as conn:
                incidents.retitle_incident(
                    conn,
                    incident_id=incident_id,
                    title=body.title,
                    by=auth.acting(body.by),
                    now=time.time(),
                )
                return IncidentOut(**incidents.get_incident(conn, incident_id=incident_id))

    # -- run identity and economics --------------------------------------------------

    def attempts(self, run: str) -> list[dict[str, Any]]:
        """Raises ``NotFound`` for an unknown run; ``[]`` for a run whose agents sent no
        ``attempt_start`` (trainwarden < 0.11)."""
        with self._engine.connect() as conn:
            return identity.run_attempts(conn, run=run)

    def identity(self, run: str) -> dict[str, Any]:
        """Raises ``NotFound`` for an unknown run, or one without attempts."""
        with self._engine.connect() as conn:
            return identity.run_identity(conn, run=run)

    def economics(self, run: str) -> dict[str, Any]:
        """Checkpoints, goodput and the cadence advisor at serve's price and MTBF settings."""
        with self._engine.connect() as conn:
            return economics.run_economics(
                conn, run=run, settings=economics.settings_of(self._settings)
            )

    def diff(self, run: str, other: str) -> dict[str, Any]:
        """Raises ``NotFound`` when either run is unknown."""
        with self._engine.connect() as conn:
            return identity.run_diff(conn, a=run, b=other)

    # -- collectives (which rank, which collective) --------------------------------

    def collectives(self, run: str) -> dict[str, Any]:
        """The ranks' Flight Recorder rings lined up by sequence id, and the verdict.
        Raises ``NotFound`` for an unknown run."""
        with self._engine.connect() as conn:
            return hang.view(conn, run=run, now=time.time())

    def request_collectives(self, run: str, *, by: str) -> dict[str, Any]:
        """Ask every rank of the run for its collectives now (their agents answer with
        their next ingest answer); recorded as ``by``, with whom the session acts as."""
        with _refusals():
            auth.check_admin()
            with write(self._engine) as conn:
                return hang.request(
                    conn,
                    run=run,
                    by=auth.acting(by),
                    now=time.time(),
                    reason="asked from the web UI",
                    board=self._commands,
                )

    # -- replicas (silent data corruption) -------------------------------------------

    def replicas(self, run: str) -> list[dict[str, Any]]:
        """The run's replica comparisons (silent data corruption checks), oldest first.
        Raises ``NotFound`` for an unknown run."""
        with self._engine.connect() as conn:
            return replicas.results(conn, run=run)

    # -- data integrity (epoch coverage, mixture, data events) -------------------------

    def data(self, run: str) -> dict[str, Any]:
        """The run's judged epochs, its realized against its declared data mixture and its
        newest data events (``GET /api/v1/runs/{run}/data``). Raises ``NotFound`` for an
        unknown run."""
        with self._engine.connect() as conn:
            return data_view.view(conn, run=run).model_dump()
