"""The alerts page's builders as pure functions of the API's objects, what its buttons
do (through a real database, SQLite and PostgreSQL), and its URL."""

from __future__ import annotations

import time
from typing import Any

import dash
import pytest
from sqlalchemy import insert

from trainwarden.collector.actions.schemas import ActionOut
from trainwarden.collector.alerting.schemas import AlertOut, Matcher, SilenceOut
from trainwarden.collector.store import models as m
from trainwarden.webui import components
from trainwarden.webui.client import LocalClient, Refused
from trainwarden.webui.components import notice
from trainwarden.webui.pages.alerts import panels as alerts
from trainwarden.webui.pages.alerts import query as alerts_query
from trainwarden.webui.pages.alerts.actions import SilenceForm, perform

from .helpers import classes, classes_of, text, walk

NOW = 1_700_000_000.0


def alert(**over: Any) -> AlertOut:
    base: dict[str, Any] = dict(
        id=7,
        fingerprint="f",
        rule="FatalXid",
        run="r1",
        rank=3,
        node="node1",
        gpu="0",
        severity="critical",
        state="firing",
        labels={},
        runbook_url="/runbooks/FatalXid",
        annotations={
            "description": "rank 3 (node node1): XID 79",
            "runbook_url": "/runbooks/FatalXid",
        },
        value=79.0,
        step=10,
        action="evict",
        active_since=NOW - 60,
        fired_at=NOW - 60,
        resolved_at=None,
        updated_at=NOW,
        acked_at=None,
        acked_by=None,
        ack_comment=None,
        silenced_by=None,
        inhibited_by=None,
        notified="firing",
        last_sent_at=NOW - 60,
    )
    return AlertOut(**{**base, **over})


def action(**over: Any) -> ActionOut:
    base: dict[str, Any] = dict(
        id=4,
        run="r1",
        kind="evict",
        state="proposed",
        mode="require-ack",
        trigger="rule:FatalXid",
        alert_id=7,
        rank=None,
        node="node1",
        approver=None,
        plan=None,
        result=None,
        reason="XID 79",
        history=[],
        created_at=NOW - 5,
        updated_at=NOW - 5,
        finished_at=None,
    )
    return ActionOut(**{**base, **over})


def silence(**over: Any) -> SilenceOut:
    base: dict[str, Any] = dict(
        id=3,
        matchers=[Matcher(name="run", value="r1"), Matcher(name="rank", value="1|2", regex=True)],
        starts_at=NOW - 10,
        ends_at=NOW + 3600,
        created_by="ana",
        comment="node1 maintenance",
        created_at=NOW - 10,
        active=True,
    )
    return SilenceOut(**{**base, **over})


def buttons(component: Any) -> dict[str, Any]:
    return {p.children: p.id for p in walk(component) if type(p).__name__ == "Button"}


def links(component: Any, cls: str) -> list[str]:
    return [p.href for p in walk(component) if cls in classes_of(p)]


# -- rows ------------------------------------------------------------------------


def test_a_firing_alert_row_shows_severity_runbook_where_since_and_acts() -> None:
    row = alerts.alert_row(alert(), now=NOW)
    assert {"alert-row", "alert-firing", "severity-critical", "status-firing"} <= set(classes(row))
    assert links(row, "runbook-link") == ["/runbooks/FatalXid"]
    assert links(row, "run-link") == ["/runs/r1"]
    shown = text(row)
    assert "FatalXid" in shown and "XID 79" in shown
    assert "rank 3 · node1 · GPU 0" in shown and "(60s ago)" in shown
    assert buttons(row) == {
        "Acknowledge": {"type": "alerts-ack", "index": 7},
        "Silence…": {"type": "alerts-mute", "index": 7},
    }


def test_an_alert_seen_after_its_onset_says_where_the_anomaly_began() -> None:
    # Fast steps: the pass that fired LossSpike ran 19 steps after the loss left its trend.
    late = alert(rule="LossSpike", rank=None, onset_step=121, fired_at_step=140)
    assert text(alerts.since(late, NOW)).endswith("; began at step 121")
    assert "began at step 121" in text(alerts.alert_row(late, now=NOW))
    # An event fires at its own step: nothing to add.
    assert "began" not in text(alerts.since(alert(onset_step=10, fired_at_step=10), NOW))
    assert "began" not in text(alerts.since(alert(), NOW))  # stored before onsets were kept


def test_acknowledged_silenced_and_inhibited_alerts_say_so() -> None:
    row = alerts.alert_row(
        alert(acked_by="ana", acked_at=NOW - 30, silenced_by=2, inhibited_by=5), now=NOW
    )
    shown = text(row)
    assert "acked by ana 30s ago" in shown
    assert "silenced (#2)" in shown and "inhibited by alert #5" in shown
    assert "alert-quiet" in classes(row)
    assert list(buttons(row)) == ["Silence…"]  # acknowledged once is enough


def test_a_resolved_alert_has_no_buttons_and_says_when_it_resolved() -> None:
    row = alerts.alert_row(alert(state="resolved", resolved_at=NOW - 120), now=NOW)
    assert buttons(row) == {}
    assert "status-resolved" in classes(row) and "(2 min ago)" in text(row)


@pytest.mark.parametrize(
    ("runbook_url", "href"),
    [
        ("/runbooks/FatalXid", "/runbooks/FatalXid"),
        ("https://tw.example.org/runbooks/FatalXid", "https://tw.example.org/runbooks/FatalXid"),
        (None, "/runbooks/FatalXid"),
        ("FatalXid.md", "/runbooks/FatalXid"),
        ("javascript:alert(1)", "/runbooks/javascript:alert(1)"),  # never a script link
    ],
)
def test_runbook_link(runbook_url: str | None, href: str) -> None:
    assert alerts.runbook_href(alert(runbook_url=runbook_url)) == href


def test_empty_states_say_what_to_do() -> None:
    firing = alerts.alerts_table([], now=NOW, run=None, states=["firing"])
    assert text(firing).startswith("No alerts firing.")
    default = alerts.alerts_table([], now=NOW, run="r1", states=alerts_query.OPEN)
    assert text(default) == (
        "No alerts firing or pending for run r1. Clear the run filter to see every run."
    )
    assert "Tick at least one state" in text(alerts.alerts_table([], now=NOW, run=None, states=[]))
    assert text(alerts.silences_table([], now=NOW)) == "No active silences."
    assert text(alerts.actions_table([], now=NOW, run="r1")).startswith("No actions for run r1.")


def test_alerts_table_lists_every_alert_newest_first_as_given() -> None:
    table = alerts.alerts_table(
        [alert(id=9, state="pending"), alert(id=7)], now=NOW, run=None, states=alerts_query.OPEN
    )
    assert [p.id for p in walk(table) if "alert-row" in classes_of(p)] == [
        "alert-9",
        "alert-7",
    ]


def test_silences_list_their_matchers_and_end() -> None:
    table = alerts.silences_table([silence()], now=NOW)
    assert "run=r1, rank=~1|2" in text(table) and "(in 60 min)" in text(table)
    assert buttons(table) == {"End": {"type": "alerts-unsilence", "index": 3}}


def test_a_table_whose_only_change_is_the_clock_is_not_redrawn() -> None:
    """The ages count on in the browser (assets/ages.js): a refresh seconds later draws
    the same digest, so the table and its buttons stay; a change in what it says is
    drawn, and only in its own part."""

    def parts(now: float, **over: Any) -> list[Any]:
        return [
            alerts.alerts_table([alert(**over)], now=now, run=None, states=alerts_query.OPEN),
            alerts.silences_table([silence()], now=now),
            alerts.actions_table([action()], now=now),
        ]

    first, later = parts(NOW), parts(NOW + 7)
    assert "(60s ago)" in text(first[0]) and "(67s ago)" in text(later[0])  # drawn as of now
    ages = [p for p in walk(first) if "ago" in classes_of(p) or "until" in classes_of(p)]
    assert len(ages) == 3 and all(p.to_plotly_json()["props"]["data-now"] == NOW for p in ages)
    assert [components.digest(p) for p in first] == [components.digest(p) for p in later]

    shown, seen = components.redraw(first, None)  # a page's first refresh draws it all
    assert shown == first
    assert components.redraw(later, seen)[0] == [dash.no_update] * 3
    acked = parts(NOW + 7, acked_by="ana", acked_at=NOW + 6)
    assert components.redraw(acked, seen)[0] == [acked[0], dash.no_update, dash.no_update]
    assert (
        components.digest(
            alerts.alerts_table(
                [alert(state="pending")], now=NOW, run=None, states=alerts_query.OPEN
            )
        )
        != seen[0]
    )
    # A part with no live times is hashed as drawn: any change is one.
    assert components.digest(notice("a")) != components.digest(notice("b"))


def test_actions_offer_approve_and_cancel_only_while_undecided() -> None:
    assert list(buttons(alerts.action_row(action(), now=NOW))) == ["Approve", "Cancel"]
    assert list(buttons(alerts.action_row(action(state="approved"), now=NOW))) == ["Cancel"]
    done = action(
        state="done",
        mode="dry-run",
        result={"dry_run": True, "would": {"node": "node1"}, "problem": None},
    )
    row = alerts.action_row(done, now=NOW)
    assert buttons(row) == {}
    assert "dry run, nothing done; would evict: node node1" in text(row)
    failed = action(state="failed", reason="blast-radius guard: too many nodes")
    assert "blast-radius guard" in text(alerts.action_row(failed, now=NOW))
    unset = action(
        state="done",
        mode="dry-run",
        result={"dry_run": True, "would": {"node": "node1", "backend": None}, "problem": None},
    )
    assert "would evict: node node1 (no eviction backend is configured)" in text(
        alerts.action_row(unset, now=NOW)
    )
    # A done rollback in words, not its result's fields (every rank's step, seconds, time).
    ranks = {
        str(r): {"barrier_step": 1259, "checkpoint_step": 1000, "seconds": 0.01, "at": NOW}
        for r in (0, 1)
    }
    rolled = action(
        kind="rollback",
        state="done",
        mode="auto",
        result={"ranks": ranks, "restored_within_s": 0.12},
    )
    expected = (
        "every rank (2) restored the checkpoint of step 1000 after step 1259, "
        "0.12 s after the commit"
    )
    assert expected in text(alerts.action_row(rolled, now=NOW))


def test_run_page_panel_lists_open_alerts_with_runbooks() -> None:
    panel = alerts.run_alerts_panel([alert()], run="r 1", now=NOW)
    assert "Open alerts (1)" in text(panel)
    assert links(panel, "runbook-link") == ["/runbooks/FatalXid"]
    none = alerts.run_alerts_panel([], run="r 1", now=NOW)
    assert "No open alerts" in text(none)
    history = [p.href for p in walk(none) if getattr(p, "href", None)]
    assert history == ["/alerts?run=r+1&state=pending&state=firing&state=resolved"]


# -- the URL ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("search", "parsed", "written"),
    [
        ("", (None, ["pending", "firing"]), ""),
        ("?run=r1&state=firing", ("r1", ["firing"]), "?run=r1&state=firing"),
        ("?state=resolved,firing", (None, ["firing", "resolved"]), "?state=firing&state=resolved"),
        ("?state=pending&state=firing", (None, ["pending", "firing"]), ""),
        ("?state=none", (None, []), "?state=none"),
    ],
)
def test_filters_round_trip_through_the_query_string(
    search: str, parsed: tuple[str | None, list[str]], written: str
) -> None:
    assert alerts_query.parse_query(search) == parsed
    assert alerts_query.query_string(*parsed) == written


# -- buttons ---------------------------------------------------------------------


def seed_alert(engine: Any, *, state: str = "firing") -> int:
    now = time.time()
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(m.runs)
            .values(name="r1", created_at=now, updated_at=now, world_size=2)
            .returning(m.runs.c.id)
        ).scalar_one()
        return conn.execute(
            insert(m.alerts)
            .values(
                fingerprint="fp",
                rule="FatalXid",
                run_id=run_id,
                rank=1,
                severity="critical",
                state=state,
                labels={"run": "r1", "rank": "1"},
                annotations={"runbook_url": "/runbooks/FatalXid"},
                active_since=now,
                fired_at=now,
                updated_at=now,
            )
            .returning(m.alerts.c.id)
        ).scalar_one()


def test_buttons_act_through_the_api_code_and_say_why_not(engine) -> None:  # type: ignore[no-untyped-def]
    client = LocalClient(engine)
    firing, resolved = seed_alert(engine), 0
    with engine.begin() as conn:
        run_id = conn.execute(m.runs.select()).first().id
        resolved = conn.execute(
            insert(m.alerts)
            .values(
                fingerprint="fp2",
                rule="RankDead",
                run_id=run_id,
                severity="critical",
                state="resolved",
                labels={},
                annotations={},
                active_since=NOW,
                updated_at=NOW,
                resolved_at=NOW,
            )
            .returning(m.alerts.c.id)
        ).scalar_one()
    form = SilenceForm()

    message, kind = perform(client, {"type": "alerts-ack", "index": firing}, by="", form=form)
    assert kind == "error" and "Your name" in message
    assert client.alert(firing).acked_by is None

    message, kind = perform(client, {"type": "alerts-ack", "index": firing}, by="ana", form=form)
    assert kind == "info" and client.alert(firing).acked_by == "ana"
    message, _ = perform(client, {"type": "alerts-ack", "index": firing}, by="bo", form=form)
    assert "already acknowledged by ana" in message and client.alert(firing).acked_by == "ana"
    message, kind = perform(client, {"type": "alerts-ack", "index": resolved}, by="ana", form=form)
    assert (kind, message) == ("error", f"Not done: alert {resolved} is already resolved.")

    message, kind = perform(
        client, "alerts-silence-submit", by="ana", form=SilenceForm(comment="x")
    )
    assert kind == "error" and "at least one of run, rank and alert name" in message
    message, kind = perform(
        client, "alerts-silence-submit", by="ana", form=SilenceForm(rank="two", comment="x")
    )
    assert kind == "error" and "not a rank number" in message
    message, kind = perform(client, "alerts-silence-submit", by="ana", form=SilenceForm(run="r1"))
    assert kind == "error" and "Why" in message
    assert client.silences() == []

    wanted = SilenceForm(run="r1", rank="1", alertname="FatalXid", duration_s=1800, comment="swap")
    message, kind = perform(client, "alerts-silence-submit", by="ana", form=wanted)
    assert kind == "info", message
    (made,) = client.silences()
    assert [(mt.name, mt.value) for mt in made.matchers] == [
        ("run", "r1"),
        ("rank", "1"),
        ("alertname", "FatalXid"),
    ]
    assert (made.created_by, made.comment) == ("ana", "swap")
    assert made.ends_at - made.starts_at == pytest.approx(1800)
    perform(client, {"type": "alerts-unsilence", "index": made.id}, by=None, form=form)
    assert client.silences() == []

    with engine.begin() as conn:
        proposed = conn.execute(
            insert(m.actions)
            .values(
                run_id=run_id,
                kind="evict",
                state="proposed",
                mode="require-ack",
                trigger="rule:FatalXid",
                node="node1",
                history=[],
                created_at=NOW,
                updated_at=NOW,
            )
            .returning(m.actions.c.id)
        ).scalar_one()
    message, kind = perform(
        client, {"type": "alerts-approve", "index": proposed}, by="ana", form=form
    )
    (approved,) = client.actions(run="r1")
    assert (kind, approved.state, approved.approver) == ("info", "approved", "ana"), message
    perform(client, {"type": "alerts-cancel", "index": proposed}, by="bo", form=form)
    assert client.actions(run="r1")[0].state == "cancelled"
    message, kind = perform(
        client, {"type": "alerts-approve", "index": proposed}, by="ana", form=form
    )
    assert kind == "error" and "is cancelled" in message

    with pytest.raises(Refused, match="not found"):
        client.ack(999_999, by="ana")
    message, kind = perform(
        client, {"type": "alerts-approve", "index": 999_999}, by="ana", form=form
    )
    assert (kind, message) == ("error", "Not done: action 999999 not found.")


def test_the_runs_list_counts_each_runs_firing_alerts_and_links_them() -> None:
    from types import SimpleNamespace

    from trainwarden.webui.pages.runs.data import runs_table

    class Runs:
        def list_runs(self) -> list[Any]:
            return [
                SimpleNamespace(
                    name=n,
                    status="running",
                    world_size=2,
                    ranks_seen=2,
                    last_step=5,
                    updated_at=time.time(),
                )
                for n in ("r1", "quiet run")
            ]

        def alerts(self, *, states: list[str] | None = None, **_: Any) -> list[AlertOut]:
            assert states == ["firing"]
            return [alert(id=1), alert(id=2, rank=0), alert(id=3, run="other")]

    table = runs_table(Runs())  # type: ignore[arg-type]
    rows = table.children[1].children
    cells = {row.children[0].children.children: row.children[2].children for row in rows}
    assert (cells["r1"].children, cells["r1"].href) == ("2", "/alerts?run=r1&state=firing")
    assert cells["quiet run"] == "—"
    assert "Firing alerts" in [th.children for th in table.children[0].children.children]
