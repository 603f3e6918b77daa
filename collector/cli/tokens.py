"""``trainwarden token create|list|revoke``: API tokens, straight in the database.

Run it where the collector's database is reachable (``--db`` or ``TRAINWARDEN_DB``, as
``db upgrade``); a running collector honours a revocation within ``token_cache_s``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from trainwarden.collector.cli.common import CliError, open_database, settings_of, user_name
from trainwarden.collector.store.tokens import (
    SCOPES,
    TokenError,
    create_token,
    list_tokens,
    revoke_token,
)


def cmd_create(args: argparse.Namespace) -> None:
    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.store.db import write

    engine = open_database(settings_of(args).db)
    scopes = sorted({s for given in args.scope for s in given.split(",") if s}, key=_order)
    if args.runs != "*" and "ingest" not in scopes:
        raise CliError("--runs limits what an ingest token may send: add --scope ingest")
    try:
        with write(engine) as conn:
            token = create_token(
                conn, name=args.name, scopes=scopes, runs=args.runs, by=user_name()
            )
    except TokenError as exc:
        raise CliError(str(exc)) from None
    runs = f" for runs {args.runs!r}" if "ingest" in scopes else ""
    print(
        f"trainwarden: token {args.name!r} ({', '.join(scopes)}){runs} created. It is shown "
        "once, keep it now (only its hash is stored):",
        flush=True,
    )
    print(token, flush=True)


def _order(scope: str) -> int:
    return SCOPES.index(scope) if scope in SCOPES else len(SCOPES)


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at)) if at else "-"


def cmd_list(args: argparse.Namespace) -> None:

    engine = open_database(settings_of(args).db)
    with engine.connect() as conn:
        rows = list_tokens(conn, revoked=args.all)
    if not rows:
        print("trainwarden: no tokens; create one with: trainwarden token create NAME --scope read")
        return
    header = ("NAME", "ID", "SCOPES", "RUNS", "CREATED", "BY", "LAST USED", "REVOKED")
    table: list[tuple[Any, ...]] = [header]
    for r in rows:
        table.append(
            (
                r["name"],
                r["token_id"],
                ",".join(r["scopes"]),
                r["runs"],
                _when(r["created_at"]),
                r["created_by"],
                _when(r["last_used_at"]),
                _when(r["revoked_at"]),
            )
        )
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def cmd_revoke(args: argparse.Namespace) -> None:
    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.store.db import write

    engine = open_database(settings_of(args).db)
    with write(engine) as conn:
        if not revoke_token(conn, name=args.name):
            raise CliError(f"no live token named {args.name!r} (see: trainwarden token list --all)")
    print(
        f"trainwarden: token {args.name!r} revoked; collectors refuse it within their "
        "token cache time (5 s by default)"
    )


def add_parsers(sub: Any, *, db_help: str) -> None:
    token = sub.add_parser("token", help="API tokens: create (shown once), list, revoke")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser(
        "create", help="create a token and print it (once: only its hash is kept)"
    )
    create.add_argument("name", help="what it is for, unique (e.g. llama-ingest, alice, grafana)")
    create.add_argument(
        "--scope",
        action="append",
        required=True,
        metavar="SCOPE",
        help="ingest (agents send records), read (API reads, the web UI) or admin (read, and "
        "acknowledge, silence, act, notes); repeatable or comma-separated",
    )
    create.add_argument(
        "--runs",
        default="*",
        metavar="GLOB",
        help="the runs an ingest token may send, e.g. 'llama-*' (default: every run)",
    )
    create.add_argument("--db", help=db_help)
    create.set_defaults(func=cmd_create)
    listing = token_sub.add_parser("list", help="list tokens (never their secrets)")
    listing.add_argument("--all", action="store_true", help="revoked ones too")
    listing.add_argument("--db", help=db_help)
    listing.set_defaults(func=cmd_list)
    revoke = token_sub.add_parser("revoke", help="revoke a token by name")
    revoke.add_argument("name")
    revoke.add_argument("--db", help=db_help)
    revoke.set_defaults(func=cmd_revoke)
