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
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Any

from .values import Captured

MAX_IDS = 65_536
"""The most ids ``s.samples`` takes for one step of one rank (a typo must not ship a
whole dataset's index every step)."""


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


def summarize(captured: Captured) -> tuple[str, int] | None:
    """On the exporter thread: ``(digest, count)``, or None while a device copy is in
    flight. Ids outside int64 cannot come from a tensor; from a sequence they are an
    issue the caller reports (``OverflowError``)."""
    if captured.event is not None and not captured.event.query():
        return None
    ids = captured.tensor
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(ids, torch.Tensor):
        flat = ids.reshape(-1).to(torch.int64)
        count = flat.numel()
        try:
            data = flat.numpy().astype("<i8").tobytes()
        except RuntimeError:  # torch without numpy
            data = b"".join(v.to_bytes(8, "little", signed=True) for v in flat.tolist())
    elif hasattr(ids, "astype"):  # a numpy array
        data = ids.reshape(-1).astype("<i8").tobytes()
        count = int(ids.size)
    else:
        count = len(ids)
        packed = array("q", ids)  # OverflowError for an id outside int64
        if sys.byteorder != "little":
            packed.byteswap()
        data = packed.tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest(), count
