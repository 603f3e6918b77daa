"""Which rank, which collective: the ranks page's Collectives section and the overview's
hang banner, drawn from the collector's hang view (hand-written views of its form), then
from a real database whose ranks sent their Flight Recorder rings through the ingest API."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from trainwarden.collector.api import auth
from trainwarden.collector.app import create_app
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.store.tokens import Principal
from trainwarden.webui.app import create_dash
from trainwarden.webui.client import LocalClient, Refused, may_change
from trainwarden.webui.pages.overview import data as overview_data
from trainwarden.webui.pages.ranks import actions as ranks_actions
from trainwarden.webui.pages.ranks import collectives_panel as coll
from trainwarden.webui.pages.ranks import data as ranks_data

from ..collector.helpers import batch
from .dash_call import dash_call
from .helpers import classes_of, walk
from .helpers import text as cells_text

T0 = 1_795_730_000.0  # 2026-11-26 21:53:20 UTC
SUMMARY = (
    "rank 5 (node n17) never entered all_reduce #4817 on pg 0 (default_pg, 8 ranks); "
    "7 ranks wait in it since 21:53:27 UTC"
)


def row(rank: int, *, seq: int | None = 4817, role: str | None = "victim", **over: Any) -> dict:
    base = {
        "rank": rank,
        "node": f"n{rank + 12}",
        "last_seq": seq,
        "op": "all_reduce",
        "in_sizes": [[1024]],
        "in_dtypes": ["Float"],
        "state": "scheduled",
        "done": False,
        "since": T0 + 7,
        "role": role,
        "dumped_at": T0 + 10,
        "note": None,
    }
    return {**base, **over}


def culprit_view(world: int = 8, culprit: int = 5) -> dict[str, Any]:
    rows = [row(r) for r in range(world) if r != culprit]
    # The collector sends the culprit first; the page must not rely on it.
    rows.append(row(culprit, seq=4816, role="culprit", done=True, since=T0 + 6))
    return {
        "run": "demo",
        "requested_at": T0 + 8,
        "verdict": {
            "at": T0 + 12,
            "summary": SUMMARY,
            "kind": "culprit",
            "culprits": [culprit],
            "victims": [r for r in range(world) if r != culprit],
            "dead": [],
            "no_ring": [],
            "unusable": {"9": "rank 9 is outside the run's world (8 ranks)"},
            "group": {"pg": "0", "desc": "default_pg", "size": world},
            "seq": 4817,
            "op": "all_reduce",
            "desync": None,
        },
        "groups": [
            {"pg": "0", "desc": "default_pg", "ranks": list(range(world)), "rows": rows},
        ],
        "rings": {
            str(r): {"at": T0 + 10, "trigger": "stalled", "available": True, "reason": None}
            for r in range(world)
        },
    }


def text(component: Any) -> str:
    """What a reader sees: the components' texts, spaces collapsed."""
    return " ".join(cells_text(component).split())


def rows_of(component: Any) -> list[Any]:
    return [c for c in walk(component) if "coll-row" in classes_of(c)]


def rank_of(tr: Any) -> int:
    return int(tr.to_plotly_json()["props"]["data-rank"])


# -- the verdict and a group's table -------------------------------------------------


def test_the_culprit_is_named_highlighted_and_listed_first() -> None:
    section = coll.section(culprit_view(), may_change=True)
    shown = text(section)
    summary = next(c for c in walk(section) if "coll-summary" in classes_of(c))
    assert "".join(cells_text(part) for part in summary.children) == SUMMARY
    # In the summary, the culprit's "rank 5" is in the culprit's colour.
    marked = [c for c in walk(section) if "coll-culprit" in classes_of(c)]
    assert any(text(c) == "rank 5" for c in marked), [text(c) for c in marked]
    assert "culprit: rank 5" in shown and "victims: ranks 0–4, 6, 7" in shown
    rows = rows_of(section)
    assert [rank_of(r) for r in rows] == [5, 0, 1, 2, 3, 4, 6, 7]
    assert "coll-culprit" in classes_of(rows[0])
    assert all("coll-victim" in classes_of(r) for r in rows[1:])
    first = [text(td) for td in rows[0].children]
    assert first == [
        *("5", "n17", "4816", "all_reduce", "1024 Float", "scheduled · done"),
        *("21:53:26", "culprit"),
    ]
    assert "scheduled · not done" in text(rows[1]) and "21:53:27" in text(rows[1])
    # Where, and the ring the collector could not use (said, not dropped silently).
    assert "pg 0 (default_pg, 8 ranks) · seq 4817 · all_reduce" in shown
    assert "rank 9: rank 9 is outside the run's world" in shown
    assert "Rings from 8 ranks (8 on a stall), newest read 21:53:30 UTC" in shown
    assert "Asked the ranks at 21:53:28 UTC" in shown
    assert "coll-verdict-culprit" in classes(section)


def classes(component: Any) -> list[str]:
    return [c for part in walk(component) for c in classes_of(part)]


def test_a_desync_shows_each_side() -> None:
    view = culprit_view(world=2, culprit=1)
    view["verdict"].update(
        kind="desync",
        summary="desync on pg 0 (default_pg, 2 ranks) at collective #2: rank 0 issued "
        "all_reduce Float[[10]] vs rank 1 issued all_reduce Float[[0]]",
        culprits=[0, 1],
        victims=[],
        seq=2,
        desync={
            "pg": "0",
            "seq": 2,
            "sides": [
                {"ranks": [0], "op": "all_reduce", "sizes": [[10]], "dtypes": ["Float"]},
                {"ranks": [1], "op": "all_gather", "sizes": [[0], [3, 4]], "dtypes": ["Half"]},
            ],
        },
    )
    section = coll.section(view, may_change=False)
    sides = [c for c in walk(section) if "coll-side" in classes_of(c)]
    assert [[text(td) for td in s.children] for s in sides] == [
        ["0", "all_reduce", "10 Float"],
        ["1", "all_gather", "0 Half, 3×4"],
    ]
    assert "Desync on pg 0 at seq 2: the ranks issued 2 different collectives" in text(section)
    assert "coll-verdict-desync" in classes(section)
    assert "Read collectives" not in text(section)  # a session that may only read


def test_a_group_of_thousands_shows_a_screenful_and_counts_the_rest() -> None:
    world = 4096
    view = culprit_view(world=world, culprit=3000)
    rows = view["groups"][0]["rows"]
    for r in rows[-40:-1]:  # a few victims a step behind, to be counted apart
        r["last_seq"] = 4816
    section = coll.section(view, may_change=True)
    drawn = rows_of(section)
    assert len(drawn) == coll.MAX_ROWS
    assert rank_of(drawn[0]) == 3000 and "coll-culprit" in classes_of(drawn[0])
    assert [rank_of(r) for r in drawn[1:4]] == [0, 1, 2]
    more = [c for c in walk(section) if "coll-more" in classes_of(c)]
    assert text(more) == "… and 4,032 more ranks: 3,993 at seq 4817, 39 at seq 4816"
    assert "victims: ranks 0–2999, 3001–4095" in text(section)  # one line, not 4,095 numbers
    same = coll.group_part({"pg": "0", "desc": "", "rows": [row(r) for r in range(100)]})
    assert text([c for c in walk(same) if "coll-more" in classes_of(c)]) == (
        "… and 36 more ranks at seq 4817"
    )


def test_many_process_groups_the_verdicts_first_and_the_rest_counted() -> None:
    view = culprit_view()
    tp = [
        {"pg": str(i), "desc": f"tp{i}", "ranks": [i], "rows": [row(i, role=None)]}
        for i in range(1, 20)
    ]
    view["groups"] = [*tp, *view["groups"]]
    section = coll.section(view, may_change=True)
    titles = [text(c) for c in walk(section) if "coll-group-title" in classes_of(c)]
    assert len(titles) == coll.MAX_GROUPS
    assert titles[0] == "pg 0 · default_pg · 8 ranks · the verdict's group"
    assert titles[1].startswith("pg 1 · tp1")
    assert "… and 12 more process groups (pg 8, 9, 10, 11, 12, …)" in text(section)


def test_no_data_is_one_quiet_line_and_a_button_for_who_may_change() -> None:
    empty: dict[str, Any] = {
        "run": "demo",
        "requested_at": None,
        "verdict": None,
        "groups": [],
        "rings": {},
    }
    assert not coll.has_data(empty)
    assert coll.section(empty, may_change=True) is None  # nothing above the heatmaps
    quiet = coll.quiet_line(empty, may_change=True)
    assert text(quiet) == "Collectives " + coll.QUIET + " Read collectives now"
    buttons = [c for c in walk(quiet) if getattr(c, "id", None) == READ_BOTTOM]
    assert len(buttons) == 1
    assert "Read" not in text(coll.quiet_line(empty, may_change=False))  # may only read
    asked = coll.quiet_line({**empty, "requested_at": T0}, may_change=True)
    assert "Asked the ranks at 21:53:20 UTC. Waiting for their rings." in text(asked)
    assert coll.quiet_line(culprit_view(), may_change=True) is None  # the section says it all


READ_BOTTOM = {"type": coll.READ, "index": "bottom"}


def test_the_collectives_go_on_top_while_the_hang_is_live_and_else_below() -> None:
    """Above the rank states while ranks are hung or a culprit is named; at the bottom of
    the page otherwise, so that a run that is fine keeps its heatmaps where they were."""
    empty: dict[str, Any] = {
        "run": "demo",
        "requested_at": None,
        "verdict": None,
        "groups": [],
        "rings": {},
    }
    top, bottom = coll.placed(empty, hung=0, may_change=True)
    assert top is None and text(bottom).startswith("Collectives " + coll.QUIET)
    top, bottom = coll.placed({**empty, "requested_at": T0}, hung=3, may_change=True)
    assert bottom is None and "Waiting for their rings" in text(top)
    assert [c.id for c in walk(top) if isinstance(getattr(c, "id", None), dict)] == [
        {"type": coll.READ, "index": "top"}  # the answer is shown by the button
    ]
    culprit = culprit_view()
    top, bottom = coll.placed(culprit, hung=0, may_change=True)  # a hang of a run now gone
    assert bottom is None and "never entered all_reduce #4817" in text(top)
    over = culprit_view()
    over["verdict"].update(kind="none", summary="no rank waits in a collective", culprits=[])
    top, bottom = coll.placed(over, hung=0, may_change=True)
    assert top is None and "no rank waits in a collective" in text(bottom)
    assert coll.placed(over, hung=2, may_change=True)[1] is None


def test_rings_the_agents_could_not_read_are_a_verdict_of_no_data_saying_why() -> None:
    reason = "this torch (2.4.0) has no Flight Recorder"
    view = {
        "run": "demo",
        "requested_at": T0,
        "verdict": {
            "at": T0,
            "summary": f"no usable Flight Recorder ring yet (rank 0: {reason})",
            "kind": "no_data",
            "culprits": [],
            "victims": [],
            "dead": [],
            "no_ring": [0],
            "unusable": {},
            "group": None,
            "seq": None,
            "op": None,
            "desync": None,
        },
        "groups": [],
        "rings": {"0": {"at": T0 + 1, "trigger": "command", "available": False, "reason": reason}},
    }
    section = coll.section(view, may_change=True)
    shown = text(section)
    assert "coll-verdict-no_data" in classes(section)
    assert "no ring: rank 0" in shown
    assert "Rings from 0 ranks, newest read 21:53:21 UTC. Asked the ranks at 21:53:20 UTC. " in (
        shown
    )
    assert f"No ring from 1 rank: rank 0: {reason}." in shown
    assert "Read collectives again" in shown


def test_small_texts() -> None:
    assert coll.ranks_text([7, 0, 1, 2, 4, 5]) == "0–2, 4, 5, 7"
    assert coll.ranks_text(range(0, 40, 2)).endswith(", … (20 ranks)")
    assert coll.sizes_text([[1024, 8], []], ["Float", "Int"]) == "1024×8 Float, scalar Int"
    assert coll.sizes_text(None, None) == "—"
    assert coll.utc(T0) == "21:53:20" and coll.utc(None) == "—"


# -- the overview's banner -----------------------------------------------------------


def test_the_banner_shows_while_ranks_are_hung_and_links_to_the_section() -> None:
    view = culprit_view()
    found = coll.banner(view, run="my run", hung=7)
    assert found is not None and found.id == "run-hang-banner"
    said = "".join(cells_text(part) for part in found.children)
    assert said.startswith("Hang: rank 5 (node n17) never entered all_reduce #4817")
    links = [c for c in walk(found) if getattr(c, "href", None)]
    assert [link.href for link in links] == ["/runs/my%20run/ranks#ranks-collectives"]
    assert coll.ANCHOR == "ranks-collectives"
    assert coll.banner(view, run="demo", hung=0) is None  # the job moves again
    assert coll.banner(None, run="demo", hung=3) is None
    view["verdict"]["kind"] = "none"  # every rank entered it: nobody to name
    assert coll.banner(view, run="demo", hung=3) is None
    view["verdict"]["kind"] = "desync"
    assert text(coll.banner(view, run="demo", hung=3)).startswith("Desync: ")


# -- through a real database -----------------------------------------------------------

RUN = "hang"
WORLD = 4


def ring_of(rank: int, *, now: float) -> dict[str, Any]:
    """Rank 2 issued collectives 1..6 and all completed; the others wait in 7."""
    last = 6 if rank == 2 else 7
    entries = [
        {
            "seq": s,
            "op": "all_reduce",
            "in_sizes": [[1024]],
            "in_dtypes": ["Float"],
            "out_sizes": [[1024]],
            "out_dtypes": ["Float"],
            "state": "scheduled" if s == 7 else "completed",
            "done": s < 7,
            "created": now - 20 + s,
            "started": None,
            "completed": None,
        }
        for s in range(1, last + 1)
    ]
    data = {
        "trigger": "stalled",
        "request": None,
        "available": True,
        "reason": None,
        "dumped_at": now,
        "groups": [
            {"pg": "0", "desc": "default_pg", "ranks": list(range(WORLD)), "entries": entries}
        ],
    }
    return {"id": f"fr-{rank}-{now}", "kind": "collectives", "ts": now, "data": data}


@pytest.fixture
def seeded(engine: Any) -> Iterator[Any]:
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as api:
        now = time.time()
        for r in range(WORLD):
            body = batch(RUN, rank=r, world_size=WORLD, events=[ring_of(r, now=now)])
            response = api.post("/api/v1/ingest", json=body)
            assert response.status_code == 200, response.text
        yield engine


def test_the_section_names_the_rank_that_never_arrived(seeded: Any) -> None:
    client = LocalClient(seeded)
    section, below = ranks_data.collectives_part(client, RUN, hung=0)
    assert below is None  # a culprit is named: above the states
    assert "rank 2 (node node2) never entered all_reduce #7 on pg 0" in text(section)
    rows = rows_of(section)
    assert [rank_of(r) for r in rows] == [2, 0, 1, 3]
    assert "coll-culprit" in classes_of(rows[0]) and text(rows[0].children[2]) == "6"
    with pytest.raises(NotFound):
        client.collectives("no-such-run")

    # "Read collectives now" asks every rank; the section reads again at once.
    message, kind = ranks_actions.read_collectives(client, RUN)
    assert kind == "info" and message.startswith("Asked its 4 ranks for their collectives")
    assert client.collectives(RUN)["requested_at"] is not None
    assert ranks_actions.read_collectives(client, "no-such-run")[1] == "error"

    # The page's refresh draws the section with the states, and redraws it only when
    # what it shows changed.
    app = create_dash(client)
    values = {"ranks-run.data": RUN, "ranks-url.search": ""}
    first = dash_call(app, "ranks-states.children", values, ["ranks-interval.n_intervals"])
    drawn = first[coll.ANCHOR]["children"]
    assert "never entered all_reduce #7" in str(drawn)
    assert first["ranks-coll-bottom"]["children"] is None
    digest = first["ranks-coll-digest"]["data"]
    again = dash_call(
        app,
        "ranks-states.children",
        {**values, "ranks-coll-digest.data": digest},
        ["ranks-interval.n_intervals"],
    )
    assert coll.ANCHOR not in again and "ranks-coll-bottom" not in again
    assert "ranks-states" in again


def test_the_overview_banner_only_while_a_rank_is_hung(seeded: Any) -> None:
    client = LocalClient(seeded)
    run = client.get_run(RUN)
    assert overview_data.hang_banner(client, run) is None  # nobody hung: no banner, no query
    hung = run.model_copy(
        update={"ranks": [r.model_copy(update={"state": "hung"}) for r in run.ranks]}
    )
    found = overview_data.hang_banner(client, hung)
    assert found is not None and "rank 2 (node node2) never entered" in text(found)


def test_a_session_that_may_only_read_gets_no_button_and_cannot_ask(seeded: Any) -> None:
    """The button's rule is the change's: what auth.check_admin refuses is not offered."""
    client = LocalClient(seeded)
    assert may_change()  # auth off: anyone may
    reset = auth.current.set(Principal(name="viewer", scopes=frozenset({"read"}), via="session"))
    try:
        assert not may_change()
        with pytest.raises(Refused, match="may view, not change"):
            client.request_collectives(RUN, by="ui")
        top, _ = ranks_data.collectives_part(client, RUN, hung=4)
        assert "never entered all_reduce #7" in text(top) and "Read collectives" not in text(top)
    finally:
        auth.current.reset(reset)
    reset = auth.current.set(Principal(name="oncall", scopes=frozenset({"admin"})))
    try:
        assert may_change()
        client.request_collectives(RUN, by="ui")
    finally:
        auth.current.reset(reset)
