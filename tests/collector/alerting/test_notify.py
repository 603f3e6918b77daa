"""Notifiers against real receivers: Alertmanager itself, and local HTTP endpoints that
stand in for PagerDuty, Slack and webhooks, record what they get and answer as told."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainwarden.alerts import Notification, fingerprint
from trainwarden.collector.alerting.notify import (
    Attempt,
    Dispatcher,
    NotifyConfig,
    NotifyConfigError,
    load_notify_config,
)

from ...helpers import ROOT
from ...net import free_port
from ...receivers import Receiver, running_alertmanager

RUNBOOK = "http://127.0.0.1:8000/runbooks/Straggler"
RUN_URL = "http://127.0.0.1:8000/runs/r1"


def note(status: str = "firing", *, alert_id: int = 1, **labels: str) -> Notification:
    """A Straggler alert on rank 3 (``labels`` added or replaced)."""
    labels = {
        "alertname": "Straggler",
        "severity": "warning",
        "run": "r1",
        "rank": "3",
        "node": "n1",
    } | labels
    now = time.time()
    return Notification(
        alert_id=alert_id,
        fingerprint=fingerprint("Straggler", labels),
        status=status,  # type: ignore[arg-type]
        labels=labels,
        annotations={
            "summary": f"Rank {labels['rank']} is 40% slower than the median",
            "description": "Step time above 1.4 x the run's median.",
            "runbook_url": RUNBOOK,
        },
        starts_at=now - 60,
        ends_at=None if status == "firing" else now,
        generator_url=RUN_URL,
    )


def episode(**labels: str) -> tuple[Notification, Notification]:
    """One alert firing and then resolved: the same start, to the millisecond."""
    firing = note("firing", **labels)
    return firing, dataclasses.replace(firing, status="resolved", ends_at=firing.starts_at + 60)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def config(tmp_path: Path, text: str) -> NotifyConfig:
    path = tmp_path / "notify.yaml"
    path.write_text(textwrap.dedent(text))
    return load_notify_config(path)


async def until(cond: Callable[[], object], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g}s for {what}")
        await asyncio.sleep(0.02)


def deliver(
    cfg: NotifyConfig, *notes: Notification, **options: Any
) -> tuple[list[Attempt], Dispatcher]:
    """Submit ``notes`` in order and wait for every delivery to end."""
    attempts: list[Attempt] = []

    async def main() -> Dispatcher:
        d = Dispatcher(cfg, on_attempt=attempts.append, **({"backoff_s": 0.01} | options))
        await d.start()
        for n in notes:
            assert d.submit(n)
        await d.drain(30)
        await d.stop()
        return d

    return attempts, asyncio.run(main())


# -- Alertmanager, the real one ---------------------------------------------------------


@pytest.fixture
def alertmanager(tmp_path: Path, receiver: Receiver) -> Iterator[str]:
    """Alertmanager on loopback, routing everything to ``receiver`` at /am within ~1 s."""
    with running_alertmanager(tmp_path, receiver.url("/am")) as url:
        yield url


def to_alertmanager(tmp_path: Path, url: str) -> NotifyConfig:
    """A notifier config that sends every alert to the Alertmanager at ``url``."""
    return config(
        tmp_path,
        f"""\
        receivers:
          - {{name: am, kind: alertmanager, url: "{url}"}}
        routes:
          - receivers: [am]
        """,
    )


def test_alertmanager_shows_the_alert_with_its_runbook_and_resolves_it(
    tmp_path: Path, alertmanager: str, receiver: Receiver
) -> None:
    cfg = to_alertmanager(tmp_path, alertmanager)
    firing, resolved = episode()
    attempts: list[Attempt] = []

    def hooked(status: str) -> list[Any]:
        return [a for r in receiver.got("/am") for a in r.body["alerts"] if a["status"] == status]

    async def main() -> None:
        d = Dispatcher(cfg, on_attempt=attempts.append)
        await d.start()
        async with httpx.AsyncClient(base_url=alertmanager) as am:
            assert d.submit(firing)
            await d.drain(10)
            (alert,) = (await am.get("/api/v2/alerts")).json()
            assert alert["labels"] == firing.labels
            assert alert["annotations"]["runbook_url"] == RUNBOOK
            assert alert["status"]["state"] == "active"
            assert alert["generatorURL"] == RUN_URL
            # Alertmanager itself sends it on, runbook and all
            await until(lambda: hooked("firing"), "Alertmanager's webhook (firing)")
            assert hooked("firing")[0]["annotations"]["runbook_url"] == RUNBOOK

            assert d.submit(resolved)
            await d.drain(10)
            assert (await am.get("/api/v2/alerts", params={"active": "true"})).json() == []
            await until(lambda: hooked("resolved"), "Alertmanager's webhook (resolved)")
            assert hooked("resolved")[0]["labels"] == firing.labels
        await d.stop()

    asyncio.run(main())
    assert [(a.receiver, a.kind, a.status, a.ok, a.http_status, a.final) for a in attempts] == [
        ("am", "alertmanager", "firing", True, 200, True),
        ("am", "alertmanager", "resolved", True, 200, True),
    ]


def test_alertmanager_resolves_the_one_page_a_storm_became(
    tmp_path: Path, alertmanager: str, receiver: Receiver
) -> None:
    from trainwarden.alerts.grouping import grouped

    cfg = to_alertmanager(tmp_path, alertmanager)
    ranks = [episode(rank=str(r), node=f"n{r // 8}") for r in range(8, 16)]  # a node's ranks
    (first,) = grouped([f for f, _ in ranks[:5]], over=3)  # five in one pass
    (firing,) = grouped([f for f, _ in ranks], over=3)  # the other three join in the next
    (resolved,) = grouped([r for _, r in ranks], over=3)

    async def main() -> None:
        d = Dispatcher(cfg)
        await d.start()
        async with httpx.AsyncClient(base_url=alertmanager) as am:
            assert d.submit(first)
            await d.drain(10)
            (alert,) = (await am.get("/api/v2/alerts")).json()
            assert alert["annotations"]["summary"] == "Straggler on 5 ranks (8-12) of run r1"
            assert d.submit(firing)
            await d.drain(10)
            (alert,) = (await am.get("/api/v2/alerts")).json()  # one page for eight ranks
            assert alert["labels"]["grouped"] == "true" and "rank" not in alert["labels"]
            assert alert["annotations"]["summary"] == "Straggler on 8 ranks (8-15) of run r1"
            assert d.submit(resolved)
            await d.drain(10)
            assert (await am.get("/api/v2/alerts", params={"active": "true"})).json() == []
        await d.stop()

    asyncio.run(main())


# -- PagerDuty, Slack and webhook payloads -------------------------------------------------


def test_pagerduty_slack_and_webhook_get_their_own_shapes(
    tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TW_TEST_PD_KEY", "R0UT1NGKEY")
    cfg = config(
        tmp_path,
        f"""\
        receivers:
          - name: pd
            kind: pagerduty
            routing_key: ${{TW_TEST_PD_KEY}}
            url: {receiver.url("/pd")}
          - {{name: chat, kind: slack, url: "{receiver.url("/slack")}"}}
          - name: hook
            kind: webhook
            url: {receiver.url("/hook")}
            headers: {{Authorization: "Bearer s3cret"}}
            external_url: http://trainwarden.example
        routes:
          - receivers: [pd, chat, hook]
        """,
    )
    firing, resolved = episode()
    attempts, d = deliver(cfg, firing, resolved)
    assert (d.sent, d.failed, d.dropped) == (6, 0, 0)
    assert all(a.ok and a.final and a.attempt == 1 for a in attempts)

    trigger, resolve = (r.body for r in receiver.got("/pd"))
    assert trigger["routing_key"] == resolve["routing_key"] == "R0UT1NGKEY"
    assert (trigger["event_action"], resolve["event_action"]) == ("trigger", "resolve")
    assert trigger["dedup_key"] == resolve["dedup_key"] == firing.fingerprint
    payload = trigger["payload"]
    assert payload["severity"] == "warning"
    assert payload["summary"] == "[warning] Straggler: Rank 3 is 40% slower than the median"
    assert (payload["source"], payload["group"], payload["component"]) == ("n1", "r1", "rank 3")
    assert payload["custom_details"]["runbook_url"] == RUNBOOK
    assert payload["custom_details"]["rank"] == "3"
    assert trigger["links"] == [{"href": RUNBOOK, "text": "Runbook"}]

    fired, cleared = (r.body for r in receiver.got("/slack"))
    assert fired["text"].startswith(":rotating_light: *[FIRING] Straggler (warning)*")
    assert f"<{RUNBOOK}|Runbook>" in fired["text"]
    assert cleared["text"].startswith(":white_check_mark: *[RESOLVED] Straggler (warning)*")
    shown = json.dumps(fired["blocks"])
    for part in (
        "Rank 3 is 40% slower",
        "run `r1`",
        "rank `3`",
        "node `n1`",
        f"<{RUNBOOK}|Runbook>",
        f"<{RUN_URL}|Open in trainwarden>",
    ):
        assert part in shown, part

    hooks = receiver.got("/hook")
    assert [h.headers["Authorization"] for h in hooks] == ["Bearer s3cret"] * 2
    body = hooks[0].body
    assert {
        k: body[k]
        for k in ("version", "groupKey", "truncatedAlerts", "status", "receiver", "externalURL")
    } == {
        "version": "4",
        "groupKey": firing.fingerprint,
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "hook",
        "externalURL": "http://trainwarden.example",
    }
    assert body["commonLabels"] == firing.labels
    assert body["commonAnnotations"]["runbook_url"] == RUNBOOK
    (alert,) = body["alerts"]
    assert alert["fingerprint"] == firing.fingerprint
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"  # Alertmanager's "not ended"
    assert alert["generatorURL"] == RUN_URL
    (ended,) = hooks[1].body["alerts"]
    assert ended["status"] == "resolved" and ended["endsAt"].endswith("Z")
    assert ended["startsAt"] == alert["startsAt"]


# -- retries, give-ups, and what a bad receiver cannot do -----------------------------------


def hook_config(tmp_path: Path, receiver: Receiver, *paths: str) -> NotifyConfig:
    """A webhook receiver per path, named after it, every alert routed to all."""
    names = ", ".join(p.strip("/") for p in paths)
    receivers = "".join(
        f"  - {{name: {p.strip('/')}, kind: webhook, url: '{receiver.url(p)}'}}\n" for p in paths
    )
    return config(tmp_path, f"receivers:\n{receivers}routes:\n  - receivers: [{names}]\n")


def test_a_failing_receiver_is_retried_until_it_takes_it(
    tmp_path: Path, receiver: Receiver
) -> None:
    receiver.answer("/flaky", 500, 429, 200)
    attempts, d = deliver(hook_config(tmp_path, receiver, "/flaky"), note())
    assert [(a.attempt, a.ok, a.http_status, a.final) for a in attempts] == [
        (1, False, 500, False),
        (2, False, 429, False),
        (3, True, 200, True),
    ]
    assert attempts[0].error == "HTTP 500: bad day at the receiver"
    assert len(receiver.got("/flaky")) == 3
    assert (d.sent, d.failed) == (1, 0)


def test_a_refused_notification_is_not_retried(tmp_path: Path, receiver: Receiver) -> None:
    receiver.answer("/strict", 400)
    attempts, d = deliver(hook_config(tmp_path, receiver, "/strict"), note())
    assert [(a.attempt, a.ok, a.http_status, a.final) for a in attempts] == [(1, False, 400, True)]
    assert len(receiver.got("/strict")) == 1
    assert (d.sent, d.failed) == (0, 1)


def test_a_receiver_that_is_down_is_given_up_after_max_attempts(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}/"  # nothing listens there
    cfg = config(
        tmp_path,
        f"receivers:\n  - {{name: down, kind: slack, url: '{down}'}}\n"
        "routes:\n  - receivers: [down]\n",
    )
    attempts, d = deliver(cfg, note(), max_attempts=3)
    assert [(a.attempt, a.ok, a.http_status, a.error, a.final) for a in attempts] == [
        (1, False, None, "connect refused", False),
        (2, False, None, "connect refused", False),
        (3, False, None, "connect refused", True),
    ]
    assert (d.sent, d.failed) == (0, 1)


def test_a_hung_receiver_delays_neither_other_receivers_nor_other_alerts(
    tmp_path: Path, receiver: Receiver
) -> None:
    receiver.answer("/hung", "hang", 200)  # the first request never gets an answer
    cfg = hook_config(tmp_path, receiver, "/hung", "/fine")
    first, second = note(rank="3"), note(rank="5", alert_id=2)
    attempts: list[Attempt] = []

    def seen(receiver_name: str, n: Notification) -> list[Attempt]:
        return [a for a in attempts if a.receiver == receiver_name and a.alert_id == n.alert_id]

    async def main() -> None:
        d = Dispatcher(cfg, on_attempt=attempts.append, timeout_s=3, max_attempts=1)
        await d.start()
        d.submit(first)
        await until(lambda: receiver.got("/hung"), "the hung request")
        d.submit(second)
        await until(
            lambda: seen("fine", first) and seen("fine", second) and seen("hung", second),
            "the other deliveries",
        )
        assert seen("hung", first) == []  # ... while the first one still hangs
        await d.drain(20)
        await d.stop()

    asyncio.run(main())
    (timed_out,) = seen("hung", first)
    assert (timed_out.ok, timed_out.final, timed_out.error) == (False, True, "timed out after 3s")
    assert attempts[-1] is timed_out
    assert all(a.ok for a in attempts[:-1]) and len(attempts) == 4


def test_a_resolve_never_overtakes_its_firing(tmp_path: Path, receiver: Receiver) -> None:
    receiver.answer("/slow", "slow")
    firing, resolved = episode()
    deliver(hook_config(tmp_path, receiver, "/slow"), firing, resolved)
    assert receiver.log == ["got firing", "answered firing", "got resolved", "answered resolved"]


def test_a_failed_firing_is_not_retried_once_its_resolve_waits(
    tmp_path: Path, receiver: Receiver
) -> None:
    receiver.answer("/flaky", 503, 200)
    firing, resolved = episode()
    attempts, d = deliver(hook_config(tmp_path, receiver, "/flaky"), firing, resolved)
    assert [r.body["status"] for r in receiver.got("/flaky")] == ["firing", "resolved"]
    assert [(a.status, a.ok, a.final) for a in attempts] == [
        ("firing", False, True),
        ("resolved", True, True),
    ]
    expected = (
        "HTTP 503: bad day at the receiver; not retried: a newer notification of this alert follows"
    )
    assert attempts[0].error == expected
    assert (d.sent, d.failed) == (1, 1)


def test_submit_never_blocks_a_full_queue_drops_and_counts(
    tmp_path: Path, receiver: Receiver
) -> None:
    d = Dispatcher(hook_config(tmp_path, receiver, "/a", "/b"), queue_size=2)
    # not started: nothing is delivered, so the queues fill up
    assert d.submit(note(rank="1")) and d.submit(note(rank="2"))
    assert d.submit(note(rank="3")) is False
    assert (d.dropped, d.stats["pending"]) == (2, {"a": 2, "b": 2})  # one per receiver


def test_submit_from_the_engines_thread(tmp_path: Path, receiver: Receiver) -> None:
    cfg = hook_config(tmp_path, receiver, "/hook")
    accepted: list[bool] = []

    async def main() -> Dispatcher:
        d = Dispatcher(cfg)
        await d.start()
        engine = threading.Thread(
            target=lambda: accepted.extend(
                d.submit(note(rank=str(r), alert_id=r)) for r in range(20)
            )
        )
        engine.start()
        await asyncio.to_thread(engine.join)
        await d.drain(20)
        await d.stop()
        assert d.submit(note()) is False  # stopped: refused, counted
        return d

    d = asyncio.run(main())
    assert accepted == [True] * 20
    assert sorted(
        int(r.body["alerts"][0]["labels"]["rank"]) for r in receiver.got("/hook")
    ) == list(range(20))
    assert (d.sent, d.failed, d.dropped) == (20, 0, 1)


def test_an_on_attempt_that_raises_breaks_no_delivery(tmp_path: Path, receiver: Receiver) -> None:
    calls: list[Attempt] = []

    def broken(attempt: Attempt) -> None:
        calls.append(attempt)
        raise RuntimeError("database is down")

    async def main() -> Dispatcher:
        d = Dispatcher(hook_config(tmp_path, receiver, "/hook"), on_attempt=broken)
        await d.start()
        d.submit(note(rank="1"))
        d.submit(note(rank="2", alert_id=2))
        await d.drain(20)
        await d.stop()
        return d

    assert asyncio.run(main()).sent == 2
    assert len(calls) == 2 and len(receiver.got("/hook")) == 2


# -- routing ----------------------------------------------------------------------------------


def test_routes_match_labels_exactly_or_by_regex_and_can_stop(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        """\
        receivers:
          - {name: pd, kind: pagerduty, routing_key: k}
          - {name: chat, kind: slack, url: "http://127.0.0.1:1/chat", send_resolved: false}
          - {name: am, kind: alertmanager, url: "http://127.0.0.1:1"}
          - {name: test-hook, kind: webhook, url: "http://127.0.0.1:1/hook"}
        routes:
          - match: {severity: critical}
            match_re: {run: "prod-.*"}
            receivers: [pd, chat]
          - match_re: {run: "test-.*"}
            receivers: [test-hook]
            continue: false
          - receivers: [am, chat]
        """,
    )

    def names(n: Notification) -> list[str]:
        return [r.name for r in cfg.receivers_for(n)]

    assert names(note(severity="critical", run="prod-7")) == ["pd", "chat", "am"]
    assert names(note(severity="critical", run="preprod-7")) == ["am", "chat"]  # a full match
    assert names(note(severity="warning", run="prod-7")) == ["am", "chat"]
    assert names(note(severity="critical", run="test-1")) == ["test-hook"]  # continue: false
    assert names(note("resolved", severity="critical", run="prod-7")) == ["pd", "am"]


# -- configuration errors ----------------------------------------------------------------------

GOOD_RECEIVERS = """\
receivers:
  - {name: am, kind: alertmanager, url: "http://127.0.0.1:9093"}
  - name: pd
    kind: pagerduty
    routing_key: abc
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            GOOD_RECEIVERS
            + "  - {name: am, kind: slack, url: 'http://x'}\nroutes: [{receivers: [am]}]\n",
            "notify.yaml:6: receiver 'am': name: already used by receiver #1",
        ),
        (
            GOOD_RECEIVERS + "routes:\n  - receivers: [am]\n  - receivers: [pd, pagerduty]\n",
            "notify.yaml:8: route #2: receivers[1]: 'pagerduty' is not a receiver; known: am, pd",
        ),
        (
            GOOD_RECEIVERS.replace("routing_key: abc", "routing_key: ${TW_TEST_UNSET}")
            + "routes: [{receivers: [pd]}]\n",
            "notify.yaml:3: receiver 'pd': routing_key: ${TW_TEST_UNSET}: "
            "the environment variable TW_TEST_UNSET is not set",
        ),
        (
            GOOD_RECEIVERS.replace("routing_key: abc", "routing_kye: abc")
            + "routes: [{receivers: [pd]}]\n",
            "notify.yaml:3: receiver 'pd': routing_kye: is not a field here (a typo?)",
        ),
        (
            GOOD_RECEIVERS.replace("http://127.0.0.1:9093", "127.0.0.1:9093")
            + "routes: [{receivers: [am]}]\n",
            "notify.yaml:2: receiver 'am': url: '127.0.0.1:9093' "
            "is not an http:// or https:// URL with a host",
        ),
        (
            GOOD_RECEIVERS.replace("kind: pagerduty", "kind: opsgenie")
            + "routes: [{receivers: [am]}]\n",
            "notify.yaml:3: receiver 'pd': kind: 'opsgenie' is not a kind; "
            "known: alertmanager, pagerduty, slack, webhook",
        ),
        (
            GOOD_RECEIVERS + "routes:\n  - match_re: {run: 'prod-('}\n    receivers: [am]\n",
            "notify.yaml:7: route #1: match_re: run: 'prod-(' is not a regular expression",
        ),
        (
            GOOD_RECEIVERS
            + "routes:\n  - match: {severity: critical, severity: warning}\n    receivers: [am]\n",
            "notify.yaml:7:33: YAML syntax error: key 'severity' repeats line 7",
        ),
        (
            GOOD_RECEIVERS + "routes:\n  - receivers: [am]\n    contiune: false\n",
            "notify.yaml:7: route #1: contiune: is not a field here (a typo?)",
        ),
        (GOOD_RECEIVERS, "notify.yaml: routes: is required"),
    ],
)
def test_config_errors_name_the_file_the_receiver_or_route_and_the_field(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "notify.yaml"
    path.write_text(text)
    with pytest.raises(NotifyConfigError) as caught:
        load_notify_config(path)
    assert f"{tmp_path}/{expected}" in str(caught.value), str(caught.value)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(NotifyConfigError) as caught:
        load_notify_config(
            tmp_path / "n.yaml",
            text="receivers:\n  - {kind: slack, url: ftp://x}\nroutes: []\nsend_resolved: maybe\n",
        )
    lines = str(caught.value).splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == [
        "receiver #1: name: is required",
        "receiver #1: url: 'ftp://x' is not an http:// or https:// URL with a host",
        "routes: List should have at least 1 item after validation, not 0 (got [])",
        "send_resolved: Input should be a valid boolean, unable to interpret input (got 'maybe')",
    ]


def test_the_documented_example_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (ROOT / "docs" / "notifiers.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", doc, re.S)
    assert example is not None
    monkeypatch.setenv("PAGERDUTY_ROUTING_KEY", "k")
    monkeypatch.setenv("WEBHOOK_TOKEN", "t")
    cfg = load_notify_config("docs/notifiers.md", text=example.group(1))
    assert sorted({r.kind for r in cfg.receivers.values()}) == [
        "alertmanager",
        "pagerduty",
        "slack",
        "webhook",
    ]
