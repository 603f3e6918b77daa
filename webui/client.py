"""How the UI reads data: through the collector's query layer, never its own SQL.

Alerts, silences and actions are read and changed through the collector's API route
functions, called in-process: an acknowledgement from the page is the same code path
(checks, refusals, audit trail) as ``POST /api/v1/alerts/{id}/ack``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Protocol

from fastapi import HTTPException
from pydantic import ValidationError
from sqlalchemy import Engine

from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.api.routes import actions as actions_api
from trainwarden.collector.api.routes import alerts as alerts_api
from trainwarden.collector.api.routes import economics as economics_api
from trainwarden.collector.api.routes import incidents as incidents_api
from trainwarden.collector.api.routes.actions import ActionOut, CheckpointOut
from trainwarden.collector.api.routes.alerts import AlertOut, SilenceOut
from trainwarden.collector.api.routes.incidents import IncidentOut, NoteOut
from trainwarden.collector.read import queries, series
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

    def user_metrics(self, run: str) -> list[str]: ...

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


@contextmanager
def _refusals() -> Iterator[None]:
    """The API's refusals (HTTP 404/409/422 there) as :class:`Refused` here."""
    try:
        yield
    except HTTPException as exc:
        raise Refused(str(exc.detail)) from None
    except queries.NotFound as exc:
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
    ) -> None:
        self._engine = engine
        # All that the API's routes read from their request: the app's engine, action
        # policy and settings (the timeline's external URL and price per GPU-hour).
        state = SimpleNamespace(
            engine=engine, action_policy=policy or ActionPolicy(), settings=settings or Settings()
        )
        self._request: Any = SimpleNamespace(app=SimpleNamespace(state=state))

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

    def user_metrics(self, run: str) -> list[str]:
        """The run's user metrics (``user.<name>``), once rolled up."""
        with self._engine.connect() as conn:
            return list(queries.run_metrics(conn, run=run, builtin=[])["user"])

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
        return actions_api.list_checkpoints(run, self._request)

    # -- alerts, silences, actions: the API's own functions ------------------------
    # No auth yet (issue 10): whoever reaches the UI may acknowledge, silence, approve
    # and cancel, as whoever reaches the API may.

    def alerts(
        self, *, run: str | None = None, states: list[str] | None = None, limit: int = 200
    ) -> list[AlertOut]:
        return alerts_api.list_alerts(self._request, run=run, state=states or None, limit=limit)  # type: ignore[arg-type]

    def alert(self, alert_id: int) -> AlertOut:
        with _refusals():
            return alerts_api.get_alert(alert_id, self._request)

    def silences(self) -> list[SilenceOut]:
        return alerts_api.list_silences(self._request)

    def actions(self, *, run: str | None = None, limit: int = 100) -> list[ActionOut]:
        return actions_api.list_actions(self._request, run=run, limit=limit)

    def ack(self, alert_id: int, *, by: str, comment: str = "") -> AlertOut:
        with _refusals():
            body = alerts_api.AckIn(by=by, comment=comment)
            return alerts_api.ack_alert(alert_id, body, self._request)

    def silence(
        self, *, matchers: list[dict[str, Any]], duration_s: float, by: str, comment: str
    ) -> SilenceOut:
        with _refusals():
            body = alerts_api.SilenceIn.model_validate(
                dict(matchers=matchers, duration_s=duration_s, created_by=by, comment=comment)
            )
            return alerts_api.create_silence(body, self._request)

    def end_silence(self, silence_id: int) -> SilenceOut:
        with _refusals():
            return alerts_api.expire_silence(silence_id, self._request)

    def decide(self, action_id: int, *, approve: bool, by: str, reason: str = "") -> ActionOut:
        with _refusals():
            body = actions_api.ByIn(by=by, reason=reason)
            route = actions_api.approve_action if approve else actions_api.cancel_action
            return route(action_id, body, self._request)

    # -- incidents, the logbook, timelines ------------------------------------------

    def incidents(self, run: str, *, merged: bool = False) -> list[IncidentOut]:
        """Raises ``NotFound`` for an unknown run."""
        return incidents_api.list_incidents(run, self._request, merged=merged)

    def timeline(self, run: str, *, incident: int | None = None) -> dict[str, Any]:
        """Raises ``NotFound`` for an unknown run, or an incident not of this run."""
        return incidents_api.get_timeline(run, self._request, incident=incident)

    def notes(self, run: str) -> list[NoteOut]:
        return incidents_api.list_notes(run, self._request)

    def add_note(self, run: str, *, author: str, text: str, incident: int | None = None) -> NoteOut:
        with _refusals():
            body = incidents_api.NoteIn(author=author, text=text, incident=incident)
            return incidents_api.add_note(run, body, self._request)

    def close_incident(
        self, incident_id: int, *, by: str, summary: str | None = None
    ) -> IncidentOut:
        with _refusals():
            body = incidents_api.CloseIn(by=by, summary=summary)
            return incidents_api.close_incident(incident_id, body, self._request)

    def retitle_incident(self, incident_id: int, *, by: str, title: str) -> IncidentOut:
        with _refusals():
            body = incidents_api.RetitleIn(by=by, title=title)
            return incidents_api.retitle_incident(incident_id, body, self._request)

    # -- run identity and economics --------------------------------------------------

    def attempts(self, run: str) -> list[dict[str, Any]]:
        """Raises ``NotFound`` for an unknown run; ``[]`` for a run whose agents sent no
        ``attempt_start`` (trainwarden < 0.11)."""
        return economics_api.list_attempts(run, self._request)

    def identity(self, run: str) -> dict[str, Any]:
        """Raises ``NotFound`` for an unknown run, or one without attempts."""
        return economics_api.run_identity(run, self._request)

    def economics(self, run: str) -> dict[str, Any]:
        """Checkpoints, goodput and the cadence advisor at serve's price and MTBF settings."""
        return economics_api.run_economics(run, self._request)

    def diff(self, run: str, other: str) -> dict[str, Any]:
        """Raises ``NotFound`` when either run is unknown."""
        return economics_api.run_diff(run, other, self._request)
