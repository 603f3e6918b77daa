"""Which rank, which collective: the ranks' Flight Recorder rings lined up (pure).

Each rank's ``collectives`` event (``agent/flight.py``) holds, per process group, its
newest collectives with their sequence ids. In a hang, every live rank waits in some
collective; :func:`analyze` lines the ranks of each group up by sequence id:

- a rank **waits** in the oldest collective it issued that has not completed (gloo
  records no completion time, but retires a finished entry; a rank whose ring says
  nothing of completion waits in its newest);
- the ranks of the group that have not issued that sequence id are who it waits on; a
  dead rank (no heartbeats, no ring) is among them when it is a member;
- following "waits on" across groups, the **culprits** are the ranks waited on that
  wait on no one themselves (a rank behind in one group because it waits in another is
  a victim there too); everyone waiting is a **victim**;
- ranks that issued different ops, sizes or dtypes under one sequence id of a group
  are a **desync**: both (all) sides are named; the fewer side is the culprit.

Rings that cannot be used are left out and said (``unusable``, rank -> why): a rank
outside the run's world, sequence ids that go backwards (within the ring, or a group's
highest sequence id lower than in the ring the same rank sent before it in the same
attempt: a restart's process starts again from 1, which is not backwards), a ring the
agent could not read (and why). A member whose ring is neither read nor known to be
missing (not in yet, or left out) is **unread**: when no read rank is missing, the
verdict is ``incomplete`` and names the unread ranks instead of saying no rank is
missing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Lane:
    """One rank's view of one process group."""

    last: int  # the highest sequence id it issued (0: none)
    wait: int | None  # the sequence id it waits in, if any
    entries: dict[int, dict[str, Any]]
    since: float | None = None  # when it issued what it waits in


@dataclass
class _Group:
    pg: str
    desc: str
    members: set[int] = field(default_factory=set)
    lanes: dict[int, _Lane] = field(default_factory=dict)


def _signature(e: Mapping[str, Any]) -> tuple[Any, ...]:
    return (e.get("op"), repr(e.get("in_sizes")), repr(e.get("in_dtypes")))


def _lane(group: Mapping[str, Any]) -> _Lane:
    entries = {int(e["seq"]): dict(e) for e in group.get("entries") or ()}
    done_known = group.get("last_completed") is not None or any(
        e.get("done") for e in entries.values()
    )
    last = max([0, *entries, int(group.get("last_enqueued") or 0)])
    completed = group.get("last_completed")
    if done_known:
        waiting = [
            s
            for s, e in entries.items()
            if not e.get("done") and (completed is None or s > int(completed))
        ]
        wait = min(waiting) if waiting else None
    else:
        wait = max(entries) if entries else None
    since = entries[wait].get("created") if wait is not None and wait in entries else None
    return _Lane(last=last, wait=wait, entries=entries, since=since)


def _last(group: Mapping[str, Any]) -> int:
    """The highest sequence id a ring says its rank issued on a group (0: none)."""
    seqs = [int(e["seq"]) for e in group.get("entries") or ()]
    return max([0, *seqs, int(group.get("last_enqueued") or 0)])


def _problem(
    rank: int, data: Mapping[str, Any], world: int, before: Mapping[str, Any] | None = None
) -> str | None:
    """Why this rank's ring cannot be used, if it cannot. ``before``: the ring this rank
    sent before it (in the same attempt), whose sequence ids this one may not go back
    from."""
    if not 0 <= rank < world:
        return f"rank {rank} is outside the run's world ({world} ranks)"
    for g in data.get("groups") or ():
        outside = sorted(int(r) for r in g.get("ranks") or () if not 0 <= int(r) < world)
        if outside:
            return (
                f"its pg {g.get('pg')} names rank {outside[0]}, outside the run's world "
                f"({world} ranks)"
            )
        seqs = [int(e["seq"]) for e in g.get("entries") or ()]
        for a, b in zip(seqs, seqs[1:], strict=False):
            if b <= a:
                return f"its sequence ids go backwards on pg {g.get('pg')} ({b} after {a})"
    if before is None or not before.get("available"):
        return None
    was = {str(g.get("pg")): _last(g) for g in before.get("groups") or ()}
    for g in data.get("groups") or ():
        pg, last = str(g.get("pg")), _last(g)
        if last < was.get(pg, 0):
            return (
                f"its sequence ids go backwards on pg {pg}: its newest ring ends at #{last}, "
                f"the one it sent before at #{was[pg]}"
            )
    return None


def _who(ranks: Iterable[int], nodes: Mapping[int, str | None]) -> str:
    ranks = sorted(ranks)
    shown = ranks[:8]
    where = sorted({n for r in shown if (n := nodes.get(r))})
    head = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, shown))
    if len(ranks) > len(shown):
        head += f" and {len(ranks) - len(shown)} more"
    if where:
        head += f" ({'node' if len(where) == 1 else 'nodes'} {', '.join(where[:4])})"
    return head


def clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(ts)) if ts else "?"


def _what(e: Mapping[str, Any] | None) -> str:
    if not e:
        return "?"
    dtypes = e.get("in_dtypes") or []
    sizes = e.get("in_sizes") or []
    return f"{e.get('op')} {'/'.join(map(str, dtypes)) or '?'}{sizes}"


def analyze(
    rings: Mapping[int, Mapping[str, Any]],
    *,
    world: int,
    nodes: Mapping[int, str | None] | None = None,
    dead: Iterable[int] = (),
    earlier: Mapping[int, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The verdict on a run's rings (rank -> its newest ``collectives`` event data).
    ``dead``: ranks the health evaluator holds dead (no heartbeats). ``earlier``: rank ->
    the ring it sent before its newest, in the same attempt (a ring whose sequence ids
    on a group end before the earlier one's did went backwards: left out)."""
    nodes = nodes or {}
    earlier = earlier or {}
    dead = set(dead)
    unusable: dict[str, str] = {}
    no_ring: dict[int, str] = {}
    groups: dict[str, _Group] = {}
    usable: set[int] = set()
    for rank, data in sorted(rings.items()):
        why = _problem(rank, data, world, earlier.get(rank))
        if why:
            unusable[str(rank)] = why
            continue
        if not data.get("available"):
            no_ring[rank] = str(data.get("reason") or "the agent could not read it")
            continue
        usable.add(rank)
        for g in data.get("groups") or ():
            group = groups.setdefault(str(g["pg"]), _Group(str(g["pg"]), str(g.get("desc") or "")))
            group.desc = group.desc or str(g.get("desc") or "")
            group.members.update(int(r) for r in g.get("ranks") or ())
            group.members.add(rank)
            group.lanes[rank] = _lane(g)
    if "0" in groups and groups["0"].members <= set(range(world)):
        groups["0"].members = set(range(world))  # the default group: the whole world
    for rank in dead - usable:
        no_ring.setdefault(rank, "dead: no heartbeats")
    for group in groups.values():  # a member that issued nothing on it, as far as it says
        for rank in group.members & usable - set(group.lanes):
            group.lanes[rank] = _Lane(last=0, wait=None, entries={})
    base = {
        "unusable": unusable,
        "no_ring": sorted(no_ring),
        "no_ring_why": {str(r): why for r, why in sorted(no_ring.items())},
        "dead": sorted(dead),
    }
    if not usable:
        reasons = "; ".join(f"rank {r}: {why}" for r, why in sorted(no_ring.items())[:4])
        reasons = reasons or "; ".join(f"rank {r}: {w}" for r, w in unusable.items()) or "none"
        return {
            **base,
            **_empty("no_data", f"no usable Flight Recorder ring yet ({reasons})"),
        }

    desync = _desync(groups, nodes)
    # Who waits on whom: (group, seq) a rank waits in, and the members that never issued it.
    waits: dict[int, tuple[_Group, int, set[int]]] = {}
    for group in groups.values():
        for rank, lane in group.lanes.items():
            if lane.wait is None:
                continue
            missing = {
                m
                for m in group.members
                if (m in group.lanes and group.lanes[m].last < lane.wait)
                or (m not in group.lanes and m in no_ring)
            }
            here = (group, lane.wait, missing)
            before = waits.get(rank)
            if before is None or (lane.since or 0.0) < (
                before[0].lanes[rank].since or float("inf")
            ):
                waits[rank] = here  # several: the oldest (NCCL may have queued more)
    blocked = {r for r, (_, _, missing) in waits.items() if missing}
    waited_on = set().union(*(missing for _, _, missing in waits.values()))
    culprits = {r for r in waited_on if r not in blocked}
    if desync is not None:
        sides = desync["sides"]
        fewest = min(len(s["ranks"]) for s in sides)
        culprits = {r for s in sides if len(s["ranks"]) == fewest for r in s["ranks"]}
        if len(sides) == 2 and len(sides[0]["ranks"]) == len(sides[1]["ranks"]):
            culprits = {r for s in sides for r in s["ranks"]}
        victims = sorted((set(waits) | blocked) - culprits)
        group = groups[desync["pg"]]
        return {
            **base,
            "kind": "desync",
            "summary": _desync_text(desync, group, waits, nodes),
            "culprits": sorted(culprits),
            "victims": victims,
            "group": {"pg": group.pg, "desc": group.desc, "size": len(group.members)},
            "seq": desync["seq"],
            "op": sides[0]["op"],
            "desync": desync,
        }
    if culprits:
        return {**base, **_culprit(culprits, groups, waits, blocked, nodes, dead, no_ring)}
    if waits:
        group, seq, _ = min(waits.values(), key=lambda w: (w[1], w[0].pg))
        e = next(lane.entries.get(seq) for lane in group.lanes.values() if seq in lane.entries)
        unread = sorted(group.members - set(group.lanes) - set(no_ring))
        if unread:
            return {**base, **_incomplete(group, seq, e, waits, unread, unusable, nodes)}
        return {
            **base,
            **_empty(
                "none",
                f"every rank of pg {group.pg} ({group.desc or 'no name'}, {len(group.members)} "
                f"ranks) entered {(e or {}).get('op', '?')} #{seq}: no rank is missing; the "
                "collective itself is stuck (network, NCCL) or ranks wait outside collectives",
            ),
            "victims": sorted(waits),
            "group": {"pg": group.pg, "desc": group.desc, "size": len(group.members)},
            "seq": seq,
            "op": (e or {}).get("op"),
        }
    return {
        **base,
        **_empty(
            "none",
            "no rank waits in a collective: every collective in the rings completed (the "
            "ranks are stuck outside collectives: data loading, I/O, the Python side)",
        ),
    }


def _incomplete(
    group: _Group,
    seq: int,
    e: Mapping[str, Any] | None,
    waits: Mapping[int, tuple[_Group, int, set[int]]],
    unread: list[int],
    unusable: Mapping[str, str],
    nodes: Mapping[int, str | None],
) -> dict[str, Any]:
    """No rank whose ring was read is missing, but members of the group are not read: a
    ring not in yet (asked, not answered) or left out (``unusable``). The rank missing, if
    any, is among them: said so, no one named (a guess would page the wrong rank)."""
    waiting = sorted(r for r, w in waits.items() if w[0] is group and w[1] == seq)
    left_out = [r for r in unread if str(r) in unusable]
    not_in = [r for r in unread if str(r) not in unusable]
    parts = []
    if not_in:
        parts.append(f"{_who(not_in, nodes)}: no ring in yet")
    if left_out:
        parts.append(f"{_who(left_out, nodes)}: ring left out ({unusable[str(left_out[0])]})")
    op = (e or {}).get("op", "?")
    return {
        **_empty(
            "incomplete",
            f"{_who(waiting, nodes)} {'waits' if len(waiting) == 1 else 'wait'} in {op} #{seq} "
            f"on pg {group.pg} ({group.desc or 'no name'}, {len(group.members)} ranks) and "
            f"every rank whose ring was read entered it; not read: {'; '.join(parts)}. The "
            "rank missing, if any, is among those not read",
        ),
        "victims": sorted(waits),
        "unread": unread,
        "group": {"pg": group.pg, "desc": group.desc, "size": len(group.members)},
        "seq": seq,
        "op": op,
    }


def _empty(kind: str, summary: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "summary": summary,
        "culprits": [],
        "victims": [],
        "group": None,
        "seq": None,
        "op": None,
        "desync": None,
    }


def _desync(groups: Mapping[str, _Group], nodes: Mapping[int, str | None]) -> dict[str, Any] | None:
    """The lowest sequence id of any group under which ranks issued different collectives."""
    found: dict[str, Any] | None = None
    for group in groups.values():
        seqs: dict[int, dict[tuple[Any, ...], list[int]]] = defaultdict(lambda: defaultdict(list))
        for rank, lane in group.lanes.items():
            for seq, e in lane.entries.items():
                seqs[seq][_signature(e)].append(rank)
        for seq in sorted(seqs):
            if len(seqs[seq]) < 2:
                continue
            sides = []
            for ranks in sorted(seqs[seq].values(), key=lambda rs: (-len(rs), rs)):
                e = group.lanes[ranks[0]].entries[seq]
                sides.append(
                    {
                        "ranks": sorted(ranks),
                        "op": e.get("op"),
                        "sizes": e.get("in_sizes"),
                        "dtypes": e.get("in_dtypes"),
                    }
                )
            if found is None or seq < found["seq"]:
                found = {"pg": group.pg, "seq": seq, "sides": sides}
            break
    return found


def _desync_text(
    desync: dict[str, Any],
    group: _Group,
    waits: Mapping[int, tuple[_Group, int, set[int]]],
    nodes: Mapping[int, str | None],
) -> str:
    sides = " vs ".join(
        f"{_who(s['ranks'], nodes)} issued "
        + _what({"op": s["op"], "in_sizes": s["sizes"], "in_dtypes": s["dtypes"]})
        for s in desync["sides"]
    )
    since = [s for r in waits if r in group.lanes and (s := group.lanes[r].since) is not None]
    tail = f"; {len(waits)} ranks blocked since {clock(min(since))}" if since and waits else ""
    return (
        f"desync on pg {group.pg} ({group.desc or 'no name'}, {len(group.members)} ranks) at "
        f"collective #{desync['seq']}: {sides}{tail}"
    )


def _culprit(
    culprits: set[int],
    groups: Mapping[str, _Group],
    waits: Mapping[int, tuple[_Group, int, set[int]]],
    blocked: set[int],
    nodes: Mapping[int, str | None],
    dead: set[int],
    no_ring: Mapping[int, str],
) -> dict[str, Any]:
    # The group to name: where the culprits are missing and least else is (the ranks
    # there wait on the culprits directly, not on ranks stuck in another group).
    candidates = [w for w in waits.values() if w[2] & culprits]
    group, seq, missing = min(
        candidates, key=lambda w: (len(w[2] - culprits), -len(w[2] & culprits), w[1], w[0].pg)
    )
    waiting = sorted(r for r, w in waits.items() if w[0] is group and w[1] == seq)
    e = next(group.lanes[r].entries.get(seq) for r in waiting if seq in group.lanes[r].entries)
    since = min((s for r in waiting if (s := group.lanes[r].since)), default=None)
    named = sorted(missing & culprits)
    state = ""
    if set(named) <= dead:
        state = " is dead (no heartbeats) and" if len(named) == 1 else " are dead and"
    elif set(named) & set(no_ring):
        state = " (no ring)"
    op = (e or {}).get("op", "?")
    text = (
        f"{_who(named, nodes)}{state} never entered {op} #{seq} on pg {group.pg} "
        f"({group.desc or 'no name'}, {len(group.members)} ranks); {len(waiting)} "
        f"{'rank waits' if len(waiting) == 1 else 'ranks wait'} in it since {clock(since)}"
    )
    others = sorted(culprits - set(named))
    if others:
        text += f"; also waited on: {_who(others, nodes)}"
    behind = len(blocked - set(waiting) - culprits)
    if behind:
        text += f"; {behind} more blocked behind them in other groups"
    return {
        "kind": "culprit",
        "summary": text,
        "culprits": sorted(culprits),
        "victims": sorted(set(waits) - culprits),
        "group": {"pg": group.pg, "desc": group.desc, "size": len(group.members)},
        "seq": seq,
        "op": op,
        "sizes": (e or {}).get("in_sizes"),
        "dtypes": (e or {}).get("in_dtypes"),
        "since": since,
        "desync": None,
    }


def table(
    rings: Mapping[int, Mapping[str, Any]],
    verdict: Mapping[str, Any] | None,
    *,
    world: int,
    nodes: Mapping[int, str | None],
) -> list[dict[str, Any]]:
    """Per process group, each rank's last collective and its role: the UI's table."""
    culprits = set((verdict or {}).get("culprits") or ())
    victims = set((verdict or {}).get("victims") or ())
    unusable = (verdict or {}).get("unusable") or {}
    out: dict[str, dict[str, Any]] = {}
    for rank, data in sorted(rings.items()):
        if not 0 <= rank < world or not data.get("available"):
            continue
        for g in data.get("groups") or ():
            lane = _lane(g)
            pg = str(g["pg"])
            group = out.setdefault(
                pg, {"pg": pg, "desc": str(g.get("desc") or ""), "ranks": set(), "rows": []}
            )
            group["ranks"].update(int(r) for r in g.get("ranks") or ())
            group["ranks"].add(rank)
            seq = lane.wait if lane.wait is not None else lane.last
            e = lane.entries.get(seq) or {}
            group["rows"].append(
                {
                    "rank": rank,
                    "node": nodes.get(rank),
                    "last_seq": lane.last,
                    "op": e.get("op"),
                    "in_sizes": e.get("in_sizes"),
                    "in_dtypes": e.get("in_dtypes"),
                    "state": e.get("state"),
                    "done": e.get("done"),
                    "since": lane.since,
                    "role": "culprit"
                    if rank in culprits
                    else "victim"
                    if rank in victims
                    else None,
                    "dumped_at": data.get("dumped_at"),
                    "note": f"left out: {unusable[str(rank)]}" if str(rank) in unusable else None,
                }
            )
    for rank in sorted(set((verdict or {}).get("no_ring") or ())):
        why = ((verdict or {}).get("no_ring_why") or {}).get(str(rank), "no ring")
        for group in out.values():
            if rank in group["ranks"] or group["pg"] == "0":
                group["rows"].append(
                    {
                        "rank": rank,
                        "node": nodes.get(rank),
                        "last_seq": None,
                        "op": None,
                        "in_sizes": None,
                        "in_dtypes": None,
                        "state": None,
                        "done": None,
                        "since": None,
                        "role": "culprit" if rank in culprits else None,
                        "dumped_at": None,
                        "note": f"no ring: {why}",
                    }
                )
    result = []
    for pg in sorted(out, key=lambda p: (len(p), p)):
        group = out[pg]
        group["ranks"] = sorted(group["ranks"])
        group["rows"].sort(key=lambda r: (r["role"] != "culprit", r["rank"]))
        result.append(group)
    return result


def with_crashes(
    verdict: dict[str, Any] | None,
    crashes: Mapping[int, Mapping[str, Any]],
    *,
    nodes: Mapping[int, str | None] | None = None,
) -> dict[str, Any] | None:
    """The verdict with what crashed ranks died of (``crashes``: rank -> its brief, from
    ``ingest/crashes.py``). With no verdict, or one that names no culprit, the crashes are
    the verdict (``kind: crashed``, the crashed ranks its culprits): a rank aborted by
    gloo or NCCL leaves its peers erroring out, not hung, so no ring may come at all."""
    if not crashes:
        return verdict
    nodes = nodes or {}
    said = {str(r): dict(c) for r, c in sorted(crashes.items())}
    culprits = set((verdict or {}).get("culprits") or ())
    order = sorted(crashes, key=lambda r: (r not in culprits, r))
    lines = [f"{_who([r], nodes)} {crashes[r]['summary']}" for r in order]
    if verdict is not None and verdict.get("kind") in ("culprit", "desync"):
        return {**verdict, "summary": f"{verdict['summary']}; " + "; ".join(lines), "crashes": said}
    first = crashes[order[0]]
    return {
        **(verdict or {}),
        **_empty("crashed", "; ".join(lines)),
        "culprits": sorted(crashes),
        "op": first.get("collective"),
        "crashes": said,
        "before": (verdict or {}).get("summary"),
    }
