"""Epochs, the coverage sample and watched loaders (agent/datafeed.py, agent/loader.py,
agent/samples.py's Universe), and the data mixture (agent/mixture.py): what a step and
an ``epoch_end`` event send, and bad input refused at the call."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import trainwarden.agent as tw
from trainwarden.agent.samples import EXACT_MAX, SamplesError, Universe, summarize, take

from .helpers import RecordingTransport


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_URL", "TRAINWARDEN_DRILL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TRAINWARDEN_DATASET_SIZE", raising=False)
    yield
    tw.shutdown(timeout_s=1)


def start(**kwargs: Any) -> RecordingTransport:
    transport = RecordingTransport()
    tw.init(run="data", transport=transport, gpu_interval_s=0, spool_dir="none", **kwargs)
    return transport


def epoch_ends(transport: RecordingTransport) -> list[dict[str, Any]]:
    return [
        {**e["data"], "step": e["step"]}
        for b in transport.bodies
        for e in b["events"]
        if e["kind"] == "epoch_end"
    ]


def test_a_small_dataset_sends_every_id_and_its_epoch() -> None:
    transport = start(dataset_size=100)
    for step in range(4):
        with tw.step(step) as s:
            s.samples(torch.arange(step * 10, step * 10 + 10), epoch=step // 2)
    tw.end_epoch()
    tw.shutdown()
    steps = {s["step"]: s for s in transport.steps()}
    assert steps[3]["samples_kept"] == list(range(30, 40))
    assert [steps[i]["samples_epoch"] for i in range(4)] == [0, 0, 1, 1]
    # epoch 0 ended by the step in epoch 1, epoch 1 by tw.end_epoch(); each after its last step
    assert epoch_ends(transport) == [
        {"epoch": 0, "last_step": 1, "step": 1, "dataset_size": 100, "kept": 100, "exact": True},
        {"epoch": 1, "last_step": 3, "step": 3, "dataset_size": 100, "kept": 100, "exact": True},
    ]


def test_without_a_dataset_size_only_the_digest_goes() -> None:
    transport = start()
    with tw.step(0) as s:
        s.samples([1, 2, 3])
    tw.end_epoch()
    tw.shutdown()
    (step,) = transport.steps()
    assert "samples_kept" not in step and step["samples_epoch"] == 0
    assert epoch_ends(transport) == [{"epoch": 0, "last_step": 0, "step": 0}]


def test_a_large_dataset_sends_one_fixed_sample_of_its_ids_the_same_in_every_form() -> None:
    n = 10 * EXACT_MAX + 7
    universe = Universe(n)
    assert (universe.kept, universe.exact) == (EXACT_MAX, False)
    ids = torch.randint(0, n, (4096,))
    kept = summarize(take(ids), universe)[2]
    assert kept == summarize(take(ids.tolist()), universe)[2]
    assert kept == summarize(take(ids.numpy()), universe)[2]
    assert kept == [i for i in ids.tolist() if (universe.a * i + universe.b) % n < EXACT_MAX]
    assert 0.05 < len(kept) / 4096 < 0.15  # about 1 in 10
    # the sample of the whole dataset is exactly EXACT_MAX ids (a permutation's image)
    every = np.arange(n, dtype=np.int64)
    assert int(((every * universe.a + universe.b) % n < EXACT_MAX).sum()) == EXACT_MAX
    # ids outside [0, n) are always sent: they are counted as out of range
    assert summarize(take([-1, n, 2**62]), universe)[2] == [-1, n, 2**62]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (0, "dataset_size must be a whole number of samples from 1 to 2147483648, got 0"),
        (2**31 + 1, "got 2147483649"),
        (1.5, "got 1.5"),
        ("many", "dataset_size \\(TRAINWARDEN_DATASET_SIZE\\) must be a whole number"),
    ],
)
def test_a_bad_dataset_size_is_refused_at_init(given: Any, message: str) -> None:
    with pytest.raises(tw.ConfigError, match=message):
        tw.init(run="data", dataset_size=given, transport=RecordingTransport())


def test_a_bad_epoch_is_refused_at_the_call() -> None:
    start()
    with tw.step(0) as s, pytest.raises(SamplesError, match="epoch must be a whole number"):
        s.samples([1], epoch=-1)


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i * i)])


class EveryOther(torch.utils.data.Sampler[int]):
    """A sampler with an epoch: the even indices in epoch 0, the odd ones after."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.epoch % 2, self.n, 2))

    def __len__(self) -> int:
        return len(range(self.epoch % 2, self.n, 2))


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "two-workers"])
def test_a_watched_loader_gives_each_step_its_batch_s_indices_and_ends_each_epoch(
    workers: int,
) -> None:
    transport = start()
    sampler = EveryOther(40)
    loader = tw.watch_loader(
        DataLoader(Squares(40), batch_size=4, sampler=sampler, num_workers=workers)
    )
    assert len(loader) == 5
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in loader:
            with tw.step(step) as s:
                s.loss(batch.sum())
            step += 1
    tw.shutdown()
    steps = transport.steps()
    assert [s["samples_kept"] for s in steps[:2]] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert steps[5]["samples_kept"] == [1, 3, 5, 7] and steps[5]["samples_epoch"] == 1
    assert [e["samples_count"] for e in steps] == [4] * 10
    assert [(e["epoch"], e["last_step"], e["dataset_size"]) for e in epoch_ends(transport)] == [
        (0, 4, 40),
        (1, 9, 40),
    ]


def test_two_batches_before_one_step_are_its_samples_and_s_samples_wins() -> None:
    transport = start(dataset_size=1000)  # given: the loader's length does not replace it
    loader = tw.watch_loader(DataLoader(Squares(12), batch_size=3))
    batches = iter(loader)
    with tw.step(0):
        next(batches), next(batches)  # gradient accumulation: two micro-batches
    with tw.step(1) as s:
        next(batches)
        s.samples([500, 501])
    tw.shutdown()
    steps = transport.steps()
    assert [s["samples_kept"] for s in steps] == [[0, 1, 2, 3, 4, 5], [500, 501]]


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(5))


def test_an_iterable_dataset_is_given_back_with_a_warning_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    start()
    loader = DataLoader(Stream(), batch_size=2)
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        assert tw.watch_loader(loader) is loader
    assert "its dataset is iterable-style: its samples have no indices" in caplog.text


def test_data_sources_add_up_per_step_and_bad_ones_are_refused_at_the_call() -> None:
    transport = start(data_mixture={"web": 0.7, "code": 0.3})
    with tw.step(0) as s:
        s.data_source("web", 700)
        s.data_source("code", torch.tensor(200))
        s.data_source("code", np.int64(100))
        for name, tokens, message in [
            ("Web", 1, "must match"),
            ("web", -1, "is not a count >= 0"),
            ("web", 1.5, "is not a count >= 0"),
            ("web", "many", "tokens must be a whole number"),
        ]:
            with pytest.raises(ValueError, match=message):
                s.data_source(name, tokens)
    tw.shutdown()
    (step,) = transport.steps()
    assert step["data_sources"] == {"web": 700, "code": 300}
    start_event = next(
        e for b in transport.bodies for e in b["events"] if e["kind"] == "attempt_start"
    )
    assert start_event["data"]["data_mixture"] == {"web": 0.7, "code": 0.3}


@pytest.mark.parametrize(
    ("mixture", "message"),
    [
        ({"web": 0.7, "code": 0.2}, "must sum to 1, they sum to 0.9"),
        ({"web": 1.2, "code": -0.2}, "data_mixture\\['code'\\] must be a weight >= 0"),
        ({"Web": 1.0}, "must match"),
        ({}, "must be a mapping"),
        ({"web": "all"}, "must be a number"),
    ],
)
def test_a_bad_mixture_is_refused_at_init(mixture: Any, message: str) -> None:
    with pytest.raises(tw.ConfigError, match=message):
        tw.init(run="data", data_mixture=mixture, transport=RecordingTransport())


def test_after_an_ended_epoch_the_next_ids_are_the_next_epoch() -> None:
    transport = start(dataset_size=10)
    with tw.step(0) as s:
        s.samples([0, 1])
    tw.end_epoch()
    with tw.step(1) as s:
        s.samples([2, 3])  # no epoch given: the one after the ended one
    tw.end_epoch()
    tw.end_epoch()  # nothing open: nothing more said
    tw.shutdown()
    assert [s["samples_epoch"] for s in transport.steps()] == [0, 1]
    assert [(e["epoch"], e["last_step"]) for e in epoch_ends(transport)] == [(0, 0), (1, 1)]


def test_a_sampler_left_at_one_epoch_is_counted_on_with_a_warning_and_drop_last_declared(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transport = start()
    sampler = EveryOther(20)  # set_epoch never called: epoch 0 every time
    loader = tw.watch_loader(DataLoader(Squares(20), batch_size=4, sampler=sampler, drop_last=True))
    step = 0
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        for _ in range(3):
            for _batch in loader:
                with tw.step(step):
                    pass
                step += 1
    tw.shutdown()
    assert caplog.text.count("is still at epoch 0 on a new iteration") == 1
    ends = epoch_ends(transport)
    # 10 even indices in batches of 4 with drop_last: 2 batches a pass, 2 samples left out
    assert [(e["epoch"], e["last_step"], e["dropped"]) for e in ends] == [
        (0, 1, 2),
        (1, 3, 2),
        (2, 5, 2),
    ]
