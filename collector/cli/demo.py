"""``trainwarden demo``: the collector plus a live multi-rank CPU training run.

The collector runs in this process (uvicorn on a thread); each rank is its own
``python -m trainwarden.agent.demo_trainer`` process joined by a gloo process group,
exactly as a user's trainer would run under torchrun.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
from sqlalchemy import Engine

from trainwarden.collector.actions.policy import ActionPolicy, RollbackPolicy
from trainwarden.collector.actions.records import summary
from trainwarden.collector.settings import Settings

# What the demo injects unless told otherwise: visible, and nothing that ends the run.
# The loss spike is 1000x: the demo's steps take ~55 ms, so LossSpike's 20 steps are ~1 s
# and the doubled loss must outlast a few of the engine's 2 s passes to go pending, then
# firing; then its rollback runs (demo_policy) and every rank goes back to the checkpoint
# of step 1000. At 30x the demo's model shrugged it off: its loss rose 15 % and nothing
# fired.
DEFAULT_DRILL = (
    "thermal=90C@rank=0,step=300; slow=1.5x@rank=1,steps=600-900; "
    "loss_spike=1000x@step=1200; xid=63@rank=1,step=1500"
)
CHECKPOINT_EVERY = 250  # steps: markers on the overview, and a rollback has somewhere to go
# A demo step: ~45 ms of "device" work (a sleep inside the step, as a GPU would take) and
# a ~5 ms wait for its batch (making it, and the CLI's --data-delay sleep of 2 ms): a
# healthy input pipeline, a tenth of the step, under DataLoaderStall's fifth. (A 30 ms
# sleep against 20 ms of work kept that alert pending on every rank: a fault nobody had
# injected, at the top of the demo's page.)
WORK_MS = 45.0


def demo_policy() -> ActionPolicy:
    """The demo's actions: a rollback runs (LossSpike sends every rank back to the newest
    good checkpoint, and the run goes on from there); an eviction or a stop stays a dry
    run (there is no scheduler to drain a node through, and the run should go on)."""
    return ActionPolicy(rollback=RollbackPolicy(mode="auto"))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (``port`` 0: one the system picks), held from
    here on: the demo's URLs name the port it holds, not one found free and bound later."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def start_server(  # type: ignore[no-untyped-def]
    engine: Engine, settings: Settings, sock: socket.socket, actions: ActionPolicy | None = None
):
    """Start uvicorn on a thread, serving on ``sock``; returns the server once it accepts
    connections."""
    # deferred: see collector/cli/__init__.py
    import uvicorn

    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.app import create_app

    app = create_app(engine, settings, actions=actions, auth_settings=settings.auth_settings())
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning")
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="trainwarden-serve", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the collector did not start on {settings.host}:{settings.port}")
        time.sleep(0.05)
    return server


def launch_ranks(
    *,
    run: str,
    url: str,
    ranks: int,
    steps: int,
    data_delay: float,
    drill: str | None = None,
    work_ms: float = WORK_MS,
    log_path: str | None = None,
    token: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = CHECKPOINT_EVERY,
) -> list[subprocess.Popen]:
    master_port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port),
            OMP_NUM_THREADS="1",
        )
        env.pop("TRAINWARDEN_DRILL", None)
        env.pop("TRAINWARDEN_TOKEN", None)
        if token:
            env["TRAINWARDEN_TOKEN"] = token  # an ingest token: the ranks may only send
        if drill:
            env["TRAINWARDEN_DRILL"] = drill
        cmd = [
            sys.executable,
            "-m",
            "trainwarden.agent.demo_trainer",
            "--run-name",
            run,
            "--url",
            url,
            "--steps",
            str(steps),
            "--data-delay",
            str(data_delay),
            "--work-ms",
            str(work_ms),
        ]
        if checkpoint_dir:
            cmd += ["--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(checkpoint_every)]
        log = open(log_path, "a") if log_path else None  # noqa: SIM115 (closed with the process)
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None)
        )
    return procs


def demo_tokens(engine: Engine) -> tuple[str, str]:
    """(admin, ingest) tokens made fresh for this demo (the previous demo's are replaced)."""
    # deferred: see collector/cli/__init__.py
    from trainwarden.collector.store.db import write
    from trainwarden.collector.store.tokens import replace_token

    with write(engine) as conn:
        admin = replace_token(conn, name="demo-admin", scopes=["admin"], by="trainwarden demo")
        ingest = replace_token(
            conn, name="demo-ingest", scopes=["ingest"], runs="demo-*", by="trainwarden demo"
        )
    return admin, ingest


def _listed(base: str, what: str, run: str, token: str | None) -> list[dict[str, Any]] | None:
    """``GET /api/v1/{what}?run=...``, announced with its count; None if it cannot be read."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        found = httpx.get(
            f"{base}/api/v1/{what}", params={"run": run}, headers=headers, timeout=10
        ).json()
    except (httpx.HTTPError, ValueError):
        return None
    print(f"trainwarden demo: {len(found)} {what} ({base}/api/v1/{what}?run={run})", flush=True)
    return list(found)


def print_alerts(base: str, run: str, token: str | None = None) -> None:
    """What the alert engine raised during the demo, with the runbook of each."""
    alerts = _listed(base, "alerts", run, token)
    if alerts is None:
        return
    for a in reversed(alerts):  # oldest first
        where = f" rank {a['rank']}" if a["rank"] is not None else ""
        print(
            f"  {a['state']:8} {a['severity']:8} {a['rule']}{where}: "
            f"{a['annotations'].get('description', '')}  runbook: {a['runbook_url']}",
            flush=True,
        )


def print_actions(base: str, run: str, token: str | None = None) -> None:
    """What the action engine did (or, in a dry run, would have done) during the demo."""
    actions = _listed(base, "actions", run, token)
    if actions is None:
        return
    for a in sorted(actions, key=lambda a: a["id"]):
        what = summary(a["kind"], a["state"], a.get("result"), a.get("reason"))
        print(f"  {a['kind']:8} {a['state']:8} {a['mode']:8} {a['trigger']}: {what}", flush=True)


def run_demo(
    engine: Engine,
    settings: Settings,
    *,
    ranks: int,
    steps: int,
    data_delay: float,
    keep_serving: bool,
    drill: str | None = None,
    actions: ActionPolicy | None = None,
) -> None:
    """``actions``: the action policy (default :func:`demo_policy`)."""
    actions = actions or demo_policy()
    try:
        sock = listen(settings.host, settings.port)
    except OSError:
        if not settings.port:
            raise
        sock = listen(settings.host, 0)
        taken = settings.port
        print(f"trainwarden demo: port {taken} is taken; using {sock.getsockname()[1]}", flush=True)
    settings = settings.model_copy(update={"port": sock.getsockname()[1]})
    base = f"http://{settings.host}:{settings.port}"
    if settings.external_url is None:  # runbook links in alerts: absolute, clickable
        settings = settings.model_copy(update={"external_url": base})
    admin = ingest = None
    if settings.auth != "off":
        admin, ingest = demo_tokens(engine)
    server = start_server(engine, settings, sock, actions)
    run = time.strftime("demo-%Y%m%d-%H%M%S")
    print(f"trainwarden demo: dashboard {base}/runs/{run}", flush=True)
    if admin:
        print(
            f"trainwarden demo: log in with one click: {base}/login?token={admin}&next=/runs/{run}",
            flush=True,
        )
        print(
            f"trainwarden demo: admin token (API: Authorization: Bearer ...): {admin}", flush=True
        )
    print(
        f"trainwarden demo: {ranks} ranks training for {steps} steps (Ctrl-C to stop)", flush=True
    )
    if drill:
        print(f"trainwarden demo: drill {drill}", flush=True)
    modes = ", ".join(f"{kind} {actions.of(kind).mode}" for kind in ("rollback", "evict", "stop"))
    print(f"trainwarden demo: actions: {modes} (--actions FILE for your own)", flush=True)
    log_path = os.path.join(tempfile.gettempdir(), f"trainwarden-{run}.log")
    print(f"trainwarden demo: training output in {log_path}", flush=True)
    checkpoints = os.path.join(tempfile.gettempdir(), f"trainwarden-{run}-checkpoints")
    print(
        f"trainwarden demo: a checkpoint every {CHECKPOINT_EVERY} steps in {checkpoints}",
        flush=True,
    )
    procs = launch_ranks(
        run=run,
        url=base,
        ranks=ranks,
        steps=steps,
        data_delay=data_delay,
        drill=drill,
        log_path=log_path,
        token=ingest,
        checkpoint_dir=checkpoints,
    )
    try:
        codes = [p.wait() for p in procs]
        if any(codes):
            print(
                f"trainwarden demo: training exited with {codes}; see {log_path}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print("trainwarden demo: training finished", flush=True)
        print_alerts(base, run, admin)
        print_actions(base, run, admin)
        if keep_serving:
            print(
                f"trainwarden demo: dashboard still at {base}/runs/{run} (Ctrl-C to stop)",
                flush=True,
            )
            while True:
                time.sleep(3600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        server.should_exit = True
        time.sleep(0.3)
