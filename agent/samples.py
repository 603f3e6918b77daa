"""Sample ids: which samples a rank trained on at a step (``s.samples(ids)``).

The training thread only hands the ids over (:func:`take`: a reference to a tensor, a
copy of a short sequence, a non-blocking device-to-host copy for a CUDA tensor); the
exporter thread reads them and computes what the step sends (:func:`summarize`):

- ``samples_count``: how many ids;
- ``samples_digest``: an order-sensitive 64-bit digest, 16 hex digits: BLAKE2b (8 bytes)
  of the ids as little-endian int64, in the order given. Equal digests mean the same ids
  in the same order (a collision needs 2**32 distinct batches for even odds); one id
  changed, added, dropped or moved changes it.

The collector compares digests: two ranks of one data-parallel group with the digest
of one step have trained on the same batch (a seeding bug: the effective batch is N
times smaller).

**Epoch coverage.** With a dataset size (``tw.init(dataset_size=N)``, or the length of a
loader's dataset under ``tw.watch_loader``) the step also sends its epoch and the ids
themselves (``samples_kept``), and the collector counts, at each epoch's end, the ids
seen, repeated and missing (collector/health/coverage.py). What is sent is bounded by
the dataset, not by the run's length or its world: while ``N <= EXACT_MAX`` (1,048,576)
every id goes, and the counts are **exact** (which ids, on which steps and ranks).
Beyond, each rank sends only the ids of one fixed sample of the dataset, the same on
every rank and in every process: the ``EXACT_MAX`` ids ``i`` with
``(a * i + b) mod N < EXACT_MAX`` (:class:`Universe`; an affine permutation of the
indices, so the sample's size is known exactly and a sampler's stride cannot hide from
it). On the sample the counts are still exact, so every id the collector names as
repeated or missing is one; the epoch's totals are estimated from it (scaled by
``N / EXACT_MAX``, with their standard error). Ids outside ``[0, N)`` are always sent,
and counted as out of range.
"""

from __future__ import annotations

import hashlib
import math
import sys
from array import array
from typing import Any

from .values import Captured

MAX_IDS = 65_536
"""The most ids ``s.samples`` takes for one step of one rank (a typo must not ship a
whole dataset's index every step)."""
EXACT_MAX = 1_048_576
"""Datasets of at most this many samples are checked id by id; larger ones on a fixed
sample of this many ids (:class:`Universe`)."""
MAX_DATASET = 2**31
"""The largest ``dataset_size`` the coverage check takes (ids are then below 2**31, and
``a * i + b`` stays inside int64)."""


class SamplesError(ValueError):
    """``s.samples(ids)`` was given something that is not a batch of integer ids."""


def take(ids: Any) -> Captured:
    """On the training thread: hold ``ids`` for the exporter thread. Never syncs.

    ``ids``: an integer tensor (any shape: flattened in its order), or a sequence of
    Python ints (a list, tuple, range). Raises :class:`SamplesError` at once for a
    float or bool tensor, a sequence holding anything but ints, or more than
    :data:`MAX_IDS` ids."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(ids, torch.Tensor):
        if ids.dtype not in (_INT_DTYPES or _int_dtypes(torch)):
            raise SamplesError(f"s.samples: ids must be integers, got a {ids.dtype} tensor")
        n = ids.numel()
        if n > MAX_IDS:
            raise SamplesError(f"s.samples: {n} ids in one step, over {MAX_IDS}")
        # Kept as it is: an integer tensor tracks no gradient, and it is read (not
        # copied) later, as a loss is: do not change it in place after the step.
        if ids.is_cuda:
            host = ids.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return Captured(host, event)
        return Captured(ids)
    if isinstance(ids, range):
        if len(ids) > MAX_IDS:
            raise SamplesError(f"s.samples: {len(ids)} ids in one step, over {MAX_IDS}")
        return Captured(ids)
    if not isinstance(ids, (list, tuple)):
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(ids, numpy.ndarray):
            if ids.dtype.kind not in "iu":
                raise SamplesError(f"s.samples: ids must be integers, got a {ids.dtype} array")
            if ids.size > MAX_IDS:
                raise SamplesError(f"s.samples: {ids.size} ids in one step, over {MAX_IDS}")
            return Captured(ids.copy())
        raise SamplesError(
            "s.samples: give the step's sample ids as an integer tensor, a numpy array, or "
            f"a list / tuple / range of ints, got {type(ids).__name__}"
        )
    if len(ids) > MAX_IDS:
        raise SamplesError(f"s.samples: {len(ids)} ids in one step, over {MAX_IDS}")
    if not set(map(type, ids)) <= _INT:  # bool is not an id; numpy ints: pass an array
        i, value = next((i, v) for i, v in enumerate(ids) if type(v) is not int)
        raise SamplesError(
            f"s.samples: ids must be integers; item {i} is {type(value).__name__} {value!r:.40}"
        )
    return Captured(tuple(ids))


_INT = {int}
_INT_DTYPES: frozenset[Any] = frozenset()


def _int_dtypes(torch: Any) -> frozenset[Any]:
    global _INT_DTYPES
    names = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
    _INT_DTYPES = frozenset(getattr(torch, n) for n in names if hasattr(torch, n))
    return _INT_DTYPES


class Universe:
    """The ids of a dataset of ``size`` samples that a rank sends for the coverage check:
    all of them up to :data:`EXACT_MAX`, else those whose image under the permutation
    ``i -> (a * i + b) mod size`` is below ``EXACT_MAX`` (``a`` coprime with ``size``,
    near its golden section). The collector rebuilds the same from ``size``."""

    __slots__ = ("size", "kept", "a", "b")

    def __init__(self, size: Any) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_DATASET:
            raise SamplesError(
                f"dataset_size must be a whole number of samples from 1 to {MAX_DATASET}, "
                f"got {size!r:.40}"
            )
        self.size = size
        self.kept = min(size, EXACT_MAX)
        a = int(size * 0.6180339887498949) | 1
        while math.gcd(a, size) != 1:
            a += 2
        self.a = a % size or 1
        self.b = size // 3

    @property
    def exact(self) -> bool:
        return self.kept == self.size

    def facts(self) -> dict[str, Any]:
        """What the ``epoch_end`` event says of it."""
        return {"dataset_size": self.size, "kept": self.kept, "exact": self.exact}

    def keep_flat(self, flat: Any) -> list[int]:
        """The ids of ``flat`` (an int64 tensor or numpy array, or a sequence of ints) this
        rank sends, in order."""
        n, a, b, m = self.size, self.a, self.b, self.kept
        if hasattr(flat, "tolist") and not isinstance(flat, (list, tuple, range)):
            if self.exact:
                return flat.tolist()
            inside = (flat >= 0) & (flat < n)
            # Outside [0, n) the product may wrap: those ids are kept whatever it gives.
            keep = ~inside | ((flat * a + b) % n < m)
            return flat[keep].tolist()
        if self.exact:
            return list(flat)
        return [i for i in flat if not 0 <= i < n or (i * a + b) % n < m]


def summarize(
    captured: Captured, universe: Universe | None = None
) -> tuple[str, int, list[int] | None] | None:
    """On the exporter thread: ``(digest, count, kept)`` (``kept``: the ids sent for the
    coverage check, None without a ``universe``), or None while a device copy is in
    flight. Ids outside int64 cannot come from a tensor; from a sequence they are an
    issue the caller reports (``OverflowError``)."""
    if captured.event is not None and not captured.event.query():
        return None
    ids = captured.tensor
    torch = sys.modules.get("torch")
    flat: Any
    if torch is not None and isinstance(ids, torch.Tensor):
        flat = ids.reshape(-1).to(torch.int64)
        count = flat.numel()
        try:
            data = flat.numpy().astype("<i8").tobytes()
        except RuntimeError:  # torch without numpy
            data = b"".join(v.to_bytes(8, "little", signed=True) for v in flat.tolist())
    elif hasattr(ids, "astype"):  # a numpy array
        flat = ids.reshape(-1).astype("int64")
        data = flat.astype("<i8").tobytes()
        count = int(ids.size)
    else:
        flat = ids
        count = len(ids)
        packed = array("q", ids)  # OverflowError for an id outside int64
        if sys.byteorder != "little":
            packed.byteswap()
        data = packed.tobytes()
    kept = None if universe is None else universe.keep_flat(flat)
    return hashlib.blake2b(data, digest_size=8).hexdigest(), count, kept
