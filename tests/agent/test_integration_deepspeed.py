"""The DeepSpeed integration in one process (agent/integrations/deepspeed.py), ZeRO-1
on CPU with gloo: each optimizer step is a step (accumulated micro-batches are one) with
this rank's loss, DeepSpeed's gradient norm, phases and tokens; ``save_checkpoint`` is
reported as the weights after update ``global_steps - 1``; a rollback restores through
``engine.load_checkpoint`` and the loop goes on from its step; a stop raises
``SystemExit(76)`` out of ``engine.step()``; with no URL, or a deepspeed outside the
tested range, training goes on unobserved with the engine's own methods, said once."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read at deepspeed's first accelerator use

import pytest
import torch

import trainwarden.agent as tw
from trainwarden.agent import core
from trainwarden.agent.integrations import deepspeed as tw_deepspeed

from .helpers import RecordingTransport
from .integration_drills import applied, rollback, said_untested

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import deepspeed  # noqa: E402
from tiny_lm import TinyLM, synthetic  # noqa: E402

BATCH = 4


@pytest.fixture(scope="module", autouse=True)
def _group() -> Iterator[None]:
    """A one-rank gloo group for the module (DeepSpeed uses the one it finds)."""
    saved = dict(os.environ)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TRAINWARDEN_URL", "TRAINWARDEN_DRILL", "TRAINWARDEN_RUN"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


def engine_of(accumulation: int = 2) -> Any:
    torch.manual_seed(0)
    model = TinyLM(width=16)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


class Loop:
    """The example's loop, keeping what the integration must agree with (read here with
    host syncs): each micro-batch's loss, each update's gradient norm."""

    def __init__(self, engine: Any, root: Path, *, save_every: int = 0) -> None:
        self.engine, self.root, self.save_every = engine, root, save_every
        self.data = synthetic(256, seed=0)
        self.g = torch.Generator().manual_seed(0)
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.before_step: dict[int, Any] = {}  # global_steps -> a call, once

    def run(self, updates: int) -> None:
        engine = self.engine
        while engine.global_steps < updates:
            call = self.before_step.pop(engine.global_steps, None)
            if call is not None:
                call()
            for _ in range(engine.gradient_accumulation_steps()):
                ids = self.data[torch.randint(0, len(self.data), (BATCH,), generator=self.g)]
                loss = engine(ids)
                self.losses.append(loss.item())
                engine.backward(loss)
                engine.step()
            self.norms.append(float(engine.get_global_grad_norm()))
            n = engine.global_steps
            if self.save_every and n % self.save_every == 0:
                engine.save_checkpoint(str(self.root / "ckpt"))


def watched(engine: Any) -> tuple[RecordingTransport, Any]:
    transport = RecordingTransport()
    watch = tw_deepspeed.watch(
        engine, "ds-unit", init={"transport": transport, "gpu_interval_s": 0}
    )
    assert watch.on
    return transport, watch


def test_each_optimizer_step_is_a_step_with_its_loss_norm_tokens_and_checkpoints(
    tmp_path: Path,
) -> None:
    engine = engine_of()
    transport, watch = watched(engine)
    loop = Loop(engine, tmp_path, save_every=2)
    loop.run(4)
    watch.remove()
    tw.shutdown()
    steps = transport.steps()
    assert [s["step"] for s in steps] == [0, 1, 2, 3]  # 8 micro-batches, 4 updates
    means = [(a + b) / 2 for a, b in zip(loop.losses[::2], loop.losses[1::2], strict=True)]
    assert [s["loss"] for s in steps] == [pytest.approx(m, rel=1e-6) for m in means]
    assert [s["grad_norm"] for s in steps] == [pytest.approx(n, rel=1e-6) for n in loop.norms]
    assert [s["lr"] for s in steps] == [3e-3] * 4  # each update's learning rate
    for s in steps:
        assert math.isfinite(s["loss"]) and s["grad_norm"] > 0, s
        assert s["tokens"] == 2 * BATCH * 32  # two micro-batches of input ids
        assert s["fwd_s"] > 0 and s["bwd_s"] > 0 and s["opt_s"] > 0, s
    start = next(e for e in transport.events() if e["kind"] == "attempt_start")
    config = start["data"]["config"]
    assert (config["zero_stage"], config["gradient_accumulation_steps"]) == (1, 2), config
    assert config["framework"] == f"deepspeed {deepspeed.__version__}"
    checkpoints = [
        (e["step"], e["data"]["path"]) for e in transport.events() if e["kind"] == "checkpoint"
    ]
    root = tmp_path / "ckpt"
    assert checkpoints == [(1, str(root / "global_step2")), (3, str(root / "global_step4"))]
    assert "step" not in engine.__dict__  # removed: the engine's own method again


def test_a_rollback_restores_through_load_checkpoint_and_goes_on_from_its_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_of(accumulation=1)
    transport, watch = watched(engine)
    loop = Loop(engine, tmp_path, save_every=2)
    path = tmp_path / "ckpt" / "global_step4"  # the weights after update 3
    saved: dict[str, torch.Tensor] = {}
    restored: dict[str, Any] = {}

    def keep() -> None:  # the weights as they were saved at global_steps 4
        saved.update({n: p.detach().clone() for n, p in engine.module.named_parameters()})

    def send() -> None:
        assert core._agent is not None
        core._agent.commands.receive(rollback(path, 3, 6, lr_scale=0.5))

    def snapshot(plan: tw.RollbackPlan) -> None:  # runs after the integration's restore
        restored["weights"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        restored["global_steps"] = engine.global_steps
        restored["lr"] = engine.optimizer.param_groups[0]["lr"]

    tw.on_rollback(snapshot)
    loop.before_step = {4: keep, 6: send}
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        loop.run(9)
    watch.remove()
    tw.shutdown()
    # After step 6 the engine is at update 4 again; the loop goes on to its end.
    assert [s["step"] for s in transport.steps()] == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert restored["global_steps"] == 4
    for name, value in saved.items():
        assert torch.equal(restored["weights"][name], value), name
    assert restored["lr"] == pytest.approx(3e-3 * 0.5)  # the plan's lr_scale
    ack = applied(transport)
    assert (ack["applied"], ack["barrier_step"], ack["checkpoint_step"]) == (True, 6, 3), ack
    assert f"rolled back to {path} (step 3) after step 6" in caplog.text


def test_a_checkpoint_that_holds_another_step_fails_the_rollback(tmp_path: Path) -> None:
    engine = engine_of(accumulation=1)
    transport, watch = watched(engine)
    loop = Loop(engine, tmp_path, save_every=2)
    overwritten = tmp_path / "ckpt" / "global_step6"  # reported as step 3: wrong

    def send() -> None:
        assert core._agent is not None
        core._agent.commands.receive(rollback(overwritten, 3, 6, lr_scale=None))

    loop.before_step = {6: send}
    loop.run(8)
    watch.remove()
    tw.shutdown()
    ack = applied(transport)
    assert ack["applied"] is False and "holds global step 6, not 4" in ack["error"], ack


def test_a_stop_raises_the_stopped_exit_code_out_of_engine_step(tmp_path: Path) -> None:
    engine = engine_of(accumulation=1)
    transport, _ = watched(engine)
    loop = Loop(engine, tmp_path)

    def send() -> None:
        assert core._agent is not None
        core._agent.commands.receive([{"id": 1, "type": "stop", "reason": "node evicted"}])

    loop.before_step = {2: send}
    with pytest.raises(SystemExit) as stopped:
        loop.run(6)
    assert stopped.value.code == tw.STOPPED_EXIT_CODE
    assert [s["step"] for s in transport.steps()] == [0, 1, 2]  # stopped at step 2's end
    (end,) = [e for e in transport.events() if e["kind"] == "attempt_end"]
    assert (end["data"]["reason"], end["data"]["exit_code"]) == ("stopped", 76)


def test_no_url_or_an_untested_version_leaves_the_engine_unobserved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_of()
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        watch = tw_deepspeed.watch(engine, "ds-unit")
    assert not watch.on and core._agent is None and "step" not in engine.__dict__
    assert caplog.text.count("no collector URL (TRAINWARDEN_URL, or url=): training goes on") == 1
    Loop(engine, tmp_path).run(1)

    caplog.clear()
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    transport = RecordingTransport()
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        watch = tw_deepspeed.watch(engine, "ds-unit", init={"transport": transport})
    assert not watch.on and "step" not in engine.__dict__
    said_untested(caplog.text, transport, "deepspeed", "0.20.0")
