"""How fast trainwarden names a hung job's culprit from the Flight Recorder, on real gloo ranks.

Each run starts the demo trainer's ranks against a real ``trainwarden serve`` with a
drill, and polls the API from the moment the drill fired (its ``drill`` event) until
``GET /api/v1/runs/{run}/collectives`` names what the scenario expects, and (hangs) the
``RankHung`` alert carries it in its ``collective`` annotation (while pending: it fires,
and so pages, only after its ``for`` of 1 minute). The UI is watched in a headless
Chromium (``/usr/bin/chromium``, Playwright): the run's Ranks page and overview, opened
before the fault, until the Ranks page's collectives summary and the overview's banner
name it (``ui_s``: the later of the two; ``--no-ui`` skips it). Printed: the latency of
each, per run, and their median.

    python bench/hang_culprit.py                          # 8 ranks, hang@rank=5,step=40
    python bench/hang_culprit.py --scenario desync        # 2 ranks, desync@rank=1,step=30
    python bench/hang_culprit.py --scenario two-groups    # 4 ranks, a second group of 2, 3 hangs
    python bench/hang_culprit.py --runs 5 --json out.json

Target (issue 33): the API, the UI and the alert name the rank, the op and the sequence
id within 10 s of the hang's start (the alert: while pending).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import serving  # noqa: E402

SCENARIOS: dict[str, dict[str, Any]] = {
    "hang": {
        "world": 8,
        "drill": "hang@rank=5,step=40,for=60s",
        "args": [],
        "expect": {"kind": "culprit", "culprits": [5], "pg": "0"},
        "ui": ["rank 5 ", "never entered all_reduce #"],
        "victims": [0, 1, 2, 3, 4, 6, 7],
        "alert": True,
    },
    "desync": {
        "world": 2,
        "drill": "desync@rank=1,step=30,for=30s",
        "args": [],
        "expect": {"kind": "desync", "culprits": [0, 1], "pg": "0"},
        "ui": ["desync on pg 0", "rank 0 ", "rank 1 "],
        "victims": [],
        "alert": False,
    },
    "two-groups": {
        "world": 4,
        "drill": "hang@rank=3,step=30,for=60s",
        "args": ["--extra-group"],  # ranks 2 and 3 share a second process group
        "expect": {"kind": "culprit", "culprits": [3], "pg": "1"},
        "ui": ["rank 3 ", "never entered all_reduce #", "on pg 1 "],
        "victims": [0, 1, 2],
        "alert": True,
    },
}


def launch(url: str, run: str, world: int, drill: str, args: list[str], logs: Path) -> list[Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "TRAINWARDEN_DRILL": drill,
            "TRAINWARDEN_FLUSH_INTERVAL": "0.5",
            "TRAINWARDEN_PROFILE_EVERY": "0",
        }
        cmd = [
            sys.executable,
            "-m",
            "trainwarden.agent.demo_trainer",
            "--run-name",
            run,
            "--url",
            url,
            "--steps",
            "400",
            "--work-ms",
            "40",
            "--batch-size",
            "16",
            *args,
        ]
        log = (logs / f"{run}-rank{rank}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _get(url: str, path: str, **params: Any) -> Any:
    try:
        response = httpx.get(url + path, params=params, timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def matches(verdict: dict[str, Any] | None, expect: dict[str, Any]) -> bool:
    return (
        verdict is not None
        and verdict["kind"] == expect["kind"]
        and verdict["culprits"] == expect["culprits"]
        and (verdict.get("group") or {}).get("pg") == expect["pg"]
        and verdict.get("seq") is not None
        and bool(verdict.get("op"))
    )


CHROMIUM = "/usr/bin/chromium"
UI_PAGES = {  # page -> the element that names the culprit on it
    "ranks": ("/runs/{run}/ranks", "#ranks-collectives .coll-summary"),
    "overview": ("/runs/{run}", "#run-hang-banner"),
}


class UiWatch(threading.Thread):
    """The run's Ranks page and overview in a headless Chromium, opened as soon as the run
    exists and left open (each refreshes itself, as an on-call's tab does): ``seen`` is
    when each first named what ``needles`` says (wall clock)."""

    def __init__(self, url: str, run: str, needles: list[str]) -> None:
        super().__init__(daemon=True, name=f"ui-{run}")
        self.url, self.run_name, self.needles = url, run, needles
        self.seen: dict[str, float] = {}
        self.error: str | None = None
        self.stop = threading.Event()

    def done(self) -> bool:
        return len(self.seen) == len(UI_PAGES) or self.error is not None

    def run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # said in the output, not a crash of the bench
            self.error = f"{type(exc).__name__}: {exc}"

    def _watch(self) -> None:
        from playwright.sync_api import sync_playwright

        while not self.stop.is_set() and _get(self.url, f"/api/v1/runs/{self.run_name}") is None:
            time.sleep(0.2)
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            )
            pages = {}
            for name, (path, _) in UI_PAGES.items():
                pages[name] = browser.new_page()
                pages[name].goto(self.url + path.format(run=self.run_name))
            while not self.stop.is_set() and len(self.seen) < len(UI_PAGES):
                for name, page in pages.items():
                    if name in self.seen:
                        continue
                    texts = page.locator(UI_PAGES[name][1]).all_inner_texts()
                    if any(all(n in t for n in self.needles) for t in texts):
                        self.seen[name] = time.time()
                time.sleep(0.2)
            browser.close()


def one_run(
    url: str, run: str, scenario: dict[str, Any], logs: Path, *, ui: bool = True
) -> dict[str, Any]:
    watch = UiWatch(url, run, scenario["ui"]) if ui else None
    if watch is not None:
        watch.start()
    procs = launch(url, run, scenario["world"], scenario["drill"], scenario["args"], logs)
    out: dict[str, Any] = {"run": run, "drill": scenario["drill"]}
    try:
        deadline = time.monotonic() + 180
        fired = None
        while fired is None and time.monotonic() < deadline:
            drills = _get(url, f"/api/v1/runs/{run}/events", kind="drill") or []
            fired = min((e["ts"] for e in drills), default=None)
            if any(p.poll() not in (None, 0) for p in procs) and fired is None:
                raise RuntimeError(f"a rank exited early; logs in {logs}")
            time.sleep(0.2)
        if fired is None:
            raise RuntimeError("the drill never fired")
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not (
            "complete_s" in out
            and ("alert_s" in out or not scenario["alert"])
            and (watch is None or watch.done())
        ):
            now = time.time()
            if "complete_s" not in out:
                view = _get(url, f"/api/v1/runs/{run}/collectives") or {}
                verdict = view.get("verdict")
                if matches(verdict, scenario["expect"]):
                    out.setdefault("api_s", round(now - fired, 2))  # rank, op and seq named
                    out["verdict"] = verdict
                    if verdict["victims"] == scenario["victims"]:  # every rank's ring in
                        out["complete_s"] = round(now - fired, 2)
            if scenario["alert"] and "alert_s" not in out:
                for a in _get(url, "/api/v1/alerts", run=run) or []:
                    named = (a.get("annotations") or {}).get("collective") or ""
                    if a["rule"] == "RankHung" and "never entered" in named:
                        out["alert_s"] = round(now - fired, 2)
                        out["alert"] = {"rank": a["rank"], "collective": named}
            time.sleep(0.2)
        ranks = _get(url, f"/api/v1/runs/{run}/ranks") or []
        out["hung_s"] = min(
            (r["state_since"] - fired for r in ranks if r["state"] == "hung" and r["state_since"]),
            default=None,
        )
        if watch is not None:
            for name, at in watch.seen.items():
                out[f"ui_{name}_s"] = round(at - fired, 2)
            if watch.done() and watch.error is None:
                out["ui_s"] = max(out["ui_ranks_s"], out["ui_overview_s"])
            out["ui_error"] = watch.error
    finally:
        if watch is not None:
            watch.stop.set()
            watch.join(30)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="hang")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--db", help="collector database (default: a fresh SQLite file)")
    p.add_argument("--json", help="write the runs' results here")
    p.add_argument("--no-ui", action="store_true", help="do not watch the UI in Chromium")
    args = p.parse_args()
    scenario = SCENARIOS[args.scenario]
    logs = Path(tempfile.mkdtemp(prefix="tw-hang-"))
    db = args.db or f"sqlite:///{logs / 'collector.db'}"
    results = []
    with serving(db, log_name="hang-culprit") as url:
        for i in range(args.runs):
            r = one_run(url, f"hang-{args.scenario}-{i}", scenario, logs, ui=not args.no_ui)
            results.append(r)
            print(
                f"run {i}: {scenario['drill']} on {scenario['world']} ranks: hung state "
                f"{_s(r.get('hung_s'))}, API verdict {_s(r.get('api_s'))} (all ranks' "
                f"rings {_s(r.get('complete_s'))})"
                + (f", alert (pending) {_s(r.get('alert_s'))}" if scenario["alert"] else "")
                + (
                    ""
                    if args.no_ui
                    else f", UI {_s(r.get('ui_s'))} (Ranks page {_s(r.get('ui_ranks_s'))}, "
                    f"overview banner {_s(r.get('ui_overview_s'))}"
                    + (f"; {r['ui_error']}" if r.get("ui_error") else "")
                    + ")"
                )
                + f" after the fault; {(r.get('verdict') or {}).get('summary', 'NO VERDICT')}",
                flush=True,
            )
    for key in ("hung_s", "api_s", "complete_s", "alert_s", "ui_s"):
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            print(
                f"{key}: median {statistics.median(values):.2f} s, max {max(values):.2f} s "
                f"over {len(values)} of {len(results)} runs"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if any(r.get("api_s") is None or r["api_s"] > 10 for r in results):
        sys.exit(1)


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


if __name__ == "__main__":
    main()
