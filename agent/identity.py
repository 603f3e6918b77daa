"""Who this process is: the attempt of the run it belongs to, the code it runs and the
environment it runs in.

Collected once per process, on the agent's ``trainwarden-identity`` thread (git and the
package list take tens of milliseconds, which ``tw.init`` must not): the result is the
``attempt_start`` event. Every part is wrapped: what cannot be read is left ``None``,
never an error in the trainer.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import AgentConfig

log = logging.getLogger(__name__)

GIT_TIMEOUT_S = 2.0
# A pre-commit hook or a wrapper may point git elsewhere: ask about the directory itself.
_GIT_ENV_DROP = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_PREFIX")


def attempt_key(environ: Mapping[str, str] | None = None) -> tuple[str | None, int | None]:
    """(attempt key, restart count) from the launcher. The key names one process lifetime
    of the job: every rank of one launch shares it, and a restart gets a new one. None when
    no launcher says (the collector then groups by the agents' sessions)."""
    env = os.environ if environ is None else environ
    elastic_run, elastic_restarts = (
        env.get("TORCHELASTIC_RUN_ID"),
        env.get("TORCHELASTIC_RESTART_COUNT"),
    )
    slurm_job = env.get("SLURM_JOB_ID")
    restarts = _int(elastic_restarts) if elastic_run and elastic_restarts else None
    if restarts is None and slurm_job:
        restarts = _int(env.get("SLURM_RESTART_COUNT") or "0")
    if env.get("TRAINWARDEN_ATTEMPT"):
        # With the key, its restart count when the launcher tells no environment one:
        # the Ray Train integration learns it in the worker (integrations/ray.py).
        if restarts is None:
            restarts = _int(env.get("TRAINWARDEN_RESTART_COUNT"))
        return env["TRAINWARDEN_ATTEMPT"], restarts
    if elastic_run and elastic_restarts:
        return f"torchelastic:{elastic_run}:{elastic_restarts}", restarts
    if slurm_job:
        return f"slurm:{slurm_job}:{env.get('SLURM_RESTART_COUNT') or 0}", restarts
    return None, None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _git(directory: str, *args: str) -> str | None:
    env = {k: v for k, v in os.environ.items() if k not in _GIT_ENV_DROP}
    env["GIT_OPTIONAL_LOCKS"] = "0"  # `git status` must not take the index lock from the user
    try:
        done = subprocess.run(
            ["git", "-C", directory, *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):  # no git, a timeout
        return None
    return done.stdout if done.returncode == 0 else None


def _code_directories() -> list[str]:
    """The trainer script's directory first (that is the code), then the working directory."""
    out = []
    script = sys.argv[0] if sys.argv else ""
    if script and script not in ("-c", "-m", "-"):
        out.append(os.path.dirname(os.path.abspath(script)))
    with contextlib.suppress(OSError):  # a deleted working directory
        out.append(os.getcwd())
    return list(dict.fromkeys(d for d in out if os.path.isdir(d)))


def code_version(directories: list[str] | None = None) -> dict[str, Any]:
    """``{commit, dirty, branch, root}`` of the git repository the code runs from.
    ``TRAINWARDEN_CODE_VERSION`` names the commit where there is no ``.git`` (an image)."""
    code: dict[str, Any] = {"commit": None, "dirty": None, "branch": None, "root": None}
    for directory in _code_directories() if directories is None else directories:
        root = _git(directory, "rev-parse", "--show-toplevel")
        if root is None:
            continue
        code["root"] = root.strip() or None
        head = _git(directory, "rev-parse", "HEAD", "--abbrev-ref", "HEAD")
        if head is not None:  # None: a repository without a commit yet
            lines = head.split()
            code["commit"] = lines[0] if lines else None
            branch = lines[1] if len(lines) > 1 else None
            code["branch"] = branch if branch != "HEAD" else None  # detached
        status = _git(directory, "status", "--porcelain", "--untracked-files=no")
        code["dirty"] = None if status is None else bool(status.strip())
        break
    override = os.environ.get("TRAINWARDEN_CODE_VERSION")
    if override:
        code["commit"] = override
    return code


def package_lines() -> list[str]:
    """``name==version`` of every installed distribution, sorted."""
    from importlib import metadata

    lines = set()
    for dist in metadata.distributions():
        try:
            name = dist.metadata["Name"]
            if name:
                lines.add(f"{name}=={dist.version}")
        except Exception:  # a broken .dist-info: leave it out
            continue
    return sorted(lines)


def packages_hash(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def environment(*, world_size: int, local_rank: int, gpu_device: Any = None) -> dict[str, Any]:
    """Versions and hardware. torch is looked at only if the trainer imported it; the
    driver comes from NVML only if the agent's GPU monitor already opened it."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": None,
        "cuda": None,
        "nccl": None,
        "gpu": None,
        "gpu_count": None,
        "driver": None,
        "host": socket.gethostname(),
        "platform": None,
        "world_size": world_size,
        "packages_hash": None,
    }
    _try(env, "platform", platform.platform)
    torch: Any = sys.modules.get("torch")
    cuda = False
    if torch is not None:
        _try(env, "torch", lambda: str(torch.__version__))
        _try(env, "cuda", lambda: torch.version.cuda)
        try:
            cuda = bool(torch.cuda.is_available())
        except Exception:
            cuda = False
    if cuda:
        _try(env, "nccl", lambda: _nccl_version(torch))
        _try(env, "gpu_count", lambda: int(torch.cuda.device_count()))
        if torch.cuda.is_initialized():  # never initialize CUDA for the trainer: NVML below
            _try(env, "gpu", lambda: str(torch.cuda.get_device_name()))
    if gpu_device is not None and not getattr(gpu_device, "simulated", True):
        nvml = getattr(gpu_device, "_nvml", None)
        _try(env, "gpu", lambda: str(gpu_device.name))
        if nvml is not None:
            _try(env, "driver", lambda: _text(nvml.nvmlSystemGetDriverVersion()))
            _try(env, "gpu_count", lambda: int(nvml.nvmlDeviceGetCount()))
    return env


def _nccl_version(torch: Any) -> str | None:
    version = torch.cuda.nccl.version()
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    if isinstance(version, int):  # older torch: 2.21.5 as 22105
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return str(version)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(out: dict[str, Any], key: str, read: Any) -> None:
    try:
        value = read()
    except Exception as exc:  # one field missing, never the trainer's problem
        log.debug("trainwarden: cannot read %s: %s", key, exc)
        return
    if value is not None:
        out[key] = value


def skeleton(config: AgentConfig) -> dict[str, Any]:
    """The ``attempt_start`` data with what is known without looking: the rest is ``None``
    until :func:`collect` fills it in (what goes out if it cannot finish in time)."""
    attempt, restarts = attempt_key()
    data: dict[str, Any] = {
        "attempt": attempt,
        "restart_count": restarts,
        "config": config.run_config,
        "tags": list(config.tags),
        "data_snapshot": config.data_snapshot,
        "data_mixture": config.data_mixture,
        "dataset_size": config.dataset_size,
        "code": {"commit": None, "dirty": None, "branch": None, "root": None},
        "env": {
            "python": platform.python_version(),
            "torch": None,
            "cuda": None,
            "nccl": None,
            "gpu": None,
            "gpu_count": None,
            "driver": None,
            "host": config.host,
            "platform": None,
            "world_size": config.world_size,
            "packages_hash": None,
        },
    }
    if config.rank == 0:
        data["packages"] = []
    return data


def collect(config: AgentConfig, data: dict[str, Any], *, gpu_device: Any = None) -> None:
    """Fill ``data`` (from :func:`skeleton`) in place, part by part."""
    try:
        data["env"] = environment(
            world_size=config.world_size, local_rank=config.local_rank, gpu_device=gpu_device
        )
    except Exception:
        log.debug("trainwarden: environment snapshot failed", exc_info=True)
    try:
        data["code"] = code_version()
    except Exception:
        log.debug("trainwarden: code version failed", exc_info=True)
    try:
        lines = package_lines()
        data["env"]["packages_hash"] = packages_hash(lines)
        if config.rank == 0:  # the full list once per attempt, not once per rank
            data["packages"] = lines
    except Exception:
        log.debug("trainwarden: package list failed", exc_info=True)
