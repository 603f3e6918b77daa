"""The Hugging Face Trainer callback in one process (agent/integrations/hf.py): each
optimizer step is a step with this rank's loss, grad norm, phases and tokens; checkpoints
are reported as the weights after update N - 1; without a URL or a run name training
goes on unobserved, said once."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest
import torch

import trainwarden.agent as tw
from trainwarden.agent.integrations.hf import TrainwardenCallback

from .test_agent import RecordingTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from hf_trainer import VOCAB, Synthetic  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_URL", "TRAINWARDEN_DRILL", "TRAINWARDEN_RUN"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


def trainer(
    out: Path, callback: TrainwardenCallback, steps: int = 6, logging_steps: int = 100
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
    )
    return Trainer(model=model, args=args, train_dataset=Synthetic(256), callbacks=[callback])


def test_each_optimizer_step_is_a_step_with_its_loss_tokens_and_checkpoints(tmp_path: Path) -> None:
    transport = RecordingTransport()
    callback = TrainwardenCallback(init={"transport": transport, "gpu_interval_s": 0})
    hf = trainer(tmp_path / "run-a", callback, logging_steps=1)
    hf.train()
    tw.shutdown()
    steps = transport.steps()
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


def test_without_a_collector_url_training_goes_on_unobserved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        result = trainer(tmp_path / "run-b", TrainwardenCallback(), steps=2).train()
    assert result.global_step == 2
    assert caplog.text.count("no collector URL (TRAINWARDEN_URL, or url=): training goes on") == 1


def test_a_version_outside_the_tested_range_is_said_once() -> None:
    from trainwarden.agent.integrations.common import check_version

    assert check_version("transformers", "5.24.0", "5", "6") is None
    assert check_version("transformers", "6.0.0.dev0", "5", "6") == (
        "trainwarden: transformers 6.0.0.dev0 is outside the tested range >=5,<6: "
        "training goes on, observed as far as this version allows"
    )
    assert check_version("transformers", "4.57.1", "5", "6") is not None
