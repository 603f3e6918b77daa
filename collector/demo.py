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

import httpx
from sqlalchemy import Engine

from .settings import Settings

# What the demo injects unless told otherwise: visible, and nothing that ends the run.
# The loss spike is 1000x: the demo's steps take ~55 ms, so LossSpike's 20 steps are ~1 s
# and the doubled loss must outlast a few of the engine's 2 s passes to go pending, then
# firing (its rollback, dry-run by default, then names the checkpoint it would go back
# to). At 30x the demo's model shrugged it off: its loss rose 15 % and nothing fired.
DEFAULT_DRILL = (
    "thermal=90C@rank=0,step=300; slow=1.5x@rank=1,steps=600-900; "
    "loss_spike=1000x@step=1200; xid=63@rank=1,step=1500"
)
CHECKPOINT_EVERY = 250  # steps: markers on the overview, and a rollback has somewhere to go


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def start_server(engine: Engine, settings: Settings):  # type: ignore[no-untyped-def]
    """Start uvicorn on a thread; returns the server once it accepts connections."""
    import uvicorn

    from .app import create_app

    app = create_app(engine, settings, auth_settings=settings.auth_settings())
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="trainwarden-serve", daemon=True)
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
    work_ms: float = 20.0,
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
    from .db import write
    from .tokens import replace_token

    with write(engine) as conn:
        admin = replace_token(conn, name="demo-admin", scopes=["admin"], by="trainwarden demo")
        ingest = replace_token(conn, name="demo-ingest", scopes=["ingest"], runs="demo-*",
                               by="trainwarden demo")  # fmt: skip
    return admin, ingest


def print_alerts(base: str, run: str, token: str | None = None) -> None:
    """What the alert engine raised during the demo, with the runbook of each."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        alerts = httpx.get(
            f"{base}/api/v1/alerts", params={"run": run}, headers=headers, timeout=10
        ).json()
    except (httpx.HTTPError, ValueError):
        return
    print(f"trainwarden demo: {len(alerts)} alerts ({base}/api/v1/alerts?run={run})", flush=True)
    for a in reversed(alerts):  # oldest first
        where = f" rank {a['rank']}" if a["rank"] is not None else ""
        print(f"  {a['state']:8} {a['severity']:8} {a['rule']}{where}: "
              f"{a['annotations'].get('description', '')}  runbook: {a['runbook_url']}", flush=True)  # fmt: skip


def run_demo(
    engine: Engine,
    settings: Settings,
    *,
    ranks: int,
    steps: int,
    data_delay: float,
    keep_serving: bool,
    drill: str | None = None,
) -> None:
    if not _port_free(settings.host, settings.port):
        port = free_port(settings.host)
        print(f"trainwarden demo: port {settings.port} is taken; using {port}", flush=True)
        settings = settings.model_copy(update={"port": port})
    base = f"http://{settings.host}:{settings.port}"
    if settings.external_url is None:  # runbook links in alerts: absolute, clickable
        settings = settings.model_copy(update={"external_url": base})
    admin = ingest = None
    if settings.auth != "off":
        admin, ingest = demo_tokens(engine)
    server = start_server(engine, settings)
    run = time.strftime("demo-%Y%m%d-%H%M%S")
    print(f"trainwarden demo: dashboard {base}/runs/{run}", flush=True)
    if admin:
        print(f"trainwarden demo: log in with one click: {base}/login?token={admin}&next=/runs/{run}",
              flush=True)  # fmt: skip
        print(f"trainwarden demo: admin token (API: Authorization: Bearer ...): {admin}",
              flush=True)  # fmt: skip
    print(
        f"trainwarden demo: {ranks} ranks training for {steps} steps (Ctrl-C to stop)", flush=True
    )
    if drill:
        print(f"trainwarden demo: drill {drill}", flush=True)
    log_path = os.path.join(tempfile.gettempdir(), f"trainwarden-{run}.log")
    print(f"trainwarden demo: training output in {log_path}", flush=True)
    checkpoints = os.path.join(tempfile.gettempdir(), f"trainwarden-{run}-checkpoints")
    print(f"trainwarden demo: a checkpoint every {CHECKPOINT_EVERY} steps in {checkpoints}",
          flush=True)  # fmt: skip
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
