"""``trainwarden note`` and ``trainwarden postmortem``: the operator logbook and the
post-mortem report from the command line.

Both talk HTTP to a running collector (``--url``, default ``TRAINWARDEN_URL`` or
http://127.0.0.1:8000) with the token in ``TRAINWARDEN_TOKEN`` (``note`` needs admin,
``postmortem`` read): what an on-call engineer has. ``postmortem --db URL`` reads a
database directly instead (a collector that is down, a copy of its database).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from trainwarden.collector.cli.common import (
    URL_HELP,
    CliError,
    collector_url,
    open_database,
    request,
    user_name,
)


def _shown(url: str) -> str:
    """A webhook's path is often its secret (Slack's is): name only where it goes."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/…" if parts.path not in ("", "/") else url


def cmd_note(args: argparse.Namespace) -> None:
    body: dict[str, Any] = {"author": args.author or user_name(), "text": args.text}
    if args.incident is not None:
        body["incident"] = args.incident
    if args.step is not None:
        body["step"] = args.step
    url = f"{collector_url(args)}/api/v1/runs/{quote(args.run, safe='')}/notes"
    note = request("POST", url, json=body).json()
    where = f" (incident {note['incident']})" if note.get("incident") is not None else ""
    print(f"trainwarden: note {note['id']} added to run {args.run}{where}")


def _report(args: argparse.Namespace) -> dict[str, Any]:
    price = args.price_per_gpu_hour
    if price is None and os.environ.get("TRAINWARDEN_PRICE_PER_GPU_HOUR"):
        price = float(os.environ["TRAINWARDEN_PRICE_PER_GPU_HOUR"])
    if args.db:
        # deferred: see collector/cli/__init__.py
        from trainwarden.collector.incidents.postmortem import report_of
        from trainwarden.collector.read.queries import NotFound

        engine = open_database(args.db)
        try:
            with engine.connect() as conn:
                return report_of(
                    conn,
                    run=args.run,
                    incident_id=args.incident,
                    price_per_gpu_hour=price,
                    charts=args.format != "md",
                )
        except NotFound as exc:
            raise CliError(str(exc)) from None
        finally:
            engine.dispose()
    params: dict[str, Any] = {"format": "json"}
    if args.incident is not None:
        params["incident"] = args.incident
    if price is not None:
        params["price"] = price
    url = f"{collector_url(args)}/api/v1/runs/{quote(args.run, safe='')}/postmortem"
    report: dict[str, Any] = request("GET", url, params=params).json()
    return report


def cmd_postmortem(args: argparse.Namespace) -> None:
    """Fetch the report, write it (``--out`` or stdout), then post it (``--post``). A
    failed post is reported with its status (exit 1) after the file was written."""
    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.incidents.posting import post_report
    from trainwarden.collector.incidents.postmortem import render

    report = _report(args)
    text = render(report, args.format)
    n = len(report["incidents"])
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"trainwarden: wrote {args.out} ({args.format}, {n} incident(s))", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.post:
        outcome = post_report(report, args.post, kind=args.post_kind)
        if not outcome.ok:
            print(
                f"trainwarden: error: posting the report to {_shown(args.post)} failed: "
                f"{outcome.describe()}",
                file=sys.stderr,
            )
            sys.exit(1)
        print(
            f"trainwarden: report posted to {_shown(args.post)} ({outcome.describe()})",
            file=sys.stderr,
        )


def add_parsers(
    sub: Any, *, note: Callable[..., None], postmortem: Callable[..., None], db_help: str
) -> None:
    url_help = URL_HELP
    n = sub.add_parser("note", help="add a note to a run's logbook (shown in its timelines)")
    n.add_argument("run", help="run name")
    n.add_argument("text", help="the note")
    n.add_argument("--author", help="who writes it (default: your user name)")
    n.add_argument(
        "--incident", type=int, help="the incident it is about (default: the run's open one)"
    )
    n.add_argument("--step", type=int, help="the training step it is about")
    n.add_argument("--url", help=url_help)
    n.set_defaults(func=note)

    p = sub.add_parser(
        "postmortem",
        help="a run's post-mortem: incidents, timeline, time to detect / page / act / recover, "
        "GPU-hours lost; as Markdown, HTML (charts, opens offline) or JSON",
    )
    p.add_argument("run", help="run name")
    p.add_argument(
        "--incident", type=int, help="only this incident (default: every incident of the run)"
    )
    p.add_argument("--format", choices=["md", "html", "json"], default="md", help="default md")
    p.add_argument("--out", metavar="FILE", help="write here (default: stdout)")
    p.add_argument(
        "--post", metavar="URL", help="also POST it to a Slack-compatible or generic webhook"
    )
    p.add_argument(
        "--post-kind",
        choices=["auto", "slack", "webhook"],
        default="auto",
        help='slack: {"text": mrkdwn}; webhook: {"text": markdown, "report": {...}}; '
        "auto: slack when the URL says slack (default)",
    )
    p.add_argument(
        "--price-per-gpu-hour",
        type=float,
        metavar="PRICE",
        help="for the cost lost (default TRAINWARDEN_PRICE_PER_GPU_HOUR, else the collector's)",
    )
    p.add_argument("--url", help=url_help)
    p.add_argument("--db", help="read this database directly instead of a collector; " + db_help)
    p.set_defaults(func=postmortem)
