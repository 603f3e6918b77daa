"""Real agents against a real ``trainwarden serve`` with auth as shipped: a trainer with
an ingest token gets its steps stored; one without a token is refused, keeps its
records in its spool and says so, and they arrive once it restarts with the token."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .. import warm
from ..helpers import Server, create_token, start_serve, stop_serve


def train(server: Server, run: str, *, token: str | None, start: int, steps: int) -> str:
    # One process, no launcher (torchrun's own start-up is ~3 s a run here; the launcher is
    # tested in test_restart_drill and test_training).
    cmd = [
        sys.executable,
        "-m",
        "trainwarden.agent.demo_trainer",
        "--url",
        server.url,
        "--run-name",
        run,
        "--steps",
        str(steps),
        "--start-step",
        str(start),
        "--data-delay",
        "0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINWARDEN_FLUSH_INTERVAL": "0.2"}
    for name in ("TRAINWARDEN_TOKEN", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    if token:
        env["TRAINWARDEN_TOKEN"] = token
    result = warm.run(cmd, env=env, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def test_only_an_agent_with_an_ingest_token_is_stored_and_a_refused_one_keeps_its_records(
    tmp_path: Path,
) -> None:
    db = f"sqlite:///{tmp_path / 'auth.db'}"
    server = start_serve(db, tmp_path / "serve.log", auth=True)
    try:
        ingest = create_token(db, "llama-agents", "ingest", runs="llama-*")
        train(server, "llama-ok", token=ingest, start=0, steps=12)
        assert server.get("/api/v1/runs/llama-ok").json()["last_step"] == 11

        out = train(server, "llama-late", token=None, start=0, steps=12)
        assert "refused this agent's token" in out, out[-2000:]
        assert server.get("/api/v1/runs/llama-late").status_code == 404
        spool = Path(os.environ["TRAINWARDEN_SPOOL_DIR"])
        assert list(spool.rglob("*.json")), "the refused records wait in the spool"

        wrong_run = train(server, "gpt-other", token=ingest, start=0, steps=3)
        assert "refused" in wrong_run and "gpt-other" in wrong_run
        assert server.get("/api/v1/runs/gpt-other").status_code == 404

        # The token fixed, the run restarts: what waited is replayed first.
        train(server, "llama-late", token=ingest, start=12, steps=3)
        loss = server.get("/api/v1/runs/llama-late/series", metric="loss").json()
        assert loss["step"] == list(range(15))
    finally:
        stop_serve(server)
