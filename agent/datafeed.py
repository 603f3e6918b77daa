"""The training thread's data bookkeeping: each step's epoch, the end of an epoch, and
the ids a watched loader fed since the last step.

``s.samples(ids, epoch=e)`` gives a step's epoch; a step in another epoch than the one
before ends that one, and ``tw.end_epoch()`` (or a watched loader running out) ends the
current one. Each end queues an ``epoch_end`` event (the epoch, its last step, and the
dataset's size and sample when one is known: agent/samples.py), after the epoch's last
step. The collector judges an epoch's coverage once every rank ended it.

All of it runs on the training thread and costs a comparison a step; nothing here reads
a tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .samples import Captured, SamplesError, Universe


def check_epoch(epoch: Any) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise SamplesError(f"epoch must be a whole number >= 0, got {epoch!r:.40}")
    return epoch


class DataFeed:
    """One per agent (``Recorder.data``)."""

    __slots__ = ("epoch", "last_step", "open", "fed", "fed_epoch", "universe", "dropped", "_emit")

    def __init__(self, emit: Callable[[int, int, dict[str, Any]], None]) -> None:
        self._emit = emit  # (epoch, last step, the universe's facts): queues epoch_end
        self.epoch: int | None = None  # the epoch of the last step that gave ids
        self.last_step: int | None = None
        self.open = False  # the epoch has steps and was not ended yet
        self.fed: list[Any] | None = None  # a watched loader's batches since the last step
        self.fed_epoch = 0
        self.universe: Universe | None = None  # set by dataset_size or a watched loader
        self.dropped = 0  # samples a watched loader leaves out of an epoch by design

    def at(self, step: int, epoch: int | None) -> int:
        """The epoch of ``step``'s ids (when None: the open one, else the one after the
        last ended); another epoch than the open one ends it first."""
        if epoch is None:  # the open epoch, or the one after an ended one
            epoch = 0 if self.epoch is None else self.epoch + (0 if self.open else 1)
        elif epoch != self.epoch:
            check_epoch(epoch)
            if self.open:
                self.end()
        self.epoch, self.last_step, self.open = epoch, step, True
        return epoch

    def end(self) -> None:
        """The open epoch is over: its ``epoch_end`` event goes after its last step."""
        if self.open and self.epoch is not None and self.last_step is not None:
            self.open = False
            facts = self.universe.facts() if self.universe is not None else {}
            if self.dropped:
                facts["dropped"] = self.dropped
            self._emit(self.epoch, self.last_step, facts)

    def end_of(self, epoch: int) -> None:
        """A watched loader's iteration over ``epoch`` ran out."""
        if self.epoch == epoch:
            self.end()

    def feed(self, ids: Any, epoch: int) -> None:
        """A watched loader's batch (its indices): the step that ends next trained on it."""
        if self.fed is None or epoch != self.fed_epoch:
            self.fed, self.fed_epoch = [], epoch
        self.fed.append(ids)

    def take_fed(self) -> tuple[Captured, int]:
        """The fed batches' ids as one step's (the batches of a gradient accumulation)."""
        fed, self.fed = self.fed or [], None
        if len(fed) == 1:  # the usual: one batch a step, its own list (loader.py)
            return Captured(fed[0]), self.fed_epoch
        ids: list[int] = []
        for batch in fed:
            ids.extend(batch)
        return Captured(ids), self.fed_epoch
