"""The Ranks page's replica agreement strips, drawn from hand-written comparisons."""

from __future__ import annotations

from typing import Any

from trainwarden.webui.pages.ranks.replicas_panel import MAX_CELLS, strips


def result(step: int, group: str = "0-3", suspects=(), missing=()) -> dict[str, Any]:
    return {
        "step": step,
        "replica_group": group,
        "agree": not suspects,
        "suspects": list(suspects),
        "missing": list(missing),
        "fingerprints": 4 - len(missing),
        "decided_at": 0.0,
    }


def cells(div: Any) -> list[tuple[str, str]]:
    strip = div.children[1]
    return [(c.className.split()[-1], c.title) for c in strip.children]


def test_no_checks_no_section() -> None:
    assert strips([]) is None


def test_a_suspect_stands_out_with_the_step_it_was_first_found_at() -> None:
    section = strips(
        [result(10), result(20, missing=[3]), result(30, suspects=[2]), result(40, suspects=[2])]
    )
    assert section is not None
    (row,) = [c for c in section.children if getattr(c, "className", "") == "rep-row"]
    assert cells(row) == [
        ("rep-ok", "step 10: 4 replicas agree"),
        ("rep-partial", "step 20: agreed; no fingerprint from [3]"),
        ("rep-bad", "step 30: suspects [2]"),
        ("rep-bad", "step 40: suspects [2]"),
    ]
    said = row.children[2]
    assert said.children == "suspects: rank 2 (from step 30)" and "rep-suspect" in said.className


def test_a_probe_suspect_stands_out_though_the_parameters_agree() -> None:
    rows = [result(10, "0,2"), {**result(20, "0,2"), "probe_suspects": [2], "probes": 2}]
    rows += [result(10, "1,3"), {**result(20, "1,3"), "probe_suspects": [], "probes": 2}]
    section = strips(rows)
    assert section is not None
    found = [c for c in section.children if getattr(c, "className", "") == "rep-row"]
    assert [r.children[0].children for r in found] == ["ranks 0,2", "ranks 1,3"]
    assert cells(found[0])[1] == (
        "rep-bad",
        "step 20: parameters agree; probe suspects [2] (compute differently)",
    )
    assert found[0].children[2].children == "suspects: rank 2 (its probe, from step 20)"
    assert cells(found[1])[1] == ("rep-ok", "step 20: 4 replicas agree")


def test_groups_with_suspects_come_first_and_strips_keep_the_newest_checks() -> None:
    rows = [result(s, "0-2:2") for s in range(0, 1000, 10)]
    rows += [result(s, "1-3:2", suspects=[3] if s == 500 else []) for s in range(0, 1000, 10)]
    section = strips(rows)
    found = [c for c in section.children if getattr(c, "className", "") == "rep-row"]
    assert [r.children[0].children for r in found] == ["ranks 1-3:2", "ranks 0-2:2"]
    assert len(cells(found[1])) == MAX_CELLS
    assert cells(found[1])[-1][1] == "step 990: 4 replicas agree"
    assert found[1].children[2].children == f"{MAX_CELLS} checks, all agree"


def test_the_ranks_page_draws_the_run_s_comparisons(engine: Any) -> None:
    """Through the page's callback, on comparisons the health evaluator made of ingested
    fingerprints (SQLite and PostgreSQL)."""
    from fastapi.testclient import TestClient

    from trainwarden.collector.app import create_app
    from trainwarden.collector.health.evaluator import evaluate
    from trainwarden.collector.store.db import write
    from trainwarden.webui.app import create_dash
    from trainwarden.webui.client import LocalClient

    from ..collector.helpers import batch, step
    from .dash_call import dash_call

    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as api:
        for rank in range(4):
            steps = [
                {
                    **step(s),
                    "fingerprint": ("%032x" % (7 if rank == 1 and s == 20 else 5)),
                    "replica_group": "0-3",
                }
                for s in (10, 20)
            ]
            response = api.post(
                "/api/v1/ingest", json=batch("r1", rank=rank, world_size=4, steps=steps)
            )
            assert response.status_code == 200, response.text
    with write(engine) as conn:
        evaluate(conn)
    app = create_dash(LocalClient(engine))
    found = dash_call(
        app,
        "ranks-replicas.children",
        {"ranks-run.data": "r1"},
        ["ranks-heat-interval.n_intervals"],
    )
    drawn = str(found["ranks-replicas"]["children"])
    assert "suspects: rank 1 (from step 20)" in drawn
    assert "step 10: 4 replicas agree" in drawn and "step 20: suspects [1]" in drawn
