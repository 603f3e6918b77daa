"""Loopback helpers with no dependency beyond the standard library: the agent's tests use
them on a GPU machine that has only the agent's packages (scripts/gpu_check.sh)."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def attempt_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports for the rendezvous of a job's successive
    attempts (``MASTER_PORT``), below the kernel's ephemeral range (32768 on Linux) and
    above the node relays' (20000-29999). A port from :func:`free_port` is in the
    ephemeral range: by the time a requeued attempt listens on it (or on it plus one),
    an outgoing connection may hold it (a Slurm drill's attempt 1 died of EADDRINUSE)."""
    found: list[int] = []
    for port in random.sample(range(30_000, 32_768), 2_768):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"no {n} free loopback ports in 30000-32767")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket closes
