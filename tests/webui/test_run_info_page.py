"""The run page: its pieces as pure functions of the API's answers (durations, the flat
config, the verdict in words, the stacked bar, the diff), and what it draws from a real
database (SQLite and PostgreSQL) for a run with two attempts, a run from an agent older
than run identity, and a missing run."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import dash
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from trainwarden.collector.app import create_app
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.settings import Settings
from trainwarden.webui.client import LocalClient
from trainwarden.webui.pages.run_info import data as run_info_data
from trainwarden.webui.pages.run_info import figures as ri_figures
from trainwarden.webui.pages.run_info import panels as view

from ..collector import economics_scenario as sc
from .helpers import text, walk

# -- pieces --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "want"),
    [
        (None, "—"),
        (math.inf, "—"),
        (4.25, "4.2 s"),
        (42, "42 s"),
        (1004, "17 min"),
        (2.3 * 3600, "2.3 h"),
        (3 * 86400, "3.0 days"),
    ],
)
def test_durations_read_as_people_say_them(seconds: float | None, want: str) -> None:
    assert view.span(seconds) == want


def test_a_nested_config_is_flat_dotted_keys_in_the_given_order() -> None:
    rows = view.flat(sc.CONFIG)
    assert rows == [
        ("lr", 3e-4),
        ("batch", 512),
        ("model.layers", 24),
        ("model.d_model", 2048),
        ("optim.name", "adamw"),
        ("optim.betas", [0.9, 0.95]),
    ]
    assert [view.value_text(v) for _, v in rows][-1] == "[0.9, 0.95]"
    assert view.flat({}) == [] and view.flat({"empty": {}}) == [("empty", {})]


def test_the_code_version_is_a_short_sha_with_its_dirty_flag_and_branch() -> None:
    assert (
        view.code_text({"commit": "9f8e7d6c5b4a", "dirty": True, "branch": "main"})
        == "9f8e7d6 (dirty) on main"
    )
    assert view.code_text({"commit": "9f8e7d6c5b4a", "dirty": False}) == "9f8e7d6"
    assert "not a git checkout" in view.code_text(None)


@pytest.mark.parametrize(
    ("verdict", "interval", "words"),
    [
        ("too_rare", 2.3 * 3600, "Checkpointing every 2.3 h; T* is 17 min: save more often"),
        ("too_often", 60, "Checkpointing every 60 s; T* is 17 min: save less often"),
        ("ok", 1200, "within 2× of T*"),
    ],
)
def test_the_verdict_in_words(verdict: str, interval: float, words: str) -> None:
    adv = {"verdict": verdict, "interval_s": interval, "optimal_interval_s": 1004.0}
    assert words in view.verdict_text(adv)
    unknown = {
        "verdict": "unknown",
        "interval_s": None,
        "optimal_interval_s": None,
        "why": "fewer than two checkpoints: no interval yet",
    }
    assert (
        view.verdict_text(unknown) == "No verdict yet: fewer than two checkpoints: no interval yet."
    )


def test_the_breakdown_is_one_stacked_bar_of_the_allocation_in_the_theme() -> None:
    good = {
        "allocation_gpu_s": 1000.0,
        "breakdown_gpu_s": {
            "kept": 700.0,
            "replayed": 100.0,
            "recovery": 50.0,
            "checkpoint": 10.0,
            "data_wait": 40.0,
            "other": 100.0,
        },
    }
    fig = ri_figures.breakdown_figure(good, theme="dark", revision="r")
    assert isinstance(fig, dict) and fig["layout"]["barmode"] == "stack"
    assert [t["name"] for t in fig["data"]] == [label for _, label, _ in ri_figures.BREAKDOWN]
    assert sum(t["x"][0] for t in fig["data"]) == pytest.approx(100)
    assert fig["data"][0]["text"] == ["kept 70%"] and fig["data"][3]["text"] == [""]  # 1%: no room
    assert fig["layout"]["font"]["color"] == ri_figures.INK["dark"][0]
    empty = ri_figures.breakdown_figure(None, theme=None, revision="r")
    assert empty["data"] == [] and "No allocation yet" in empty["layout"]["annotations"][0]["text"]


def test_the_diff_lists_what_changed_between_the_runs() -> None:
    d = {
        "a": "econ",
        "b": "other",
        "identical": False,
        "config": [{"key": "lr", "a": 3e-4, "b": 1e-3}],
        "code": [],
        "env": [{"key": "torch", "a": "2.5.1", "b": "2.6.0"}],
        "tags": {"only_a": [], "only_b": ["hot"]},
        "data_snapshot": None,
        "world_size": None,
        "packages": {
            "added": ["rich==13.0"],
            "removed": [],
            "changed": [{"name": "torch", "a": "2.5.1", "b": "2.6.0"}],
        },
    }
    shown = text(view.diff_view(d))
    for part in (
        "Config",
        "lr",
        "0.0003",
        "0.001",
        "Environment",
        "2.6.0",
        "tags",
        "hot",
        "Packages",
        "rich==13.0",
    ):
        assert part in shown, part
    assert "Code" not in shown
    same = view.diff_view({"a": "x", "b": "y", "identical": True})
    assert "same config, code, environment and packages" in text(same)


# -- from a real database --------------------------------------------------------------------


@pytest.fixture
def seeded(engine: Engine) -> Iterator[LocalClient]:
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as api:

        def post(b: dict[str, Any]) -> None:
            r = api.post("/api/v1/ingest", json=b)
            assert r.status_code == 200, r.text

        sc.seed(post)
    flush(engine, now=time.time(), grace_s=0)
    yield LocalClient(
        engine, settings=Settings(price_per_gpu_hour=sc.PRICE, mtbf_hours=sc.MTBF_HOURS)
    )


def test_the_page_of_a_run_with_two_attempts(seeded: LocalClient) -> None:
    parts = run_info_data.page_parts(seeded, sc.RUN, "light", now=time.time())
    assert parts["ri-notice"] is None
    ident = text(parts["ri-identity"])
    assert "optim.name" in ident and "adamw" in ident and "0.0003" in ident
    assert "9f8e7d6 (dirty) on main" in ident and "s3://corpus/v7@2026-11-01" in ident
    assert "NVIDIA H100 80GB HBM3 × 1" in ident and "2: gpu-node0, gpu-node1" in ident
    attempts = text(parts["ri-attempts"])
    assert "exception" in attempts and "CUDA error" in attempts and "running" in attempts
    assert "0 → 155" in attempts and "144 → " in attempts
    econ = seeded.economics(sc.RUN)
    ettr = [c for c in walk(parts["ri-goodput"]) if getattr(c, "id", None) == "ri-ettr"][0]
    assert ettr.children == f"{econ['goodput']['ettr']:.1%}"
    assert "at 2.5 per GPU-hour" in text(parts["ri-goodput"])
    ckpt = text(parts["ri-checkpoints"])
    assert "3 checkpoints" in ckpt and "20 s (median)" in ckpt and "14.2 GB" in ckpt
    assert "Checkpointing every 2.4 h; T* is 17 min: save more often" in ckpt
    assert "configured: MTBF 7 h" in ckpt
    assert parts["ri-compare.options"] == [sc.OLD, sc.OTHER]

    # A refresh that finds the same redraws nothing (a scrolled table stays scrolled).
    first, digests = run_info_data.changed(parts, None)
    again, _ = run_info_data.changed(parts, digests)
    assert all(x is not dash.no_update for x in first)
    assert all(x is dash.no_update for x in again)

    diff = text(run_info_data.diff_part(seeded, sc.RUN, sc.OTHER))
    assert "lr" in diff and "0.001" in diff
    assert "has no identity" in text(run_info_data.diff_part(seeded, sc.RUN, sc.OLD))
    assert "not found" in text(run_info_data.diff_part(seeded, sc.RUN, "gone"))


def test_a_run_without_identity_and_a_missing_run(seeded: LocalClient) -> None:
    parts = run_info_data.page_parts(seeded, sc.OLD, None, now=time.time())
    assert "no identity yet" in text(parts["ri-identity"])
    assert "Upgrade the agent and pass tw.init(config=" in text(parts["ri-identity"])
    assert "No checkpoints reported yet" in text(parts["ri-checkpoints"])
    assert "%" in text(parts["ri-goodput"])  # goodput works without identity
    with pytest.raises(NotFound):
        run_info_data.page_parts(seeded, "nope", None, now=time.time())
