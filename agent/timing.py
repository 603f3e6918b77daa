"""Where a step's time went: phases and the compute / communication split.

Pure functions over timestamps (nanoseconds, one clock); they run on the exporter
thread, never on the training thread.

Definitions (per rank, per step):

- *exposed communication*: time in the step in which the rank waits on a collective
  with no compute running;
- *overlapped communication*: collective time hidden behind compute;
- *compute*: the rest of the step that is not idle; *idle*: neither (only the sampled
  profiler can see it; the hook path counts it as compute).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Interval = tuple[int, int]

PHASES = ("forward", "backward", "optimizer", "other")


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(intervals: Sequence[Interval]) -> int:
    """Total length of already merged intervals."""
    return sum(end - start for start, end in intervals)


def clip(intervals: Sequence[Interval], lo: int, hi: int) -> list[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists (a linear sweep)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def phase_durations(marks: Sequence[tuple[str, int]], start: int, end: int) -> dict[str, int]:
    """Durations per phase from ``(name, t)`` marks: a phase lasts until the next mark.

    Time before the first mark counts as ``other``. Repeated names (gradient
    accumulation: forward, backward, forward, backward...) add up.
    """
    out = dict.fromkeys(PHASES, 0)
    current, since = "other", start
    for name, t in sorted(marks, key=lambda m: m[1]):
        t = min(max(t, start), end)
        out[current] = out.get(current, 0) + t - since
        current, since = name, t
    out[current] = out.get(current, 0) + end - since
    return out


def split_from_hook(comm: Sequence[Interval], start: int, end: int) -> dict[str, int] | None:
    """The split from DDP comm-hook intervals (bucket ready -> collective done).

    Backward compute ends when the last bucket becomes ready; the union of collective
    time after that is exposed, the rest of it was overlapped by backward compute.
    """
    if not comm:
        return None
    backward_end = max(ready for ready, _ in comm)
    union = merge(clip(comm, start, end))
    exposed = length(clip(union, backward_end, end))
    total = length(union)
    return {
        "compute": end - start - exposed,
        "exposed_comm": exposed,
        "overlapped_comm": total - exposed,
        "idle": 0,
    }


def split_from_trace(
    compute: Iterable[Interval], comm: Iterable[Interval], start: int, end: int
) -> dict[str, int]:
    """The split from a profiler trace: an interval sweep over compute and comm events."""
    compute_u = merge(clip(merge(compute), start, end))
    comm_u = merge(clip(merge(comm), start, end))
    overlapped = length(intersect(compute_u, comm_u))
    comm_total = length(comm_u)
    busy = length(merge([*compute_u, *comm_u]))
    return {
        "compute": length(compute_u),
        "exposed_comm": comm_total - overlapped,
        "overlapped_comm": overlapped,
        "idle": end - start - busy,
    }
