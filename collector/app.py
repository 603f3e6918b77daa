"""``create_app``: the FastAPI application with the API, ``/metrics`` and the Dash UI at ``/``."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from sqlalchemy import Engine

from trainwarden.agent import wire
from trainwarden.alerts import Rule, load_rule_packs
from trainwarden.collector.actions.commands import CommandBoard
from trainwarden.collector.actions.engine import ActionEngine
from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.alerting.engine import AlertEngine, EngineSettings
from trainwarden.collector.alerting.notify import Dispatcher
from trainwarden.collector.alerting.notify.thread import NotifierThread
from trainwarden.collector.api import auth, errors
from trainwarden.collector.api.prom import CollectorMetrics
from trainwarden.collector.api.routes import actions as actions_api
from trainwarden.collector.api.routes import alerts as alerts_api
from trainwarden.collector.api.routes import collectives as collectives_api
from trainwarden.collector.api.routes import data as data_api
from trainwarden.collector.api.routes import economics as economics_api
from trainwarden.collector.api.routes import incidents as incidents_api
from trainwarden.collector.api.routes import ingest as ingest_api
from trainwarden.collector.api.routes import nodes as nodes_api
from trainwarden.collector.api.routes import ops, otlp, runs
from trainwarden.collector.api.routes import replicas as replicas_api
from trainwarden.collector.api.routes.ingest import EXTRA_SCHEMAS, DirectIngest
from trainwarden.collector.health.evaluator import health_loop
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.incidents.engine import IncidentEngine
from trainwarden.collector.incidents.store import IncidentSettings
from trainwarden.collector.ingest.limits import BodyLimit, InFlight, IngestBackpressure, Pressure
from trainwarden.collector.ingest.pressure_board import PressureBoard
from trainwarden.collector.ingest.writer import IngestWriter
from trainwarden.collector.loops import Loop
from trainwarden.collector.read import economics, runbooks
from trainwarden.collector.rollups.worker import rollup_loop
from trainwarden.collector.settings import Settings

DEFAULT_HEALTH = HealthSettings()
DEFAULT_ALERTING = EngineSettings()


async def _probe_loop_lag(lags: deque[float], every_s: float = 0.1) -> None:
    """How late the event loop runs a timer: requests not yet read wait about as long."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(every_s)
        lags.append(max(0.0, loop.time() - started - every_s))


def _stop_together(stops: list[Callable[[], None]]) -> None:
    """Tell every background thread to stop at once and wait for them all: shutting
    down takes the slowest one's pass in progress (an alert pass over a very large run
    takes seconds), not the sum of them."""
    threads = [threading.Thread(target=stop, name="trainwarden-stop") for stop in stops]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# FastAPI's native OpenTelemetry (0.16x) asks on every request whether a global tracer or
# meter provider is set: 2 % of the collector's interpreter time under ingest load (py-spy,
# 8,192 ranks). The collector serves its own /metrics; FastAPI's spans are off.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def create_app(
    engine: Engine,
    settings: Settings | None = None,
    *,
    ui: bool = True,
    health: HealthSettings | None = DEFAULT_HEALTH,
    rollups: bool = True,
    rules: list[Rule] | None = None,
    runbook_dirs: list[Path] | None = None,
    alerting: EngineSettings | None = DEFAULT_ALERTING,
    notify: Any = None,
    actions: ActionPolicy | None = None,
    act: bool = True,
    incidents: bool = True,
    auth_settings: auth.AuthSettings | None = None,
) -> FastAPI:
    """Build the app on an engine whose schema is already at head (see ``db.upgrade``).

    ``health``: settings of the rank-health evaluator thread; ``None`` runs none.
    ``rollups``: run the rollup worker thread (tests turn it off and call ``flush``).
    ``alerting``: settings of the alert engine thread; ``None`` runs none.
    ``notify``: a ``collector.alerting.notify.NotifyConfig`` (``serve --notify FILE``): where
    alerts are sent; without one, alerts are evaluated, stored and served, not sent.
    ``actions``: the action policy (``serve --actions FILE``); default: every kind dry-run.
    ``act``: run the action engine thread (tests turn it off and call ``run_once``).
    ``incidents``: run the incident engine thread (cool-down, posting and price from
    ``settings``; tests turn it off and call ``run_once``).
    ``auth_settings``: check tokens, scopes and UI sessions (``serve`` passes them unless
    ``--auth off``); ``None``: every request is let in, as tests built in-process want.
    """
    settings = settings or Settings()
    lags: deque[float] = deque(maxlen=20)  # the event loop's lateness over the last ~2 s

    def loop_lag() -> float:
        return max(lags, default=0.0)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loops: list[Loop] = []
        if rollups:
            loops.append(rollup_loop(engine))
        # Whether the collector fell behind lately, and whom it refused: health and the
        # absence alerts allow for it (a busy collector is not a dead rank).
        app.state.pressure = pressure = Pressure(lambda: writer.lag_s() + loop_lag())
        metrics.on_busy = pressure.refused
        # ... and what the other collectors on the database refused: any of them may lead
        # the pass that asks (SQLite has one collector).
        shared = None if engine.dialect.name == "sqlite" else PressureBoard(engine, pressure)
        if shared is not None:
            shared.start()
        if health is not None:
            loops.append(
                health_loop(
                    engine,
                    health,
                    pressure=pressure,
                    board=app.state.commands,
                    observe=metrics.health_pass_seconds.observe,
                )
            )
        for loop in loops:
            loop.start()
        if ui:
            from trainwarden.webui.app import warm_up  # Dash: see create_dash below

            warm_up(app.state.dash)
        notifier = alert_engine = None
        if notify is not None:
            notifier = NotifierThread(Dispatcher(notify, on_attempt=lambda a: engine_deliveries(a)))
            notifier.start()
        if alerting is not None:
            alert_engine = AlertEngine(
                engine,
                app.state.rules,
                settings=alerting,
                external_url=settings.external_url,
                submit=notifier.submit if notifier else None,
                lag=pressure.lag_s,  # its own delay, or another collector's
                metrics=metrics,
                pressure=pressure,
            )
            alert_engine.economics = economics.settings_of(settings)
            alert_engine.start()
        app.state.alert_engine = alert_engine
        app.state.notifier = notifier
        action_engine = None
        if act:
            action_engine = ActionEngine(
                engine, app.state.action_policy, board=app.state.commands, rules=app.state.rules
            )
            action_engine.start()
        app.state.action_engine = action_engine
        incident_engine = None
        if incidents:
            incident_engine = IncidentEngine(
                engine,
                IncidentSettings(
                    cooldown_s=settings.incident_cooldown_s,
                    post_url=settings.postmortem_post,
                    price_per_gpu_hour=settings.price_per_gpu_hour,
                ),
            )
            incident_engine.start()
        app.state.incident_engine = incident_engine
        probe = asyncio.create_task(_probe_loop_lag(lags))
        yield
        probe.cancel()
        engines = (incident_engine, action_engine, alert_engine, shared, *loops)
        _stop_together([e.stop for e in engines if e is not None])
        if notifier is not None:  # after the alert engine, which hands it notifications
            notifier.stop()
        writer.stop()

    def engine_deliveries(attempt: Any) -> None:
        running = app.state.alert_engine
        if running is not None:
            running.deliveries.append(attempt)

    app = FastAPI(
        lifespan=lifespan,
        title="trainwarden collector",
        version="0.1.0",
        description="Stores what trainwarden agents send and serves it to the UI and to tools.",
        **_NO_NATIVE_TELEMETRY,
    )
    app.state.engine = engine
    app.state.settings = settings
    app.state.rules = load_rule_packs() if rules is None else rules
    app.state.runbook_dirs = list(runbook_dirs or [])
    app.state.metrics = metrics = CollectorMetrics(engine)
    app.state.writer = writer = IngestWriter(
        engine,
        max_pending_rows=settings.max_pending_rows,
        max_queue_wait_s=settings.max_queue_wait_s,
        on_flush=metrics.on_flush,
    )
    metrics.ingest_queue_rows.set_function(lambda: writer.pending_rows)
    metrics.ingest_lag_seconds.set_function(lambda: writer.lag_s() + loop_lag())
    app.include_router(ingest_api.router)
    app.include_router(runs.router)
    app.include_router(ops.router)

    def openapi() -> dict[str, Any]:  # the self-parsed ingest bodies have schemas too
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(EXTRA_SCHEMAS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.include_router(otlp.router)
    app.include_router(runbooks.router)
    app.include_router(alerts_api.router)
    app.include_router(alerts_api.silences)
    app.include_router(actions_api.router)
    app.include_router(actions_api.of_runs)
    app.include_router(incidents_api.router)
    app.include_router(incidents_api.of_runs)
    app.include_router(economics_api.router)
    app.include_router(collectives_api.router)
    app.include_router(replicas_api.router)
    app.include_router(data_api.router)
    app.include_router(nodes_api.router)
    app.state.action_policy = actions or ActionPolicy()
    app.state.commands = CommandBoard()
    app.state.alert_engine = None
    # The ingest routes, answered past FastAPI's layers; the innermost of our middleware
    # (added first), so under the body limit, the backpressure gate and auth.
    direct = {
        wire.INGEST_PATH: ingest_api.ingest,
        wire.COLUMNS_PATH: ingest_api.ingest_columns,
        "/v1/metrics": otlp.otlp_metrics,
    }
    app.add_middleware(DirectIngest, routes=direct)
    app.add_middleware(BodyLimit, limit_bytes=settings.max_body_bytes)
    inflight = InFlight()
    metrics.ingest_in_flight.set_function(lambda: inflight.n)
    app.add_middleware(
        IngestBackpressure,
        limit=settings.max_inflight_ingest,
        on_reject=lambda sender: app.state.metrics.busy(auth.vouched(sender)),
        inflight=inflight,
    )
    app.state.authenticator = None
    if auth_settings is not None:  # added last: the outermost, so a stranger gets nothing else
        app.state.authenticator = auth.Authenticator(engine, auth_settings)
        app.add_middleware(auth.AuthMiddleware, authenticator=app.state.authenticator)
        app.include_router(auth.router)

    def _count_invalid(request: Request) -> None:
        if request.url.path.startswith("/api/v1/ingest"):
            app.state.metrics.ingest_requests.labels("invalid").inc()

    errors.install(app, on_invalid=_count_invalid)

    if ui:
        # Dash and plotly take about a second to import, and an API-only collector (ui
        # off: tests, a separate UI deployment) never needs them.
        from a2wsgi import WSGIMiddleware

        from trainwarden.webui.app import create_dash
        from trainwarden.webui.client import LocalClient

        dash_app = create_dash(
            LocalClient(
                engine,
                policy=app.state.action_policy,
                settings=settings,
                commands=app.state.commands,
            ),
            refresh_s=settings.ui_refresh_s,
        )
        app.state.dash = dash_app
        app.mount("/", WSGIMiddleware(dash_app.server))  # type: ignore[arg-type]  # last: API routes match first
    return app
