"""The Accelerate tracker in one process (agent/integrations/accelerate.py): each optimizer
step of an ``accelerator.accumulate`` loop is a step with this rank's loss, grad norm,
phases, tokens and the logged values; ``save_state`` is a reported checkpoint whose step
``load_state`` reads back; a rollback restores the checkpoint in process and a stop ends
the process, both at a step boundary; without a URL or a run name, or with an
accelerate outside the tested range, training goes on unobserved, said once."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file

import trainwarden.agent as tw
from trainwarden.agent import core
from trainwarden.agent.integrations.accelerate import TrainwardenTracker

from .helpers import RecordingTransport
from .integration_drills import applied, rollback, said_untested

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from accelerate_trainer import VOCAB, Synthetic, TinyLM  # noqa: E402

LR = 1e-3


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "TRAINWARDEN_URL",
        "TRAINWARDEN_DRILL",
        "TRAINWARDEN_RUN",
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)
    AcceleratorState._reset_state(True)  # each test its own Accelerator
    GradientState._reset_state()


def recording(**init: Any) -> tuple[RecordingTransport, TrainwardenTracker]:
    transport = RecordingTransport()
    tracker = TrainwardenTracker(
        "unit-acc", init={"transport": transport, "gpu_interval_s": 0, **init}
    )
    return transport, tracker


def prepared(tracker: TrainwardenTracker, accumulation: int = 2, samples: int = 48) -> tuple:
    accelerator = Accelerator(
        log_with=[tracker], gradient_accumulation_steps=accumulation, cpu=True
    )
    accelerator.init_trackers("unit-project", config={"lr": LR, "accumulation": accumulation})
    torch.manual_seed(0)
    model = TinyLM(dim=32, layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(Synthetic(samples), batch_size=4)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def train(
    accelerator: Any,
    model: Any,
    optimizer: Any,
    loader: Any,
    out: Path,
    *,
    save_every: int = 3,
    log_every: int = 1,
    at: int | None = None,
    commands: list[dict[str, Any]] | None = None,
) -> dict[str, list[float]]:
    """The example's loop: what each optimizer step's micro-batches lost, and the norms
    ``clip_grad_norm_`` returned. ``commands`` reach the agent after update ``at``."""
    facts: dict[str, list[float]] = {"losses": [], "norms": []}
    micro: list[float] = []
    completed = 0
    for batch in loader:
        with accelerator.accumulate(model):
            ids = batch["input_ids"]
            loss = F.cross_entropy(model(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            accelerator.backward(loss)
            micro.append(loss.item())
            if accelerator.sync_gradients:
                facts["norms"].append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        completed += 1
        facts["losses"].append(sum(micro) / len(micro))
        micro = []
        if completed == at and commands:
            assert core._agent is not None
            core._agent.commands.receive(commands)
        if completed % save_every == 0:
            accelerator.save_state(str(out / f"step_{completed}"))
        if completed % log_every == 0:
            accelerator.log({"train/loss": loss.item(), "Accuracy": torch.tensor(0.5)}, completed)
    accelerator.end_training()
    return facts


def test_each_optimizer_step_is_a_step_with_its_loss_tokens_and_checkpoints(tmp_path: Path) -> None:
    transport, tracker = recording()
    accelerator, model, optimizer, loader = prepared(tracker)
    tracker.watch(accelerator, model, optimizer)
    accelerator.log({"epoch": 0})  # between steps: the next step's
    # Logged on every other step: the others end at the next forward (the last one at
    # end_training).
    facts = train(accelerator, model, optimizer, loader, tmp_path, log_every=2)
    tw.shutdown()
    steps = transport.steps()
    assert [s["step"] for s in steps] == list(range(6))  # 12 micro-batches, 2 a step
    # This rank's loss: the mean of the losses given to accelerator.backward in the step
    assert [s["loss"] for s in steps] == [pytest.approx(v, rel=1e-6) for v in facts["losses"]]
    # The norm clip_grad_norm_ returned (before clipping at 0.5), not the clipped one
    assert [s["grad_norm"] for s in steps] == [pytest.approx(v, rel=1e-6) for v in facts["norms"]]
    assert all(n > 0.5 for n in facts["norms"])
    for s in steps:
        assert math.isfinite(s["loss"]) and 0 < s["loss"] < 10, s
        assert s["tokens"] == 2 * 4 * 32  # two micro-batches of 4 sequences of 32
        assert s["fwd_s"] > 0 and s["bwd_s"] > 0 and s["opt_s"] > 0, s
    assert [s["lr"] for s in steps] == [LR] * 6  # the built-in lr, not a user metric
    metrics = [s.get("metrics") or {} for s in steps]
    assert metrics[0]["epoch"] == 0.0
    assert [sorted(m) for m in metrics[1:]] == [
        ["accuracy", "train.loss"] if n % 2 else [] for n in range(1, 6)
    ]
    assert all(m["accuracy"] == 0.5 for m in metrics if "accuracy" in m)
    events = transport.events()
    start = next(e for e in events if e["kind"] == "attempt_start")
    config = start["data"]["config"]
    assert config["lr"] == LR and config["accumulation"] == 2
    assert config["framework"] == f"accelerate {__import__('accelerate').__version__}"
    assert config["accelerate"] == {
        "num_processes": 1,
        "distributed_type": "NO",
        "mixed_precision": "no",
        "gradient_accumulation_steps": 2,
    }
    checkpoints = [(e["step"], e["data"]["path"]) for e in events if e["kind"] == "checkpoint"]
    assert checkpoints == [(2, str(tmp_path / "step_3")), (5, str(tmp_path / "step_6"))]
    assert all(e["data"]["bytes"] > 0 for e in events if e["kind"] == "checkpoint")
    assert json.loads((tmp_path / "step_3" / "trainwarden.json").read_text()) == {"step": 2}
    assert transport.bodies[0]["run"] == "unit-acc"
    # end_training took the wrappers off this Accelerator
    assert {"backward", "clip_grad_norm_", "log", "save_state"}.isdisjoint(vars(accelerator))


def test_load_state_numbers_the_steps_on_from_the_checkpoint(tmp_path: Path) -> None:
    _, first = recording()
    accelerator, model, optimizer, loader = prepared(first, samples=24)
    first.watch(accelerator, model, optimizer)
    train(accelerator, model, optimizer, loader, tmp_path)  # 3 steps, step_3 holds step 2
    tw.shutdown()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    transport, tracker = recording()
    accelerator, model, optimizer, loader = prepared(tracker, samples=16)
    tracker.watch(accelerator, model, optimizer)  # before load_state: it reads the step
    accelerator.load_state(str(tmp_path / "step_3"))
    assert tracker.step == 3
    train(accelerator, model, optimizer, loader, tmp_path / "again")
    tw.shutdown()
    assert [s["step"] for s in transport.steps()] == [3, 4]


def test_a_rollback_restores_the_checkpoint_in_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transport, tracker = recording()
    accelerator, model, optimizer, loader = prepared(tracker, samples=64)  # 8 steps
    tracker.watch(accelerator, model, optimizer)
    restored: dict[str, Any] = {}

    def snapshot(plan: tw.RollbackPlan) -> None:  # registered after the tracker's: runs after
        inner = accelerator.unwrap_model(model)
        restored["weights"] = {k: v.clone() for k, v in inner.state_dict().items()}
        restored["adam_steps"] = {
            float(s["step"]) for s in optimizer.state_dict()["state"].values()
        }
        restored["lr"] = optimizer.param_groups[0]["lr"]
        restored["micro"] = accelerator.step

    tw.on_rollback(snapshot)
    path = tmp_path / "step_4"  # the weights after update 3
    commands = rollback(path, 3, 5, lr_scale=0.5)
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        train(
            accelerator, model, optimizer, loader, tmp_path, save_every=2, at=5, commands=commands
        )
    tw.shutdown()
    # After step 5 the model is at update 3 again; the loop's own 8 updates go on.
    assert [s["step"] for s in transport.steps()] == [0, 1, 2, 3, 4, 5, 4, 5]
    saved = load_file(str(path / "model.safetensors"))
    for name, value in saved.items():
        assert torch.equal(restored["weights"][name], value), name
    assert restored["adam_steps"] == {4.0}  # the optimizer's state, as saved
    assert restored["lr"] == pytest.approx(LR * 0.5)  # the plan's lr_scale
    assert restored["micro"] == 12  # its place in the gradient accumulation kept
    ack = applied(transport)
    assert (ack["applied"], ack["barrier_step"], ack["checkpoint_step"]) == (True, 5, 3), ack
    assert f"rolled back to {path} (step 3) after step 5" in caplog.text
    checkpoints = [
        (e["step"], Path(e["data"]["path"]).name)
        for e in transport.events()
        if e["kind"] == "checkpoint"
    ]
    # step_6 was saved in step 5 before the rollback; step_8 holds update 5 again
    assert checkpoints == [(1, "step_2"), (3, "step_4"), (5, "step_6"), (5, "step_8")]


def test_a_stop_ends_the_process_at_a_step_boundary(tmp_path: Path) -> None:
    transport, tracker = recording()
    accelerator, model, optimizer, loader = prepared(tracker)
    tracker.watch(accelerator, model, optimizer)
    stop = [{"id": 1, "type": "stop", "reason": "node evicted"}]
    with pytest.raises(SystemExit) as stopped:
        train(accelerator, model, optimizer, loader, tmp_path, log_every=100, at=2, commands=stop)
    assert stopped.value.code == tw.STOPPED_EXIT_CODE
    # received after update 1; step 1 ends at the next forward: the process ends there
    assert [s["step"] for s in transport.steps()] == [0, 1]


def test_without_a_collector_url_training_goes_on_unobserved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = TrainwardenTracker("unit-acc")
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        accelerator, model, optimizer, loader = prepared(tracker, samples=16)
        tracker.watch(accelerator, model, optimizer)
        facts = train(accelerator, model, optimizer, loader, tmp_path)
    assert len(facts["losses"]) == 2 and core._agent is None
    assert caplog.text.count("no collector URL (TRAINWARDEN_URL, or url=): training goes on") == 1


def test_without_a_run_name_training_goes_on_unobserved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = TrainwardenTracker(init={"transport": RecordingTransport()})
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        accelerator, model, optimizer, loader = prepared(tracker, samples=16)
        tracker.watch(accelerator, model, optimizer)
        facts = train(accelerator, model, optimizer, loader, tmp_path)
    assert len(facts["losses"]) == 2 and core._agent is None
    assert caplog.text.count("no run name") == 1


def test_an_accelerate_outside_the_tested_range_is_said_once_and_not_observed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import accelerate

    from trainwarden.agent.integrations.common import check_version

    assert check_version("accelerate", accelerate.__version__) is None  # the one installed
    assert check_version("accelerate", "1.14.0") is not None
    monkeypatch.setattr(accelerate, "__version__", "2.0.0")
    transport, tracker = recording()
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        accelerator, model, optimizer, loader = prepared(tracker, samples=16)
        tracker.watch(accelerator, model, optimizer)
        facts = train(accelerator, model, optimizer, loader, tmp_path)
    assert len(facts["losses"]) == 2
    said_untested(caplog.text, transport, "accelerate", "2.0.0")
    assert not model._forward_pre_hooks and "backward" not in vars(accelerator)  # no hooks


def test_a_failure_of_the_tracker_leaves_the_training_going_unobserved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport, tracker = recording()
    accelerator, model, optimizer, loader = prepared(tracker)
    tracker.watch(accelerator, model, optimizer)
    opened = tracker._open

    def open_twice() -> None:  # the third step cannot open (inside the model's forward hook)
        if tracker.step == 2:
            raise RuntimeError("boom")
        opened()

    monkeypatch.setattr(tracker, "_open", open_twice)
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        facts = train(accelerator, model, optimizer, loader, tmp_path, log_every=100)
    tw.shutdown()
    assert len(facts["losses"]) == 6  # the loop ran to its end
    assert [s["step"] for s in transport.steps()] == [0, 1]
    assert caplog.text.count("the Accelerate tracker failed (boom): unobserved from here") == 1
    # the hooks came off at the next accelerator.backward (not inside the forward hook)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert {"backward", "clip_grad_norm_", "log", "save_state"}.isdisjoint(vars(accelerator))
