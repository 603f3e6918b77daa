"""``s.metric(name, value)``: the trainer's own scalars, through the transport seam."""

from __future__ import annotations

import re
import threading

import pytest
import torch

import trainwarden.agent as tw
from trainwarden.agent import core

from .helpers import RecordingTransport

pytestmark = pytest.mark.usefixtures("clean_agent")


def test_user_metrics_ride_in_the_step_record() -> None:
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.05)
    with tw.step(0) as s:
        s.metric("lr", 3e-4)
        s.metrics(aux_loss=torch.tensor(0.25), **{"moe.balance": torch.tensor([1.0, 3.0])})
        s.metric("lr", 1e-4)  # the last value of a name wins
    with tw.step(1) as s:
        s.metric("eval.loss", float("nan"))
        s.metric("grad.scale", torch.tensor(float("inf")))
        s.metric("empty", torch.empty(0))
    with tw.step(2):
        pass
    tw.shutdown()
    steps = transport.steps()
    assert steps[0]["metrics"] == {"lr": 1e-4, "aux_loss": 0.25, "moe.balance": 2.0}
    # JSON has no NaN: the strings the collector reads as such.
    assert steps[1]["metrics"] == {"eval.loss": "nan", "grad.scale": "inf", "empty": None}
    assert steps[1]["issues"] == {"user.empty": "empty tensor"}
    assert "metrics" not in steps[2]


def test_tensor_metrics_are_read_by_the_exporter_not_on_the_training_thread(monkeypatch) -> None:
    reads: list[str] = []
    original = torch.Tensor.item

    def spy(self):  # type: ignore[no-untyped-def]
        reads.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "item", spy)
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.05)
    with tw.step(0) as s:
        s.metric("aux_loss", torch.tensor(1.5))
    tw.shutdown()
    assert reads and set(reads) == {"trainwarden-exporter"}
    assert transport.steps()[0]["metrics"] == {"aux_loss": 1.5}


@pytest.mark.parametrize("name", ["LR", "9lives", "lr-rate", "", "a" * 33, "lr rate", 7])
def test_a_bad_name_raises_at_the_call_naming_it(name: object) -> None:
    tw.init(run="unit", transport=RecordingTransport(), flush_interval_s=0.05)
    with tw.step(0) as s, pytest.raises(ValueError, match=re.escape(repr(name))):
        s.metric(name, 1.0)  # type: ignore[arg-type]


def test_at_most_32_metrics_a_step() -> None:
    tw.init(run="unit", transport=RecordingTransport(), flush_interval_s=0.05)
    with tw.step(0) as s:
        s.metrics(**{f"m{i}": float(i) for i in range(32)})
        s.metric("m0", 5.0)  # a name it has: not one more
        with pytest.raises(ValueError, match="'m32' is one too many: at most 32"):
            s.metric("m32", 1.0)


def test_a_step_without_user_metrics_allocates_none() -> None:
    tw.init(run="unit", transport=RecordingTransport(), flush_interval_s=0.05)
    with tw.step(0) as s:
        s.loss(1.0)
        record = s._record
    assert isinstance(record, core.StepRecord) and record.metrics is None


def test_otlp_carries_user_metrics() -> None:
    try:  # the otlp extra: installed by scripts/install.sh and CI; missing is a failure
        from trainwarden.agent.otlp import OtlpTransport
    except ImportError as exc:
        pytest.fail(f"the OTLP exporter needs pip install 'trainwarden[otlp]': {exc}")

    transport = OtlpTransport("http://127.0.0.1:9", token=None, timeout_s=1.0)
    step = {
        "step": 3,
        "ts": 1_700_000_000.0,
        "duration_s": 0.5,
        "metrics": {"lr": 1e-4, "eval.loss": "nan", "lost": None},
    }
    body = {
        "run": "r",
        "agent": {"rank": 0, "world_size": 1, "host": "h", "session": "s"},
        "steps": [step],
        "events": [],
        "gpu": [],
    }
    data = transport.metrics_data(body)
    transport.close()
    metrics = {m.name: m for m in data.resource_metrics[0].scope_metrics[0].metrics}
    lr = metrics["trainwarden.user.lr"].data.data_points[0]
    assert lr.value == 1e-4 and lr.attributes == {"trainwarden.step": 3}
    assert str(metrics["trainwarden.user.eval.loss"].data.data_points[0].value) == "nan"
    assert "trainwarden.user.lost" not in metrics  # no value read: no point


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_metrics_do_not_sync_the_training_thread() -> None:
    transport = RecordingTransport()
    tw.init(run="unit", transport=transport, flush_interval_s=0.05)
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host-device sync below raises
    try:
        for i in range(3):
            with tw.step(i) as s:
                y = x @ x
                s.metrics(aux_loss=y.mean(), **{"moe.balance": y.std()})
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tw.shutdown()
    steps = transport.steps()
    assert [sorted(s["metrics"]) for s in steps] == [["aux_loss", "moe.balance"]] * 3
    assert all(isinstance(s["metrics"]["aux_loss"], float) for s in steps)


def test_the_learning_rate_is_a_built_in_field_not_a_user_metric() -> None:
    transport = RecordingTransport()
    tw.init(run="lr-unit", transport=transport, gpu_interval_s=0)
    with tw.step(0) as s:
        s.lr(torch.tensor(3e-4))  # a tensor: read off the training thread
    with tw.step(1) as s:
        s.lr(float("nan"))  # kept, as for the loss: the collector names it in issues
    with tw.step(2):
        pass
    tw.shutdown()
    steps = transport.steps()
    assert steps[0]["lr"] == pytest.approx(3e-4) and "metrics" not in steps[0]
    assert steps[1]["lr"] == "nan"
    assert "lr" not in steps[2]
