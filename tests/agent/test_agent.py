"""The agent on its own, through its transport seam (no network). The real HTTP path is
exercised against a real ``serve`` in tests/e2e."""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import trainwarden.agent as tw
from trainwarden.agent import core

from .helpers import RecordingTransport

pytestmark = pytest.mark.usefixtures("clean_agent")


def test_steps_are_timed_and_sent_off_the_training_thread() -> None:
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.05)
    inner, outer, bodies = [], [], []  # the test's own clock: inside and around each step
    for i in range(5):
        time.sleep(0.01)  # the "data loader": shows as data wait of the next step
        entering = time.perf_counter()
        with tw.step(i, tokens=128) as s:
            began = time.perf_counter()
            time.sleep(0.02)
            s.loss(torch.tensor(2.0 - i * 0.1))
            ended = time.perf_counter()
        outer.append(time.perf_counter() - entering)
        inner.append(ended - began)
        bodies.append((began, ended))
    tw.shutdown()
    steps = transport.steps()
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    # Each duration lies between the body's own time and the time around the with.
    assert all(i <= s["duration_s"] <= o for s, i, o in zip(steps, inner, outer, strict=True))
    assert steps[0]["data_wait_s"] is None  # nothing before the first step
    # Each wait: at least the loader's 10 ms, at most from the last step's body's end to
    # this one's body's start as the test saw them (the agent's stamps are inside those).
    for s, (_, last_end), (start, _) in zip(steps[1:], bodies, bodies[1:], strict=False):
        assert 0.01 <= s["data_wait_s"] <= start - last_end, (s, start - last_end)
    assert [round(s["loss"], 3) for s in steps] == [2.0, 1.9, 1.8, 1.7, 1.6]
    assert all(s["tokens"] == 128 for s in steps)
    assert transport.threads == {"trainwarden-exporter"}
    kinds = [e["kind"] for e in transport.events()]
    assert kinds == ["attempt_start", "start", "gpu_telemetry", "shutdown", "attempt_end"]
    telemetry = transport.events()[2]["data"]
    if nvml_gpu_present():  # a GPU machine: its name, and samples from the NVML thread
        assert telemetry["state"] == "ok" and telemetry["name"] and not telemetry["simulated"]
        assert any(b["gpu"] for b in transport.bodies)
    else:  # one clear "no GPU telemetry" state, nothing else
        assert telemetry["state"] == "unavailable" and "NVML" in telemetry["reason"]
        assert not any(b["gpu"] for b in transport.bodies)
    assert transport.events()[3]["step"] == 4


def nvml_gpu_present() -> bool:
    """Whether this machine has a GPU that NVML answers for (the agent then samples it)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return bool(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


def test_gpu_telemetry_can_be_turned_off() -> None:
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, gpu_interval_s=0)
    with tw.step(0):
        pass
    tw.shutdown()
    (telemetry,) = [e for e in transport.events() if e["kind"] == "gpu_telemetry"]
    assert telemetry["data"] == {"state": "off", "reason": "gpu_interval_s=0"}
    assert not any(b["gpu"] for b in transport.bodies)
    with pytest.raises(tw.ConfigError, match=r"gpu_interval_s .* must be > 0.0 \(or 0: off\)"):
        tw.init(run="unit", transport=transport, gpu_interval_s=-1)
    header = transport.bodies[0]["agent"]
    assert (header["rank"], header["world_size"]) == (0, 1)
    assert header["session"]


def test_loss_tensor_is_read_by_the_exporter_not_on_the_training_thread(monkeypatch) -> None:
    reads: list[str] = []
    original = torch.Tensor.item

    def spy(self):  # type: ignore[no-untyped-def]
        reads.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "item", spy)
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.05)
    with tw.step(0) as s:
        s.loss(torch.tensor([1.0, 3.0]))  # not a scalar: the mean is reported
    tw.shutdown()
    assert reads and set(reads) == {"trainwarden-exporter"}
    assert transport.steps()[0]["loss"] == 2.0


def test_odd_values_are_recorded_as_what_they_are() -> None:
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.05)
    with tw.step(0) as s:
        s.loss(torch.tensor(float("nan")))
    with tw.step(1, tokens=torch.ones(3, 4).numel()) as s:
        s.loss(torch.empty(0))
    with tw.step(2) as s:
        s.loss(float("inf"))
    tw.shutdown()
    steps = transport.steps()
    assert steps[0]["loss"] == "nan" and steps[0]["tokens"] is None
    assert steps[1]["loss"] is None and steps[1]["issues"] == {"loss": "empty tensor"}
    assert steps[1]["tokens"] == 12
    assert steps[2]["loss"] == "inf"


def test_an_exception_in_the_step_propagates_and_is_recorded() -> None:
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.05)
    with pytest.raises(ZeroDivisionError), tw.step(0):
        1 / 0  # noqa: B018
    tw.shutdown()
    assert transport.steps()[0]["issues"] == {"exception": "ZeroDivisionError"}


def test_collector_down_spools_to_disk_and_the_next_process_sends_it_in_order(
    caplog, tmp_path: Path
) -> None:
    transport = RecordingTransport(fail=True)
    caplog.set_level(logging.WARNING, logger="trainwarden.agent")
    spool = tmp_path / "spool"
    tw.init(
        run="unit",
        transport=transport,
        flush_interval_s=0.01,
        gpu_interval_s=0,
        spool_dir=str(spool),
    )
    for i in range(50):
        with tw.step(i):
            pass
    time.sleep(0.2)
    agent = tw.init.__globals__["_core"]._agent
    tw.shutdown(timeout_s=2)
    stats = agent.stats
    # 50 steps + the attempt_start, start, gpu_telemetry, shutdown and attempt_end events
    assert stats.recorded == 55
    assert stats.sent == 0
    # Nothing lost: all of it waits on disk, for this rank of this run.
    assert stats.spooled == 55
    assert stats.dropped_send_failed == stats.dropped_at_shutdown == 0
    files = sorted(p.name for p in (spool / "unit" / "rank-0").iterdir())
    assert files and all(f.endswith(".json") for f in files)
    warnings = [r for r in caplog.records if "did not take a batch" in r.getMessage()]
    assert len(warnings) == 1  # said once, not once per batch

    # The next process of the same run and rank, with the collector back: the spool goes
    # first, in order, then its own records; every record once.
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.01, spool_dir=str(spool))
    with tw.step(50):
        pass
    tw.shutdown(timeout_s=2)
    assert [s["step"] for s in transport.steps()] == list(range(51))
    kinds = [e["kind"] for e in transport.events()]
    assert kinds.count("start") == 2 and kinds.count("shutdown") == 2
    second = [i for i, k in enumerate(kinds) if k == "start"][1]
    assert kinds.index("shutdown") < second  # the earlier process's first
    assert list((spool / "unit" / "rank-0").iterdir()) == []


def test_without_a_spool_directory_what_waits_is_lost_at_exit_and_counted() -> None:
    transport = RecordingTransport(fail=True)
    tw.init(
        run="unit", transport=transport, flush_interval_s=0.01, gpu_interval_s=0, spool_dir="none"
    )
    for i in range(50):
        with tw.step(i):
            pass
    time.sleep(0.2)
    agent = tw.init.__globals__["_core"]._agent
    tw.shutdown(timeout_s=2)
    assert (agent.stats.sent, agent.stats.dropped_at_shutdown) == (0, 55)


def test_the_spool_replays_in_order_when_the_collector_returns_and_keeps_its_bound(
    tmp_path: Path,
) -> None:
    transport = RecordingTransport(fail=True)
    tw.init(
        run="unit",
        transport=transport,
        flush_interval_s=0.01,
        batch_size=10,
        spool_dir=str(tmp_path),
        spool_max_mb=0.004,
    )  # ~4 KB: a few batches
    for i in range(300):
        with tw.step(i):
            pass
        if i % 10 == 9:
            time.sleep(0.02)  # the exporter moves each batch of 10 to the spool
    time.sleep(0.3)
    stats = tw.stats()
    assert stats["sent"] == 0 and stats["dropped_queue_full"] == 0
    assert stats["dropped_spool_full"] > 0  # past the bound, the oldest batches went
    transport.fail = False  # the collector is back
    deadline = time.monotonic() + 10
    while 299 not in [s["step"] for s in transport.steps()]:
        assert time.monotonic() < deadline, "the spool was not replayed"
        time.sleep(0.05)
    steps = [s["step"] for s in transport.steps()]
    assert steps == sorted(steps) and steps[-1] == 299  # in order, newest last
    stats = tw.stats()
    assert stats["replayed"] > 0
    # Every step was either sent once or dropped (and counted) as the spool's oldest.
    assert len(steps) == len(set(steps)) and 300 - len(steps) <= stats["dropped_spool_full"]


def test_an_unwritable_spool_directory_falls_back_to_memory(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    caplog.set_level(logging.WARNING, logger="trainwarden.agent")
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.01, spool_dir=str(blocker))
    with tw.step(0):
        pass
    tw.shutdown(timeout_s=2)
    assert [s["step"] for s in transport.steps()] == [0]
    assert any("cannot use the spool directory" in r.getMessage() for r in caplog.records)


class BlockedTransport(RecordingTransport):
    """A collector that takes a request and never answers until released. ``returned``
    says that a send got past the hold (released, or after 30 s without): a call that
    returned while it is unset did not wait for the send."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(delay_s=delay_s)
        self.sending, self.release = threading.Event(), threading.Event()
        self.returned = threading.Event()

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.sending.set()
        self.release.wait(30)
        self.returned.set()
        return super().send(path, body)


def test_a_slow_collector_never_blocks_the_training_thread() -> None:
    transport = BlockedTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.01, batch_size=1, profile_every=0)
    with tw.step(0):
        pass
    assert transport.sending.wait(10)  # a send is under way, and held
    for i in range(1, 200):
        with tw.step(i):
            pass
    # 199 more steps ran while that send was still held: the trainer never waited on it.
    assert transport.sending.is_set() and not transport.release.is_set()
    assert not transport.returned.is_set()
    transport.release.set()
    tw.shutdown(timeout_s=5)


def test_full_queue_drops_the_oldest_and_counts_it() -> None:
    transport = RecordingTransport(delay_s=0.3)
    tw.init(run="unit", transport=transport, queue_size=10, flush_interval_s=5, batch_size=1000)
    for i in range(100):
        with tw.step(i):
            pass
    stats = tw.stats()
    assert stats["dropped_queue_full"] >= 80
    tw.shutdown(timeout_s=3)
    sent = [s["step"] for s in transport.steps()]
    assert sent and sent[-1] == 99  # the newest records survive


def test_without_url_runs_locally_and_says_so_once(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="trainwarden.agent")
    tw.init(run="local-only")
    for i in range(3):
        with tw.step(i) as s:
            s.loss(1.5)
    recent = tw.recent()
    assert [r.step for r in recent if r.kind == "step"] == [0, 1, 2]
    assert sum("no collector URL" in r.getMessage() for r in caplog.records) == 1


def test_step_before_init_says_what_to_do() -> None:
    tw.shutdown()
    with pytest.raises(RuntimeError, match="tw.init"):
        tw.step(0)


def test_shutdown_is_bounded_by_its_timeout() -> None:
    transport = BlockedTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.01)
    with tw.step(0):
        pass
    assert transport.sending.wait(10)  # the send that will not return
    tw.shutdown(timeout_s=0.5)
    # shutdown returned while the send is still held: bounded by its timeout, not by it
    assert not transport.release.is_set() and core._agent is None
    assert not transport.returned.is_set()
    transport.release.set()


def test_json_numbers_survive_the_wire() -> None:
    from trainwarden.agent.values import json_number

    assert json_number(1.5) == 1.5
    assert json_number(float("nan")) == "nan"
    assert json_number(-math.inf) == "-inf"


def test_a_busy_collector_loses_nothing_and_gets_each_record_once_in_order() -> None:
    from trainwarden.agent.exporter import CollectorError

    busy = CollectorError(503, "busy", retry_after=0.2)
    transport = RecordingTransport(script=[busy, busy, ConnectionError("reset")])
    agent = tw.init(run="unit", transport=transport, flush_interval_s=0.05, batch_size=8)
    for i in range(40):
        with tw.step(i):
            pass
        time.sleep(0.005)
    time.sleep(1.5)
    tw.shutdown()
    assert [s["step"] for s in transport.steps()] == list(range(40))
    assert agent.stats.retries >= 3 and agent.stats.dropped_send_failed == 0


def test_a_refused_batch_is_dropped_and_counted_not_retried() -> None:
    from trainwarden.agent.exporter import CollectorError

    class RefusesFirstSteps(RecordingTransport):
        """422 for the first batch that carries steps (not a start event sent alone)."""

        bodies_with_steps = False

        def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            if body["steps"] and not self.script and not self.bodies_with_steps:
                self.bodies_with_steps = True
                raise CollectorError(422, "steps[0].ts: bad")
            return super().send(path, body)

    transport = RefusesFirstSteps()
    agent = tw.init(run="unit", transport=transport, flush_interval_s=0.05)
    with tw.step(0):
        pass
    deadline = time.monotonic() + 10  # step 0's batch refused before step 1 exists
    while not transport.bodies_with_steps and time.monotonic() < deadline:
        time.sleep(0.01)
    with tw.step(1):
        pass
    tw.shutdown()
    assert agent.stats.dropped_send_failed >= 1 and agent.stats.retries == 0
    assert [s["step"] for s in transport.steps()] == [1]


def test_checkpoint_saved_is_an_event_with_its_step_and_path() -> None:
    tw.init(run="local-only")
    tw.checkpoint_saved(200, "/ckpt/step-200", seconds=12.5)
    (ckpt,) = [r for r in tw.recent() if r.kind == "event" and r.body["kind"] == "checkpoint"]
    assert ckpt.body["step"] == 200
    assert ckpt.body["data"] == {"path": "/ckpt/step-200", "seconds": 12.5}


class RefusingTransport(RecordingTransport):
    """A collector that refuses this agent's token (missing, revoked, wrong run)."""

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from trainwarden.agent.exporter import CollectorError

        raise CollectorError(401, '{"detail": "the token is not valid"}')


def test_a_refused_token_loses_nothing_and_says_so_once(caplog, tmp_path: Path) -> None:
    caplog.set_level(logging.WARNING, logger="trainwarden.agent")
    spool = tmp_path / "spool"
    tw.init(
        run="unit",
        transport=RefusingTransport(),
        flush_interval_s=0.01,
        gpu_interval_s=0,
        spool_dir=str(spool),
    )
    for i in range(20):
        with tw.step(i):
            pass
    time.sleep(0.2)
    agent = tw.init.__globals__["_core"]._agent
    tw.shutdown(timeout_s=2)
    assert agent.stats.batches_refused_auth >= 1
    assert agent.stats.dropped_send_failed == agent.stats.dropped_at_shutdown == 0
    assert agent.stats.spooled == 25
    said = [r for r in caplog.records if "refused this agent's token" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert "TRAINWARDEN_TOKEN" in said[0].getMessage()

    transport = RecordingTransport()  # restarted with the right token: replayed first
    tw.init(run="unit", transport=transport, flush_interval_s=0.01, spool_dir=str(spool))
    tw.shutdown(timeout_s=2)
    assert [s["step"] for s in transport.steps()] == list(range(20))


class TakenRankTransport(RecordingTransport):
    """A collector that takes a first batch, then answers 409: another live process of the
    run holds this rank (collector/ingest/claims.py), naming it."""

    def __init__(self) -> None:
        super().__init__()
        self.sends = 0

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from trainwarden.agent.exporter import CollectorError

        self.sends += 1
        if self.sends == 1:
            return super().send(path, body)
        raise CollectorError(
            409,
            '{"detail": "run \'unit\' rank 0 is held by another live process, pid 4711 on '
            'node-a (session 1f2e3d4c)", "reason": "rank_conflict", "run": "unit", "rank": 0}',
        )


def test_a_rank_another_process_holds_stops_the_sending_once_said(caplog, tmp_path: Path) -> None:
    caplog.set_level(logging.WARNING, logger="trainwarden.agent")
    transport = TakenRankTransport()
    tw.init(
        run="unit",
        transport=transport,
        flush_interval_s=0.01,
        heartbeat_s=0.05,
        gpu_interval_s=0,
        spool_dir=str(tmp_path / "spool"),
    )
    agent = tw.init.__globals__["_core"]._agent
    with tw.step(0):
        pass
    deadline = time.monotonic() + 10
    while transport.sends < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sends = transport.sends
    for i in range(1, 200):  # the trainer goes on, at its own pace
        with tw.step(i):
            pass
    time.sleep(0.3)  # six heartbeats' time: none goes out
    tw.shutdown(timeout_s=2)
    assert sends == transport.sends == 2  # nothing sent after the 409, not even a goodbye
    stats = agent.stats
    assert stats.spooled == stats.replayed == stats.dropped_send_failed == 0
    assert stats.dropped_conflict == stats.recorded - stats.sent > 199
    kept = [p for p in (tmp_path / "spool").rglob("*.json") if "last-words" not in p.parts]
    assert kept == []  # no batch kept for later
    said = [r for r in caplog.records if "refused this process's batches" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "pid 4711 on node-a" in said[0].getMessage()
    assert "dropped_conflict" in said[0].getMessage()


def test_the_http_transport_names_its_sender_so_a_refusal_still_counts_as_a_beat() -> None:
    import http.server

    from trainwarden.agent.exporter import CollectorError, HttpTransport

    seen: list[str | None] = []

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(self.headers.get("X-Trainwarden-Sender"))
            body = b'{"error": "collector busy"}'
            self.send_response(503)
            self.send_header("Retry-After", "2")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Busy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    transport = HttpTransport(f"http://127.0.0.1:{server.server_port}", token=None, timeout_s=5)
    try:
        with pytest.raises(CollectorError) as refused:
            transport.send(
                "/api/v1/ingest", {"run": "llama-70b", "agent": {"rank": 12}, "steps": []}
            )
        assert refused.value.status == 503 and refused.value.retry_after == 2.0
        assert seen == ["llama-70b/12"]
    finally:
        transport.close()
        server.shutdown()


def test_flush_returns_once_the_batch_is_sent_not_while_it_is_in_flight() -> None:
    transport = BlockedTransport(delay_s=0.3)  # each request takes 300 ms
    transport.release.set()  # not held, for now
    agent = tw.init(
        run="unit", transport=transport, flush_interval_s=30, heartbeat_s=30, gpu_interval_s=0
    )
    for i in range(5):
        with tw.step(i):
            pass
    agent.flush(timeout_s=10)
    assert [s["step"] for s in transport.steps()] == [0, 1, 2, 3, 4]

    # The collector holds the next request for longer than the flush may wait.
    for event in (transport.release, transport.sending, transport.returned):
        event.clear()  # (every send so far has returned: the flush above waited for them)
    with tw.step(5):
        pass
    t0 = time.monotonic()
    agent.flush(timeout_s=0.3)
    assert time.monotonic() - t0 > 0.25  # it waited its time
    # and returned while the send is still held: it did not wait for that.
    assert transport.sending.wait(10) and not transport.returned.is_set()
    transport.release.set()
    tw.shutdown(timeout_s=10)
    assert [s["step"] for s in transport.steps()] == [0, 1, 2, 3, 4, 5]
    # The exporter has stopped: nothing to wait for. A flush that waited would take its
    # whole hour.
    after = threading.Thread(target=agent.flush, kwargs={"timeout_s": 3600}, daemon=True)
    after.start()
    after.join(60)
    assert not after.is_alive(), "a flush after shutdown waited for its timeout"


def test_stats_are_typed_and_keep_their_names() -> None:
    agent = tw.init(run="unit", transport=RecordingTransport(), gpu_interval_s=0)
    with tw.step(0):
        pass
    stats = tw.stats()
    # A plain dict with the names tw.stats() has always returned, in this order.
    assert type(stats) is dict and stats == agent.stats.as_dict()
    assert list(stats) == [
        "recorded",
        "dropped_queue_full",
        "sent",
        "batches_sent",
        "batches_failed",
        "batches_refused_auth",
        "dropped_send_failed",
        "exporter_cpu_ns",
        "heartbeats",
        "retries",
        "dropped_at_shutdown",
        "spooled",
        "replayed",
        "spooled_from_earlier",
        "dropped_spool_full",
        "dropped_spool_failed",
        "dropped_spool_unreadable",
        "dropped_conflict",
    ]
    tw.shutdown()
    assert agent.stats.sent == agent.stats.recorded >= 1  # all of it went out
    assert agent.stats["sent"] == agent.stats.sent  # read by name, as before it was typed
    with pytest.raises(KeyError):
        agent.stats["as_dict"]
