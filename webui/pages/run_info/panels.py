"""What the run page (``/runs/<name>/info``) shows, as pure functions of the API's
answers (tests call them directly): the run's identity (config, tags, data snapshot,
code, environment), its attempts, its goodput, its
checkpoints and the cadence advisor's verdict, and the diff against another run."""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Sequence
from typing import Any

from dash import html

from ...components import notice

MISSING = "—"
RUNBOOK = "/runbooks/CheckpointCadence"
ENV = (
    ("python", "Python"),
    ("torch", "torch"),
    ("cuda", "CUDA"),
    ("nccl", "NCCL"),
    ("gpu", "GPU"),
    ("driver", "Driver"),
    ("platform", "Platform"),
)
END_CLASS = {
    "exception": "status-failed",
    "lost": "status-dead",
    "evicted": "status-evicted",
    "sigterm": "status-slow",
    "stopped": "status-finished",
    "completed": "status-finished",
}
NO_IDENTITY = (
    "This run has no identity yet: its agents sent no attempt_start (trainwarden older "
    "than 0.11). Upgrade the agent and pass tw.init(config=..., tags=[...], "
    "data_snapshot=...) to see the config, code version, environment and attempts here; "
    "goodput and checkpoints below work without it."
)


# -- formatting ------------------------------------------------------------------------


def span(seconds: float | None) -> str:
    """A duration as people say it: ``42 s``, ``17 min``, ``2.3 h``, ``3.1 days``."""
    if seconds is None or not math.isfinite(seconds):
        return MISSING
    s = abs(seconds)
    if s < 90:
        text = f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
    elif s < 90 * 60:
        text = f"{s / 60:.0f} min"
    elif s < 48 * 3600:
        text = f"{s / 3600:.1f} h"
    else:
        text = f"{s / 86400:.1f} days"
    return ("-" if seconds < 0 else "") + text


def size(n: float | None) -> str:
    if n is None:
        return MISSING
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return MISSING  # not reached


def when(ts: float | None) -> str:
    if ts is None:
        return MISSING
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def value_text(value: Any) -> str:
    if value is None:
        return MISSING
    if isinstance(value, str):
        return value
    return json.dumps(value)


def flat(config: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """A nested config as (dotted key, value) rows, in the order it was given."""
    if not isinstance(config, dict):
        return [(prefix, config)] if prefix else []
    rows: list[tuple[str, Any]] = []
    for key, inner in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        rows += flat(inner, name) if isinstance(inner, dict) and inner else [(name, inner)]
    return rows


def _kv(rows: Sequence[tuple[str, Any]], *, id_: str | None = None, cls: str = "") -> html.Table:
    body = html.Tbody([html.Tr([html.Th(k), html.Td(v)]) for k, v in rows])
    extra: dict[str, Any] = {"id": id_} if id_ else {}
    return html.Table(body, className=f"ri-kv {cls}".strip(), **extra)


def _card(title: str, *children: Any, cls: str = "") -> html.Div:
    return html.Div([html.H4(title), *children], className=f"ri-card {cls}".strip())


# -- identity -------------------------------------------------------------------------------


def code_text(code: dict[str, Any] | None) -> str:
    """``abc1234 (dirty) on main``; what the agent could not tell, it says so."""
    if not code or not code.get("commit"):
        return "not a git checkout (or git not found)"
    text = str(code["commit"])[:7]
    if code.get("dirty"):
        text += " (dirty)"
    if code.get("branch"):
        text += f" on {code['branch']}"
    return text


def identity_section(ident: dict[str, Any] | None) -> Any:
    """Config as a flat table; tags, data snapshot and code; the environment."""
    if ident is None:
        return notice(NO_IDENTITY)
    rows = flat(ident.get("config") or {})
    config = (
        _kv([(k, value_text(v)) for k, v in rows], id_="ri-config", cls="ri-config")
        if rows
        else html.P(
            "No config given: pass tw.init(config=...) (a dict; nested keys show dotted).",
            className="hint",
        )
    )
    tags = ident.get("tags") or []
    code = ident.get("code") or {}
    what = _kv(
        [
            (
                "Tags",
                html.Span([html.Span(t, className="mark") for t in tags]) if tags else MISSING,
            ),
            ("Data snapshot", ident.get("data_snapshot") or MISSING),
            ("Code", html.Span(code_text(code), title=str(code.get("commit") or ""), id="ri-code")),
            ("Repository", code.get("root") or MISSING),
        ],
        id_="ri-what",
    )
    env = ident.get("env") or {}
    gpu = env.get("gpu")
    if gpu and env.get("gpu_count"):
        gpu = f"{gpu} × {env['gpu_count']}"
    nodes = ident.get("nodes") or []
    envrows: list[tuple[str, Any]] = [
        (label, value_text(gpu if key == "gpu" else env.get(key))) for key, label in ENV
    ]
    packages = ident.get("packages_hash") or env.get("packages_hash")
    envrows += [
        ("World size", value_text(ident.get("world_size") or env.get("world_size"))),
        ("Nodes", f"{len(nodes)}: {', '.join(nodes)}" if nodes else MISSING),
        (
            "Packages hash",
            html.Span(str(packages)[:12], title=str(packages)) if packages else MISSING,
        ),
    ]
    return html.Div(
        [
            _card(f"Config ({len(rows)} keys)", config, cls="ri-card-wide"),
            html.Div(
                [_card("Run", what), _card("Environment", _kv(envrows, id_="ri-env"))],
                className="ri-stack",
            ),
        ],
        className="ri-grid",
    )


# -- attempts ------------------------------------------------------------------------------


def attempts_table(tries: Sequence[dict[str, Any]], *, now: float) -> Any:
    if not tries:
        return notice(
            "No attempts recorded: attempts come from the agents' attempt_start "
            "events (trainwarden 0.11 or later)."
        )
    header = ("#", "Started", "Ended", "Duration", "World size", "Nodes", "Steps", "Exit")
    rows = []
    for t in tries:
        end = t.get("ended_at")
        running = t.get("state") == "running"
        first, last = t.get("first_step"), t.get("last_step")
        steps = MISSING if first is None else f"{first} → {MISSING if last is None else last}"
        reason = t.get("exit_reason")
        exit_ = (
            html.Span("running", className="status status-running")
            if running
            else [
                html.Span(
                    reason or "?", className=f"status {END_CLASS.get(reason or '', 'status-dead')}"
                ),
                html.Div(t.get("exit_detail") or "", className="detail"),
            ]
        )
        nodes = t.get("nodes") or []
        rows.append(
            html.Tr(
                [
                    html.Td(t["number"]),
                    html.Td(when(t["started_at"])),
                    html.Td("running" if running else when(end)),
                    html.Td(span((now if running else (end or t["started_at"])) - t["started_at"])),
                    html.Td(value_text(t.get("world_size"))),
                    html.Td(", ".join(nodes) or MISSING, className="detail"),
                    html.Td(steps),
                    html.Td(exit_, className="ri-exit"),
                ],
                id=f"ri-attempt-{t['number']}",
                className="ri-attempt",
            )
        )
    return html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in header])), html.Tbody(rows)],
        className="runs-table ri-attempts",
    )


# -- goodput --------------------------------------------------------------------------------


def _money(good: dict[str, Any]) -> str:
    cost, price = good.get("cost"), good.get("price_per_gpu_hour")
    if cost is None or price is None:
        return "no price set (serve --price-per-gpu-hour)"
    return f"{cost['used']:.2f} used, {cost['lost']:.2f} lost at {price:g} per GPU-hour"


def goodput_section(good: dict[str, Any]) -> Any:
    """ETTR as a big number, and the figures around it."""
    ettr = good.get("ettr")
    hours = good.get("gpu_hours") or {}
    big = html.Div(
        [
            html.Div(MISSING if ettr is None else f"{ettr:.1%}", id="ri-ettr", className="ri-big"),
            html.Div("ETTR: step time kept ÷ allocation", className="hint"),
        ],
        className="ri-big-box",
    )
    state = "so far (running)" if good.get("running") else "in all"
    facts = _kv(
        [
            ("Wall clock", f"{span(good.get('wall_s'))} {state}"),
            (
                "GPU-hours",
                f"{hours.get('used', 0.0):.3f} used · {hours.get('kept', 0.0):.3f} kept · "
                f"{hours.get('lost', 0.0):.3f} lost",
            ),
            ("Cost", _money(good)),
            (
                "Attempts",
                f"{good.get('attempts', 0)} ({good.get('interruptions', 0)} interruptions, "
                f"{good.get('rollbacks', 0)} rollbacks)",
            ),
            (
                "Steps",
                f"{good.get('kept_steps', 0)} kept · {good.get('replayed_steps', 0)} replayed",
            ),
        ],
        id_="ri-goodput-facts",
    )
    return html.Div([big, facts], className="ri-goodput")


# -- checkpoints and the advisor --------------------------------------------------------------


def verdict_text(adv: dict[str, Any]) -> str:
    """The advisor's verdict in words."""
    verdict, now_, best = adv.get("verdict"), adv.get("interval_s"), adv.get("optimal_interval_s")
    if verdict == "unknown" or best is None or now_ is None:
        return f"No verdict yet: {adv.get('why') or 'not enough checkpoints'}."
    head = f"Checkpointing every {span(now_)}; T* is {span(best)}"
    if verdict == "too_rare":
        return f"{head}: save more often (a failure loses half an interval on average)."
    if verdict == "too_often":
        return f"{head}: save less often (every save blocks training for C)."
    return f"{head}: within 2× of T*, nothing to change."


def checkpoints_section(ckpt: dict[str, Any], adv: dict[str, Any]) -> Any:
    """Count, last, interval, blocking cost C, bytes; T* = sqrt(2 C tau), the expected
    waste now and at T*, and the verdict with the runbook."""
    if not ckpt.get("count"):
        return notice(
            "No checkpoints reported yet. Call tw.checkpoint_saved(step, path, "
            "seconds=..., bytes=...) after a save, or wrap it in "
            "`with tw.checkpointing(step):` to time it."
        )
    last = ckpt.get("last") or {}
    steps = ckpt.get("interval_steps")
    drain = ckpt.get("drain_s")
    stats = _kv(
        [
            ("Saved", f"{ckpt['count']} checkpoints"),
            (
                "Last",
                f"step {last.get('step', MISSING)} at {when(last.get('ts'))}"
                + (f" · {last['path']}" if last.get("path") else ""),
            ),
            (
                "Interval",
                MISSING if steps is None else f"{steps:g} steps · {span(ckpt.get('interval_s'))}",
            ),
            (
                "Blocking cost C",
                f"{span(ckpt.get('blocking_s'))} (median) · "
                f"{span(ckpt.get('blocking_total_s'))} in all"
                + (f" · async drain {span(drain)}" if drain is not None else ""),
            ),
            ("Size", size(ckpt.get("bytes"))),
        ],
        id_="ri-ckpt",
    )
    best, tau, cost = adv.get("optimal_interval_s"), adv.get("mtbf_s"), adv.get("cost_s")
    waste_now, waste_best = adv.get("waste_now"), adv.get("waste_optimal")
    advice = _kv(
        [
            (
                "T* = √(2·C·τ)",
                html.Span(
                    MISSING
                    if best is None
                    else f"{span(best)} (√(2 × {span(cost)} × {span(tau)}))",
                    id="ri-tstar",
                ),
            ),
            ("τ (time between interruptions)", f"{span(tau)} — {adv.get('mtbf_source', '')}"),
            ("Expected waste", f"{_pct(waste_now)} now · {_pct(waste_best)} at T*"),
        ],
        id_="ri-advisor",
    )
    verdict = adv.get("verdict") or "unknown"
    return html.Div(
        [
            _card("Checkpoints", stats),
            _card(
                "Cadence advisor",
                advice,
                html.P(
                    [
                        html.Span(
                            verdict_text(adv),
                            id="ri-verdict",
                            className=f"ri-verdict ri-verdict-{verdict}",
                        ),
                        " ",
                        html.A(
                            "Runbook: checkpoint cadence",
                            href=RUNBOOK,
                            className="runbook-link",
                            target="_blank",
                        ),
                    ]
                ),
            ),
        ],
        className="ri-grid",
    )


def _pct(x: float | None) -> str:
    return MISSING if x is None else f"{x:.2%}"


# -- the diff ---------------------------------------------------------------------------------


def _changes(title: str, rows: Sequence[dict[str, Any]], a: str, b: str) -> Any:
    if not rows:
        return None
    body = [
        html.Tr([html.Td(r["key"]), html.Td(value_text(r["a"])), html.Td(value_text(r["b"]))])
        for r in rows
    ]
    return _card(
        title,
        html.Table(
            [html.Thead(html.Tr([html.Th("Key"), html.Th(a), html.Th(b)])), html.Tbody(body)],
            className="ri-kv ri-diff-table",
        ),
    )


def diff_view(d: dict[str, Any]) -> Any:
    """What differs between this run (``a``) and the other (``b``)."""
    a, b = d["a"], d["b"]
    if d.get("identical"):
        return notice(f"{a} and {b} have the same config, code, environment and packages.")
    parts = [
        _changes("Config", d.get("config") or [], a, b),
        _changes("Code", d.get("code") or [], a, b),
        _changes("Environment", d.get("env") or [], a, b),
    ]
    other = []
    tags = d.get("tags") or {}
    if tags.get("only_a") or tags.get("only_b"):
        other.append({"key": "tags", "a": tags.get("only_a"), "b": tags.get("only_b")})
    for key in ("data_snapshot", "world_size"):
        if d.get(key):
            other.append({"key": key.replace("_", " "), "a": d[key]["a"], "b": d[key]["b"]})
    parts.append(_changes("Run", other, a, b))
    pkg = d.get("packages")
    if pkg and "hash_a" in pkg:
        parts.append(
            _changes("Packages", [{"key": "hash", "a": pkg["hash_a"], "b": pkg["hash_b"]}], a, b)
        )
    elif pkg and any(pkg.values()):
        rows = [{"key": n, "a": None, "b": n} for n in pkg.get("added") or []]
        rows += [{"key": n, "a": n, "b": None} for n in pkg.get("removed") or []]
        rows += [{"key": c["name"], "a": c["a"], "b": c["b"]} for c in pkg.get("changed") or []]
        parts.append(_changes("Packages", rows, a, b))
    return html.Div([p for p in parts if p is not None], id="ri-diff-result", className="ri-grid")
