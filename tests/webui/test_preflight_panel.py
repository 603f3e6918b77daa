"""The preflight table (Ranks and Hardware pages): drawn from the collector's judged
results on a real database, through the in-process client and the hardware page's
callback; nothing for a run that ran no preflight."""

from __future__ import annotations

from typing import Any

from trainwarden.webui.app import create_dash
from trainwarden.webui.client import LocalClient
from trainwarden.webui.pages.ranks.preflight_panel import preflight_table

from ..collector.node_findings import NOW, add_event, add_run
from .dash_call import dash_call
from .helpers import text, walk


def ran(engine: Any) -> LocalClient:
    with engine.begin() as conn:
        run_id = add_run(conn, "p", {r: f"node-{r}" for r in range(3)})
        for rank, gemm in ((0, 1e11), (1, 1.02e11), (2, 0.4e11)):
            data = {
                "device": "cpu",
                "dtype": "float32",
                "gemm_flops": gemm,
                "copy_bytes_per_s": 2e10,
                "allreduce_bytes_per_s": 6e8,
                "faults": ["1 uncorrectable ECC error (simulated: preflight=ecc drill)"]
                if rank == 1
                else [],
            }
            add_event(conn, run_id, "preflight", NOW, data, rank=rank, step=None)
        add_run(conn, "none", {0: "node-0"})
    return LocalClient(engine)


def test_the_table_names_each_rank_against_the_median_and_the_failures(engine) -> None:  # type: ignore[no-untyped-def]
    client = ran(engine)
    shown = preflight_table(client.preflight("p"))
    said = text(shown)
    assert "2 of 3 ranks failed preflight: 1, 2" in said
    assert "0.40×" in said and "100.0 GFLOP/s" in said and "node-2" in said
    assert "A fault marked simulated is a drill's stand-in" in said
    failed = [c for c in walk(shown) if getattr(c, "className", "") == "preflight-failed"]
    assert len(failed) == 2
    assert preflight_table(client.preflight("none")) is None


def test_the_hardware_page_shows_it_too(engine) -> None:  # type: ignore[no-untyped-def]
    app = create_dash(ran(engine))
    got = dash_call(app, "hw-preflight.children", {"hw-run.data": "p"}, ["hw-tick.data"])
    assert "2 of 3 ranks failed preflight" in str(got["hw-preflight"]["children"])
    got = dash_call(app, "hw-preflight.children", {"hw-run.data": "nope"}, ["hw-tick.data"])
    assert got["hw-preflight"]["children"] is None
