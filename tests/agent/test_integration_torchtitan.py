"""The torchtitan integration's logic on CPU (agent/integrations/torchtitan.py).

torchtitan's Trainer cannot be built here (it needs CUDA and triton), so
:class:`StandInTrainer` stands in for it, and is a fake: it has the parts of
``torchtitan.trainer.Trainer`` the integration touches, doing what torchtitan 0.3.0 does
with them, on a real model, optimizer and checkpoint files: ``train()`` bumps ``step``
then calls ``train_step`` and ``checkpointer.save(step)``; ``train_step`` draws its
micro-batches, counts the valid tokens, calls ``forward_backward_step`` once a
micro-batch (a loss sum over the global valid tokens, then backward), then
``clip_grad_norm_`` of the module passed in (torchtitan's ``dist_utils``) and the
optimizer; the checkpointer saves every ``interval`` steps into ``step-N`` and loads
model, optimizer and ``step`` back. What runs of the integration is its own code, as
on a GPU; the real Trainer runs in scripts/gpu_check.sh.

Checked: each step is torchtitan's step with this rank's loss over its valid tokens,
the gradient norm torchtitan computed, the tokens; checkpoints reported as
``step-N``; a rollback through ``checkpointer.load`` goes on from the checkpoint's step
(and the save right after it is skipped); a stop raises ``SystemExit(76)``."""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import trainwarden.agent as tw
from trainwarden.agent import core
from trainwarden.agent.integrations.torchtitan import IGNORE_INDEX, observed_class

from .helpers import RecordingTransport
from .integration_drills import applied, rollback

VOCAB, LENGTH, BATCH = 32, 16, 4


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_URL", "TRAINWARDEN_DRILL", "TRAINWARDEN_RUN"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, **_: Any) -> torch.Tensor:
    """torchtitan's ``dist_utils.clip_grad_norm_`` on one rank: the total norm, clipped."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


class Checkpointer:
    """torchtitan's CheckpointManager, as the integration uses it: ``save`` returns
    whether it wrote ``step-N``; ``load(step)`` restores the trainer's states."""

    def __init__(self, trainer: StandInTrainer, folder: Path, interval: int) -> None:
        self.trainer, self.folder, self.interval = trainer, folder, interval
        self.saves: list[int] = []

    def _create_checkpoint_id(self, step: int) -> str:
        return str(self.folder / f"step-{step}")

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        if curr_step % self.interval and not last_step:
            return False
        t = self.trainer
        self.folder.mkdir(parents=True, exist_ok=True)
        state = {"model": t.model.state_dict(), "optim": t.optimizers.state_dict(), "step": t.step}
        torch.save(state, self._create_checkpoint_id(curr_step))
        self.saves.append(curr_step)
        return True

    def load(self, step: int = -1) -> bool:
        state = torch.load(self._create_checkpoint_id(step), weights_only=True)
        t = self.trainer
        t.model.load_state_dict(state["model"])
        t.optimizers.load_state_dict(state["optim"])
        t.step = state["step"]  # Trainer.load_state_dict's train state
        return True


class StandInTrainer:
    """The fake Trainer (see the module's docstring): one rank, no pipeline."""

    norm_module = types.SimpleNamespace(clip_grad_norm_=clip_grad_norm_)

    def __init__(self, config: Any) -> None:
        torch.manual_seed(0)
        self.config = config
        self.step = 0
        self.model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
        self.model_parts = [self.model]
        self.optimizers = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.lr_schedulers = types.SimpleNamespace(schedulers=[])
        self.parallel_dims = types.SimpleNamespace(pp_enabled=False)
        self.metrics_processor = types.SimpleNamespace(num_flops_per_token=6 * 1000)
        self.checkpointer = Checkpointer(self, Path(config.dump_folder) / "checkpoint", 3)
        self.gradient_accumulation_steps = 2
        self.rank_losses: list[float] = []  # this rank's mean loss a step, read with syncs
        self.norms: list[float] = []

    def forward_backward_step(self, *, input_dict: Any, labels: Any, global_valid_tokens: Any):
        logits = self.model(input_dict["input"])
        loss = (
            F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
            / global_valid_tokens
        )
        loss.backward()
        return loss

    def train_step(self, data_iterator: Iterator[tuple[dict[str, Any], torch.Tensor]]) -> None:
        self.optimizers.zero_grad()
        batches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        valid = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
        global_valid = torch.tensor(valid)  # one rank: the global count is this rank's
        total = 0.0
        for input_dict, labels in batches:
            loss = self.forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid
            )
            total += loss.item()
        self.rank_losses.append(total)  # sum over global valid = this rank's mean here
        norm = self.norm_module.clip_grad_norm_(list(self.model.parameters()), 1.0)
        self.norms.append(float(norm))
        self.optimizers.step()

    def train(self, steps: int, before: dict[int, Any] | None = None) -> None:
        data = self.batches()
        while self.step < steps:
            call = (before or {}).pop(self.step + 1, None)
            if call is not None:
                call()
            self.step += 1
            self.train_step(data)
            self.checkpointer.save(self.step, last_step=self.step == steps)

    @staticmethod
    def batches() -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        g = torch.Generator().manual_seed(1)
        while True:
            ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
            labels = ids[:, 1:].clone()
            labels[:, :3] = IGNORE_INDEX  # some positions count in no loss
            yield {"input": ids[:, :-1]}, labels


def observed(tmp_path: Path) -> tuple[RecordingTransport, Any]:
    transport = RecordingTransport()
    config = types.SimpleNamespace(dump_folder=str(tmp_path / "tt-run"), to_dict=lambda: {"x": 1})
    cls = observed_class(StandInTrainer, StandInTrainer.norm_module)
    trainer = cls(config, tw_init={"transport": transport, "gpu_interval_s": 0})
    assert trainer._tw.on
    return transport, trainer


def test_each_step_has_this_rank_s_loss_torchtitan_s_norm_tokens_and_checkpoints(
    tmp_path: Path,
) -> None:
    transport, trainer = observed(tmp_path)
    trainer.train(6)
    tw.shutdown()
    steps = transport.steps()
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]  # torchtitan's numbering
    assert [s["loss"] for s in steps] == [pytest.approx(x, rel=1e-5) for x in trainer.rank_losses]
    assert [s["grad_norm"] for s in steps] == [pytest.approx(n, rel=1e-5) for n in trainer.norms]
    for s in steps:
        assert math.isfinite(s["loss"]) and s["tokens"] == 2 * BATCH * LENGTH, s
        assert s["fwd_s"] > 0 and s["bwd_s"] > 0 and s["opt_s"] > 0, s
        assert s["flops"] == 6 * 1000 * 2 * BATCH * LENGTH, s  # torchtitan's FLOPs a token
    start = next(e for e in transport.events() if e["kind"] == "attempt_start")
    assert transport.bodies[0]["run"] == "tt-run"  # the dump folder's name
    assert start["data"]["config"]["x"] == 1
    checkpoints = [
        (e["step"], e["data"]["path"]) for e in transport.events() if e["kind"] == "checkpoint"
    ]
    folder = tmp_path / "tt-run" / "checkpoint"
    assert checkpoints == [(3, str(folder / "step-3")), (6, str(folder / "step-6"))]


def test_a_rollback_loads_through_the_checkpointer_and_goes_on_from_its_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transport, trainer = observed(tmp_path)
    path = tmp_path / "tt-run" / "checkpoint" / "step-3"
    saved: dict[str, torch.Tensor] = {}
    restored: dict[str, Any] = {}

    def keep() -> None:  # before step 4: the weights step-3 holds
        saved.update({k: v.clone() for k, v in trainer.model.state_dict().items()})

    def send() -> None:
        assert core._agent is not None
        core._agent.commands.receive(rollback(path, 3, 5, lr_scale=0.5))

    def snapshot(plan: tw.RollbackPlan) -> None:  # after the integration's restore
        restored["weights"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        restored["step"], restored["lr"] = trainer.step, trainer.optimizers.param_groups[0]["lr"]

    tw.on_rollback(snapshot)
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        trainer.train(7, before={4: keep, 5: send})
    tw.shutdown()
    assert [s["step"] for s in transport.steps()] == [1, 2, 3, 4, 5, 4, 5, 6, 7]
    assert restored["step"] == 3 and restored["lr"] == pytest.approx(1e-2 * 0.5)
    for name, value in saved.items():
        assert torch.equal(restored["weights"][name], value), name
    # train() saved after the restored step 3 again: skipped (step-3 exists); then on
    assert trainer.checkpointer.saves == [3, 6, 7]
    ack = applied(transport)
    assert (ack["applied"], ack["barrier_step"], ack["checkpoint_step"]) == (True, 5, 3), ack
    assert f"rolled back to {path} (step 3) after step 5" in caplog.text
    assert "torchtitan's dataloader was restored with the checkpoint" in caplog.text


def test_a_stop_raises_the_stopped_exit_code_out_of_train_step(tmp_path: Path) -> None:
    transport, trainer = observed(tmp_path)

    def send() -> None:
        assert core._agent is not None
        core._agent.commands.receive([{"id": 1, "type": "stop", "reason": "node evicted"}])

    with pytest.raises(SystemExit) as stopped:
        trainer.train(6, before={2: send})
    assert stopped.value.code == tw.STOPPED_EXIT_CODE
    assert [s["step"] for s in transport.steps()] == [1, 2]
