"""The state of every live rank in one evaluation (healthy, slow, hung or dead) and its
detail: who is a culprit, who a victim waiting on whom, and why. Pure: it decides from
the rank rows, the step views and the settings; the evaluator reads and writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.health.step_views import StepView
from trainwarden.collector.ingest import endings

PHASE_ORDER = {None: 0, "step": 0, "forward": 1, "backward": 2, "optimizer": 3, "other": 4}


def _idle_s(rank: Any, *, now: float, late: float, refused_at: float | None) -> float:
    """How long the rank has gone without completing a step, at the least.

    What it said: how long it had gone without one when it sent its latest request, by
    its own clock (``progress_at`` and ``sent_at`` both are the agent's: no skew between
    clocks, no time the request spent in transit or in a queue). Plus the time since,
    less ``late`` (news of a step may be on its way); not when a later request of the
    rank was refused (it may have carried that news)."""
    sent_at = rank["last_seen"] - (rank["clock_skew_s"] or 0.0)
    said = sent_at - rank["progress_at"]
    if refused_at is not None and refused_at > rank["last_seen"]:
        return said
    return said + max(0.0, now - rank["last_seen"] - late)


def dead_detail(
    rank: Any, now: float, places: Callable[[], Mapping[int, Mapping[str, Any]]] | None = None
) -> dict[str, Any]:
    """A rank found dead. A rank that was in a hang's verdict keeps its place in it (the
    verdict, not the order in which heartbeats stopped, says who is the culprit: a victim
    that dies is a dead victim); so does one the standing verdict names whose state had
    moved on (``places``: :func:`endings.standing_places`, asked only then); any other
    rank that dies is a culprit."""
    silent = f"no heartbeat for {now - rank['last_seen']:.1f}s"
    before = rank["state_detail"] or {}
    if not (rank["state"] in ("hung", "dead") and before.get("role") in ("culprit", "victim")):
        placed = places().get(rank["rank"]) if places is not None else None
        before = dict(placed) if placed is not None else {}
    if before.get("role") in ("culprit", "victim"):
        kept = {key: before[key] for key in endings.VERDICT_KEYS if key in before}
        if kept["role"] == "victim":
            return {**kept, "reason": f"{silent}; was waiting on rank(s) {kept.get('waiting_on')}"}
        return {**kept, "reason": silent}
    return {"role": "culprit", "reason": silent}


def decide_states(
    ranks: list[Any],
    *,
    now: float,
    settings: HealthSettings,
    median_step: float | None,
    slow: dict[int, float],
    steps: dict[int, StepView],
    lag_s: float = 0.0,
    heard: Mapping[int, float] | None = None,
    still_dead: Callable[[], list[int]] | None = None,
    places: Callable[[], Mapping[int, Mapping[str, Any]]] | None = None,
) -> dict[int, tuple[str, dict[str, Any]]]:
    """The state and detail of every live rank. ``lag_s``: how late the collector hears
    from ranks; silence that long is the collector's, not the rank's. ``heard``: when a
    rank last sent a request the collector refused (as alive as one it took).
    ``still_dead``: the dead ranks not in ``ranks`` (not heard from since), asked for
    only when hung ranks may be waiting on them. ``places``: where the standing verdict
    places the ranks, asked only for a rank found dead whose own state no longer says."""
    hung_after = max(settings.hung_min_s, settings.hung_steps * (median_step or 0.0))
    heard = heard or {}
    dead, stalled = [], []
    for r in ranks:
        beat = r["heartbeat_s"] or 2.0
        seen = max(r["last_seen"], heard.get(r["rank"], r["last_seen"]))
        if now - seen > settings.dead_after_beats * beat + lag_s or _unheard_since_death(r, seen):
            dead.append(r)
        elif (
            r["progress_at"] is not None
            and _idle_s(r, now=now, late=lag_s, refused_at=heard.get(r["rank"])) > hung_after
        ):
            stalled.append(r)
    out: dict[int, tuple[str, dict[str, Any]]] = {}
    for r in dead:
        out[r["rank"]] = ("dead", dead_detail(r, now, places))
    if stalled:
        blamed_dead = sorted(
            {r["rank"] for r in dead if out[r["rank"]][1]["role"] == "culprit"}
            | set(still_dead() if still_dead else ())
        )
        if blamed_dead:
            culprits: list[Any] = []
        else:
            key = min(
                (
                    r["last_step"] if r["last_step"] is not None else -1,
                    PHASE_ORDER.get(r["phase"], 5),
                )
                for r in stalled
            )
            culprits = [
                r
                for r in stalled
                if (
                    r["last_step"] if r["last_step"] is not None else -1,
                    PHASE_ORDER.get(r["phase"], 5),
                )
                == key
            ]
        blamed = blamed_dead or sorted(r["rank"] for r in culprits)
        for r in stalled:
            idle = _idle_s(r, now=now, late=lag_s, refused_at=heard.get(r["rank"]))
            detail: dict[str, Any]
            if r in culprits:
                detail = {
                    "role": "culprit",
                    "reason": f"no step completed for {idle:.1f}s (in "
                    f"{r['phase'] or 'between steps'})",
                }
            else:
                detail = {
                    "role": "victim",
                    "waiting_on": blamed,
                    "reason": f"blocked for {idle:.1f}s in {r['phase'] or 'a step'}, waiting "
                    f"on rank(s) {blamed}",
                }
            out[r["rank"]] = ("hung", detail)
    exposed = steps[max(steps)].exposed if steps else {}
    for r in ranks:
        if r["rank"] in out:
            continue
        if r["rank"] in slow:
            out[r["rank"]] = (
                "slow",
                {
                    "role": "culprit",
                    "compute_ratio": round(slow[r["rank"]], 3),
                    "reason": f"compute {slow[r['rank']]:.2f}x the peer median",
                },
            )
            continue
        detail = {}
        waited = exposed.get(r["rank"])
        if slow and waited:
            detail = {
                "role": "victim",
                "waiting_on": sorted(slow),
                "reason": f"exposed comm {waited * 1000:.0f} ms waiting on straggler(s) "
                f"{sorted(slow)}",
            }
        out[r["rank"]] = ("healthy", detail)
    return out


def _unheard_since_death(rank: Any, seen: float) -> bool:
    """A rank declared dead stays dead until it is heard from again: a collector whose lag
    grew since (which raises the dead threshold) does not bring it back to life."""
    return rank["state"] == "dead" and seen <= (rank["state_since"] or 0.0)
