"""Drills page people: real gloo ranks with an XID, a loss spike and a hung rank, a real
``trainwarden serve`` evaluating the default pack (plus two quick drill rules), the real
Alertmanager, and local HTTP receivers standing in for PagerDuty, Slack and a webhook.

Checks that the right alerts fire with their runbook links, reach every receiver the
routes name, are inhibited where they should be, resolve when the condition clears,
and that the XID pages within a second of reaching the collector (printed).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from .. import warm
from ..helpers import Server, start_serve, stop_serve, wait_for
from ..net import free_port
from ..receivers import Receiver, running_alertmanager
from .helpers import demo_ranks, stop

# Quick versions of the pack's RankHung (for: 1m) and LossSpike (for: 20 steps over a
# 200-step baseline), so that a drill of a minute shows a whole lifecycle.
DRILL_RULES = """\
rules:
  - name: DrillRankHung
    kind: event
    summary: A rank stopped making progress (drill rule).
    params: {match: rank_state, to: [hung], role: culprit}
    severity: warning
    runbook: RankHung.md
  - name: DrillLossSpike
    kind: event
    summary: A rank flagged a loss or grad-norm spike (drill rule).
    params: {match: flag, flags: [loss_spike, grad_norm_spike]}
    keep_firing_for: 5s
    severity: warning
    runbook: LossSpike.md
"""


def notify_file(path: Path, am: str, recv: Receiver) -> Path:
    path.write_text(
        textwrap.dedent(f"""\
        receivers:
          - {{name: am, kind: alertmanager, url: "{am}"}}
          - {{name: pd, kind: pagerduty, routing_key: drill-key, url: "{recv.url("/pd")}"}}
          - {{name: chat, kind: slack, url: "{recv.url("/slack")}"}}
          - {{name: hook, kind: webhook, url: "{recv.url("/hook")}"}}
        routes:
          - {{match: {{severity: critical}}, receivers: [pd]}}
          - {{receivers: [am, chat, hook]}}
        """)
    )
    return path


def launch(server: Server, run: str, drill: str, logs: Path) -> list[warm.Process]:
    # each rank on its own (pretend) node: inhibition is per node
    return demo_ranks(
        server,
        run,
        world=2,
        drill=drill,
        steps=90,
        work_ms=60,
        logs=logs,
        batch_size=16,
        env={"TRAINWARDEN_GPU_INTERVAL": "1"},
        per_rank=lambda rank: {"LOCAL_RANK": "0", "NODE_NAME": f"node{rank}"},
    )


def alerts(server: Server, **params: Any) -> list[dict[str, Any]]:
    response = server.get("/api/v1/alerts", **params)
    return response.json() if response.status_code == 200 else []


def one(server: Server, rule: str, rank: int, state: str | None = None) -> dict[str, Any] | None:
    found = [
        a
        for a in alerts(server, rule=rule)
        if a["rank"] == rank and (state is None or a["state"] == state)
    ]
    return found[0] if found else None


def hook_got(recv: Receiver, path: str, alertname: str, status: str) -> list[Any]:
    out = []
    for r in recv.got(path):
        body = r.body
        items = body["alerts"] if isinstance(body, dict) and "alerts" in body else []
        if any(a["labels"]["alertname"] == alertname and a["status"] == status for a in items):
            out.append(r)
    return out


# The embedded default; the alert engine runs on PostgreSQL in
# tests/collector/alerting/ (test_alerting_*.py).
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_drills_page_through_alertmanager_pagerduty_slack_and_webhooks(
    db_url: str, tmp_path: Path
) -> None:
    recv = Receiver()
    run = "paged"
    with running_alertmanager(tmp_path, recv.url("/am")) as am:
        rules = tmp_path / "drill-rules.yaml"
        rules.write_text(DRILL_RULES)
        port = free_port()
        external = f"http://127.0.0.1:{port}"
        server = start_serve(
            db_url,
            tmp_path / "serve.log",
            port=port,
            env={
                "TRAINWARDEN_RULES": str(rules),
                "TRAINWARDEN_EXTERNAL_URL": external,
                "TRAINWARDEN_NOTIFY": str(notify_file(tmp_path / "notify.yaml", am, recv)),
            },
        )
        drill = "xid=79@rank=0,step=10; loss_spike=50x@step=30; hang@rank=1,step=50,for=8s"
        procs = launch(server, run, drill, tmp_path)
        try:
            # XID 79 on rank 0: FatalXid (critical, evicts the node) pages PagerDuty and the rest.
            fatal = wait_for(lambda: one(server, "FatalXid", 0, "firing"), 90, "FatalXid firing")
            assert fatal["node"] == "node0" and fatal["action"] == "evict"
            assert fatal["runbook_url"] == f"{external}/runbooks/FatalXid"
            assert "XID 79" in fatal["annotations"]["description"]
            pd = wait_for(
                lambda: [
                    r
                    for r in recv.got("/pd")
                    if r.body["payload"]["summary"] and r.body["dedup_key"] == fatal["fingerprint"]
                ],
                20,
                "PagerDuty trigger",
            )
            assert (
                pd[0].body["event_action"] == "trigger" and pd[0].body["routing_key"] == "drill-key"
            )
            assert pd[0].body["links"][0]["href"] == fatal["runbook_url"]
            slack = wait_for(
                lambda: [r for r in recv.got("/slack") if "FatalXid" in r.body["text"]], 20, "Slack"
            )
            assert fatal["runbook_url"] in str(slack[0].body)
            hook = wait_for(lambda: hook_got(recv, "/hook", "FatalXid", "firing"), 20, "webhook")
            assert hook[0].body["alerts"][0]["annotations"]["runbook_url"] == fatal["runbook_url"]

            # ... and Alertmanager holds it with its runbook, and routes it on by itself.
            def in_alertmanager(name: str) -> list[dict[str, Any]]:
                got = httpx.get(f"{am}/api/v2/alerts", params={"active": "true"}, timeout=5).json()
                return [
                    a for a in got if a["labels"]["alertname"] == name and a["labels"]["run"] == run
                ]

            (held,) = wait_for(lambda: in_alertmanager("FatalXid"), 20, "FatalXid in Alertmanager")
            assert held["annotations"]["runbook_url"] == fatal["runbook_url"]
            assert (held["labels"]["rank"], held["labels"]["node"], held["labels"]["severity"]) == (
                "0",
                "node0",
                "critical",
            )
            wait_for(
                lambda: hook_got(recv, "/am", "FatalXid", "firing"),
                30,
                "Alertmanager's own webhook",
            )

            # The XID paged within a second of reaching the collector.
            (event,) = [e for e in server.get(f"/api/v1/runs/{run}/events", kind="xid").json()]
            latency = hook[0].at - event["recv_ts"]

            # Loss spike on both ranks: rank 1 pages; rank 0's node is being evicted, so
            # its alert is inhibited by FatalXid. Both resolve 5 s after the flags stop.
            spike = wait_for(
                lambda: one(server, "DrillLossSpike", 1), 120, "DrillLossSpike on rank 1"
            )
            wait_for(lambda: hook_got(recv, "/hook", "DrillLossSpike", "firing"), 20, "spike paged")
            inhibited = wait_for(
                lambda: one(server, "DrillLossSpike", 0), 20, "DrillLossSpike on rank 0"
            )
            assert inhibited["inhibited_by"] == fatal["id"]
            wait_for(
                lambda: one(server, "DrillLossSpike", 1, "resolved"), 60, "DrillLossSpike resolved"
            )
            assert spike["runbook_url"] == f"{external}/runbooks/LossSpike"

            # Hung rank 1: fires while it is stuck, resolves when the hang ends.
            wait_for(
                lambda: (a := one(server, "DrillRankHung", 1)) and a["fired_at"],
                120,
                "DrillRankHung fired",
            )
            wait_for(lambda: hook_got(recv, "/hook", "DrillRankHung", "firing"), 20, "hung paged")
            wait_for(
                lambda: one(server, "DrillRankHung", 1, "resolved"), 60, "DrillRankHung resolved"
            )
            wait_for(
                lambda: hook_got(recv, "/hook", "DrillRankHung", "resolved"),
                20,
                "hung resolve sent",
            )
            wait_for(
                lambda: not in_alertmanager("DrillRankHung"),
                20,
                "DrillRankHung resolved in Alertmanager",
            )
            wait_for(
                lambda: hook_got(recv, "/am", "DrillRankHung", "resolved"),
                30,
                "Alertmanager's resolve",
            )
            assert one(server, "FatalXid", 0, "firing")  # kept firing for its hour
            assert not [
                r for r in recv.got("/pd") if "DrillRankHung" in str(r.body)
            ]  # warnings: not routed to PD

            # Every delivery attempt is on record.
            detail = server.get(f"/api/v1/alerts/{fatal['id']}").json()
            assert {(d["receiver"], d["ok"]) for d in detail["deliveries"]} >= {
                ("pd", True),
                ("am", True),
                ("chat", True),
                ("hook", True),
            }
        finally:
            stop(procs)
            stop_serve(server)
            recv.close()
    print(f"\nXID 79 reached the collector -> webhook called in {latency * 1000:.0f} ms")
    assert latency <= 1.0, f"XID paged {latency:.2f} s after ingest (target <= 1 s)"
