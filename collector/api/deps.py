"""What a route may ask for, declared once as annotated dependencies: the app's database
engine, its settings and action policy, its metrics and ingest writer, and the check
that the caller may change things (``admin``). None of them adds a parameter to the API.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine

from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.api import auth
from trainwarden.collector.api.prom import CollectorMetrics
from trainwarden.collector.ingest.writer import IngestWriter
from trainwarden.collector.settings import Settings


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _policy(request: Request) -> ActionPolicy:
    return request.app.state.action_policy


def _metrics(request: Request) -> CollectorMetrics:
    return request.app.state.metrics


def _writer(request: Request) -> IngestWriter:
    return request.app.state.writer


EngineDep = Annotated[Engine, Depends(_engine)]
SettingsDep = Annotated[Settings, Depends(_settings)]
PolicyDep = Annotated[ActionPolicy, Depends(_policy)]
MetricsDep = Annotated[CollectorMetrics, Depends(_metrics)]
WriterDep = Annotated[IngestWriter, Depends(_writer)]

admin = Depends(auth.check_admin)
"""For a route that changes something: ``@router.post(..., dependencies=[admin])``
refuses a caller whose token may only read (403). The middleware checks API requests;
this check also covers the UI's own sessions."""
