"""Checkpoint cost: ``tw.checkpoint_saved(..., seconds=, bytes=, drain_seconds=)`` and
``with tw.checkpointing(step, path) as ck``, whose size is measured off the training thread."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trainwarden.agent as tw
from trainwarden.agent import checkpoints

from .helpers import RecordingTransport

pytestmark = pytest.mark.usefixtures("clean_agent")


@pytest.fixture
def transport() -> RecordingTransport:
    transport = RecordingTransport()
    tw.init(run="ckpt", transport=transport, flush_interval_s=0.05, profile_every=0)
    return transport


def _events(transport: RecordingTransport, kind: str) -> list[dict[str, Any]]:
    tw.shutdown(timeout_s=5)
    return [e for e in transport.events() if e["kind"] == kind]


def _sharded_checkpoint(folder: Path) -> int:
    """A directory tree as torch.distributed.checkpoint writes one; returns its bytes."""
    (folder / "model").mkdir(parents=True)
    (folder / "optim" / "shards").mkdir(parents=True)
    sizes = {
        "model/__0_0.distcp": 4096,
        "model/__1_0.distcp": 1000,
        "optim/shards/__0_0.distcp": 12_345,
        ".metadata": 77,
    }
    for name, size in sizes.items():
        (folder / name).write_bytes(b"\0" * size)
    (folder / "latest").symlink_to(folder / "model")  # not counted twice
    return sum(sizes.values())


def test_checkpointing_times_the_save_and_measures_a_directory(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    folder = tmp_path / "step-100"
    entering = time.perf_counter()  # the test's own clock, around the block
    with tw.checkpointing(100, folder) as ck:
        size = _sharded_checkpoint(folder)
        time.sleep(0.05)  # the save blocks training this long
    around = time.perf_counter() - entering
    assert ck.seconds is not None and 0.05 <= ck.seconds <= around
    (event,) = _events(transport, "checkpoint")
    assert event["step"] == 100 and event["severity"] == "info"
    assert event["data"] == {"path": str(folder), "seconds": ck.seconds, "bytes": size}


def test_a_single_file_and_a_missing_path(tmp_path: Path, transport: RecordingTransport) -> None:
    path = tmp_path / "step-5.pt"
    with tw.checkpointing(5, str(path)):
        path.write_bytes(b"x" * 2048)
    with tw.checkpointing(6, tmp_path / "never-written"):
        pass
    with tw.checkpointing(7):  # no path: the time alone
        pass
    saved = sorted(_events(transport, "checkpoint"), key=lambda e: e["step"])
    assert [(e["step"], e["data"].get("bytes")) for e in saved] == [(5, 2048), (6, None), (7, None)]
    assert [e["ts"] for e in saved] == sorted(e["ts"] for e in saved)  # when each save ended
    assert saved[2]["data"]["path"] is None and "bytes" not in saved[1]["data"]


def test_the_size_is_measured_off_the_training_thread(
    tmp_path: Path, transport: RecordingTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    original = checkpoints.size_of

    sizing, release, returned = threading.Event(), threading.Event(), threading.Event()

    def spy(path: str) -> int | None:  # a slow shared file system, held until released
        threads.append(threading.current_thread().name)
        sizing.set()
        release.wait(10)
        returned.set()  # released, or tired of waiting
        return original(path)

    monkeypatch.setattr(checkpoints, "size_of", spy)
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"x" * 10)
    with tw.checkpointing(1, path):
        pass
    # The training thread is past the block while the size is still being read.
    assert sizing.wait(10) and not release.is_set() and not returned.is_set()
    release.set()
    (event,) = _events(transport, "checkpoint")  # shutdown waits for the size
    assert threads == ["trainwarden-checkpoint-size"] and event["data"]["bytes"] == 10


def test_a_failed_save_is_a_warning_and_the_exception_goes_on(
    tmp_path: Path, transport: RecordingTransport
) -> None:
    with pytest.raises(OSError, match="No space left"), tw.checkpointing(9, tmp_path / "x") as ck:
        time.sleep(0.01)
        raise OSError(28, "No space left on device")
    assert _events(transport, "checkpoint") == []
    (failed,) = [e for e in transport.events() if e["kind"] == "checkpoint_failed"]
    assert failed["step"] == 9 and failed["severity"] == "warning"
    assert failed["data"] == {
        "path": str(tmp_path / "x"),
        "seconds": ck.seconds,
        "error": "OSError: [Errno 28] No space left on device",
    }


def test_an_async_save_reports_its_drain(tmp_path: Path, transport: RecordingTransport) -> None:
    entering = time.perf_counter()  # the test's own clock, around the block and the drain
    with tw.checkpointing(200, tmp_path / "async") as ck:
        pass  # async_save() returned: training goes on while it writes
    time.sleep(0.05)
    drained = ck.drained()  # the writer finished
    around = time.perf_counter() - entering
    assert ck.drained() == drained  # once
    tw.checkpoint_drained(300, 2.5, path="/ckpt/300")
    tw.checkpoint_drained(400, 1)
    tw.shutdown(timeout_s=5)
    events = [e for e in transport.events() if e["kind"] == "checkpoint_drained"]
    assert [(e["step"], e["data"]) for e in events] == [
        (200, {"path": str(tmp_path / "async"), "drain_seconds": drained}),
        (300, {"path": "/ckpt/300", "drain_seconds": 2.5}),
        (400, {"path": None, "drain_seconds": 1.0}),
    ]
    assert 0.05 <= drained <= around  # from the block's end to the drained() call


def test_checkpoint_saved_carries_the_typed_fields_and_the_trainers_own(
    transport: RecordingTransport,
) -> None:
    tw.checkpoint_saved(
        10, "/ckpt/10", seconds=12.5, bytes=np.int64(2**40), drain_seconds=30, kind="full"
    )
    tw.checkpoint_saved(20, Path("/ckpt/20"))
    saved = _events(transport, "checkpoint")
    assert saved[0]["data"] == {
        "path": "/ckpt/10",
        "seconds": 12.5,
        "bytes": 2**40,
        "drain_seconds": 30.0,
        "kind": "full",
    }
    assert saved[1]["data"] == {"path": "/ckpt/20"}  # what rollbacks and CheckpointStale read


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seconds": -1.0}, ValueError, "seconds must be a finite number of seconds >= 0"),
        ({"seconds": math.nan}, ValueError, "seconds must be a finite"),
        ({"seconds": "12s"}, TypeError, "seconds must be a number of seconds"),
        ({"drain_seconds": math.inf}, ValueError, "drain_seconds must be a finite"),
        ({"bytes": 1.5e9}, TypeError, "bytes must be an int"),
        ({"bytes": -1}, ValueError, "bytes must be >= 0"),
        ({"bytes": True}, TypeError, "bytes must be an int"),
    ],
)
def test_wrong_checkpoint_fields_are_bugs_at_the_call_site(
    transport: RecordingTransport, kwargs: dict[str, Any], error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        tw.checkpoint_saved(10, "/ckpt/10", **kwargs)


def test_wrong_steps_fail_at_once(transport: RecordingTransport) -> None:
    with pytest.raises(TypeError, match="step must be an int"):
        tw.checkpointing("100")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step must be >= 0"):
        tw.checkpoint_saved(-1, "/ckpt")
    with pytest.raises(ValueError, match="seconds must be a finite"):
        tw.checkpoint_drained(1, -2.0)
    with pytest.raises(RuntimeError, match="after the"):
        tw.checkpointing(1).drained()
