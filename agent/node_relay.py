"""The node relay of ``relay="auto"`` (the default where a node runs several ranks): which
job's relay a rank sends to, on which port, and running it in local rank 0's agent.

Each job on a node gets its own relay. Its port is not fixed: it comes from the job's
identity (:func:`job_key`: the run, the launcher's attempt, the rendezvous address), as
the first free one of eight candidates (:func:`candidate_ports`, in 20000-29999, below
Linux's ephemeral range) that every local rank computes alike. Local rank 0 binds the
first it can; the others ask each candidate's health (``/relay/health``) and take the one
that names their job and their collector. Two jobs on one node thus never share a relay
(one ending would leave the other's ranks sending direct), and a port taken by anything
else is passed over. ``TRAINWARDEN_RELAY_PORT`` pins one port instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .identity import attempt_key

if TYPE_CHECKING:
    from .config import AgentConfig

log = logging.getLogger(__name__)

PORT_BASE, PORT_SPAN, CANDIDATES = 20000, 10000, 8


def local_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """How many ranks of this job run on this node, as the launcher says: torchrun's
    ``LOCAL_WORLD_SIZE``, else Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) at this
    node's index (``SLURM_NODEID``). None when neither says."""
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit():
        return int(local)
    tasks, node = env.get("SLURM_TASKS_PER_NODE", ""), env.get("SLURM_NODEID", "")
    if not tasks or not node.isdigit():
        return None
    counts: list[int] = []
    for part in tasks.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m[1])] * int(m[2] or 1)
    index = int(node)
    return counts[index] if index < len(counts) else None


def job_key(run: str, environ: Mapping[str, str] | None = None) -> str:
    """What the ranks of one job on one node share and another job does not: the run, the
    launcher's attempt (torchrun's run id and restart, Slurm's job and requeue) and the
    rendezvous address (``MASTER_ADDR:MASTER_PORT``)."""
    env = os.environ if environ is None else environ
    attempt, _restarts = attempt_key(env)
    parts = (run, attempt or "", env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def candidate_ports(key: str, pinned: int | None = None) -> list[int]:
    """The ports the job's relay may listen on, in the order local rank 0 tries them."""
    if pinned is not None:
        return [pinned]
    start = int(key[:8], 16) % PORT_SPAN
    return [PORT_BASE + (start + i) % PORT_SPAN for i in range(CANDIDATES)]


def group(config: AgentConfig) -> str:
    """Who sends through the same relay, whose agents share a flush phase: the node, for
    a relay on it (``auto``, loopback); for one that serves several nodes, its URL."""
    host = urlsplit(config.relay).hostname if config.relay not in (None, "auto") else None
    if host is None or host == "localhost" or host.startswith("127.") or host == "::1":
        return config.node
    return str(config.relay)


def urls(config: AgentConfig) -> list[str]:
    """Where this rank looks for its job's relay (``auto``)."""
    ports = candidate_ports(job_key(config.run), config.relay_port)
    return [f"http://127.0.0.1:{port}" for port in ports]


def start(config: AgentConfig) -> Any:
    """Local rank 0's relay for ``relay="auto"``, listening on the first free candidate
    port and expecting the node's ranks; None for the other ranks, or when no candidate
    port is free (the ranks then send to the collector directly)."""
    if config.local_rank != 0 or config.url is None:
        return None
    from .relay import Relay  # an HTTP server: loaded only by an agent that runs one

    key = job_key(config.run)
    tried = []
    for port in candidate_ports(key, config.relay_port):
        try:
            relay = Relay(config.url, port=port, expect=local_world_size(), job=key)
        except OSError as exc:
            tried.append(f"{port} ({exc.strerror or exc})")
            continue
        log.info("trainwarden: this node's relay for the job listens on %s", relay.url)
        return relay.start()
    log.warning(
        "trainwarden: no node relay started (ports %s taken): the node's ranks send to "
        "the collector directly",
        ", ".join(tried),
    )
    return None
