from __future__ import annotations

from trainwarden.collector.rollups import aggregate


def row(
    rank: int, *, loss: float | None, duration: float = 1.0, tokens: int | None = 10, issues=None
) -> dict:
    return {
        "rank": rank,
        "ts": 100.0 + rank,
        "duration_s": duration,
        "data_wait_s": 0.0,
        "tokens": tokens,
        "loss": loss,
        "issues": issues,
    }


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


def test_a_step_with_no_values_yields_empty_aggregates() -> None:
    loss = by_metric([row(0, loss=None)])["loss"]
    assert (loss["n"], loss["min"], loss["median"], loss["total"]) == (0, None, None, None)
