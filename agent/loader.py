"""``tw.watch_loader(loader)``: the sample ids of each batch a map-style DataLoader
yields, recorded without the trainer passing them.

The DataLoader's index sampler (its ``batch_sampler``, or its ``sampler`` without
batching) runs in the trainer's process, also with worker processes: the watched loader
wraps it so that each batch of indices it draws is queued, and hands the oldest queued
batch over (:class:`.datafeed.DataFeed`) as the loader yields its batch. Workers return
batches in the order the indices were drawn (``in_order=True``, the default), so the two
line up, prefetching or not. The step that ends next takes every batch handed over since
the last one (the batches of a gradient accumulation), unless it called ``s.samples``
itself.

The epoch is the sampler's ``epoch`` (``DistributedSampler.set_epoch``), else the count
of the loader's iterations (the first 0; a sampler whose epoch did not move on since the
last iteration is counted on, with one warning); an iteration that runs out ends its
epoch. With ``drop_last`` the samples its incomplete last batch leaves out each epoch are
declared (``dropped`` in the ``epoch_end`` event): the coverage check allows them. The
dataset's length is its size for the coverage check, unless ``tw.init(dataset_size=...)``
gave one.

What it cannot watch it says, in one warning, and gives the loader back untouched: an
iterable-style dataset (its samples have no indices: call ``s.samples(ids)`` with ids of
your own), ``in_order=False`` (batches would not line up with their indices).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator
from typing import Any

from .datafeed import DataFeed
from .samples import MAX_DATASET

log = logging.getLogger("trainwarden")


def cannot_watch(loader: Any) -> str | None:
    """Why ``loader`` cannot be watched, or None."""
    if not all(hasattr(loader, a) for a in ("dataset", "batch_sampler", "sampler")):
        return f"a {type(loader).__name__} is not a torch DataLoader"
    torch_data = __import__("torch.utils.data", fromlist=["IterableDataset"])
    if isinstance(loader.dataset, torch_data.IterableDataset):
        return (
            "its dataset is iterable-style: its samples have no indices "
            "(call s.samples(ids) with ids of your own)"
        )
    if getattr(loader, "in_order", True) is False:
        return "in_order=False: its batches do not come in the order their indices were drawn"
    return None


def _as_list(indices: Any) -> list[Any]:
    if isinstance(indices, tuple):
        return list(indices)
    if hasattr(indices, "tolist"):  # a tensor or array of indices
        out = indices.tolist()
        return out if isinstance(out, list) else [out]
    return [indices]


class _Recording:
    """The loader's index sampler, queueing each batch of indices it draws."""

    def __init__(self, inner: Any, drawn: collections.deque[list[int]]) -> None:
        self._inner = inner
        self._drawn = drawn

    def __iter__(self) -> Iterator[Any]:
        drawn = self._drawn
        for indices in self._inner:
            # A batch sampler makes a new list a batch: kept as it is (the loader only
            # reads it); anything else is copied.
            drawn.append(indices if type(indices) is list else _as_list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class WatchedLoader:
    """Iterates as the loader does (same batches, same length, its attributes)."""

    def __init__(self, loader: Any, data: DataFeed) -> None:
        self._loader = loader
        self._data = data
        self._drawn: collections.deque[list[int]] = collections.deque()
        self._last: int | None = None  # the epoch of the last iteration
        self._warned = False
        # What the loader leaves out of an epoch by design: drop_last's incomplete batch.
        data.dropped = _dropped(getattr(loader, "batch_sampler", None))
        # The index sampler the loader iterates (DataLoader._index_sampler): wrapped in
        # place, past DataLoader's guard against changing it after construction.
        name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        object.__setattr__(loader, name, _Recording(getattr(loader, name), self._drawn))

    def _epoch(self) -> int:
        """The sampler's epoch; else, or when it did not move on since the last iteration
        (``set_epoch`` never called: a DistributedSampler then shuffles every epoch the
        same way), the count of iterations past the last epoch."""
        epoch = getattr(self._loader.sampler, "epoch", None)
        last = self._last
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0:
            if last is None or epoch > last:
                return epoch
            if not self._warned:
                self._warned = True
                log.warning(
                    "trainwarden: the loader's sampler is still at epoch %d on a new iteration: "
                    "call sampler.set_epoch(epoch) before each epoch (a DistributedSampler "
                    "shuffles every epoch the same way without it); counting it as epoch %d",
                    epoch,
                    last + 1,
                )
        return 0 if last is None else last + 1

    def __iter__(self) -> Iterator[Any]:
        data, drawn = self._data, self._drawn
        epoch = self._last = self._epoch()
        drawn.clear()  # an iteration left early: its prefetched indices were never fed
        for batch in self._loader:
            data.feed(drawn.popleft() if drawn else [], epoch)
            yield batch
        data.end_of(epoch)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _dropped(batches: Any) -> int:
    """The samples a ``drop_last`` batch sampler leaves out of each epoch (0 without)."""
    size = getattr(batches, "batch_size", None)
    if not getattr(batches, "drop_last", False) or not isinstance(size, int) or size < 1:
        return 0
    try:
        return len(batches.sampler) % size
    except (TypeError, AttributeError):
        return 0


def dataset_length(loader: Any) -> int | None:
    """The loader's dataset length, when it has one the coverage check can take."""
    try:
        n = len(loader.dataset)
    except TypeError:
        return None
    return n if 1 <= n <= MAX_DATASET else None


def watch_loader(loader: Any, data: DataFeed, use_size: Any) -> Any:
    why = cannot_watch(loader)
    if why is not None:
        log.warning("trainwarden: watch_loader cannot record this loader's sample ids: %s", why)
        return loader
    if (size := dataset_length(loader)) is not None:
        use_size(size)
    return WatchedLoader(loader, data)
