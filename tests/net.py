"""Loopback helpers with no dependency beyond the standard library: the agent's tests use
them on a GPU machine that has only the agent's packages (scripts/gpu_check.sh)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
