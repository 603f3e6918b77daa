"""The communication split on 2 real gloo ranks, by both mechanisms.

A user's DDP comm hook (registered after tw.watch, so chained inside the agent's)
delays the completion of the last gradient bucket by X ms on odd steps only. The
exposed communication the agent measures must grow by X on odd steps, and compute
must not: with the always-on comm hook, and with the sampled torch.profiler window
(here on every step).

The profiler's CPU view is looser by construction: the delay is a sleep in the hook's
``then`` callback, which runs after gloo's own op ended, sometimes on the training
thread's wait; the trace then shows it as a gap with no op (``idle``) rather than inside
``gloo:all_reduce``. On this 2-vCPU host up to 11 ms of a 20 ms delay went to idle
(seen in 2 of 8 runs). So for the profiler the delay must show as not-compute
(exposed + idle) within 10 ms, and at least half of it as exposed; on a GPU the wait is
inside the NCCL kernel, which the profiler sees whole.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import ROOT
from ..net import free_port

# Its assertions are timings (the injected delay within 10 ms): alone, not beside another
# worker's load (scripts/test.sh runs the serial tests after the parallel part).
pytestmark = pytest.mark.serial

STEPS = 40
WARMUP = 4


def median_ms(block: list[dict], key: str, parity: int) -> float:
    return statistics.median(s[key] for s in block if s["step"] % 2 == parity) * 1000


def paired_delta_ms(block: list[dict], key: str, less: str | None = None) -> float:
    """Median over odd steps of (the step's value - the mean of its two even neighbours
    [- the step's own `less` value]).

    Paired with its neighbours, a delayed step is compared with the undelayed steps run
    just before and after it: a host whose load drifts during the block (CI's) moves both
    alike, where two medians taken over the whole block keep the drift (a 50 ms delay
    once read 60.5 ms that way in CI).
    """
    by_step = {s["step"]: s for s in block}
    deltas = [
        s[key] - (by_step[step - 1][key] + by_step[step + 1][key]) / 2 - (s[less] if less else 0.0)
        for step, s in by_step.items()
        if step % 2 == 1 and step - 1 in by_step and step + 1 in by_step
    ]
    return statistics.median(deltas) * 1000


def run_ranks(out: Path, delays_ms: list[int], profile_every: int) -> list[list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tests.e2e.comm_worker",
        str(out),
        ",".join(map(str, delays_ms)),
        str(STEPS),
    ]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TRAINWARDEN_PROFILE_EVERY": str(profile_every),
        }
        # torch.profiler prints its own lines to stderr on every window: to a file, whose
        # tail a failure shows.
        with open(out / f"rank{rank}.stderr", "wb") as err:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=err))
    codes = [p.wait(timeout=240) for p in procs]
    tails = [(out / f"rank{r}.stderr").read_text(errors="replace")[-3000:] for r in range(2)]
    assert codes == [0, 0], "\n".join(f"--- rank {r} stderr:\n{t}" for r, t in enumerate(tails))
    ranks = []
    for rank in range(2):
        steps = json.loads((out / f"rank{rank}.json").read_text())
        slept = {
            int(k): v for k, v in json.loads((out / f"rank{rank}-slept.json").read_text()).items()
        }
        for s in steps:
            s["slept_s"] = slept.get(s["step"], 0.0)
            s["waited_s"] = s["exposed_comm_s"] + s["idle_s"]  # not compute
        ranks.append(steps)
    return ranks


def timing_misses(ranks: list[list[dict]], source: str, delays_ms: list[int]) -> list[str]:
    """What of one measurement is off by more than its tolerance (empty: all within).

    The invariants that hold whatever the host's load (the phases and the split cover each
    step) are asserted here; the timings come back as a list, so that a run of both ranks
    can be measured again once (see the test)."""
    misses = []
    for rank, steps in enumerate(ranks):
        assert len(steps) == STEPS * len(delays_ms)
        assert {s["comm_source"] for s in steps} == {source}
        for i, delay in enumerate(delays_ms):
            block = [s for s in steps if i * STEPS + WARMUP <= s["step"] < (i + 1) * STEPS]
            for s in block:
                # Phases cover the step, and so does the split (the profiler's is scaled
                # to the step's own duration).
                assert (
                    abs(s["fwd_s"] + s["bwd_s"] + s["opt_s"] + s["other_s"] - s["duration_s"])
                    < 1e-6
                )
                parts = s["compute_s"] + s["exposed_comm_s"] + s["idle_s"]
                assert abs(parts - s["duration_s"]) < 1e-6
                assert s["overlapped_comm_s"] >= 0
                if source == "profiler":
                    assert "mfu" not in s and "profiled" in s["issues"]["timing"]
            d_exposed = paired_delta_ms(block, "exposed_comm_s")
            # What the delay really slept: on a loaded host sleep(0.1) oversleeps (seen
            # 111 and 121 ms in CI), and the agent must measure what happened.
            slept = median_ms(block, "slept_s", 1)
            d_compute = paired_delta_ms(block, "compute_s")
            # Step by step: what the agent measured beyond its neighbours, less what that
            # very step slept.
            waited = "exposed_comm_s" if source == "hook" else "waited_s"
            error = paired_delta_ms(block, waited, less="slept_s")
            said = (
                f"{source} rank {rank} X={delay} ms (slept {slept:.1f}): "
                f"Δexposed {d_exposed:.1f} ms, Δcompute {d_compute:.1f} ms, "
                f"error {error:.1f} ms"
            )
            print(said)
            if not delay <= slept < delay * 1.5:
                misses.append(f"{said}: the sleep itself was off")
            if abs(error) > 10:
                misses.append(f"{said}: |error| > 10 ms")
            if source == "profiler" and d_exposed < slept / 2:
                misses.append(f"{said}: less than half the delay seen as exposed")
            if abs(d_compute) > 10:
                misses.append(f"{said}: |Δcompute| > 10 ms")
    return misses


@pytest.mark.parametrize(
    ("source", "delays_ms", "profile_every"),
    [("hook", [20, 50, 100], 0), ("profiler", [20, 100], 1)],
)
def test_exposed_comm_tracks_an_injected_delay(
    tmp_path: Path, source: str, delays_ms: list[int], profile_every: int
) -> None:
    # Once more if the first run is off: a shared CI host once stole ~10 ms of one rank's
    # odd steps in both of its blocks (Δcompute -9 ms, error -12 ms), where the same
    # commit reads within 3 ms here. A measurement that is wrong is wrong both times.
    first = timing_misses(run_ranks(tmp_path / "1", delays_ms, profile_every), source, delays_ms)
    if not first:
        return
    print("off the first time, measuring again:", *first, sep="\n  ")
    again = timing_misses(run_ranks(tmp_path / "2", delays_ms, profile_every), source, delays_ms)
    assert not again, "\n".join(["both runs off; the first:", *first, "the second:", *again])
