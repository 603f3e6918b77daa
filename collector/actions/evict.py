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

import os
import re
import shlex
import signal
import string
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Protocol

PLACEHOLDERS = ("node", "reason", "run", "job_id", "ranks")
MAX_REASON = 200  # Slurm keeps any length, but sinfo and squeue lines should stay readable
_BAD_NODE = re.compile(r"[\s,\[\]=\"']")  # a hostlist or option would reach other nodes


class EvictError(Exception):
    """An eviction failed; the message says which step and why. ``steps`` lists what
    had already been done (for instance the node drained, the requeue refused)."""

    def __init__(self, message: str, *, steps: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.steps = tuple(steps)


@dataclass(frozen=True)
class Eviction:
    """What to evict. Checked here so that no backend ever sees a bad node name."""

    node: str
    """Scheduler node name (agents report SLURMD_NODENAME / NODE_NAME)."""
    reason: str
    """Why, e.g. "trainwarden: FatalXid XID 79 on rank 3"; made one short line."""
    run: str
    job_id: str | None = None
    """Scheduler job id when known (SLURM_JOB_ID); else the backend looks it up."""
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.node or _BAD_NODE.search(self.node) or self.node.startswith("-"):
            raise ValueError(
                f"node {self.node!r} is not one node name (no spaces, commas, brackets, "
                "quotes or '=': a hostlist would drain other nodes)"
            )
        if self.job_id is not None and not re.fullmatch(r"[0-9]+([_+][0-9]+)?", self.job_id):
            raise ValueError(f"job_id {self.job_id!r} is not a Slurm job id (e.g. 12 or 12_3)")
        reason = " ".join(self.reason.split())  # newlines and tabs would break sinfo -R
        if len(reason) > MAX_REASON:
            reason = reason[: MAX_REASON - 3] + "..."
        object.__setattr__(self, "reason", reason or "trainwarden")
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))

    def fields(self) -> dict[str, str]:
        """The template values: {node} {reason} {run} {job_id} {ranks} ("3,5")."""
        return {
            "node": self.node,
            "reason": self.reason,
            "run": self.run,
            "job_id": self.job_id or "",
            "ranks": ",".join(str(r) for r in self.ranks),
        }


@dataclass(frozen=True)
class EvictResult:
    backend: str
    node: str
    steps: tuple[str, ...]
    """What was done, in order, human readable (the commands or API calls)."""
    output: str = ""


class EvictionBackend(Protocol):
    name: str

    def evict(self, e: Eviction, *, timeout_s: float = 30.0) -> EvictResult:
        """Blocking; raises EvictError; returns within timeout_s."""
        ...


# -- running commands ---------------------------------------------------------------------


def _tail(text: str, limit: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


class _Clock:
    """The overall deadline of one eviction."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s

    def left(self, what: str, steps: Sequence[str]) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise EvictError(f"timed out after {self.timeout_s:g} s before {what}", steps=steps)
        return left


def _run(
    argv: Sequence[str],
    *,
    clock: _Clock,
    steps: Sequence[str],
    env: Mapping[str, str] | None,
) -> str:
    """Run argv (no shell) within the deadline; its stdout. Any failure is an EvictError
    naming the command, with the exit code and the tail of stderr."""
    cmd = shlex.join(argv)
    left = clock.left(cmd, steps)
    try:
        # A session of its own, so that a timeout kills the command's children too.
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
            start_new_session=True,
        )
    except OSError as exc:
        raise EvictError(f"cannot run {argv[0]!r}: {exc.strerror or exc}", steps=steps) from exc
    try:
        out, err = proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise EvictError(
            f"`{cmd}` timed out after {clock.timeout_s:g} s (killed)", steps=steps
        ) from None
    if proc.returncode != 0:
        detail = _tail(err or out) or "(no output)"
        raise EvictError(f"`{cmd}` exited {proc.returncode}: {detail}", steps=steps)
    return out


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    try:
        # A grandchild that left the group may still hold the pipes: do not wait on it.
        proc.communicate(timeout=1)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait(1)


# -- Slurm ------------------------------------------------------------------------------

_RUNNING = {"RUNNING", "CONFIGURING", "SUSPENDED"}


@dataclass
class SlurmBackend:
    """Drain the node, then requeue its job without it.

    1. ``scontrol update NodeName=NODE State=DRAIN Reason=...``: no new jobs there;
       the running ones go on until step 3.
    2. Find the job: ``e.job_id``, else ``squeue -w NODE`` (if several jobs run there,
       the ones named like the run; if none is, EvictError lists them).
    3. Per job, if it runs: ``scontrol requeuehold`` (its tasks are killed, it waits
       held), ``scontrol update JobId=... ExcNodeList=<old>,NODE``, ``scontrol release``.
       A pending job only gets the ExcNodeList update. With ``requeue=False`` only the
       node is drained.

    Slurm holds a requeued job back for ``AuthInfo=cred_expire`` (120 s by default)
    before it starts again.
    """

    scontrol: str = "scontrol"
    squeue: str = "squeue"
    requeue: bool = True
    env: Mapping[str, str] | None = None
    """Added to the collector's environment for every command (e.g. SLURM_CONF)."""
    name = "slurm"

    def evict(self, e: Eviction, *, timeout_s: float = 30.0) -> EvictResult:
        clock = _Clock(timeout_s)
        steps: list[str] = []
        output: list[str] = []

        def run(*argv: str, record: bool = True) -> str:
            out = _run(argv, clock=clock, steps=steps, env=self.env)
            if record:
                steps.append(shlex.join(argv))
                if out.strip():
                    output.append(out.strip())
            return out

        # The drain comes first: whatever fails after it, the bad node takes no new work.
        run(self.scontrol, "update", f"NodeName={e.node}", "State=DRAIN", f"Reason={e.reason}")
        if self.requeue:
            jobs = [e.job_id] if e.job_id else self._jobs_on(e, run, steps)
            for job in jobs:
                self._requeue_without(job, e.node, run, steps)
        return EvictResult(self.name, e.node, tuple(steps), "\n".join(output))

    def _jobs_on(self, e: Eviction, run: Any, steps: list[str]) -> list[str]:
        argv = (self.squeue, "-h", "-w", e.node, "-t", "CF,R,S", "-o", "%i|%j")
        rows = [line.split("|", 1) for line in run(*argv, record=False).splitlines() if line]
        jobs = [job for job, _ in rows]
        if len(jobs) > 1:
            jobs = [job for job, name in rows if name == e.run]
            if not jobs:
                listed = ", ".join(f"{job} ({name})" for job, name in rows)
                raise EvictError(
                    f"{len(rows)} jobs run on {e.node} and none is named {e.run!r}: {listed}; "
                    "give the job id (SLURM_JOB_ID)",
                    steps=steps,
                )
        steps.append(f"{shlex.join(argv)} -> {', '.join(jobs) or 'no job'}")
        return jobs

    def _requeue_without(self, job: str, node: str, run: Any, steps: list[str]) -> None:
        shown = run(self.scontrol, "show", "job", "-o", job, record=False)
        state = _field(shown, "JobState")
        excluded = _field(shown, "ExcNodeList")
        if excluded in ("", "(null)"):
            exclude = node
        elif node in excluded.split(","):
            exclude = excluded  # evicted before: keep the list as it is
        else:
            exclude = f"{excluded},{node}"
        if state == "PENDING":
            run(self.scontrol, "update", f"JobId={job}", f"ExcNodeList={exclude}")
            return
        if state == "COMPLETING":
            # Requeued a moment ago (another node's eviction) or ending: exclude if it
            # still takes an update; either way it is no longer on the node.
            try:
                run(self.scontrol, "update", f"JobId={job}", f"ExcNodeList={exclude}")
            except EvictError as exc:
                steps.append(f"job {job} is COMPLETING, not excluded: {exc}")
            return
        if state not in _RUNNING:
            steps.append(f"job {job} is {state or 'gone'}: nothing to requeue")
            return
        run(self.scontrol, "requeuehold", job)
        try:
            run(self.scontrol, "update", f"JobId={job}", f"ExcNodeList={exclude}")
        finally:
            # Never leave the job held, even if the exclusion failed: the drain alone
            # keeps it off the node while the node stays drained.
            try:
                run(self.scontrol, "release", job)
            except EvictError as exc:
                raise EvictError(
                    f"job {job} was requeued but stays held: {exc}; run `scontrol release {job}`",
                    steps=steps,
                ) from exc


def _field(scontrol_line: str, key: str) -> str:
    m = re.search(rf"(?:^|\s){key}=(\S*)", scontrol_line)
    return m.group(1) if m else ""


# -- command ------------------------------------------------------------------------------


def _check_template(template: str, allowed: Sequence[str], where: str) -> None:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"{where}: {exc} in {template!r} (write {{{{ for a literal brace)"
        ) from exc
    for _, field_name, spec, conversion in parsed:
        if field_name is None:
            continue
        if field_name not in allowed:
            raise ValueError(
                f"{where}: unknown placeholder {{{field_name}}} in {template!r}; "
                f"known: {', '.join('{' + p + '}' for p in allowed)}"
            )
        if spec or conversion:
            raise ValueError(f"{where}: {{{field_name}}} takes no format spec or conversion")


@dataclass
class CommandBackend:
    """Run the operator's script: ``argv`` items are templates over {node} {reason}
    {run} {job_id} {ranks} (job_id "" when unknown, ranks "3,5"). No shell: each item
    is one argument, whatever the values hold. Exit 0 is success; its stdout is kept."""

    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    """Added to the collector's environment."""
    name = "command"

    def __post_init__(self) -> None:
        argv = self.argv
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(
                "argv: must be a non-empty list of strings (the program, then its "
                "arguments; no shell)"
            )
        for i, item in enumerate(argv):
            _check_template(item, PLACEHOLDERS, f"argv[{i}]")
        self.argv = list(argv)

    def evict(self, e: Eviction, *, timeout_s: float = 30.0) -> EvictResult:
        clock = _Clock(timeout_s)
        values = e.fields()
        argv = [item.format(**values) for item in self.argv]
        out = _run(argv, clock=clock, steps=(), env=self.env)
        return EvictResult(self.name, e.node, (shlex.join(argv),), out.strip())


# -- Kubernetes ---------------------------------------------------------------------------

REASON_ANNOTATION = "trainwarden.io/evict-reason"


@dataclass
class KubernetesBackend:
    """Cordon the node (``spec.unschedulable=true``, the reason in the
    ``trainwarden.io/evict-reason`` annotation) and evict the job's pods on it
    through the Eviction API (policy/v1), with the ``kubernetes`` client.

    Pods are those in ``namespace`` on the node (``fieldSelector spec.nodeName``),
    narrowed by ``label_selector`` (a template over {run} and {job_id}). Evictions that
    a PodDisruptionBudget refuses (429) are retried each second until the timeout.

    The client is configured by ``host`` (+ ``token``), else in-cluster when running in
    a pod, else from ``kubeconfig`` (default ~/.kube/config) and ``context``; or it is
    ``api_client``, a ready ``kubernetes.client.ApiClient``.
    """

    namespace: str
    label_selector: str | None = None
    _: KW_ONLY
    grace_period_s: int | None = None
    kubeconfig: str | None = None
    context: str | None = None
    host: str | None = None
    token: str | None = field(default=None, repr=False)
    verify_ssl: bool = True
    api_client: Any = field(default=None, repr=False)
    name = "kubernetes"

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError("namespace: must be the namespace of the job's pods")
        if self.label_selector is not None:
            _check_template(self.label_selector, ("run", "job_id"), "label_selector")
        grace = self.grace_period_s
        if grace is not None and (not isinstance(grace, int) or grace < 0):
            raise ValueError("grace_period_s: must be an integer >= 0")
        try:
            # Imported here, at load (about a second the first time), not in evict().
            import kubernetes.client  # noqa: F401
        except ImportError as exc:
            raise ValueError(
                "backend: kubernetes needs the `kubernetes` package: pip install 'trainwarden[k8s]'"
            ) from exc
        try:
            self._core = self._connect(self.api_client)
        except Exception as exc:  # ConfigException, a missing or unreadable file
            where = "host" if self.host else "kubeconfig"
            raise ValueError(f"{where}: cannot configure the Kubernetes client: {exc}") from exc

    def _connect(self, api_client: Any) -> Any:
        from kubernetes import client, config

        if api_client is None:
            cfg = client.Configuration()
            if self.host:
                cfg.host = self.host
                if self.token:
                    cfg.api_key = {"authorization": f"Bearer {self.token}"}
                cfg.verify_ssl = self.verify_ssl
            elif os.environ.get("KUBERNETES_SERVICE_HOST") and not self.kubeconfig:
                config.load_incluster_config(client_configuration=cfg)
            else:
                config.load_kube_config(
                    config_file=self.kubeconfig, context=self.context, client_configuration=cfg
                )
            cfg.retries = 0  # our deadline decides, not urllib3's own retries
            api_client = client.ApiClient(cfg)
        return client.CoreV1Api(api_client)

    def evict(self, e: Eviction, *, timeout_s: float = 30.0) -> EvictResult:
        from kubernetes.client.exceptions import ApiException

        clock = _Clock(timeout_s)
        steps: list[str] = []
        core = self._core

        def call(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            left = clock.left(what, steps)
            # (connect, read): older clients ignore a float and take only an int or a
            # pair; the pair splits what is left so that both together fit in it.
            connect = min(left / 4, 5.0)
            try:
                return fn(*args, _request_timeout=(connect, left - connect), **kwargs)
            except ApiException as exc:
                raise _api_error(what, exc, steps) from exc
            except Exception as exc:  # urllib3: refused, reset, read timeout
                if _is_timeout(exc):
                    raise EvictError(
                        f"{what}: timed out after {clock.timeout_s:g} s", steps=steps
                    ) from exc
                cause = getattr(exc, "reason", None) or exc  # MaxRetryError wraps it
                raise EvictError(f"{what}: {type(cause).__name__}: {cause}", steps=steps) from exc

        node = call(f"GET node {e.node}", core.read_node, e.node)
        if node.spec is not None and node.spec.unschedulable:
            steps.append(f"node {e.node} was already cordoned")
        patch = {
            "metadata": {"annotations": {REASON_ANNOTATION: e.reason}},
            "spec": {"unschedulable": True},
        }
        call(f"PATCH node {e.node}", core.patch_node, e.node, patch)
        steps.append(f"cordon {e.node} (spec.unschedulable=true, {REASON_ANNOTATION})")

        selector = None
        if self.label_selector is not None:
            selector = self.label_selector.format(run=e.run, job_id=e.job_id or "")
        kwargs: dict[str, Any] = {"field_selector": f"spec.nodeName={e.node}"}
        if selector:
            kwargs["label_selector"] = selector
        pods = call(
            f"LIST pods in {self.namespace}", core.list_namespaced_pod, self.namespace, **kwargs
        )
        names = [
            p.metadata.name
            for p in pods.items
            if p.status is None or p.status.phase not in ("Succeeded", "Failed")
        ]
        steps.append(
            f"pods of {self.namespace}/{selector or '*'} on {e.node}: {', '.join(names) or 'none'}"
        )
        for pod in names:
            self._evict_pod(core, pod, call, clock, steps)
        return EvictResult(self.name, e.node, tuple(steps))

    def _evict_pod(self, core: Any, pod: str, call: Any, clock: _Clock, steps: list[str]) -> None:
        from kubernetes import client

        delete = None
        if self.grace_period_s is not None:
            delete = client.V1DeleteOptions(grace_period_seconds=self.grace_period_s)
        body = client.V1Eviction(
            api_version="policy/v1",
            kind="Eviction",
            metadata=client.V1ObjectMeta(name=pod, namespace=self.namespace),
            delete_options=delete,
        )
        what = f"evict pod {self.namespace}/{pod}"
        while True:
            try:
                call(what, core.create_namespaced_pod_eviction, pod, self.namespace, body)
            except EvictError as exc:
                status = getattr(exc.__cause__, "status", None)
                if status == 404:
                    steps.append(f"pod {self.namespace}/{pod} was already gone")
                    return
                # 429: a PodDisruptionBudget forbids it now; it may allow it in a moment.
                if status == 429 and clock.deadline - time.monotonic() > 1.0:
                    time.sleep(1.0)
                    continue
                raise
            steps.append(f"{what} (policy/v1 Eviction)")
            return


def _is_timeout(exc: BaseException) -> bool:
    import urllib3.exceptions

    for e in (exc, getattr(exc, "reason", None)):  # MaxRetryError wraps the cause
        # NewConnectionError (refused, unreachable) subclasses ConnectTimeoutError.
        if isinstance(e, urllib3.exceptions.NewConnectionError):
            return False
        if isinstance(e, (urllib3.exceptions.TimeoutError, TimeoutError)):
            return True
    return False


def _api_error(what: str, exc: Any, steps: Sequence[str]) -> EvictError:
    """The API server's own words: the Status message, else the body, else the reason."""
    import json

    message = ""
    try:
        message = json.loads(exc.body or "{}").get("message", "")
    except (ValueError, AttributeError, TypeError):
        message = str(exc.body or "")
    detail = message or exc.reason or "no detail"
    return EvictError(f"{what}: HTTP {exc.status}: {_tail(str(detail))}", steps=steps)


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
