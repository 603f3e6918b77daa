from __future__ import annotations

from trainwarden.collector.models import rank_steps
from trainwarden.collector.rollups import aggregate


def row(
    rank: int,
    *,
    loss: float | None,
    duration: float = 1.0,
    tokens: int | None = 10,
    issues: dict | None = None,
    **telemetry: float,
) -> dict:
    """A rank_steps row as the database returns it: every column, most of them empty."""
    base: dict = dict.fromkeys(c.name for c in rank_steps.columns)
    base.update(
        rank=rank,
        ts=100.0 + rank,
        duration_s=duration,
        data_wait_s=0.0,
        tokens=tokens,
        loss=loss,
        issues=issues,
    )
    return {**base, **telemetry}


def by_metric(rows: list[dict]) -> dict[str, dict]:
    return {r["metric"]: r for r in aggregate(7, 3, rows)}


def test_min_median_max_and_argmax_across_ranks() -> None:
    stats = by_metric([row(0, loss=1.0), row(1, loss=3.0), row(2, loss=2.0, duration=4.0)])
    loss = stats["loss"]
    assert (loss["min"], loss["median"], loss["max"], loss["n"]) == (1.0, 2.0, 3.0, 3)
    assert loss["argmax_rank"] == 1 and loss["ts"] == 100.0
    assert stats["step_time"]["total"] == 4.0 and stats["step_time"]["argmax_rank"] == 2
    assert stats["tokens"]["total"] == 30
    assert stats["tokens_per_s"]["total"] == 30 / 4.0


def test_missing_and_non_finite_values_are_counted_not_aggregated() -> None:
    stats = by_metric(
        [
            row(0, loss=None, issues={"loss": "nan"}),
            row(1, loss=2.0),
            row(2, loss=None, tokens=None),
        ]
    )
    loss = stats["loss"]
    assert (loss["n"], loss["nonfinite"], loss["min"], loss["max"]) == (1, 1, 2.0, 2.0)
    assert stats["tokens"]["n"] == 2


def test_a_metric_no_rank_reports_has_no_row() -> None:
    stats = by_metric([row(0, loss=None)])
    assert "loss" not in stats and "mfu" not in stats
    assert stats["step_time"]["n"] == 1


def test_run_mfu_is_all_flops_over_the_slowest_rank_and_all_peaks() -> None:
    stats = by_metric(
        [
            row(0, loss=1.0, duration=1.0, flops=4e12, peak_flops=10e12, mfu=0.4),
            row(1, loss=1.0, duration=2.0, flops=4e12, peak_flops=10e12, mfu=0.2),
        ]
    )
    assert stats["mfu"]["total"] == 8e12 / (2.0 * 20e12)
    assert (stats["mfu"]["min"], stats["mfu"]["max"]) == (0.2, 0.4)


def test_breakdown_parts_average_over_ranks() -> None:
    stats = by_metric(
        [
            row(0, loss=1.0, duration=1.0, compute_s=0.7, exposed_comm_s=0.3),
            row(1, loss=1.0, duration=1.0, compute_s=0.9, exposed_comm_s=0.1),
        ]
    )
    assert stats["compute"]["total"] == 0.8
    assert stats["exposed_comm"]["total"] == 0.2
    assert stats["exposed_comm_frac"]["max"] == 0.3
