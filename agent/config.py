"""Agent configuration: explicit argument, else ``TRAINWARDEN_*`` variable, else default.

Every check runs at ``tw.init`` time so a wrong argument fails at once, with the fix
in the message, instead of surfacing as missing data an hour into the run.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from .mfu import dtype_name
from .mixture import check_mixture
from .node_relay import local_world_size
from .placement import IDENTITY_WAIT_S
from .samples import SamplesError, Universe

if TYPE_CHECKING:
    from typing_extensions import Unpack

EXPORTERS = ("http", "otlp")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_CONFIG_BYTES = 256 * 1024  # hyperparameters, not data: it is stored once per attempt
MAX_TAG_CHARS = 200
MAX_SNAPSHOT_CHARS = 4096
_MAX_DEPTH = 32
_INT64 = 2**63


class ConfigError(ValueError):
    """A ``tw.init`` argument or ``TRAINWARDEN_*`` variable is wrong; the message says how
    to fix it."""


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _dataset_size(value: Any) -> int | None:
    """``tw.init(dataset_size=N)`` or ``TRAINWARDEN_DATASET_SIZE``, checked."""
    value = pick(value, "TRAINWARDEN_DATASET_SIZE")
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(
                f"dataset_size (TRAINWARDEN_DATASET_SIZE) must be a whole number, got {value!r}"
            ) from None
    try:
        Universe(value)
    except SamplesError as exc:
        raise ConfigError(str(exc)) from None
    return int(value)


def _data_mixture(value: Any) -> dict[str, float] | None:
    try:
        return check_mixture(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def pick(explicit: Any, env_name: str, default: Any = None) -> Any:
    """The explicit argument, else the environment variable, else ``default``."""
    if explicit is not None:
        return explicit
    from_env = _env(env_name)
    return from_env if from_env is not None else default


def as_int(value: Any, what: str, *, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {number}")
    return number


def as_flag(value: Any, what: str) -> bool:
    """A yes / no option: a bool, or 1 / 0, true / false, yes / no, on / off."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{what} must be yes or no (1 / 0, true / false), got {value!r}")


def as_float(value: Any, what: str, *, minimum: float, zero_is_off: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number, got {value!r}") from None
    if zero_is_off and number == 0:
        return 0.0
    if not number > minimum:
        raise ConfigError(
            f"{what} must be > {minimum}{' (or 0: off)' if zero_is_off else ''}, got {number}"
        )
    return number


def _json_value(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON: mappings and sequences recursively, numbers as numbers
    (NaN and infinities as strings, as the wire carries them), anything else as ``str()``.
    A config holds torch dtypes, paths and numpy scalars: never an error."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if -_INT64 <= value < _INT64 else str(value)  # JSON libraries stop at 64 bits
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # "nan", "inf", "-inf"
    if type(value).__name__ == "bool_":  # numpy's: not an int, and float() would make it 1.0
        return bool(value)
    if depth >= _MAX_DEPTH:  # a structure that contains itself
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_value(v, depth + 1) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json_value(getattr(value, f.name), depth + 1) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_json_value(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_json_value(v, depth + 1) for v in value), key=str)
    if not isinstance(value, (bytes, bytearray)) and hasattr(value, "__index__"):
        try:  # numpy integers, a one-element integer tensor
            return _json_value(int(value.__index__()), depth + 1)
        except Exception:
            pass
    if hasattr(value, "__float__") and not isinstance(value, complex):
        try:  # numpy floats, Decimal, Fraction, a one-element float tensor
            return _json_value(float(value), depth + 1)
        except Exception:
            pass
    try:
        return str(value)
    except Exception:
        return f"<{type(value).__name__}>"


def run_config(config: Any) -> dict[str, Any] | None:
    """The ``tw.init(config=...)`` mapping as JSON-safe data; :class:`ConfigError` if it is
    not a mapping or is too big to keep with every attempt."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"config must be a mapping of hyperparameters (a dict), got {type(config).__name__}; "
            "for argparse pass vars(args), for a dataclass dataclasses.asdict(cfg)"
        )
    clean = _json_value(config)
    size = len(json.dumps(clean, ensure_ascii=False).encode())
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config is {size / 1024:.0f} KiB as JSON, over the {MAX_CONFIG_BYTES // 1024} KiB "
            "limit: pass hyperparameters, not data (leave out vocabularies, tensors, file lists)"
        )
    return clean  # type: ignore[no-any-return]


def run_tags(tags: Any) -> tuple[str, ...]:
    """``tw.init(tags=[...])`` (or ``TRAINWARDEN_TAGS="a,b"``): strings, in order, once each."""
    if tags is None:
        tags = [t.strip() for t in (_env("TRAINWARDEN_TAGS") or "").split(",")]
        tags = [t for t in tags if t]
    elif not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise ConfigError(
            f"tags must be a list of strings (e.g. tags=['baseline', 'lr-sweep']), got {tags!r}"
        )
    for t in tags:
        if not t.strip() or len(t) > MAX_TAG_CHARS:
            raise ConfigError(f"tag {t!r} is not valid: use 1-{MAX_TAG_CHARS} characters")
    return tuple(dict.fromkeys(t.strip() for t in tags))


def data_snapshot_name(value: Any) -> str | None:
    """``tw.init(data_snapshot=...)`` (or ``TRAINWARDEN_DATA_SNAPSHOT``): a name, a path or
    a URI of the data version the run trains on."""
    value = pick(value, "TRAINWARDEN_DATA_SNAPSHOT")
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or len(value) > MAX_SNAPSHOT_CHARS:
        raise ConfigError(
            f"data_snapshot must be a string of at most {MAX_SNAPSHOT_CHARS} characters "
            f"(a dataset version, path or URI), got {value!r:.100}"
        )
    return value


def _option(
    options: Mapping[str, Any], name: str, env: str, parse: Any, default: Any, **check: Any
) -> Any:
    """The option ``name`` (``tw.init``'s argument, else the variable ``env``, else
    ``default``) through ``parse`` (:func:`as_int` or :func:`as_float`) with ``check``;
    None stays None."""
    value = pick(options.get(name), env, default)
    return None if value is None else parse(value, f"{name} ({env})", **check)


class InitOptions(TypedDict, total=False):
    """``tw.init``'s keyword arguments after ``run``, ``url`` and ``token``, declared once:
    ``tw.init`` and :meth:`AgentConfig.resolve` take them as ``**options``. Each not
    given falls back to its variable (``TRAINWARDEN_QUEUE_SIZE``, ...; ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``), else to the default of :class:`AgentConfig`'s field
    of that name; what each does is in ``tw.init``'s docstring and on the fields."""

    rank: int | None
    world_size: int | None
    local_rank: int | None
    queue_size: int | None
    flush_interval_s: float | None
    batch_size: int | None
    request_timeout_s: float | None
    heartbeat_s: float | None
    peak_flops: float | None
    flops_per_step: float | None
    flops_per_token: float | None
    dtype: Any
    profile_every: int | None
    profile_dir: str | None
    drill: str | None
    gpu_interval_s: float | None
    exporter: str | None
    relay: str | None
    spool_dir: str | None
    spool_max_mb: float | None
    config: Any
    tags: Any
    data_snapshot: Any
    flight_recorder_entries: int | None
    dataset_size: int | None
    data_mixture: Any
    preflight: bool | None


@dataclass(frozen=True)
class AgentConfig:
    """What one rank's agent needs to know. Build it with :meth:`resolve`."""

    run: str
    """Logical run name. A restarted process with the same name continues the run."""
    url: str | None
    """Collector base URL (``http://host:8000``); ``None`` keeps records local only."""
    token: str | None
    """Bearer token sent to the collector, if it asks for one."""
    rank: int
    """Global rank (``RANK``)."""
    world_size: int
    """Number of ranks in the job (``WORLD_SIZE``)."""
    local_rank: int
    """Rank within the node (``LOCAL_RANK``)."""
    host: str
    """Host name of this process."""
    node: str
    """Scheduler node name (``SLURMD_NODENAME`` / ``NODE_NAME``), else the host name."""
    placement: str = "environment"
    """Where rank and world size came from: ``argument``, ``environment`` (``RANK``),
    ``process group``, ``no process group``, or ``pending``: neither tw.init nor the
    launcher said it, and the agent sends nothing until the process group does
    (:mod:`.placement`)."""
    identity_wait_s: float = IDENTITY_WAIT_S
    """A pending rank waits this long for the process group (``TRAINWARDEN_IDENTITY_WAIT``)
    unless a step comes first; then the process is rank 0 of 1."""
    queue_size: int = 10_000
    """Records held in memory before the oldest are dropped (and counted)."""
    flush_interval_s: float = 1.0
    """How often the exporter sends a batch."""
    batch_size: int = 512
    """Records per HTTP request at most."""
    request_timeout_s: float = 5.0
    """Timeout of one HTTP request to the collector."""
    heartbeat_s: float = 2.0
    """The exporter sends at least this often, even when the training thread is stuck."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device; default: the table entry for this GPU and ``dtype``."""
    flops_per_step: float | None = None
    """Model FLOPs of one step on this rank (forward + backward)."""
    flops_per_token: float | None = None
    """Model FLOPs per token (e.g. 6N for a dense transformer of N parameters)."""
    dtype: str = "bf16"
    """Compute dtype that selects the peak: bf16, fp16, fp8, tf32 or fp32."""
    profile_every: int = 1000
    """Profile one step in this many with torch.profiler (0: never); the first at step 20."""
    profile_dir: str | None = None
    """Keep the sampled profiler's chrome traces here (default: analyse and discard)."""
    drill: str | None = None
    """Fault drill spec (see trainwarden.agent.drills), e.g. ``slow=1.5x@rank=1,steps=10-60``."""
    preflight: bool = False
    """Check this rank's device, memory and collectives before step 0 (:mod:`.preflight`);
    ``TRAINWARDEN_PREFLIGHT=1``."""
    gpu_interval_s: float = 5.0
    """How often the NVML sampler reads this rank's GPU."""
    exporter: str = "http"
    """How batches go out: ``http`` (the native JSON API) or ``otlp`` (OTLP/HTTP metrics)."""
    relay_port: int | None = None
    """``relay="auto"``: the port the node's relay listens on (``TRAINWARDEN_RELAY_PORT``);
    None: one of eight picked from the job's identity (:mod:`.node_relay`)."""
    relay: str | None = None
    """The node relay's URL (``trainwarden relay``), or ``auto`` (local rank 0's agent runs
    the job's relay on the node): batches go there, to be sent on with the node's other
    ranks' in one request, and straight to ``url`` while the relay is down. Default:
    ``auto`` where the launcher says a node runs several of the job's ranks
    (``LOCAL_WORLD_SIZE``, Slurm's tasks per node) and the exporter is ``http``; ``off``:
    none."""
    spool_dir: str | None = None
    """Batches the collector cannot take wait in ``<spool_dir>/<run>/rank-<rank>`` (default:
    ``$TMPDIR/trainwarden-spool-<uid>``; ``"none"``: in memory only, lost at exit)."""
    spool_max_bytes: int = 256 * 2**20
    """Past this, the spool's oldest batches are dropped (and counted)."""
    flush_on_sigterm: bool = True
    """On SIGTERM, flush (or spool) before dying of it, if no other handler is installed."""
    run_config: dict[str, Any] | None = None
    """The trainer's hyperparameters (``tw.init(config=...)``), JSON-safe; sent once per attempt."""
    tags: tuple[str, ...] = ()
    """Labels of the run (``TRAINWARDEN_TAGS``, comma-separated)."""
    data_snapshot: str | None = None
    """The data version the run trains on (``TRAINWARDEN_DATA_SNAPSHOT``)."""
    dataset_size: int | None = None
    """How many samples an epoch holds (``TRAINWARDEN_DATASET_SIZE``): with it, the steps'
    sample ids (``s.samples``) are checked for repeats and gaps at each epoch's end."""
    data_mixture: dict[str, float] | None = None
    """The share of tokens each data source should give (``tw.init(data_mixture=...)``),
    compared with what ``s.data_source`` reports."""
    flight_recorder_entries: int = 2000
    """PyTorch Flight Recorder ring size that ``tw.init`` asks for (``TORCH_FR_BUFFER_SIZE``,
    never over the user's own value); the ring is read when a rank may be hung. 0: off."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        run: str | None = None,
        url: str | None = None,
        token: str | None = None,
        **options: Unpack[InitOptions],
    ) -> AgentConfig:
        """The configuration ``tw.init(run, url, token, **options)`` asks for: each
        argument given, else its variable, else the default; a wrong one, or a name that
        is not an argument, raises :class:`ConfigError`."""
        unknown = sorted(set(options) - set(InitOptions.__annotations__))
        if unknown:
            raise ConfigError(
                f"tw.init got {', '.join(map(repr, unknown))}: not an argument of it; the "
                f"arguments are run, url, token, {', '.join(InitOptions.__annotations__)}"
            )
        run = pick(run, "TRAINWARDEN_RUN")
        if run is None:
            raise ConfigError(
                "no run name: pass tw.init(run='my-run') or set TRAINWARDEN_RUN; "
                "all ranks of one job must use the same name"
            )
        if not isinstance(run, str) or not _RUN_NAME.match(run):
            raise ConfigError(
                f"run name {run!r} is not valid: use 1-128 characters from letters, digits "
                "and . _ : -, starting with a letter or digit (e.g. 'llama-8b-2026-11-21')"
            )

        url = pick(url, "TRAINWARDEN_URL")
        if url is not None:
            if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
                raise ConfigError(
                    f"collector url {url!r} is not valid: use http://host:port or https://host"
                )
            url = url.rstrip("/")
        # The rank is known where tw.init or the launcher (RANK) says it; else the process
        # group will (placement.py), and the agent sends nothing until then.
        placement_v = (
            "argument"
            if options.get("rank") is not None
            else "environment"
            if _env("RANK")
            else "pending"
        )
        rank_v = _option(options, "rank", "RANK", as_int, 0, minimum=0)
        # WORLD_SIZE without RANK (Lightning's launcher sets it) says nothing of this rank.
        world_env = None if placement_v == "pending" else _env("WORLD_SIZE")
        world_v = as_int(
            ws if (ws := options.get("world_size")) is not None else world_env or 1,
            "world_size (WORLD_SIZE)",
            minimum=1,
        )
        if rank_v >= world_v:
            raise ConfigError(
                f"rank {rank_v} is outside world_size {world_v}: check RANK and WORLD_SIZE "
                "(torchrun and srun set both)"
            )
        local_v = _option(options, "local_rank", "LOCAL_RANK", as_int, 0, minimum=0)
        identity_wait_v = as_float(
            pick(None, "TRAINWARDEN_IDENTITY_WAIT", IDENTITY_WAIT_S),
            "TRAINWARDEN_IDENTITY_WAIT",
            minimum=0.0,
        )
        flops = {
            name: _option(options, name, env, as_float, None, minimum=0.0)
            for name, env in (
                ("peak_flops", "TRAINWARDEN_PEAK_FLOPS"),
                ("flops_per_step", "TRAINWARDEN_FLOPS_PER_STEP"),
                ("flops_per_token", "TRAINWARDEN_FLOPS_PER_TOKEN"),
            )
        }
        flops_per_step, flops_per_token = flops["flops_per_step"], flops["flops_per_token"]
        if flops_per_step is not None and flops_per_token is not None:
            raise ConfigError(
                "give flops_per_step or flops_per_token, not both "
                "(flops_per_token x tokens is used when tw.step gets tokens=...)"
            )
        dtype_v = pick(options.get("dtype"), "TRAINWARDEN_DTYPE", "bf16")
        try:
            dtype_v = dtype_name(dtype_v)
        except ValueError as exc:
            raise ConfigError(f"dtype: {exc}") from None
        exporter_v = pick(options.get("exporter"), "TRAINWARDEN_EXPORTER", cls.exporter)
        if exporter_v not in EXPORTERS:
            raise ConfigError(
                f"exporter {exporter_v!r} is not known: use one of {', '.join(EXPORTERS)} "
                "(tw.init(exporter=...) or TRAINWARDEN_EXPORTER)"
            )
        relay = pick(options.get("relay"), "TRAINWARDEN_RELAY")
        if relay is not None and str(relay).strip().lower() in ("off", "none", "0", "false"):
            relay = None
        elif relay is not None:
            if relay != "auto" and (
                not isinstance(relay, str) or not re.match(r"^https?://[^/\s]+", relay)
            ):
                raise ConfigError(
                    f"relay {relay!r} is not valid: use 'auto' (local rank 0 runs the job's "
                    "relay on the node), 'off', or the URL where this node's "
                    "`trainwarden relay` listens, e.g. http://127.0.0.1:8470"
                )
            relay = relay.rstrip("/")
            if url is None:
                raise ConfigError(
                    "a relay needs the collector's url too (TRAINWARDEN_URL): the agent "
                    "sends there while the relay is down"
                )
        elif url is not None and exporter_v == "http" and (local_world_size() or 1) > 1:
            relay = "auto"  # the node runs several of the job's ranks: one request for them
        host = socket.gethostname()
        node = _env("SLURMD_NODENAME") or _env("NODE_NAME") or host

        return cls(
            run_config=run_config(options.get("config")),
            tags=run_tags(options.get("tags")),
            data_snapshot=data_snapshot_name(options.get("data_snapshot")),
            dataset_size=_dataset_size(options.get("dataset_size")),
            data_mixture=_data_mixture(options.get("data_mixture")),
            **flops,
            dtype=dtype_v,
            profile_every=_option(
                options,
                "profile_every",
                "TRAINWARDEN_PROFILE_EVERY",
                as_int,
                cls.profile_every,
                minimum=0,
            ),
            profile_dir=pick(options.get("profile_dir"), "TRAINWARDEN_PROFILE_DIR"),
            drill=pick(options.get("drill"), "TRAINWARDEN_DRILL"),
            preflight=as_flag(
                pick(options.get("preflight"), "TRAINWARDEN_PREFLIGHT", False),
                "preflight (TRAINWARDEN_PREFLIGHT)",
            ),
            flight_recorder_entries=_option(
                options,
                "flight_recorder_entries",
                "TRAINWARDEN_FLIGHT_RECORDER_ENTRIES",
                as_int,
                cls.flight_recorder_entries,
                minimum=0,
            ),
            gpu_interval_s=_option(
                options,
                "gpu_interval_s",
                "TRAINWARDEN_GPU_INTERVAL",
                as_float,
                cls.gpu_interval_s,
                minimum=0.0,
                zero_is_off=True,
            ),
            exporter=exporter_v,
            relay=relay,
            relay_port=as_int(port, "relay port (TRAINWARDEN_RELAY_PORT)", minimum=1)
            if (port := pick(None, "TRAINWARDEN_RELAY_PORT", None)) is not None
            else None,
            spool_dir=pick(options.get("spool_dir"), "TRAINWARDEN_SPOOL_DIR"),
            flush_on_sigterm=str(pick(None, "TRAINWARDEN_FLUSH_ON_SIGTERM", "1")).strip().lower()
            not in ("0", "false", "no", "off"),
            spool_max_bytes=int(
                _option(
                    options,
                    "spool_max_mb",
                    "TRAINWARDEN_SPOOL_MAX_MB",
                    as_float,
                    cls.spool_max_bytes / 2**20,
                    minimum=0.0,
                )
                * 2**20
            ),
            run=run,
            url=url,
            token=pick(token, "TRAINWARDEN_TOKEN"),
            rank=rank_v,
            world_size=world_v,
            local_rank=local_v,
            placement=placement_v,
            identity_wait_s=identity_wait_v,
            host=host,
            node=node,
            queue_size=_option(
                options,
                "queue_size",
                "TRAINWARDEN_QUEUE_SIZE",
                as_int,
                cls.queue_size,
                minimum=1,
            ),
            flush_interval_s=_option(
                options,
                "flush_interval_s",
                "TRAINWARDEN_FLUSH_INTERVAL",
                as_float,
                cls.flush_interval_s,
                minimum=0.0,
            ),
            batch_size=_option(
                options,
                "batch_size",
                "TRAINWARDEN_BATCH_SIZE",
                as_int,
                cls.batch_size,
                minimum=1,
            ),
            heartbeat_s=_option(
                options,
                "heartbeat_s",
                "TRAINWARDEN_HEARTBEAT",
                as_float,
                cls.heartbeat_s,
                minimum=0.0,
            ),
            request_timeout_s=_option(
                options,
                "request_timeout_s",
                "TRAINWARDEN_REQUEST_TIMEOUT",
                as_float,
                cls.request_timeout_s,
                minimum=0.0,
            ),
        )
