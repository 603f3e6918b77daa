"""``trainwarden nodes list | exclude | clear``: the fleet's memory of its bad nodes
(``collector/read/nodes.py``), from a running collector (``--url``, the token in
``TRAINWARDEN_TOKEN``: read for ``list`` and ``exclude``, admin for ``clear``) or a
database read directly (``--db``, as ``postmortem`` does).

``exclude`` prints what the next job should start without: Slurm's ``--exclude=`` host
list (``node[03,17-18]``), the ``kubectl cordon`` lines, or one name a line.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict
from typing import Any
from urllib.parse import quote

from trainwarden.collector.cli.common import (
    URL_HELP,
    CliError,
    collector_url,
    open_database,
    request,
    user_name,
)

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def slurm_hostlist(names: list[str]) -> str:
    """``names`` as Slurm writes a host list: ``node[03,17-18],login1``. Numbers keep
    their width (``node03``); a run of consecutive numbers of one width is a range."""
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    plain: list[str] = []
    for name in sorted(set(names)):
        match = _NUMBERED.match(name)
        if match is None:
            plain.append(name)
            continue
        prefix, digits = match.groups()
        groups[(prefix, len(digits))].append(int(digits))
    parts = list(plain)
    for (prefix, width), numbers in sorted(groups.items()):
        numbers.sort()
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]:0{width}d}")
            continue
        spans = []
        start = previous = numbers[0]
        for number in [*numbers[1:], None]:
            if number is not None and number == previous + 1:
                previous = number
                continue
            first, last = f"{start:0{width}d}", f"{previous:0{width}d}"
            spans.append(first if start == previous else f"{first}-{last}")
            if number is not None:
                start = previous = number
        parts.append(f"{prefix}[{','.join(spans)}]")
    return ",".join(sorted(parts))


def _days(text: str) -> float:
    """``7d``, ``36h``, ``90m`` or a number of days."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([dhm]?)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise CliError(f"--since {text!r}: give a duration such as 7d, 36h or 90m")
    value, unit = float(match.group(1)), match.group(2) or "d"
    return value / {"d": 1, "h": 24, "m": 1440}[unit]


def _nodes(args: argparse.Namespace) -> list[dict[str, Any]]:
    days = _days(args.since)
    if args.db:
        # deferred: see collector/cli/__init__.py
        from trainwarden.collector.read import nodes

        engine = open_database(args.db)
        try:
            with engine.connect() as conn:
                return nodes.nodes(conn, now=time.time(), days=days)
        finally:
            engine.dispose()
    found: list[dict[str, Any]] = request(
        "GET", f"{collector_url(args)}/api/v1/nodes", params={"days": days}
    ).json()
    return found


def cmd_list(args: argparse.Namespace) -> None:
    for node in _nodes(args):
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(node["kinds"].items()))
        print(f"{node['node']}\t{node['findings']} findings in {node['runs']} runs\t{kinds}")


def cmd_exclude(args: argparse.Namespace) -> None:
    names = [
        n["node"]
        for n in _nodes(args)
        if n["findings"] >= args.min_findings and n["runs"] >= args.min_runs
    ]
    if args.format == "slurm":
        if names:
            print(f"--exclude={slurm_hostlist(names)}")
    elif args.format == "k8s":
        for name in sorted(names):
            print(f"kubectl cordon {name}")
    else:
        for name in sorted(names):
            print(name)


def cmd_clear(args: argparse.Namespace) -> None:
    by = args.by or user_name()
    if args.db:
        # deferred: see collector/cli/__init__.py
        from trainwarden.collector.read import nodes
        from trainwarden.collector.store.db import write
        from trainwarden.collector.store.errors import Invalid

        engine = open_database(args.db)
        try:
            with write(engine) as conn:
                nodes.clear(conn, args.node, by=by, note=args.note, now=time.time())
        except Invalid as exc:
            raise CliError(str(exc)) from None
        finally:
            engine.dispose()
    else:
        url = f"{collector_url(args)}/api/v1/nodes/{quote(args.node, safe='')}/clear"
        request("POST", url, json={"by": by, "note": args.note})
    print(f"trainwarden: node {args.node} cleared by {by}: its findings so far no longer count")


def add_parsers(sub: Any, *, db_help: str) -> None:
    nodes = sub.add_parser(
        "nodes",
        help="the nodes that hurt training, across runs: list them, print an exclude list, "
        "mark one repaired",
    )
    verbs = nodes.add_subparsers(dest="nodes_command", required=True)

    def where(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help=URL_HELP)
        p.add_argument("--db", help="read this database directly instead; " + db_help)

    def window(p: argparse.ArgumentParser) -> None:
        p.add_argument("--since", default="7d", help="the findings of this long back: 7d, 36h, 90m")

    listing = verbs.add_parser("list", help="each node with findings: how many, in how many runs")
    window(listing)
    where(listing)
    listing.set_defaults(func=cmd_list)

    exclude = verbs.add_parser(
        "exclude", help="the nodes the next job should start without, as an exclude list"
    )
    window(exclude)
    exclude.add_argument(
        "--min-findings", type=int, default=2, help="at least this many findings (default 2)"
    )
    exclude.add_argument(
        "--min-runs", type=int, default=1, help="in at least this many runs (default 1)"
    )
    exclude.add_argument(
        "--format",
        choices=["slurm", "k8s", "plain"],
        default="plain",
        help="slurm: --exclude=node[03,17-18]; k8s: kubectl cordon lines; plain: a name a line",
    )
    where(exclude)
    exclude.set_defaults(func=cmd_exclude)

    clear = verbs.add_parser(
        "clear", help="mark a node repaired: its findings so far no longer count (admin)"
    )
    clear.add_argument("node", help="the node's name, as the scheduler knows it")
    clear.add_argument("--note", required=True, help="what was repaired")
    clear.add_argument("--by", help="who clears it (default: your user name)")
    where(clear)
    clear.set_defaults(func=cmd_clear)
