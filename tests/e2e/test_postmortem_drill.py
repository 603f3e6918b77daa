"""The post-mortem of a real drill: gloo ranks with a loss spike, a real ``trainwarden
serve`` that fires LossSpike, pages a local webhook and rolls the run back (the rollback
drill's rules and policy), then ``trainwarden postmortem`` as an on-call engineer runs it.

Checks that the report tells the story in order (the injected fault, the alert pending
and firing, the page, the rollback executing and done, recovery) with durations equal
to the stored timestamps, that a real receiver gets the posted report, and that the HTML
report opened from disk in headless Chromium draws its charts with no console error.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ..helpers import start_serve, stop_serve, wait_for
from ..receivers import Receiver
from .helpers import ACTIONS, RULES, launch, stop
from .launch import finished_action


def open_report(browser: Any, path: Path) -> dict[str, Any]:
    """Open an HTML report from disk; wait for its charts; return what the page shows and
    every console error and uncaught exception."""
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on(
        "request",
        lambda req: (
            errors.append(f"fetched {req.url}")
            if not req.url.startswith(("file:", "data:"))
            else None
        ),
    )
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
        shown = page.evaluate("""() => ({
            charts: document.querySelectorAll('.js-plotly-plot').length,
            traces: [...document.querySelectorAll('.js-plotly-plot')].map(p => p._fullData.length),
            lines: document.querySelectorAll('.js-plotly-plot .scatterlayer path.js-line').length,
            entries: document.querySelectorAll('tr.entry').length,
        })""")
    finally:
        page.close()
    shown["errors"] = errors
    return shown


def trainwarden(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainwarden.collector.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def first(entries: list[dict[str, Any]], source: str, kind: str, **ref: Any) -> int:
    for i, e in enumerate(entries):
        if (e["source"], e["kind"]) == (source, kind) and all(
            e["ref"].get(k) == v for k, v in ref.items()
        ):
            return i
    raise AssertionError(
        f"no {source}/{kind} {ref} in {[(e['source'], e['kind']) for e in entries]}"
    )


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)  # SQLite: tests/collector
def test_the_postmortem_of_a_rollback_drill_tells_it_in_order_with_the_stored_durations(
    db_url: str, tmp_path: Path, browser: Any
) -> None:
    recv = Receiver()
    rules, actions, notify = (
        tmp_path / "rules.yaml",
        tmp_path / "actions.yaml",
        tmp_path / "notify.yaml",
    )
    rules.write_text(RULES)
    actions.write_text(ACTIONS)
    notify.write_text(
        textwrap.dedent(f"""\
        receivers:
          - {{name: oncall, kind: webhook, url: "{recv.url("/page")}"}}
        routes:
          - {{receivers: [oncall]}}
        """)
    )
    server = start_serve(
        db_url,
        tmp_path / "serve.log",
        env={
            "TRAINWARDEN_RULES": str(rules),
            "TRAINWARDEN_DEFAULT_RULES": "0",
            "TRAINWARDEN_ACTIONS": str(actions),
            "TRAINWARDEN_NOTIFY": str(notify),
            "TRAINWARDEN_PRICE_PER_GPU_HOUR": "4",
        },
    )
    run = "postmortem2"
    procs = launch(server, run, 2, tmp_path / "ckpt", tmp_path)
    try:
        codes = [p.wait(300) for p in procs]
        assert codes == [0, 0], [
            (tmp_path / f"{run}-rank{r}.log").read_text()[-2000:] for r in range(2)
        ]
        action = finished_action(server, run)
        assert action["state"] == "done", action
        incident = wait_for(
            lambda: [
                i
                for i in server.get(f"/api/v1/runs/{run}/incidents").json()
                if action["id"] in i["actions"]
            ],
            30,
            "the incident with the rollback",
        )[0]
        alert = server.get(f"/api/v1/alerts/{action['alert_id']}").json()
        wait_for(
            lambda: [
                d
                for d in server.get(f"/api/v1/alerts/{action['alert_id']}").json()["deliveries"]
                if d["ok"]
            ],
            30,
            "the page on record",
        )

        out = tmp_path / "report.json"
        got = trainwarden(
            "postmortem",
            run,
            "--incident",
            str(incident["id"]),
            "--format",
            "json",
            "--out",
            str(out),
            "--post",
            recv.url("/report"),
            "--url",
            server.url,
        )
        assert got.returncode == 0, got.stderr
        page = tmp_path / "report.html"
        html = trainwarden(
            "postmortem", run, "--format", "html", "--out", str(page), "--url", server.url
        )
        assert html.returncode == 0, html.stderr

        # What the collector stored, read back through its API.
        alert = server.get(f"/api/v1/alerts/{action['alert_id']}").json()
        action = server.get(f"/api/v1/actions/{action['id']}").json()
        drills = server.get(f"/api/v1/runs/{run}/events", kind="drill").json()
        steps = server.get(f"/api/v1/runs/{run}/series", metric="step_time").json()
        incident = server.get(f"/api/v1/incidents/{incident['id']}").json()
        all_alerts = [server.get(f"/api/v1/alerts/{i}").json() for i in incident["alerts"]]
    finally:
        stop(procs)
        stop_serve(server)
        recv.close()

    report = json.loads(out.read_text())
    (t,) = report["incidents"]
    entries, f = t["entries"], t["figures"]
    # In order: the fault, the alert pending and firing, the page, the action, recovery.
    story = [
        first(entries, "event", "drill"),
        first(entries, "alert", "pending", alert=alert["id"]),
        first(entries, "alert", "firing", alert=alert["id"]),
        first(entries, "page", "delivered"),
        first(entries, "action", "executing", action=action["id"]),
        first(entries, "action", "done", action=action["id"]),
        first(entries, "derived", "recovered"),
    ]
    # The page and the action both follow the firing; which comes first is a race between
    # the notifier and the action engine (an auto rollback need not wait for the page).
    said = [(entries[i]["source"], entries[i]["kind"]) for i in story]
    paged, acted = story[3], story[4]
    assert story[:3] == sorted(story[:3]) and story[2] < min(paged, acted), said
    assert max(paged, acted) < story[5] < story[6], said
    assert entries[story[0]]["text"] == "fault injected (drill): loss_spike x50"

    # The durations are the differences of the stored timestamps.
    fault = min(e["ts"] for e in drills)
    pending = min(a["active_since"] for a in all_alerts)
    firing = min(a["fired_at"] for a in all_alerts if a["fired_at"] is not None)
    paged = min(
        d["at"] + d["duration_s"]
        for a in all_alerts
        for d in a["deliveries"]
        if d["ok"] and d["status"] == "firing"
    )
    executing = min(h["at"] for h in action["history"] if h["state"] == "executing")
    recovered = min(ts for ts in steps["ts"] if ts > action["finished_at"])
    assert f["fault_at"] == pytest.approx(fault)
    assert f["detect_s"] == pytest.approx(pending - fault)
    assert f["page_s"] == pytest.approx(paged - firing)
    # ... and against the receiver's own clock: the firing page arrived there before its
    # delivery was done, and within the delivery's time of it.
    pages = [r for r in recv.got("/page") if '"firing"' in json.dumps(r.body)]
    arrived = min(r.at for r in pages)
    delivery = min(
        d["duration_s"] for a in all_alerts for d in a["deliveries"] if d["status"] == "firing"
    )
    assert arrived - firing <= f["page_s"] + 0.01  # arrival before the answer came back
    # The alert went pending after the fault and before the page reached the receiver.
    assert f["fault_at"] <= f["fault_at"] + f["detect_s"] <= arrived, (f, arrived)
    assert f["page_s"] - delivery - 0.05 <= arrived - firing, (arrived - firing, f, delivery)
    assert f["act_s"] == pytest.approx(executing - firing)
    assert f["recover_s"] == pytest.approx(recovered - fault)
    ranks = action["result"]["ranks"].values()
    assert f["steps_lost"] == max(r["barrier_step"] for r in ranks) - 30  # restored step 30
    # ... which the trainers' own logs say too: each rank printed where it rolled back.
    said = {
        int(m[1])
        for r in range(2)
        for m in re.finditer(
            r"rolled back to step 30 after step (\d+)",
            (tmp_path / f"{run}-rank{r}.log").read_text(),
        )
    }
    assert said == {30 + f["steps_lost"]}, (said, f["steps_lost"])
    # ... and when, by their own clock: every rank restored after the action started
    # executing (act), and before the first step after it (recover).
    restored = [
        float(m[1])
        for r in range(2)
        for m in re.finditer(
            r"rolled back to step 30 after step \d+; .* \(at ([\d.]+)\)",
            (tmp_path / f"{run}-rank{r}.log").read_text(),
        )
    ]
    assert len(restored) == 2, restored
    assert firing + f["act_s"] <= min(restored), (firing, f, restored)
    assert max(restored) <= f["fault_at"] + f["recover_s"], (f, restored)
    assert f["gpu_hours_lost"] == pytest.approx(2 * f["time_lost_s"] / 3600)
    assert f["cost"] == pytest.approx(4 * f["gpu_hours_lost"])  # serve's price per GPU-hour
    for key in ("detect_s", "page_s", "act_s", "recover_s"):
        assert f[key] >= 0, (key, f)

    # The posted report reached a real receiver; the HTML draws its charts offline.
    (posted,) = recv.got("/report")
    assert posted.body["report"]["incidents"][0]["figures"] == f
    shown = open_report(browser, page)
    assert shown["errors"] == []
    assert shown["charts"] == 1 and shown["traces"][0] >= 3 * 3  # loss, step time, MFU
    assert shown["lines"] > 0 and shown["entries"] >= len(story)
    print(
        f"\npost-mortem of {run}: detect {f['detect_s']:.2f} s, page {f['page_s']:.2f} s, "
        f"act {f['act_s']:.2f} s, recover {f['recover_s']:.2f} s, {f['steps_lost']} steps and "
        f"{f['gpu_hours_lost'] * 3600:.1f} GPU-seconds lost"
    )


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_html_report_opened_from_disk_draws_its_charts_with_no_console_error(
    engine: Any, tmp_path: Path, browser: Any
) -> None:
    from trainwarden.collector.incidents.grouping import group
    from trainwarden.collector.incidents.postmortem import report_of
    from trainwarden.collector.incidents.report_html import render_html
    from trainwarden.collector.store.db import write

    from ..collector import incident_scenario as sc

    sc.rollback_incident(engine)
    with write(engine) as conn:
        group(conn, now=sc.T0 + 80, cooldown_s=60)
    with engine.connect() as conn:
        page = tmp_path / "report.html"
        page.write_text(render_html(report_of(conn, run=sc.RUN, now=sc.T0 + 100)))
    shown = open_report(browser, page)
    assert shown["errors"] == []
    assert shown["charts"] == 1 and shown["traces"] == [
        3 * 3 + 1
    ]  # loss, step time, MFU; rank 0's °C
    assert shown["lines"] >= 3 and shown["entries"] > 10
