"""Node eviction: take a bad node out of a training job through the cluster scheduler.

One protocol, three backends (docs/eviction.md):

- :class:`SlurmBackend` drains the node with a reason, then requeues the job with the
  node excluded (``requeuehold`` → ``ExcNodeList`` → ``release``: Slurm refuses to
  change the excluded nodes of a running job, and a held job cannot start elsewhere
  in between).
- :class:`KubernetesBackend` cordons the node and evicts the job's pods on it through
  the Eviction API (policy/v1), which honours PodDisruptionBudgets.
- :class:`CommandBackend` runs the operator's own script with templated arguments.

``evict`` blocks, never longer than ``timeout_s`` in all, and raises :class:`EvictError`
saying exactly what failed. It is safe to repeat: draining a drained node, cordoning a
cordoned one or evicting a pod that is already gone changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainwarden.collector.actions.evict.base import (
    EvictError,
    Eviction,
    EvictionBackend,
    EvictResult,
)
from trainwarden.collector.actions.evict.command import CommandBackend
from trainwarden.collector.actions.evict.kubernetes import KubernetesBackend
from trainwarden.collector.actions.evict.slurm import SlurmBackend

__all__ = [
    "CommandBackend",
    "EvictError",
    "EvictResult",
    "Eviction",
    "EvictionBackend",
    "KubernetesBackend",
    "SlurmBackend",
    "load_backend",
]


# -- configuration ------------------------------------------------------------------------

_OPTIONS: dict[str, tuple[str, ...]] = {
    "slurm": ("scontrol", "squeue", "requeue", "env"),
    "command": ("argv", "env"),
    "kubernetes": (
        "namespace",
        "label_selector",
        "grace_period_s",
        "kubeconfig",
        "context",
        "host",
        "token",
        "verify_ssl",
    ),
}


def load_backend(spec: Mapping[str, Any]) -> EvictionBackend:
    """Build a backend from its YAML mapping: ``{backend: slurm|command|kubernetes, ...}``.
    Raises ValueError naming the field that is wrong."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"eviction: must be a mapping with a `backend` key, got {spec!r}")
    kind = spec.get("backend")
    if kind not in _OPTIONS:
        raise ValueError(f"backend: must be one of {', '.join(_OPTIONS)}, got {kind!r}")
    options = {k: v for k, v in spec.items() if k != "backend"}
    for key in options:
        if key not in _OPTIONS[kind]:
            raise ValueError(
                f"{key}: unknown option for backend {kind} (known: {', '.join(_OPTIONS[kind])})"
            )
    env = options.get("env")
    if env is not None and (
        not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values())
    ):
        raise ValueError("env: must be a mapping of names to strings")
    for key in (
        "scontrol",
        "squeue",
        "namespace",
        "label_selector",
        "kubeconfig",
        "context",
        "host",
        "token",
    ):
        if key in options and not isinstance(options[key], str):
            raise ValueError(f"{key}: must be a string, got {options[key]!r}")
    for key in ("requeue", "verify_ssl"):
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"{key}: must be true or false, got {options[key]!r}")
    if kind == "slurm":
        return SlurmBackend(**options)
    if kind == "command":
        if "argv" not in options:
            raise ValueError("argv: required for backend command (a list: program, arguments)")
        return CommandBackend(**options)
    if "namespace" not in options:
        raise ValueError("namespace: required for backend kubernetes")
    return KubernetesBackend(**options)
