"""The Lightning callback in one process (agent/integrations/lightning.py): each optimizer
step is a step (accumulated micro-batches are one) with this rank's loss, the gradient
norm, phases and tokens; checkpoints are reported as the weights after update N - 1
(the moving ``last.ckpt`` never); a rollback restores a checkpoint in-process and the
loop goes on from its step; a stop ends ``fit`` with ``SystemExit(76)``; without a URL
or a run name, or with a lightning outside the tested range, training goes on
unobserved, said once."""

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
from trainwarden.agent.integrations.lightning import TrainwardenCallback, run_name

from .helpers import RecordingTransport
from .integration_drills import applied, rollback, said_untested

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning_trainer import Synthetic, TinyLM  # noqa: E402

BATCH, LENGTH = 4, 16


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_URL", "TRAINWARDEN_DRILL", "TRAINWARDEN_RUN"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


class Recorded(TinyLM):
    """The example's model, keeping what the callback must agree with: each micro-batch's
    loss and each optimizer step's gradient norm (read here with host syncs)."""

    def __init__(self) -> None:
        super().__init__(width=16)
        self.losses: list[float] = []
        self.norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack(grads)).item())


def fit(
    root: Path,
    callbacks: list[Any],
    *,
    steps: int = 6,
    accumulation: int = 2,
    save_every: int = 3,
    model: Any = None,
    **trainer: Any,
) -> tuple[L.Trainer, Any]:
    torch.manual_seed(0)
    model = model or Recorded()
    loader = torch.utils.data.DataLoader(Synthetic(512, length=LENGTH), batch_size=BATCH)
    checkpoint = ModelCheckpoint(
        dirpath=root / "ckpt", every_n_train_steps=save_every, save_top_k=-1, save_last=True
    )
    pl = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulation,
        logger=trainer.pop("logger", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint, *callbacks],
        **trainer,
    )
    pl.fit(model, loader)
    return pl, model


def recording() -> tuple[RecordingTransport, TrainwardenCallback]:
    transport = RecordingTransport()
    return transport, TrainwardenCallback(init={"transport": transport, "gpu_interval_s": 0})


def test_each_optimizer_step_is_a_step_with_its_loss_tokens_and_checkpoints(tmp_path: Path) -> None:
    transport, callback = recording()
    root = tmp_path / "run-a"
    _, model = fit(root, [callback], default_root_dir=root)
    tw.shutdown()
    steps = transport.steps()
    assert [s["step"] for s in steps] == list(range(6))  # 12 micro-batches, 6 updates
    # This rank's loss of each step: the mean of its two micro-batches' losses, as the
    # model computed them (the callback's comes from the outputs, on the device).
    means = [(a + b) / 2 for a, b in zip(model.losses[::2], model.losses[1::2], strict=True)]
    assert [s["loss"] for s in steps] == [pytest.approx(m, rel=1e-6) for m in means]
    # the gradient norm of each update, before any clipping, as the model sees it
    assert [s["grad_norm"] for s in steps] == [pytest.approx(n, rel=1e-5) for n in model.norms]
    assert [s["lr"] for s in steps] == [3e-3] * 6  # each update's learning rate
    for s in steps:
        assert math.isfinite(s["loss"]) and 0 < s["loss"] < 10, s
        assert s["tokens"] == 2 * BATCH * LENGTH  # two micro-batches' input_ids
        assert s["fwd_s"] > 0 and s["bwd_s"] > 0 and s["opt_s"] > 0, s
    events = transport.events()
    start = next(e for e in events if e["kind"] == "attempt_start")
    config = start["data"]["config"]
    assert (config["accumulate_grad_batches"], config["max_steps"]) == (2, 6)
    assert (config["strategy"], config["precision"]) == ("SingleDeviceStrategy", "32-true")
    assert (config["width"], config["lr"]) == (16, 3e-3)  # the module's hparams
    assert config["framework"] == f"lightning {L.__version__}"
    # Saved at global steps 3 and 6: the weights after updates 2 and 5; last.ckpt
    # (written again at every save) is not one a rollback could use.
    checkpoints = [(e["step"], e["data"]["path"]) for e in events if e["kind"] == "checkpoint"]
    assert checkpoints == [
        (2, str(root / "ckpt" / "epoch=0-step=3.ckpt")),
        (5, str(root / "ckpt" / "epoch=0-step=6.ckpt")),
    ]
    assert (root / "ckpt" / "last.ckpt").exists()
    assert transport.bodies[0]["run"] == "run-a"  # default_root_dir's name


def full_state(module: Any) -> dict[str, torch.Tensor]:
    """The module's state, sharded tensors (FSDP2's DTensors) gathered."""
    state = module.state_dict()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()
    }


class Inject(Callback):
    """Hands the agent commands before the step ``at`` starts, as the exporter would."""

    def __init__(self, at: int, commands: list[dict[str, Any]]) -> None:
        self.at, self.commands, self.sent = at, commands, False
        self.restored: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        def snapshot(plan: tw.RollbackPlan) -> None:  # runs after the callback's restore
            state = trainer.optimizers[0].state_dict()
            self.restored = {
                "weights": full_state(pl_module),
                "adam_steps": {float(s["step"]) for s in state["state"].values()},
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "global_step": trainer.global_step,
            }

        tw.on_rollback(snapshot)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
        if trainer.global_step == self.at and not self.sent:
            self.sent = True
            assert core._agent is not None
            core._agent.commands.receive(self.commands)


def test_a_rollback_restores_the_checkpoint_in_process_and_goes_on_from_its_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transport, callback = recording()
    root = tmp_path / "run-r"
    path = root / "ckpt" / "epoch=0-step=4.ckpt"  # the weights after update 3
    inject = Inject(6, rollback(path, 3, 6, lr_scale=0.5))
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        pl, _ = fit(
            root,
            [callback, inject],
            steps=10,
            accumulation=1,
            save_every=2,
            default_root_dir=root,
        )
    tw.shutdown()
    # After step 6 every rank is at update 4 again; the run goes on to max_steps.
    steps = transport.steps()
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 9]
    assert [s["lr"] for s in steps] == [pytest.approx(v) for v in [3e-3] * 7 + [1.5e-3] * 6]
    assert pl.global_step == 10
    saved = torch.load(path, weights_only=False)
    assert inject.restored["global_step"] == 4
    for name, value in saved["state_dict"].items():
        assert torch.equal(inject.restored["weights"][name], value), name
    later = torch.load(root / "ckpt" / "epoch=0-step=6.ckpt", weights_only=False)["state_dict"]
    assert any(not torch.equal(later[n], v) for n, v in saved["state_dict"].items())
    assert inject.restored["adam_steps"] == {4.0}  # the optimizer's state, as saved
    assert inject.restored["lr"] == pytest.approx(3e-3 * 0.5)  # the plan's lr_scale
    ack = applied(transport)
    assert (ack["applied"], ack["barrier_step"], ack["checkpoint_step"]) == (True, 6, 3), ack
    assert f"rolled back to {path} (step 3) after step 6" in caplog.text
    # The checkpoints saved after the rollback are new files (ModelCheckpoint versions
    # a name it meets again): none overwrites one a later rollback may need.
    checkpoints = [
        (e["step"], Path(e["data"]["path"]).name)
        for e in transport.events()
        if e["kind"] == "checkpoint"
    ]
    assert checkpoints == [
        (1, "epoch=0-step=2.ckpt"),
        (3, "epoch=0-step=4.ckpt"),
        (5, "epoch=0-step=6.ckpt"),
        (3, "epoch=0-step=4-v1.ckpt"),  # at the rollback's own batch end
        (5, "epoch=0-step=6-v1.ckpt"),
        (7, "epoch=0-step=8.ckpt"),
        (9, "epoch=0-step=10.ckpt"),
    ]


def test_a_checkpoint_that_holds_another_step_fails_the_rollback(tmp_path: Path) -> None:
    transport, callback = recording()
    root = tmp_path / "run-o"
    # reported as step 3, but the file holds global step 6 (overwritten)
    overwritten = root / "ckpt" / "epoch=0-step=6.ckpt"
    inject = Inject(6, rollback(overwritten, 3, 6, lr_scale=None))
    fit(root, [callback, inject], steps=8, accumulation=1, save_every=2, default_root_dir=root)
    tw.shutdown()
    assert [s["step"] for s in transport.steps()] == list(range(8))  # trained on, unrestored
    ack = applied(transport)
    assert ack["applied"] is False and "holds global step 6, not 4" in ack["error"], ack
    assert inject.restored == {}


def test_a_stop_ends_fit_with_the_stopped_exit_code(tmp_path: Path) -> None:
    transport, callback = recording()
    root = tmp_path / "run-s"
    inject = Inject(2, [{"id": 1, "type": "stop", "reason": "node evicted"}])
    with pytest.raises(SystemExit) as stopped:
        fit(root, [callback, inject], default_root_dir=root)
    assert stopped.value.code == tw.STOPPED_EXIT_CODE
    assert [s["step"] for s in transport.steps()] == [0, 1, 2]  # stopped at step 2's end
    (end,) = [e for e in transport.events() if e["kind"] == "attempt_end"]
    assert (end["data"]["reason"], end["data"]["exit_code"]) == ("stopped", 76)


def test_without_a_collector_url_or_a_run_name_training_goes_on_unobserved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        pl, _ = fit(tmp_path / "run-b", [TrainwardenCallback()], steps=2, default_root_dir=tmp_path)
    assert pl.global_step == 2 and core._agent is None
    assert caplog.text.count("no collector URL (TRAINWARDEN_URL, or url=): training goes on") == 1

    caplog.clear()
    monkeypatch.chdir(tmp_path)  # no default_root_dir: the working directory is no run name
    _, callback = recording()
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        pl, _ = fit(tmp_path / "run-c", [callback], steps=2)
    assert pl.global_step == 2 and core._agent is None
    assert caplog.text.count("no run name (TRAINWARDEN_RUN, run=, or the framework's own)") == 1


def test_the_run_name_comes_from_a_named_logger_or_the_root_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    named = L.Trainer(logger=CSVLogger(tmp_path, name="exp-7"), default_root_dir=tmp_path / "r")
    assert run_name(named) == "exp-7"
    default = L.Trainer(logger=CSVLogger(tmp_path), default_root_dir=tmp_path / "r")
    assert run_name(default) == "r"  # "lightning_logs" names no run
    assert run_name(L.Trainer(logger=False)) is None


def test_a_version_outside_the_tested_range_is_said_once_and_not_observed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainwarden.agent.integrations.common import check_version

    assert check_version("lightning", L.__version__) is None  # the one installed
    assert check_version("lightning", "2.5.5") is not None
    monkeypatch.setattr(L, "__version__", "2.7.0")
    transport, callback = recording()
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        pl, _ = fit(tmp_path / "run-v", [callback], steps=2, default_root_dir=tmp_path / "run-v")
    assert pl.global_step == 2
    said_untested(caplog.text, transport, "lightning", "2.7.0")


class Sharded(TinyLM):
    """The example's model under FSDP2 (``fully_shard``), as ``ModelParallelStrategy``
    asks: sharded in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__(width=16)
        self.saved: dict[int, dict[str, torch.Tensor]] = {}

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step not in self.saved:  # the first time: as it was saved
            self.saved[self.trainer.global_step] = full_state(self)


@pytest.fixture
def _own_process_group():
    """A strategy that makes the process group in this process: the group and the
    environment it set (MASTER_ADDR / MASTER_PORT ...) go when the test ends."""
    import os

    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.usefixtures("_own_process_group")
def test_fsdp2_steps_checkpoints_and_an_in_process_rollback_in_one_process(
    tmp_path: Path,
) -> None:
    """FSDP2 through Lightning's ModelParallelStrategy, one process on CPU (Lightning's
    FSDPStrategy, FSDP1, needs a GPU): steps with loss and this rank's gradient norm,
    checkpoints that are distributed-checkpoint folders, and a rollback that loads one
    through the strategy (weights and optimizer state, sharded)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    transport, callback = recording()
    root = tmp_path / "run-f"
    path = root / "ckpt" / "epoch=0-step=4.ckpt"
    inject = Inject(6, rollback(path, 3, 6, lr_scale=None))
    model = Sharded()
    fit(
        root,
        [callback, inject],
        model=model,
        steps=8,
        accumulation=1,
        save_every=2,
        default_root_dir=root,
        strategy=ModelParallelStrategy(),
    )
    tw.shutdown()
    steps = transport.steps()
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7]
    for s in steps:
        assert math.isfinite(s["loss"]) and s["grad_norm"] > 0 and s["tokens"] == BATCH * LENGTH
    assert path.is_dir()  # each rank's shards and the metadata
    assert inject.restored["global_step"] == 4 and inject.restored["adam_steps"] == {4.0}
    for name, value in model.saved[4].items():  # the weights after update 3, as saved
        assert torch.equal(inject.restored["weights"][name], value), name
    moved = model.saved[6]  # after update 5: training had moved on from them
    assert any(not torch.equal(moved[n], v) for n, v in model.saved[4].items())
