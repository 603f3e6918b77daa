"""The app's layout: the page the browser opens is in it, so its callbacks fire at load."""

from __future__ import annotations

import json
from typing import Any

from trainwarden.webui.app import create_dash


def layout(referer: str | None) -> dict[str, Any]:
    client: Any = object()  # the run pages' layouts read no data
    headers = {"Referer": referer} if referer is not None else {}
    answer = create_dash(client).server.test_client().get("/_dash-layout", headers=headers)
    assert answer.status_code == 200
    return json.loads(answer.get_data(as_text=True))


def component(tree: Any, id_: str) -> dict[str, Any] | None:
    """The component of ``tree`` (Dash's layout JSON) whose id is ``id_``."""
    if isinstance(tree, list):
        return next((c for t in tree if (c := component(t, id_)) is not None), None)
    if not isinstance(tree, dict):
        return None
    props = tree.get("props", {})
    if props.get("id") == id_:
        return tree
    return component(props.get("children"), id_)


def test_the_page_named_by_the_referer_is_in_the_layout() -> None:
    tree = layout("http://localhost/runs/my%20run/?from=5&to=9")
    url = component(tree, "url")["props"]  # type: ignore[index]
    # The address as the browser's location has it: the Location reports no change.
    assert url["pathname"] == "/runs/my%20run/" and url["search"] == "?from=5&to=9"
    assert url["refresh"] is False
    assert component(tree, "page-path")["props"]["data"] == "/runs/my%20run"  # type: ignore[index]
    assert component(tree, "run-overview") is not None
    assert component(tree, "run-name")["props"]["data"] == "my run"  # type: ignore[index]
    assert component(tree, "run-view")["props"]["data"]["from"] == 5  # type: ignore[index]
    ranks = layout("http://localhost/runs/r1/ranks")
    assert component(ranks, "ranks-step_time") is not None
    assert component(ranks, "ranks-url")["props"]["search"] == ""  # type: ignore[index]


def test_without_a_usable_referer_the_routing_callback_makes_the_page() -> None:
    for referer in (None, "http://elsewhere.example/runs/r1", "not a url"):
        tree = layout(referer)
        assert component(tree, "page")["props"].get("children") is None, referer  # type: ignore[index]
        assert component(tree, "page-path")["props"].get("data") is None, referer  # type: ignore[index]
        assert "pathname" not in component(tree, "url")["props"], referer  # type: ignore[index]


def test_a_page_that_cannot_be_made_falls_back_to_the_routing_callback(monkeypatch: Any) -> None:
    from trainwarden.webui.pages.overview import layout as overview_layout

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("database down")

    monkeypatch.setattr(overview_layout, "layout", broken)
    tree = layout("http://localhost/runs/r1")
    assert component(tree, "page")["props"].get("children") is None  # type: ignore[index]
    assert component(tree, "page-path")["props"].get("data") is None  # type: ignore[index]
    # An unknown path is a page too: the notice that says so.
    tree = layout("http://localhost/no-such-page")
    assert "No page at /no-such-page" in json.dumps(component(tree, "page"))
