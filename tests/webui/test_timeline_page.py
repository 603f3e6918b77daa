"""The timeline page: its pieces as pure functions of the API's answers (the entries
table, the figures card, the incident list, the URL), and what it draws from a real
database (SQLite and PostgreSQL) for the rollback drill's incident, a run with none, an
unknown incident and a missing run; its buttons through the API's own functions."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from sqlalchemy import Engine

from trainwarden.collector.incidents.grouping import group
from trainwarden.collector.incidents.schemas import IncidentOut
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.settings import Settings
from trainwarden.collector.store.db import write
from trainwarden.webui.client import LocalClient
from trainwarden.webui.pages.timeline import actions as timeline_actions
from trainwarden.webui.pages.timeline import data as timeline_data
from trainwarden.webui.pages.timeline import figures as tl_figures
from trainwarden.webui.pages.timeline import panels as view
from trainwarden.webui.pages.timeline import query as tl_query

from ..collector import incident_scenario as sc
from .helpers import classes, classes_of, text, walk

NOW = sc.T0 + 100


def entry(
    at: float, source: str = "event", kind: str = "drill", text: str = "x", **over: Any
) -> dict[str, Any]:
    base = dict(
        at=at,
        step=None,
        source=source,
        kind=kind,
        rank=None,
        node=None,
        severity="info",
        text=text,
        runbook_url=None,
        ui_url=None,
        ref={},
    )
    return {**base, **over}


def incident(n: int, **over: Any) -> IncidentOut:
    base: dict[str, Any] = dict(
        id=n,
        run="r",
        title=f"Trouble {n}",
        state="open",
        severity="critical",
        auto=True,
        opened_at=sc.T0 + n,
        opened_by="trainwarden",
        closed_at=None,
        closed_by=None,
        summary=None,
        merged_into=None,
        ranks=[0],
        nodes=["node0"],
        history=[],
        alerts=[],
        actions=[],
        posted_at=None,
        post_status=None,
        updated_at=sc.T0,
    )
    return IncidentOut(**{**base, **over})


def rows(table: Any) -> list[Any]:
    return [c for c in walk(table) if "tl-entry" in classes_of(c)]


# -- the URL -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("search", "want"),
    [
        ("", None),
        (None, None),
        ("?incident=3", 3),
        ("incident=12", 12),
        ("?incident=%203%20", 3),
        ("?other=1", None),
    ],
)
def test_the_url_selects_an_incident(search: str | None, want: int | None) -> None:
    assert tl_query.parse_query(search) == (want, None)
    assert tl_query.parse_query(tl_query.query_string(want)) == (want, None)


@pytest.mark.parametrize("bad", ["abc", "-1", "0", "3.5", str(2**63)])
def test_a_url_with_no_incident_number_says_so_and_shows_the_whole_run(bad: str) -> None:
    incident_id, problem = tl_query.parse_query(f"?incident={bad}")
    assert incident_id is None
    assert problem is not None and f"“{bad}” is not an incident number" in problem


def test_download_links_name_the_format_and_the_incident() -> None:
    assert (
        tl_query.downloads_href("a b", "md")
        == "/api/v1/runs/a%20b/postmortem?format=md&download=true"
    )
    assert (
        tl_query.downloads_href("r", "json", 4)
        == "/api/v1/runs/r/postmortem?format=json&incident=4&download=true"
    )
    hrefs = [c.href for c in walk(view.downloads("r", 4)) if getattr(c, "href", None)]
    assert hrefs == [tl_query.downloads_href("r", f, 4) for f in ("md", "html", "json")]
    assert "every incident" in text(view.downloads("r", None))


# -- the entries -------------------------------------------------------------------


def test_entries_keep_the_collectors_order_with_severity_classes_and_links() -> None:
    given = [
        entry(sc.T0 + 1, text="fault injected", severity="warning", rank=0, node="node0", step=35),
        entry(
            sc.T0 + 2,
            "alert",
            "firing",
            "LossSpike firing",
            severity="critical",
            runbook_url="/runbooks/LossSpike",
            ui_url="/alerts?run=r",
        ),
        entry(sc.T0 + 2, "page", "delivered", "delivered to hook"),
        entry(sc.T0 + 3, "note", "note", "ana: looked", severity="page-me"),  # unknown: as info
    ]
    table = view.entries_table(given, now=NOW, origin=sc.T0 + 1)
    found = rows(table)
    assert [text(r).split(" ")[0] for r in found] == [view.stamp(e["at"], NOW) for e in given]
    assert "fault injected" in text(found[0]) and "LossSpike firing" in text(found[1])
    assert [next(c for c in classes_of(r) if c.startswith("tl-sev-")) for r in found] == [
        "tl-sev-warning",
        "tl-sev-critical",
        "tl-sev-info",
        "tl-sev-info",
    ]
    assert "severity-critical" in classes(found[1]) and "page-me" in text(found[3])
    links = {c.children: c.href for c in walk(found[1]) if getattr(c, "href", None)}
    assert links == {"runbook": "/runbooks/LossSpike", "view": "/alerts?run=r"}
    assert not [c for c in walk(found[2]) if getattr(c, "href", None)]  # nothing to link
    assert "rank 0 · node0" in text(found[0]) and "35" in text(found[0])
    assert "+0.0 s" in text(found[0]) and "+1.0 s" in text(found[1])  # T+ from the fault


def test_entries_show_the_date_only_when_it_is_not_today_and_tenths_of_seconds() -> None:
    at = dt.datetime(2024, 5, 1, 13, 4, 5, 678_000).timestamp()
    assert view.stamp(at, at + 60) == "13:04:05.6"
    assert view.stamp(at, at + 3 * 86400) == "2024-05-01 13:04:05.6"


def test_a_long_timeline_shows_its_newest_entries_and_says_how_many_are_left_out() -> None:
    given = [entry(sc.T0 + i, text=f"e{i}") for i in range(30)]
    shown = view.entries_table(given, now=NOW, limit=10)
    assert len(rows(shown)) == 10 and "e29" in text(shown) and "e19" not in text(shown)
    assert "Showing the newest 10 of 30 entries (20 older ones left out)" in text(shown)
    assert "Nothing happened here yet" in text(view.entries_table([], now=NOW))


# -- the figures -------------------------------------------------------------------


FIGS = {
    "detect_s": 0.8,
    "page_s": None,
    "act_s": 75.0,
    "recover_s": 4000.0,
    "steps_lost": 10,
    "time_lost_s": 5.3,
    "gpu_hours_lost": 0.0029444,
    "world_size": 2,
    "price_per_gpu_hour": None,
    "cost": None,
    "fault": "fault injected (drill): loss_spike",
}


def figure_texts(card: Any) -> dict[str, str]:
    return {
        c.id.removeprefix("tl-fig-"): text(c.children[1])
        for c in walk(card)
        if str(getattr(c, "id", "")).startswith("tl-fig-")
    }


def test_the_figures_card_formats_durations_and_shows_missing_moments_as_a_dash() -> None:
    got = figure_texts(view.figures_card(FIGS, {"detect_s": "fault -> first alert pending"}))
    assert got == {
        "detect_s": "0.8 s",
        "page_s": "—",
        "act_s": "1 min 15 s",
        "recover_s": "1 h 6 min",
        "steps_lost": "10",
        "time_lost_s": "5.3 s",
        "gpu_hours_lost": "0.003 (2 GPUs)",
        "cost": "—",
    }
    card = view.figures_card(FIGS, {"detect_s": "fault -> first alert pending"})
    hints = {c.id: c.title for c in walk(card) if str(getattr(c, "id", "")).startswith("tl-fig-")}
    assert hints["tl-fig-detect_s"] == "fault -> first alert pending"
    assert "--price-per-gpu-hour" in hints["tl-fig-cost"]  # why there is no cost
    assert "Fault: fault injected (drill)" in text(card)


def test_cost_shows_only_with_a_price() -> None:
    priced = {**FIGS, "price_per_gpu_hour": 2.0, "cost": 0.0058888}
    assert figure_texts(view.figures_card(priced, {}))["cost"] == "0.01 at 2 per GPU-hour"
    no_time = {**FIGS, "time_lost_s": None, "gpu_hours_lost": None, "price_per_gpu_hour": 2.0}
    got = figure_texts(view.figures_card(no_time, {}))
    assert (got["time_lost_s"], got["gpu_hours_lost"], got["cost"]) == ("—", "—", "—")
    assert "Pick an incident" in text(view.figures_card(None, {}))


# -- incidents ---------------------------------------------------------------------


def test_no_incidents_is_said_and_the_whole_run_stays_selected() -> None:
    listed = view.incidents_list([], run="r", selected=None, now=NOW)
    assert "No incidents" in text(listed)
    (whole,) = [c for c in walk(listed) if getattr(c, "id", None) == "tl-inc-all"]
    assert whole.href == "/runs/r/timeline" and "tl-inc-selected" in classes_of(whole)


def test_incidents_are_listed_newest_first_as_links_and_the_selected_one_is_marked() -> None:
    listed = view.incidents_list(
        [incident(1, state="closed"), incident(2)], run="my run", selected=1, now=NOW
    )
    links = [c for c in walk(listed) if str(getattr(c, "id", "")).startswith("tl-inc-")]
    assert [c.id for c in links] == ["tl-inc-all", "tl-inc-2", "tl-inc-1"]
    assert links[1].href == "/runs/my%20run/timeline?incident=2"
    assert [("tl-inc-selected" in classes_of(c)) for c in links] == [False, False, True]
    assert "#2 Trouble 2" in text(links[1]) and "status-closed" in classes(links[2])


def test_the_chart_puts_entries_on_lanes_by_source_and_marks_the_fault() -> None:
    given = [
        entry(sc.T0 + 1, severity="warning"),
        entry(sc.T0 + 2, "alert", "firing", severity="critical"),
    ]
    fig = tl_figures.timeline_figure(
        given, {"fault_at": sc.T0 + 1, "recovered_at": None}, theme="dark", revision="r:1"
    )
    assert [t.name for t in fig.data] == ["warning", "critical"]
    assert list(fig.layout.yaxis.categoryarray) == ["alert", "event"]  # the cause on top
    assert [a.text for a in fig.layout.annotations] == ["fault"]
    assert fig.layout.template.layout.paper_bgcolor == "rgb(17,17,17)"
    assert (
        "No entries"
        in tl_figures.timeline_figure([], None, theme=None, revision="r").layout.annotations[0].text
    )


# -- the page on a real database --------------------------------------------------------


@pytest.fixture
def client(engine: Engine) -> LocalClient:
    sc.rollback_incident(engine)
    sc.make_run(engine, "calm", steps=5)
    with write(engine) as conn:
        group(conn, now=sc.T0 + 80, cooldown_s=60)
    return LocalClient(engine, settings=Settings(price_per_gpu_hour=2.0))


PARTS = (
    "notice",
    "incidents",
    "header",
    "downloads",
    "figures",
    "entries",
    "chart",
    "tools",
    "close",
)


def parts(client: LocalClient, run: str, search: str) -> dict[str, Any]:
    got = timeline_data.page_parts(client, run, search, "light", now=NOW)
    return dict(zip(PARTS, got, strict=True))


def test_the_page_shows_the_incident_the_url_names(client: LocalClient) -> None:
    (inc,) = client.incidents(sc.RUN)
    got = parts(client, sc.RUN, f"?incident={inc.id}")
    assert got["notice"] is None
    assert figure_texts(got["figures"])["detect_s"] == "0.8 s"
    # The price comes from the client's settings, as serve's does.
    assert figure_texts(got["figures"])["cost"].endswith("at 2 per GPU-hour")
    texts = [text(r) for r in rows(got["entries"])]
    assert any("fault injected (drill)" in t for t in texts)
    hrefs = [c.href for c in walk(got["downloads"]) if getattr(c, "href", None)]
    assert hrefs and all(f"incident={inc.id}" in h for h in hrefs)
    assert got["tools"] == {} and got["close"] == {}  # open: it can be retitled and closed

    whole = parts(client, sc.RUN, "")
    assert whole["figures"] is None and whole["tools"] == {"display": "none"}
    # The whole run: every entry of the incident but its history and the derived ones.
    theirs = [
        r for r in rows(got["entries"]) if not {"tl-incident", "tl-derived"} & set(classes_of(r))
    ]
    assert len(rows(whole["entries"])) == len(theirs)


def test_a_run_with_no_incidents_an_unknown_incident_and_a_missing_run(client: LocalClient) -> None:
    calm = parts(client, "calm", "")
    assert "No incidents" in text(calm["incidents"]) and calm["notice"] is None
    unknown = parts(client, sc.RUN, "?incident=999")
    assert f"Run '{sc.RUN}' has no incident 999; showing the whole run" in text(unknown["notice"])
    assert rows(unknown["entries"]) and unknown["figures"] is None
    bad = parts(client, sc.RUN, "?incident=first")
    assert "“first” is not an incident number" in text(bad["notice"])
    with pytest.raises(NotFound):
        timeline_data.page_parts(client, "nope", "", None, now=NOW)


def test_the_buttons_add_a_note_retitle_and_close_through_the_api(client: LocalClient) -> None:
    (inc,) = client.incidents(sc.RUN)

    def press(button: str, **kw: Any) -> tuple[str, str]:
        return timeline_actions.perform(client, button, run=sc.RUN, **kw)

    assert press("tl-note-add", incident=inc.id, by=" ", text="hi")[1] == "error"  # who?
    assert "Write the note first" in press("tl-note-add", incident=inc.id, by="ana", text=" ")[0]
    message, kind = press("tl-note-add", incident=inc.id, by="ana", text=" looked at it ")
    assert kind == "info" and f"(incident {inc.id}) as ana" in message
    assert [(n.author, n.text, n.incident) for n in client.notes(sc.RUN)] == [
        ("ana", "looked at it", inc.id)
    ]
    refused = press("tl-note-add", incident=999, by="ana", text="x")
    assert refused == ("Not done: incident 999 not found.", "error")
    assert press("tl-retitle", incident=inc.id, by="ana", title="Loss spike at step 35") == (
        f"Incident {inc.id} is now titled “Loss spike at step 35”.",
        "info",
    )
    assert press("tl-close", incident=None, by="ana") == ("Pick an incident first.", "error")
    assert press("tl-close", incident=inc.id, by="ana", summary="rolled back")[1] == "info"
    again = press("tl-close", incident=inc.id, by="ana")
    assert again[1] == "error" and again[0].startswith("Not done: ")
    (closed,) = client.incidents(sc.RUN)
    assert (closed.state, closed.title, closed.summary) == (
        "closed",
        "Loss spike at step 35",
        "rolled back",
    )
    note_entries = [
        e for e in client.timeline(sc.RUN, incident=inc.id)["entries"] if e["source"] == "note"
    ]
    assert [e["text"] for e in note_entries] == ["ana: looked at it"]
