"""What every subcommand shares: its error type, its settings and opening the database."""

from __future__ import annotations

import argparse

from trainwarden.collector.settings import Settings


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
