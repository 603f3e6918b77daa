from __future__ import annotations

from trainwarden.agent.timing import merge, phase_durations, split_from_hook, split_from_trace


def test_merge_unions_overlapping_intervals() -> None:
    assert merge([(5, 7), (0, 2), (1, 3), (7, 9), (10, 10)]) == [(0, 3), (5, 9)]


def test_phases_last_until_the_next_mark_and_accumulate() -> None:
    marks = [
        ("forward", 10),
        ("backward", 20),
        ("forward", 50),
        ("backward", 55),
        ("optimizer", 80),
    ]
    assert phase_durations(marks, 0, 100) == {
        "forward": 15,
        "backward": 55,
        "optimizer": 20,
        "other": 10,
    }


def test_hook_split_exposed_is_comm_after_the_last_bucket_is_ready() -> None:
    # Buckets ready at 40, 60, 70 (backward compute ends at 70); collectives done at 55, 75, 90.
    split = split_from_hook([(40, 55), (60, 75), (70, 90)], 0, 100)
    assert split == {"compute": 80, "exposed_comm": 20, "overlapped_comm": 25, "idle": 0}


def test_trace_split_sweeps_compute_and_comm() -> None:
    compute = [(0, 30), (10, 20), (40, 60)]  # nested ops count once
    comm = [(25, 50), (70, 80)]
    split = split_from_trace(compute, comm, 0, 100)
    # comm 35 of which 15 under compute; busy = [0,60] + [70,80] = 70 -> idle 30
    assert split == {"compute": 50, "exposed_comm": 20, "overlapped_comm": 15, "idle": 30}
