"""Replica fingerprints: data-parallel replicas must hold bit-identical parameters.

After each optimizer step every replica of a data-parallel job holds the same bits:
a free, exact invariant. Every ``replica_check_every`` steps ``tw.watch`` has each rank
fingerprint its parameters on the device (:func:`fingerprint`) and send it with the step,
with its replica group (:func:`replica_group_of`, as text: :func:`compact`); the collector
compares the fingerprints of one step among the ranks of one group (:func:`expand`).

The fingerprint is two 64-bit words, exact in integer arithmetic:

- word 1: the sum, modulo 2**64, of every parameter element's bit pattern read as a
  signed integer of its own size (float32 as int32, bf16 / fp16 as int16, float64 as
  int64, float8 as int8) and widened to int64;
- word 2: the sum, modulo 2**64, of the squares (int64, wrapping) of the same values.

Bit-identical replicas give equal words. A single flipped bit changes one element's
integer by ±2**k (k < 64), which is never 0 modulo 2**64: word 1 changes, always. Word 2
catches much of what cancels in word 1 (two elements changed by +d and -d). The sum does
not depend on the order it is taken in, so chunking and packing small parameters
together give the same result.

What is fingerprinted: **every** parameter of the model in ``model.parameters()``
order, trainable or frozen (a corrupted frozen weight is as harmful), whatever its
dtype (integer and bool parameters by their raw bits, like floats). Buffers are not
(batch-norm statistics may legitimately differ per rank). A DTensor parameter (FSDP2)
is fingerprinted by its local shard; its replicas are the ranks that hold the same
shard (the device mesh's replicate dimension).

This module imports torch only inside its functions: the collector imports
:func:`expand` and :func:`hex_words` without torch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 2**20
"""The widened (int64) copy of a chunk of parameters never exceeds this on a GPU."""
CHUNK_ELEMENTS_CUDA = CHUNK_BYTES // 8
CHUNK_ELEMENTS_CPU = 2**18
"""On the CPU smaller chunks (2 MiB widened) stay in the caches and the allocator's reuse:
measured faster than 64 MiB ones here (bench/agent_overhead.py --replica-check)."""
MAX_GROUP_CHARS = 1024
"""The longest ``replica_group`` text the collector takes."""
MAX_GROUP_RANKS = 2**20
""":func:`expand` refuses text that names more ranks (a typo must not allocate GBs)."""
_MASK = 2**64 - 1
_ITEM = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+))?)?$")


# -- the group's text form (no torch) ------------------------------------------------------


def compact(ranks: Iterable[int]) -> str:
    """Sorted global ranks as text: ``a``, ``a-b`` (inclusive) and ``a-b:s`` (stride s)
    items, comma-separated: ``[0..7]`` → ``"0-7"``, ``[0, 4, ..., 28]`` → ``"0-28:4"``,
    ``[3, 9]`` → ``"3,9"``. Deterministic: every rank of a group writes the same text."""
    values = sorted(set(ranks))
    if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in values):
        raise ValueError(f"ranks must be integers >= 0, got {values!r:.200}")
    items: list[str] = []
    i, n = 0, len(values)
    while i < n:
        if i + 2 < n:  # three or more in one stride: a range (two are shorter as "a,b")
            stride = values[i + 1] - values[i]
            j = i + 1
            while j + 1 < n and values[j + 1] - values[j] == stride:
                j += 1
            if j - i >= 2:
                a, b = values[i], values[j]
                items.append(f"{a}-{b}" if stride == 1 else f"{a}-{b}:{stride}")
                i = j + 1
                continue
        items.append(str(values[i]))
        i += 1
    return ",".join(items)


def expand(text: str, *, limit: int = MAX_GROUP_RANKS) -> list[int]:
    """The ranks that :func:`compact` text names, sorted; ``ValueError`` saying what is
    wrong for text it could not have written (at most ``limit`` ranks)."""
    if not isinstance(text, str) or not text:
        raise ValueError("replica_group must be non-empty text such as '0-7', '0-28:4' or '3,9'")
    if len(text) > MAX_GROUP_CHARS:
        raise ValueError(f"replica_group is {len(text)} characters, over {MAX_GROUP_CHARS}")
    spans: list[range] = []
    count = 0
    for item in text.split(","):
        match = _ITEM.match(item)
        if match is None:
            raise ValueError(
                f"replica_group item {item!r} of {text!r:.80} is not 'a', 'a-b' or 'a-b:s' "
                "(ranks >= 0)"
            )
        a = int(match[1])
        b = a if match[2] is None else int(match[2])
        stride = 1 if match[3] is None else int(match[3])
        if b < a or stride < 1 or (b - a) % stride:
            raise ValueError(
                f"replica_group item {item!r}: needs a <= b, a stride >= 1 and b on the stride"
            )
        span = range(a, b + 1, stride)
        count += len(span)
        if count > limit:
            raise ValueError(f"replica_group {text[:60]!r} names over {limit} ranks")
        if spans and span[0] <= spans[-1][-1]:
            raise ValueError(f"replica_group {text!r}: items must be ascending, without overlap")
        spans.append(span)
    return [r for span in spans for r in span]


def hex_words(words: Sequence[int]) -> str:
    """Two 64-bit words (signed or not) as the wire's 32 lowercase hex digits."""
    return "".join(f"{int(w) & _MASK:016x}" for w in words)


# -- the fingerprint (torch, on the parameters' device) -----------------------------------

_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
_int_view: dict[Any, Any] = {}  # dtype -> the signed integer dtype of its size


def local_tensor(p: Any) -> Any:
    """A parameter's own elements: a DTensor's local shard (no copy). Use it under
    ``torch.no_grad()``: a view of it then tracks no gradient."""
    to_local = getattr(p, "to_local", None)  # DTensor (FSDP2, tensor parallel)
    return to_local() if to_local is not None else p


def as_int_bits(t: Any) -> Any:
    """``t``'s elements as signed integers of their own size, flattened (a view when ``t``
    is contiguous, else a copy at the same size). 16-byte elements (complex128) as two
    int64 each."""
    dtype = _int_view.get(t.dtype)
    if dtype is None:
        import torch

        dtype = _int_view[t.dtype] = getattr(torch, _INT_OF_SIZE.get(t.element_size(), "int64"))
    bits = t.view(dtype) if t.dtype != dtype else t
    if bits.dim() == 1:
        return bits
    return bits.view(-1) if bits.is_contiguous() else bits.reshape(-1)


def fingerprint(params: Iterable[Any], *, chunk_elements: int | None = None) -> Any:
    """The two words of :mod:`this module <.replica>`'s fingerprint of ``params``, as an
    int64 tensor of 2 values on the (first) parameters' device.

    Torch ops only, queued on the current stream: no host sync, no ``.item()``. Parameters
    are widened in chunks of at most ``chunk_elements`` (default: 64 MiB of int64 on a
    GPU, 2 MiB on the CPU); small ones are packed together into one chunk (one ``cat``,
    not a few kernels each). Parameters on several devices: each device's two partial
    sums are copied (``non_blocking``) to the first CUDA device among them and added.
    """
    import torch

    int64 = torch.int64
    firsts: dict[Any, list[Any]] = {}  # device -> word 1's partial sums
    seconds: dict[Any, list[Any]] = {}  # device -> word 2's
    pending: dict[tuple[Any, Any], list[Any]] = {}  # small parameters, packed per dtype
    pending_size: dict[tuple[Any, Any], int] = {}

    def sums(flat: Any) -> None:
        wide = flat.to(int64)  # a copy, except for 8-byte elements: never written to
        device = wide.device
        firsts.setdefault(device, []).append(wide.sum())
        # int64 products wrap as the contract says; dot: no temporary (not on CUDA: ints)
        squares = torch.dot(wide, wide) if device.type == "cpu" else (wide * wide).sum()
        seconds.setdefault(device, []).append(squares)

    with torch.no_grad():
        for p in params:
            bits = as_int_bits(local_tensor(p))
            n = bits.numel()
            if n == 0:
                continue
            device = bits.device
            limit = chunk_elements or (
                CHUNK_ELEMENTS_CPU if device.type == "cpu" else CHUNK_ELEMENTS_CUDA
            )
            if n >= limit:
                for start in range(0, n, limit):
                    sums(bits[start : start + limit])
                continue
            key = (device, bits.dtype)
            size = pending_size.get(key, 0)
            if size + n > limit:
                group = pending.pop(key)
                sums(group[0] if len(group) == 1 else torch.cat(group))
                size = 0
            pending.setdefault(key, []).append(bits)
            pending_size[key] = size + n
        for group in pending.values():
            sums(group[0] if len(group) == 1 else torch.cat(group))
        if not firsts:
            return torch.zeros(2, dtype=int64)
        per_device = []
        for device, parts in firsts.items():
            both = torch.stack(parts + seconds[device])  # one op, however many chunks
            per_device.append(both if len(parts) == 1 else both.view(2, -1).sum(1))
        if len(per_device) == 1:
            return per_device[0]
        cuda = [t.device for t in per_device if t.device.type == "cuda"]
        target = cuda[0] if cuda else per_device[0].device
        # To a CUDA device: never a CUDA result copied to host memory without a wait.
        return torch.stack([t.to(target, non_blocking=True) for t in per_device]).sum(0)


# -- who holds the same parameters -------------------------------------------------------


def replica_group_of(
    model: Any, override: Any = None, *, rank: int | None = None
) -> tuple[str, list[int]] | None:
    """The replica group of this rank for ``model``: ``(text, global ranks)``, or ``None``
    when there is no replica to compare with (a log line says why).

    - ``override`` (``tw.watch(..., replica_group=...)``): a ``ProcessGroup`` or a list of
      global ranks; it wins.
    - ``DistributedDataParallel``: the ranks of ``model.process_group``.
    - FSDP2 / HSDP (DTensor parameters): the ranks along the mesh dimensions on which every
      parameter is replicated (HSDP's replicate dimension) that share this rank's other
      coordinates. Plain FSDP2 (no replicate dimension) has no replica: ``None``.
    - any other model (a hand-written data-parallel loop, a tensor- or pipeline-parallel
      shard): ``None``, since which ranks hold the same parameters is not known; the
      trainer says it with ``override``.

    The group must contain this process's global rank: ``torch.distributed``'s when it is
    initialized, else ``rank`` (the agent's ``RANK``), if given.
    """
    import torch

    dist = torch.distributed if torch.distributed.is_available() else None
    if dist is not None and dist.is_initialized():
        rank = dist.get_rank()
    ranks: list[int] | None
    if override is not None:
        ranks = _ranks_of_override(override, dist)
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
        ranks = sorted(dist.get_process_group_ranks(model.process_group)) if dist else None
    elif (mesh_ranks := _mesh_replicas(model)) is not None:
        ranks = mesh_ranks
        if len(ranks) < 2:
            log.info(
                "trainwarden: replica check off: the model is sharded (FSDP2) with no "
                "replicate dimension, so no other rank holds this rank's parameters "
                "(HSDP or tw.watch(..., replica_group=...) gives it one)"
            )
            return None
    else:
        # Not DDP, not FSDP: a hand-written data-parallel loop, or a tensor / pipeline
        # shard, which other ranks do not hold. Guessing the world would page on every
        # check of a sharded model: the trainer says which ranks are replicas.
        log.info(
            "trainwarden: replica check off: the model is neither DDP nor FSDP2, so which "
            "ranks hold the same parameters is not known; tw.watch(..., replica_group=[...]) "
            "(a process group or global ranks) turns it on"
        )
        return None
    if ranks is None or not ranks:
        return None
    if rank is not None and rank not in ranks:
        raise ValueError(
            f"replica_group {compact(ranks)!r} does not contain this rank ({rank}): give the "
            "global ranks that hold the same parameters as this one, this rank included"
        )
    text = compact(ranks)
    if len(text) > MAX_GROUP_CHARS:
        log.warning(
            "trainwarden: replica check off: replica group of %d ranks is %d characters as "
            "text, over %d",
            len(ranks),
            len(text),
            MAX_GROUP_CHARS,
        )
        return None
    return text, ranks


def _ranks_of_override(override: Any, dist: Any) -> list[int]:
    if isinstance(override, (list, tuple, range, set, frozenset)):
        ranks = list(override)
        if not ranks or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks):
            raise ValueError(
                f"replica_group={override!r:.200}: give global ranks (integers >= 0), "
                "e.g. replica_group=[0, 4, 8, 12], or a ProcessGroup"
            )
        return sorted(set(ranks))
    if dist is not None and isinstance(override, dist.ProcessGroup):
        return sorted(dist.get_process_group_ranks(override))
    raise ValueError(
        f"replica_group must be a ProcessGroup or a list of global ranks, got "
        f"{type(override).__name__}"
    )


def _mesh_replicas(model: Any) -> list[int] | None:
    """For DTensor parameters: this rank's replicas along the mesh dimensions on which
    every parameter is ``Replicate()``; ``None`` when no parameter is a DTensor."""
    mesh = None
    replicated: set[int] | None = None
    for p in model.parameters():
        spec_mesh = getattr(p, "device_mesh", None)
        placements = getattr(p, "placements", None)
        if spec_mesh is None or placements is None:
            continue
        if mesh is None:
            mesh = spec_mesh
        elif spec_mesh != mesh:  # parameters on several meshes: no common replicate dim
            return []
        dims = {i for i, pl in enumerate(placements) if pl.is_replicate()}
        replicated = dims if replicated is None else replicated & dims
    if mesh is None:
        return None
    coordinate = mesh.get_coordinate()
    if coordinate is None or not replicated:  # this rank is not in the mesh, or no replica
        return []
    index = tuple(slice(None) if d in replicated else c for d, c in enumerate(coordinate))
    return sorted(int(r) for r in mesh.mesh[index].reshape(-1).tolist())
