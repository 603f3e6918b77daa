"""The ``trainwarden`` command: ``serve``, ``demo``, ``loadgen``, ``relay``, ``note``,
``postmortem``, ``token create|list|revoke``, ``nodes list|exclude|clear``, ``db upgrade`` and
``db prune``.

Each subcommand imports the server stack it needs (FastAPI, SQLAlchemy, Dash, the
collector's modules) when it runs, not this module: ``trainwarden relay`` runs on
training nodes that have only the agent's dependencies, and ``trainwarden --help``
stays fast. Those imports are marked ``# deferred``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainwarden.collector.cli.common import CliError, open_database, settings_of
from trainwarden.collector.cli.nodes import add_parsers as add_node_parsers
from trainwarden.collector.cli.reports import add_parsers, cmd_note, cmd_postmortem
from trainwarden.collector.cli.tokens import add_parsers as add_token_parsers


def _rules(args: argparse.Namespace) -> tuple[list, list]:  # type: ignore[type-arg]
    """The default rule pack plus ``--rules`` files (and ``TRAINWARDEN_RULES``, paths
    separated by ``:``), checked before anything starts: a bad file is one clear error."""

    # deferred: see collector/cli/__init__.py
    from trainwarden.alerts import RuleError, load_rule_packs

    files = [
        *filter(None, os.environ.get("TRAINWARDEN_RULES", "").split(os.pathsep)),
        *(args.rules or []),
    ]
    dirs = [Path(d) for d in (args.runbooks or [])]
    dirs += [Path(f).parent / "runbooks" for f in files if (Path(f).parent / "runbooks").is_dir()]
    try:
        default = (
            not getattr(args, "no_default_rules", False)
            and os.environ.get("TRAINWARDEN_DEFAULT_RULES", "1") != "0"
        )
        return load_rule_packs(files, runbooks_dirs=dirs, default=default), dirs
    except RuleError as exc:
        raise CliError(f"alert rules:\n{exc}") from None


def _notify(args: argparse.Namespace) -> object:
    """The notifiers file (``--notify`` or ``TRAINWARDEN_NOTIFY``), checked before
    anything starts; ``None`` when there is none (alerts are then stored, not sent)."""

    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.alerting.notify import NotifyConfigError, load_notify_config

    path = args.notify or os.environ.get("TRAINWARDEN_NOTIFY")
    if not path:
        return None
    try:
        return load_notify_config(path)
    except NotifyConfigError as exc:
        raise CliError(f"notifiers:\n{exc}") from None


def _actions(args: argparse.Namespace) -> object:
    """The action policy (``--actions`` or ``TRAINWARDEN_ACTIONS``), checked before
    anything starts; without one every action is a dry run."""

    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.actions.policy import ActionConfigError, load_policy

    try:
        return load_policy(args.actions or os.environ.get("TRAINWARDEN_ACTIONS") or None)
    except ActionConfigError as exc:
        raise CliError(f"actions:\n{exc}") from None


KEEP_ALIVE_S = 20
"""How long an idle keep-alive connection stays open (uvicorn's default is 5 s): longer
than the ``Retry-After`` a refused sender waits (5 s, api/routes/ingest.py), so that a
relay or an agent coming back after it finds its connection still open. With both 5 s,
the server closed connections just as nodes sent on them again; at 2x capacity 1 % of
the requests taken then spent 5-23 s reconnecting (bench/request_stages.py)."""


def cmd_serve(args: argparse.Namespace) -> None:
    # deferred: see collector/cli/__init__.py
    import uvicorn

    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.app import create_app
    from trainwarden.collector.store.db import masked

    settings = settings_of(args)
    if bool(settings.ssl_certfile) != bool(settings.ssl_keyfile):
        raise CliError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    if settings.workers > 1 and settings.db.startswith("sqlite"):
        raise CliError(
            f"--workers {settings.workers} needs PostgreSQL (--db postgresql+psycopg://...): "
            "SQLite takes one writer at a time, so one collector process is all it can use"
        )
    rules, runbook_dirs = _rules(args)
    notify = _notify(args)
    actions = _actions(args)
    engine = open_database(settings.db)  # migrated once, before any worker starts
    auth_settings = settings.auth_settings()

    def app_of(engine: Any) -> Any:
        return create_app(
            engine,
            settings,
            rules=rules,
            runbook_dirs=runbook_dirs,
            notify=notify,
            actions=actions,  # type: ignore[arg-type]
            auth_settings=auth_settings,
        )

    base = f"{'https' if settings.ssl_certfile else 'http'}://{settings.host}:{settings.port}"
    if auth_settings is None:
        logging.getLogger("trainwarden").warning(
            "AUTH IS OFF (--auth off): anyone who reaches %s can send records, read every run, "
            "acknowledge, silence and trigger rollbacks and evictions. Use it only on a "
            "trusted network; see docs/security.md",
            base,
        )
    else:
        _say_if_no_tokens(engine)
    print(
        f"trainwarden collector: dashboard {base}/  API {base}/api/v1  docs {base}/docs", flush=True
    )
    print(f"trainwarden collector: database {masked(settings.db)}", flush=True)
    scheme = base.split(":", 1)[0]

    def config_of(app: Any) -> Any:
        return uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            timeout_keep_alive=KEEP_ALIVE_S,
            log_level=args.log_level,
            ssl_certfile=settings.ssl_certfile,
            ssl_keyfile=settings.ssl_keyfile,
            access_log=args.access_log and args.log_level in ("debug", "info"),
        )

    def listening(host: str, port: int) -> None:
        print(f"trainwarden collector: listening on {scheme}://{host}:{port}", flush=True)

    if settings.workers == 1:
        _run(config_of(app_of(engine)), said=listening)
        return
    # deferred: see collector/cli/__init__.py
    from prometheus_client.multiprocess import mark_process_dead

    from trainwarden.collector.api.prom import share_between_processes
    from trainwarden.collector.cli.workers import serve_workers
    from trainwarden.collector.store.db import make_engine

    engine.dispose()  # each worker opens its own (a pool does not cross a fork)
    shared = tempfile.mkdtemp(prefix="trainwarden-metrics-")  # every worker's /metrics values

    def start(sock: Any, ready: Callable[[], None]) -> None:
        share_between_processes(shared)
        _run(config_of(app_of(make_engine(settings.db))), sockets=[sock], started=ready)

    def gone(pid: int) -> None:  # its counters stay in the sums; its live gauges go
        mark_process_dead(pid, shared)

    def said(host: str, port: int) -> None:
        listening(host, port)
        print(f"trainwarden collector: {settings.workers} worker processes", flush=True)

    try:
        serve_workers(
            workers=settings.workers,
            host=settings.host,
            port=settings.port,
            start=start,
            said=said,
            gone=gone,
        )
    except OSError as exc:
        raise CliError(f"cannot listen on {settings.host}:{settings.port}: {exc}") from None
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _run(
    config: Any,
    *,
    sockets: list[Any] | None = None,
    said: Callable[[str, int], None] | None = None,
    started: Callable[[], None] | None = None,
) -> None:
    """uvicorn's server (on ``sockets`` if given), calling ``said`` with each address it
    listens on once it does (with ``--port 0``, the port the system chose), and
    ``started`` once it takes requests."""
    # deferred: see collector/cli/__init__.py
    import uvicorn

    class Listening(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            for server in self.servers:
                for sock in server.sockets:
                    if said is not None:
                        said(*sock.getsockname()[:2])
            if started is not None:
                started()

    Listening(config).run(sockets=sockets)


def _say_if_no_tokens(engine: Any) -> None:
    """Auth is on and no token exists yet: say how to make the first one."""
    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.store.tokens import list_tokens

    with engine.connect() as conn:
        if list_tokens(conn, revoked=False):
            return
    print(
        "trainwarden collector: auth is on and there are no tokens yet; create them with\n"
        "  trainwarden token create ops --scope admin          # the UI and the API\n"
        "  trainwarden token create agents --scope ingest      # TRAINWARDEN_TOKEN for trainers",
        flush=True,
    )


def cmd_demo(args: argparse.Namespace) -> None:
    # deferred: see collector/cli/__init__.py
    from trainwarden.agent.drills import DrillError, parse
    from trainwarden.collector.cli.demo import (
        DEFAULT_DRILL,
        run_demo,
    )

    if args.drill is None:
        args.drill = DEFAULT_DRILL
    try:
        parse("" if args.drill.lower() == "none" else args.drill)
    except DrillError as exc:
        raise CliError(str(exc)) from None

    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.cli.demo import demo_policy

    # The demo's own policy (a rollback runs) unless one is named, as for serve.
    named = args.actions or os.environ.get("TRAINWARDEN_ACTIONS")
    actions = _actions(args) if named else demo_policy()
    settings = settings_of(args)
    engine = open_database(settings.db)
    run_demo(
        engine,
        settings,
        ranks=args.ranks,
        steps=args.steps,
        data_delay=args.data_delay,
        drill=None if args.drill.lower() == "none" else args.drill,
        keep_serving=not args.exit_when_done,
        actions=actions,  # type: ignore[arg-type]
    )


def cmd_db_upgrade(args: argparse.Namespace) -> None:
    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.store.db import masked

    settings = settings_of(args)
    open_database(settings.db)
    print(f"trainwarden: database {masked(settings.db)} is at the latest schema")


def cmd_db_prune(args: argparse.Namespace) -> None:
    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.store.partitions import (
        parse_age,
        prune,
    )

    try:
        keep = parse_age(args.keep_raw)
    except ValueError as exc:
        raise CliError(f"--keep-raw: {exc}") from None
    engine = open_database(settings_of(args).db)
    try:
        result = prune(engine, keep_raw_s=keep, dry_run=args.dry_run)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(f"trainwarden: {result.summary()}; rollups, events, alerts and actions are kept")


def _cmd_relay(args: argparse.Namespace) -> None:
    # deferred: see collector/cli/__init__.py
    from trainwarden.agent.relay import run

    try:
        run(args)
    except (ValueError, OSError) as exc:
        raise CliError(f"relay: {exc}") from None


def _cmd_loadgen(args: argparse.Namespace) -> None:
    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.cli.loadgen import cmd_loadgen

    cmd_loadgen(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainwarden",
        description="Observability and self-healing for distributed training runs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    db_help = (
        "SQLAlchemy URL: sqlite:///PATH or postgresql+psycopg://USER:PASS@HOST:PORT/DB "
        "(default: TRAINWARDEN_DB, else an SQLite file in ~/.local/share/trainwarden)"
    )

    serve = sub.add_parser(
        "serve", help="run the collector: API, /metrics and the web UI on one port"
    )
    serve.add_argument("--db", help=db_help)
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument(
        "--port", type=int, help="port (default 8000; 0: a free one, said in the output)"
    )
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="collector processes on the one port (default 1; TRAINWARDEN_WORKERS): one process "
        "uses about one core, so on a host of several cores, N of them take about N times the "
        "ingest; needs PostgreSQL (see docs/scaling.md)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="a log line for every HTTP request (with --log-level info or debug); off by "
        "default: every rank's agent posts once a second, and the line cost a tenth of the "
        "collector's CPU at 1,024 ranks without relays",
    )
    serve.add_argument(
        "--rules",
        action="append",
        metavar="FILE",
        help="your alert rules (YAML), added to the default pack; repeatable",
    )
    serve.add_argument(
        "--runbooks",
        action="append",
        metavar="DIR",
        help="a folder of your runbooks (NAME.md), looked in before the shipped ones; repeatable "
        "(a 'runbooks' folder next to a rules file is used too)",
    )
    serve.add_argument(
        "--no-default-rules",
        action="store_true",
        help="load only your --rules files, not the shipped pack (TRAINWARDEN_DEFAULT_RULES=0); "
        "copy alerts/rules/default.yaml to start from it",
    )
    serve.add_argument(
        "--notify",
        metavar="FILE",
        help="where alerts are sent (YAML: Alertmanager, PagerDuty, Slack, webhooks; see "
        "docs/notifiers.md); default TRAINWARDEN_NOTIFY; without one alerts are only stored",
    )
    serve.add_argument(
        "--actions",
        metavar="FILE",
        help="what trainwarden may do about alerts (YAML: rollback / evict / stop, each auto, "
        "require-ack or dry-run; see docs/actions.md); default TRAINWARDEN_ACTIONS; "
        "without one every action is a dry run",
    )
    serve.add_argument(
        "--price-per-gpu-hour",
        type=float,
        metavar="PRICE",
        help="what a GPU-hour costs, for the cost lost in post-mortems "
        "(TRAINWARDEN_PRICE_PER_GPU_HOUR)",
    )
    serve.add_argument(
        "--mtbf-hours",
        type=float,
        metavar="HOURS",
        help="mean time between interruptions of a job, for the checkpoint cadence advisor "
        "until a run has had two of its own (TRAINWARDEN_MTBF_HOURS)",
    )
    serve.add_argument(
        "--gpu-mtbf-hours",
        type=float,
        metavar="HOURS",
        help="without --mtbf-hours: one GPU's MTBF; a job of N GPUs is interrupted every "
        "HOURS / N (default 50000; TRAINWARDEN_GPU_MTBF_HOURS)",
    )
    serve.add_argument(
        "--incident-cooldown",
        type=float,
        metavar="SECONDS",
        help="close an incident this long after everything in it resolved (default 300; "
        "TRAINWARDEN_INCIDENT_COOLDOWN_S)",
    )
    serve.add_argument(
        "--postmortem-post",
        metavar="URL",
        help="post each incident's report to this Slack-compatible or generic webhook when it "
        "closes (TRAINWARDEN_POSTMORTEM_POST)",
    )
    serve.add_argument(
        "--auth",
        choices=["required", "off"],
        help="required (default): the API needs tokens, the UI a login; off: anyone who "
        "reaches the port may do anything (TRAINWARDEN_AUTH); see docs/security.md",
    )
    serve.add_argument(
        "--trusted-user-header",
        metavar="HEADER",
        help="trust this header, set by an authenticating reverse proxy, as the UI user's name "
        "(e.g. X-Forwarded-User; TRAINWARDEN_TRUSTED_USER_HEADER)",
    )
    serve.add_argument("--ssl-certfile", metavar="PEM", help="serve HTTPS with this certificate")
    serve.add_argument("--ssl-keyfile", metavar="PEM", help="... and this private key")
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo", help="serve + a live 2-rank CPU training run (gloo) with the agent"
    )
    demo.add_argument("--db", help=db_help)
    demo.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    demo.add_argument(
        "--port", type=int, help="port (default 8000; a free one if that is taken, or if 0)"
    )
    demo.add_argument(
        "--ranks", type=int, default=2, help="number of training processes (default 2)"
    )
    demo.add_argument("--steps", type=int, default=3000, help="training steps (default 3000)")
    demo.add_argument(
        "--data-delay",
        type=float,
        default=0.002,
        help="seconds the demo's data loader sleeps per batch, on top of making it (default "
        "0.002: with the making, ~5 ms, a tenth of a step, under DataLoaderStall's fifth)",
    )
    demo.add_argument(
        "--drill",
        default=None,
        help="fault drill for the training run (default: a thermal throttle, a slow rank, a loss "
        "spike and an XID; 'none' for a clean run); see the README for the form",
    )
    demo.add_argument(
        "--exit-when-done",
        action="store_true",
        help="stop serving when training ends (default: keep the dashboard up)",
    )
    demo.add_argument(
        "--actions",
        metavar="FILE",
        help="the action policy, as for serve (default TRAINWARDEN_ACTIONS, else the demo's: "
        "rollback auto, so that the loss-spike drill is rolled back; evict and stop dry-run)",
    )
    demo.set_defaults(func=cmd_demo)

    add_parsers(sub, note=cmd_note, postmortem=cmd_postmortem, db_help=db_help)

    add_token_parsers(sub, db_help=db_help)
    add_node_parsers(sub, db_help=db_help)

    load = sub.add_parser(
        "loadgen",
        help="simulate many ranks sending to a collector (benchmarks; an ingest "
        "token from TRAINWARDEN_TOKEN when the collector requires one)",
    )
    load.add_argument("--url", default="http://127.0.0.1:8000", help="collector URL")
    load.add_argument("--ranks", type=int, default=1024)
    load.add_argument(
        "--ranks-per-node", type=int, default=8, help="ranks per request (one a node's relay)"
    )
    load.add_argument("--steps-per-s", type=float, default=1.0)
    load.add_argument("--duration", type=float, default=30.0, help="seconds")
    load.add_argument("--run", help="run name (default loadgen-<time>)")
    load.add_argument("--slow-rank", type=int, help="make this rank a 1.3x straggler")
    load.add_argument(
        "--user-metrics",
        type=int,
        default=6,
        choices=range(33),
        metavar="N",
        help="user metrics (s.metric) per row besides the 19 built-in ones, 0 to 32 (default 6: "
        "25 metrics a row)",
    )
    load.add_argument(
        "--no-relay",
        action="store_true",
        help="each rank sends its own request (POST /api/v1/ingest), as agents with no node "
        "relay do; default: one columnar request a node, as its relay sends",
    )
    load.add_argument(
        "--sample-ids",
        type=int,
        default=0,
        metavar="N",
        help="sample ids a row (digest, count, epoch and the ids, as agents send them with a "
        "dataset size); default 0: none",
    )
    load.add_argument(
        "--replay",
        action="store_true",
        help="send a refused request again after the collector's Retry-After, oldest first, "
        "as agents' spools do (and drain them after the last step); default: count it and "
        "drop it",
    )
    load.set_defaults(func=_cmd_loadgen)

    # deferred: see collector/cli/__init__.py
    from trainwarden.agent import relay as _relay  # standard library only

    rel = sub.add_parser(
        "relay",
        help="a node relay: this node's agents send to it (TRAINWARDEN_RELAY) and it "
        "sends the collector one request for them all",
    )
    _relay.add_arguments(rel)
    rel.set_defaults(func=_cmd_relay)

    db = sub.add_parser("db", help="database maintenance")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    up = db_sub.add_parser("upgrade", help="create or upgrade the schema (Alembic)")
    up.add_argument("--db", help=db_help)
    up.set_defaults(func=cmd_db_upgrade)
    pr = db_sub.add_parser(
        "prune",
        help="drop per-rank raw data (step rows, GPU samples) older than --keep-raw; "
        "rollups, heatmap maxima, events, alerts and actions stay",
    )
    pr.add_argument("--db", help=db_help)
    pr.add_argument(
        "--keep-raw", required=True, help="age of raw data to keep, e.g. 14d, 36h, 2w (min 1d)"
    )
    pr.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")
    pr.set_defaults(func=cmd_db_prune)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except CliError as exc:
        print(f"trainwarden: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
