"""The Hugging Face Trainer callback in one process (agent/integrations/hf.py): each
optimizer step is a step with this rank's loss, grad norm, learning rate, phases and
tokens; checkpoints are reported as the weights after update N - 1; a rollback restores a
checkpoint in process and the Trainer goes on from its step; a stop ends ``train`` with
``SystemExit(76)``; without a URL or a run name, or with a transformers outside the
tested range, training goes on unobserved, said once."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import trainwarden.agent as tw
from trainwarden.agent import core
from trainwarden.agent.integrations import hf as hf_integration
from trainwarden.agent.integrations.hf import TrainwardenCallback

from .helpers import RecordingTransport
from .integration_drills import applied, rollback, said_untested

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import transformers  # noqa: E402
from hf_trainer import VOCAB, Synthetic  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_URL", "TRAINWARDEN_DRILL", "TRAINWARDEN_RUN"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


def trainer(
    out: Path,
    callback: TrainwardenCallback,
    steps: int = 6,
    logging_steps: int = 100,
    *,
    more: list[TrainerCallback] | None = None,
    **extra: Any,
) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=1,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        save_steps=3,
        logging_steps=logging_steps,
        report_to=[],
        use_cpu=True,
        seed=0,
        **extra,
    )
    return Trainer(
        model=model,
        args=args,
        train_dataset=Synthetic(256),
        callbacks=[callback, *(more or [])],
    )


def recording() -> tuple[RecordingTransport, TrainwardenCallback]:
    transport = RecordingTransport()
    return transport, TrainwardenCallback(init={"transport": transport, "gpu_interval_s": 0})


class Inject(TrainerCallback):
    """Hands the agent commands as step ``at`` starts, as the exporter would; keeps what
    a rollback restored (its ``tw.on_rollback`` handler runs after the callback's)."""

    def __init__(self, at: int, commands: list[dict[str, Any]]) -> None:
        self.at, self.commands, self.sent = at, commands, False
        self.restored: dict[str, Any] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs["model"], kwargs["optimizer"]

        def snapshot(plan: tw.RollbackPlan) -> None:
            saved = optimizer.state_dict()["state"]
            self.restored = {
                "weights": {k: v.clone() for k, v in model.state_dict().items()},
                "adam_steps": {float(s["step"]) for s in saved.values()},
                "global_step": state.global_step,
            }

        tw.on_rollback(snapshot)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at and not self.sent:
            self.sent = True
            assert core._agent is not None
            core._agent.commands.receive(self.commands)


def test_each_optimizer_step_is_a_step_with_its_loss_tokens_and_checkpoints(tmp_path: Path) -> None:
    transport, callback = recording()
    hf = trainer(tmp_path / "run-a", callback, logging_steps=1)
    hf.train()
    tw.shutdown()
    steps = transport.steps()
    # the learning rate each update used (the linear schedule's), as the Trainer logs it
    rates = [h["learning_rate"] for h in hf.state.log_history if "learning_rate" in h]
    assert len(rates) == 6 and rates[0] > rates[-1] > 0, rates
    assert [s["lr"] for s in steps] == [pytest.approx(v, rel=1e-9) for v in rates]
    assert [s["step"] for s in steps] == list(range(6))
    # One process: the Trainer's own loss of each step (logged every step here, rounded
    # to 4 digits) is this rank's loss: the micro-batches' token-weighted mean.
    logged = [h["loss"] for h in hf.state.log_history if "loss" in h]
    assert [round(s["loss"], 4) for s in steps] == [pytest.approx(v, abs=1e-4) for v in logged]
    # and its gradient norm, before the clipping (max_grad_norm 1.0), as the Trainer logs it
    norms = [h["grad_norm"] for h in hf.state.log_history if "grad_norm" in h]
    assert [s["grad_norm"] for s in steps] == [pytest.approx(v, rel=1e-5) for v in norms]
    for s in steps:
        assert math.isfinite(s["loss"]) and 0 < s["loss"] < 10, s
        assert s["tokens"] == 2 * 4 * 32  # two micro-batches of 4 sequences of 32
        assert s["grad_norm"] > 0
        assert s["fwd_s"] > 0 and s["bwd_s"] > 0 and s["opt_s"] > 0
    events = [e for b in transport.bodies for e in b["events"]]
    start = next(e for e in events if e["kind"] == "attempt_start")
    assert start["data"]["config"]["gradient_accumulation_steps"] == 2
    assert start["data"]["config"]["framework"].startswith("transformers ")
    checkpoints = [(e["step"], e["data"]["path"]) for e in events if e["kind"] == "checkpoint"]
    assert checkpoints == [
        (2, str(tmp_path / "run-a" / "checkpoint-3")),
        (5, str(tmp_path / "run-a" / "checkpoint-6")),
    ]
    assert transport.bodies[0]["run"] == "run-a"  # the output directory's name


def test_a_rollback_restores_the_checkpoint_in_process_and_goes_on_from_its_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transport, callback = recording()
    out = tmp_path / "run-r"
    folder = out / "checkpoint-3"  # the weights after update 2
    inject = Inject(5, rollback(folder, 2, 5, lr_scale=0.5))
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        hf = trainer(out, callback, steps=9, more=[inject], save_total_limit=None)
        hf.train()
    tw.shutdown()
    steps = transport.steps()
    # After step 5 the model holds update 2 again; the Trainer goes on to max_steps.
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]
    assert hf.state.global_step == 9
    assert inject.restored["global_step"] == 3
    saved = load_file(folder / "model.safetensors")
    for name, value in saved.items():
        assert torch.equal(inject.restored["weights"][name], value), name
    assert inject.restored["adam_steps"] == {3.0}  # the optimizer's state, as saved
    # the step after the checkpoint, run again, at half the learning rate it had
    first, again = steps[3], steps[6]
    assert again["lr"] == pytest.approx(0.5 * first["lr"], rel=1e-9)
    ack = applied(transport)
    assert (ack["applied"], ack["barrier_step"], ack["checkpoint_step"]) == (True, 5, 2), ack
    assert f"rolled back to {folder} (step 2) after step 5" in caplog.text


def test_a_stop_ends_train_with_the_stopped_exit_code(tmp_path: Path) -> None:
    transport, callback = recording()
    inject = Inject(2, [{"id": 1, "type": "stop", "reason": "node evicted"}])
    with pytest.raises(SystemExit) as stopped:
        trainer(tmp_path / "run-s", callback, more=[inject]).train()
    assert stopped.value.code == tw.STOPPED_EXIT_CODE
    assert [s["step"] for s in transport.steps()] == [0, 1, 2]  # stopped at step 2's end
    (end,) = [e for e in transport.events() if e["kind"] == "attempt_end"]
    assert (end["data"]["reason"], end["data"]["exit_code"]) == ("stopped", 76)


def test_without_a_collector_url_training_goes_on_unobserved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        result = trainer(tmp_path / "run-b", TrainwardenCallback(), steps=2).train()
    assert result.global_step == 2 and core._agent is None
    assert caplog.text.count("no collector URL (TRAINWARDEN_URL, or url=): training goes on") == 1


def test_without_a_run_name_or_facts_to_derive_one_training_goes_on_unobserved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, callback = recording()
    # no run_name, and an output directory with no name: "/" (nothing is saved there)
    hf = trainer(Path("/"), callback, steps=2, save_strategy="no")
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        result = hf.train()
    assert result.global_step == 2 and core._agent is None
    said = "no run name (TRAINWARDEN_RUN, run=, or the framework's own) and none to derive"
    assert caplog.text.count(said) == 1
    assert len([r for r in caplog.records if r.name == "trainwarden"]) == 1  # that line only


def test_a_transformers_outside_the_tested_range_is_said_once_and_not_observed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainwarden.agent.integrations.common import check_version

    assert check_version("transformers", transformers.__version__) is None  # the one installed
    assert check_version("transformers", "4.57.1") is not None
    # the module the callback reads (importing the Trainer makes transformers put another
    # module object in sys.modules: the name ``transformers`` here may not be it)
    monkeypatch.setattr(hf_integration.transformers, "__version__", "6.0.0.dev0")
    transport, callback = recording()
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        result = trainer(tmp_path / "run-v", callback, steps=2).train()
    assert result.global_step == 2
    said_untested(caplog.text, transport, "transformers", "6.0.0.dev0")
