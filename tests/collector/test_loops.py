"""Background loops keep to their share of a core: work that grows with the number of
ranks spaces itself out instead of starving ingest."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from trainwarden.alerts import load_rule_packs
from trainwarden.collector.alerting.engine import AlertEngine, EngineSettings
from trainwarden.collector.api.prom import CollectorMetrics
from trainwarden.collector.app import _stop_together, create_app
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.loops import Loop, spaced


def burn(cpu_s: float) -> None:
    """Spend ``cpu_s`` of this thread's CPU time."""
    until = time.thread_time() + cpu_s
    while time.thread_time() < until:
        pass


def test_spaced_keeps_the_interval_until_a_pass_costs_more_than_its_share() -> None:
    assert spaced(1.0, 0.1, 0.25) == 1.0
    assert spaced(1.0, 0.5, 0.25) == 2.0  # 0.5 s of CPU at a quarter of a core
    assert spaced(1.0, 5.0, None) == 1.0  # no share: the interval, whatever a pass costs


def test_a_loop_over_its_cpu_share_spaces_its_passes_out() -> None:
    passes: list[float] = []
    done = threading.Event()

    def work() -> None:
        passes.append(time.monotonic())
        burn(0.05)
        if len(passes) == 2:
            done.set()

    loop = Loop("test-burner", 0.01, work, max_cpu_share=0.1)
    loop.start()
    try:
        assert done.wait(10)
    finally:
        loop.stop()
    assert loop.spacing_s >= 0.5  # 50 ms of CPU a pass, a tenth of a core: 0.5 s apart
    assert passes[1] - passes[0] >= 0.5


def test_the_alert_engine_spaces_full_passes_over_its_share_and_says_so(engine) -> None:  # type: ignore[no-untyped-def]
    metrics = CollectorMetrics(engine)
    alerts = AlertEngine(
        engine,
        load_rule_packs(),
        settings=EngineSettings(interval_s=0.01, max_cpu_share=1e-6),
        submit=lambda _: None,
        metrics=metrics,
    )
    assert metrics.registry.get_sample_value("trainwarden_alert_interval_seconds") == 0.01
    alerts.start()
    try:
        deadline = time.monotonic() + 10
        while alerts.spacing_s == 0.01 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        alerts.stop()
    # Any CPU at all is over a millionth of a core: the next pass waits past the interval.
    assert alerts.spacing_s > 0.01
    assert (
        metrics.registry.get_sample_value("trainwarden_alert_interval_seconds") == alerts.spacing_s
    )


def test_metrics_show_the_alert_interval(engine) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_app(engine, ui=False)) as client:
        text = client.get("/metrics").text
    assert "trainwarden_alert_interval_seconds 2.0" in text


def test_metrics_count_the_health_passes_done(engine) -> None:  # type: ignore[no-untyped-def]
    def passes(client: TestClient) -> tuple[float, float]:
        text = client.get("/metrics").text
        found = dict(
            line.rsplit(" ", 1)
            for line in text.splitlines()
            if line.startswith("trainwarden_health_evaluation_seconds_")
        )
        return (
            float(found["trainwarden_health_evaluation_seconds_count"]),
            float(found["trainwarden_health_evaluation_seconds_sum"]),
        )

    app = create_app(engine, ui=False, health=HealthSettings(interval_s=0.01), alerting=None)
    with TestClient(app) as client:
        first, _ = passes(client)
        deadline = time.monotonic() + 10
        while passes(client)[0] < first + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        count, seconds = passes(client)
    assert count >= first + 3 and seconds > 0  # each pass done, with its time


def test_serve_leaves_no_background_thread_running(engine) -> None:  # type: ignore[no-untyped-def]
    def ours() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("trainwarden-")}

    before = ours()
    with TestClient(create_app(engine, ui=False)):
        started = ours() - before
    assert {
        "trainwarden-health",
        "trainwarden-rollup",
        "trainwarden-alerts",
        "trainwarden-actions",
    } <= started
    assert not ours() - before, "threads left running after shutdown"


def test_stops_run_together_not_one_after_another() -> None:
    # Each stop waits for the others at a barrier: run one after another they would
    # time out (the sum of the passes in progress), together they all get through.
    barrier = threading.Barrier(3, timeout=10)
    through: list[int] = []

    def stop(i: int) -> None:
        barrier.wait()
        through.append(i)

    _stop_together([lambda i=i: stop(i) for i in range(3)])  # type: ignore[misc]
    assert sorted(through) == [0, 1, 2]
