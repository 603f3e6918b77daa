"""UI load time for a large run, in a real headless Chromium.

    python bench/ui_load.py [--db postgresql+psycopg://postgres@127.0.0.1:5432/test]
                            [--ranks 1024] [--steps 10000] [--repeat 5] [--keep NAME]

Seeds a scratch PostgreSQL database with a run of RANKS x STEPS (``bench/query.py``'s
seed: per-rank rows by binary COPY, rollups and heatmap bucket maxima in SQL, here for
every metric the pages draw), starts ``trainwarden serve`` on it, and measures in
Chromium (``/usr/bin/chromium``, driven by Playwright) the time from navigation to the
first drawn graph of the run overview and of the ranks page: the first visit (the server
just started) and the median and worst of ``--repeat`` later visits. Every visit opens a
fresh browser context: nothing is cached in the browser, each visit fetches and evaluates
Dash's and plotly.js's scripts (the worst case; a returning user's browser has them
cached). Target: <= 1.5 s.
Seeding 10M rows takes minutes: ``--keep NAME`` seeds a database of that name once and
reuses it on later runs (drop it yourself when done).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import psycopg
from common import DEFAULT_DB, scratch_database, serving
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright
from query import seed
from sqlalchemy.engine import make_url

from trainwarden.collector.rollups.worker import LEVELS

CHROMIUM = os.environ.get("TRAINWARDEN_CHROMIUM", "/usr/bin/chromium")
TARGET_S = 1.5
# A drawn graph: a line or area of a Plotly plot with a real path, or a heatmap's image.
DRAWN = """() => [...document.querySelectorAll('.js-plotly-plot .scatterlayer .trace path')]
    .some(p => (p.getAttribute('d') || '').length > 20)
    || document.querySelector('.js-plotly-plot .hm image') !== null"""
PAGES = [("run overview", "/runs/big"), ("ranks page", "/runs/big/ranks")]

# Rollups (per step across ranks) of the metrics the overview draws beyond bench/query.py's
# loss, step_time and mfu: (metric, per-rank expression, run-level total expression).
EXTRA = [
    ("tokens_per_s", "tokens / duration_s", "sum(tokens) / max(duration_s)"),
    ("grad_norm", "grad_norm", "max(grad_norm)"),
    ("compute", "compute_s", "avg(compute_s)"),
    ("exposed_comm", "exposed_comm_s", "avg(exposed_comm_s)"),
    ("data_wait", "data_wait_s", "max(data_wait_s)"),
    ("tokens", "tokens", "sum(tokens)"),
]
BUCKETED = [
    ("exposed_comm", "exposed_comm_s"),
    ("loss", "loss"),
    ("compute", "compute_s"),
    ("data_wait", "data_wait_s"),
]


def seed_more(dsn: str) -> None:
    t0 = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # The ranks, as their agents would have registered: 8 to a node; rank 17 is slow.
        conn.execute(
            "INSERT INTO ranks (run_id, rank, local_rank, host, node, pid, session, "
            "first_seen, last_seen, last_step, state) "
            "SELECT 1, r, r % 8, 'node' || (r / 8), 'node' || (r / 8), 1000 + r, 's' || r, "
            "ts, ts, step, 'finished' "
            "FROM generate_series(0, (SELECT world_size FROM runs WHERE id = 1) - 1) AS r, "
            "(SELECT max(ts) AS ts, max(step) AS step FROM rank_steps WHERE rank = 0) AS last"
        )
        for metric, value, total in EXTRA:
            conn.execute(
                "INSERT INTO step_stats "
                "(run_id, metric, step, ts, n, nonfinite, min, median, max, mean, total) "
                f"SELECT 1, %s, step, min(ts), count(*), 0, min({value}), "
                f"percentile_cont(0.5) WITHIN GROUP (ORDER BY {value}), max({value}), "
                f"avg({value}), "
                f"{total} FROM rank_steps GROUP BY step",
                (metric,),
            )
        for metric, column in BUCKETED:
            for level in LEVELS:
                conn.execute(
                    "INSERT INTO bucket_maxima (run_id, metric, level, bucket, ranks, maxima) "
                    f"SELECT 1, %s, {level}, b, array_agg(rank ORDER BY rank), "
                    f"array_agg(m ORDER BY rank) FROM (SELECT step / {level} AS b, rank, "
                    f"max({column}) AS m FROM rank_steps GROUP BY 1, 2) AS t "
                    "WHERE m IS NOT NULL GROUP BY b",
                    (metric,),
                )
        conn.execute("ANALYZE")
    print(
        f"rolled up {len(EXTRA)} more metrics and {len(BUCKETED)} heatmap metrics "
        f"in {time.perf_counter() - t0:.0f}s",
        flush=True,
    )


@contextmanager
def kept_database(db_url: str, name: str) -> Iterator[tuple[str, str]]:
    """A database called ``name`` on the server of ``db_url``, created if missing, kept."""
    base = make_url(db_url)
    admin = base.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')
    yield (
        base.set(database=name).render_as_string(hide_password=False),
        base.set(drivername="postgresql", database=name).render_as_string(hide_password=False),
    )


def seeded(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        try:
            return (
                conn.execute(
                    "SELECT count(*) FROM step_stats WHERE run_id = 1 AND metric = 'grad_norm'"
                ).fetchone()[0]
                > 0
            )  # type: ignore[index]
        except psycopg.errors.UndefinedTable:
            return False


# Where a visit's time went: each request's start and end, and the main thread's long tasks.
TIMELINE = """() => ({
    requests: performance.getEntriesByType('resource').map(e => ({
        name: e.name.replace(/^https?:\\/\\/[^/]+/, '').split('?')[0],
        start: e.startTime, end: e.responseEnd, size: e.encodedBodySize})),
    longtasks: (window.__twLong || []),
})"""
OBSERVE_LONG = """window.__twLong = [];
new PerformanceObserver(l => l.getEntries().forEach(e => window.__twLong.push(
    {start: e.startTime, end: e.startTime + e.duration})))
    .observe({type: 'longtask', buffered: true});"""


def show_timeline(drawn_ms: float, timeline: dict) -> None:  # type: ignore[type-arg]
    """One visit's requests (ms from navigation: start -> end, size) and long tasks."""
    print(f"    drawn at {drawn_ms:.0f} ms")
    for r in timeline["requests"]:
        if r["start"] <= drawn_ms:
            name = r["name"][-48:]
            print(f"      {r['start']:6.0f} -> {r['end']:6.0f}  {r['size']:>9,} B  {name}")
    busy = [t for t in timeline["longtasks"] if t["start"] <= drawn_ms]
    total = sum(t["end"] - t["start"] for t in busy)
    spans = ", ".join(f"{t['start']:.0f}-{t['end']:.0f}" for t in busy)
    print(f"      long tasks before the draw: {total:.0f} ms ({spans})")


def first_graph(browser, url: str, timeline: bool = False) -> float:  # type: ignore[no-untyped-def]
    """Seconds from navigation start to the first drawn graph, in a fresh page (a new
    browser context: an empty cache). ``timeline``: print where the time went."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    if timeline:
        page.add_init_script(OBSERVE_LONG)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(url, wait_until="commit")
        page.wait_for_function(DRAWN, timeout=60_000, polling=20)
        elapsed_ms = page.evaluate("performance.now()")  # since this navigation started
        if timeline:
            show_timeline(elapsed_ms, page.evaluate(TIMELINE))
        if errors:
            raise RuntimeError(f"console errors on {url}: {errors[:3]}")
        # The page's other callbacks (the ranks page's three other heatmaps) finish before
        # the next visit: closed now, the server would still compute them during it.
        with suppress(PlaywrightError):
            page.wait_for_load_state("networkidle", timeout=10_000)
        return float(elapsed_ms) / 1000
    finally:
        page.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--keep", default=None, help="seed a database of this name once and reuse it")
    p.add_argument("--seed-only", action="store_true", help="seed (with --keep) and stop")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="print each visit's requests and the browser's long tasks up to the first graph",
    )
    args = p.parse_args()
    with (
        kept_database(args.db, args.keep) if args.keep else scratch_database(args.db) as (
            sa_url,
            dsn,
        )
    ):
        if not seeded(dsn):
            seed(sa_url, dsn, ranks=args.ranks, steps=args.steps)
            seed_more(dsn)
        if args.seed_only:
            return
        with serving(sa_url, log_name="bench-ui") as url, sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
            )
            print(
                f"navigation -> first drawn graph, {args.ranks:,} ranks x {args.steps:,} steps "
                f"({os.cpu_count()} cpus), headless Chromium; target <= {TARGET_S} s"
            )
            worst = 0.0
            for name, path in PAGES:
                cold = first_graph(browser, url + path, args.timeline)
                warm = [first_graph(browser, url + path, args.timeline) for _ in range(args.repeat)]
                worst = max(worst, cold, *warm)
                print(
                    f"  {name:<14} first visit {cold:5.2f} s   "
                    f"then median {statistics.median(warm):5.2f} s, "
                    f"max {max(warm):5.2f} s ({args.repeat} visits)"
                )
            browser.close()
            verdict = "meets" if worst <= TARGET_S else "MISSES"
            print(f"  worst {worst:.2f} s: {verdict} the {TARGET_S} s target")


if __name__ == "__main__":
    main()
