"""s.samples(ids) (agent/samples.py): what a step sends, that the digest is the contract's
(BLAKE2b-8 of the ids as little-endian int64, in order), and bad ids refused at the call."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
import pytest
import torch

import trainwarden.agent as tw
from trainwarden.agent.samples import MAX_IDS, summarize, take

from .helpers import RecordingTransport


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_URL", "TRAINWARDEN_DRILL"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


def contract(ids: list[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(ids)}q", *ids), digest_size=8).hexdigest()


@pytest.mark.parametrize(
    "given",
    [
        [5, -1, 2**40, 0],
        (5, -1, 2**40, 0),
        torch.tensor([5, -1, 2**40, 0]),
        torch.tensor([[5, -1], [2**40, 0]]),  # flattened in its order
        torch.tensor([5, 7, 1, 0], dtype=torch.int32)[[0, 3]],
        np.array([5, -1, 2**40, 0]),
    ],
)
def test_every_form_of_ids_gives_the_contract_s_digest(given: Any) -> None:
    values = given.reshape(-1).tolist() if hasattr(given, "reshape") else list(given)
    assert summarize(take(given)) == (contract(values), len(values), None)


def test_order_matters_and_a_range_is_its_ints() -> None:
    assert summarize(take([1, 2, 3])) != summarize(take([3, 2, 1]))
    assert summarize(take(range(10, 20))) == summarize(take(list(range(10, 20))))
    assert summarize(take([])) == (contract([]), 0, None)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([1.0, 2.0]), "ids must be integers, got a torch.float32 tensor"),
        (torch.tensor([True]), "got a torch.bool tensor"),
        ([1, 2.5], "item 1 is float 2.5"),
        ([1, True], "item 1 is bool True"),
        (np.array([0.5]), "got a float64 array"),
        ("0,1,2", "got str"),
        (list(range(MAX_IDS + 1)), f"{MAX_IDS + 1} ids in one step, over {MAX_IDS}"),
        (torch.arange(MAX_IDS + 1), "over 65536"),
    ],
)
def test_bad_ids_are_refused_at_the_call_saying_what_is_wrong(ids: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        take(ids)


def test_a_step_sends_its_digest_and_count_and_an_id_beyond_int64_is_an_issue() -> None:
    transport = RecordingTransport()
    tw.init(run="samples", transport=transport, gpu_interval_s=0, spool_dir="none")
    for step in range(3):
        with tw.step(step) as s:
            if step == 0:
                s.samples(torch.arange(8) + 100)
            elif step == 1:
                s.samples([2**63])
    tw.shutdown()
    steps = {s["step"]: s for s in transport.steps()}
    assert steps[0]["samples_digest"] == contract(list(range(100, 108)))
    assert steps[0]["samples_count"] == 8
    assert "samples_digest" not in steps[1] and steps[1]["issues"]["samples"] == (
        "an id outside int64"
    )
    assert "samples_digest" not in steps[2] and "samples" not in steps[2].get("issues", {})


def test_the_data_drill_parses_and_refuses_a_form_it_does_not_know() -> None:
    from trainwarden.agent.drills import DrillError, parse

    (fault,) = parse("data=same_batch@step=20")
    assert (fault.kind, fault.form, fault.rank) == ("data", "same_batch", None)
    assert fault.covers(20) and fault.covers(5000) and not fault.covers(19)
    with pytest.raises(
        DrillError, match="data=same_batch or data=forget_sampler_state, got 'shuffle'"
    ):
        parse("data=shuffle@step=2")
    with pytest.raises(DrillError, match="from step=S on"):
        parse("data=same_batch@steps=2-5")
    # forget_sampler_state acts on the next resume: no step needed, @step=0 still taken
    for spec in ("data=forget_sampler_state", "data=forget_sampler_state@step=0"):
        (fault,) = parse(spec)
        assert (fault.kind, fault.form, fault.first, fault.rank) == (
            "data",
            "forget_sampler_state",
            0,
            None,
        )
    with pytest.raises(DrillError, match="missing '@'"):
        parse("data=same_batch")
