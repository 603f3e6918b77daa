"""What every subcommand shares: its error type, its settings, opening the database, and
talking to a running collector (``--url``, with the token in ``TRAINWARDEN_TOKEN``)."""

from __future__ import annotations

import argparse
import getpass
import os
from typing import Any
from urllib.parse import urlsplit

from trainwarden.collector.settings import Settings

DEFAULT_URL = "http://127.0.0.1:8000"
URL_HELP = f"the collector (default TRAINWARDEN_URL, else {DEFAULT_URL})"


class CliError(Exception):
    """Ends the command with one clear line on stderr and exit status 2."""


def settings_of(args: argparse.Namespace) -> Settings:
    overrides = {
        k: v
        for k, v in (
            ("db", args.db),
            ("host", getattr(args, "host", None)),
            ("port", getattr(args, "port", None)),
            ("workers", getattr(args, "workers", None)),
            ("price_per_gpu_hour", getattr(args, "price_per_gpu_hour", None)),
            ("mtbf_hours", getattr(args, "mtbf_hours", None)),
            ("gpu_mtbf_hours", getattr(args, "gpu_mtbf_hours", None)),
            ("incident_cooldown_s", getattr(args, "incident_cooldown", None)),
            ("postmortem_post", getattr(args, "postmortem_post", None)),
            ("auth", getattr(args, "auth", None)),
            ("trusted_user_header", getattr(args, "trusted_user_header", None)),
            ("ssl_certfile", getattr(args, "ssl_certfile", None)),
            ("ssl_keyfile", getattr(args, "ssl_keyfile", None)),
        )
        if v is not None
    }
    return Settings(**overrides)


def open_database(url: str):  # type: ignore[no-untyped-def]
    """Connect and bring the schema to head; a failure is one line naming the URL."""
    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.store.db import (
        DatabaseError,
        check_connection,
        make_engine,
        masked,
        upgrade,
    )

    try:
        engine = make_engine(url)
        check_connection(engine)
        upgrade(engine)
    except DatabaseError as exc:
        raise CliError(str(exc)) from None
    except Exception as exc:  # a migration that fails: still one line, URL masked
        raise CliError(f"cannot prepare database {masked(url)}: {exc}") from None
    return engine


def collector_url(args: argparse.Namespace) -> str:
    """The collector a command talks to: ``--url``, else ``TRAINWARDEN_URL``, else local."""
    return (args.url or os.environ.get("TRAINWARDEN_URL") or DEFAULT_URL).rstrip("/")


def request(method: str, url: str, **kwargs: Any) -> Any:
    """A request to the collector (only: a webhook never gets the token); an error is one
    line that says what the collector answered."""
    # deferred: see collector/cli/__init__.py
    import httpx

    try:
        token = os.environ.get("TRAINWARDEN_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = httpx.request(method, url, timeout=60, headers=headers, **kwargs)
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the collector at {urlsplit(url).netloc}: {exc}") from None
    if response.status_code >= 400:
        try:
            body = response.json()
            detail = body.get("detail") or body.get("error") or body
        except ValueError:
            detail = response.text.strip()[:200]
        raise CliError(f"the collector answered {response.status_code}: {detail}")
    return response


def user_name() -> str:
    """Who runs the command, for the record (a note's author, a token's creator)."""
    try:
        return getpass.getuser()
    except Exception:  # no user name in a bare container
        return "operator"
