"""The Kubernetes backend: cordon the node and evict the job's pods on it through the
Eviction API (policy/v1), which honours PodDisruptionBudgets."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from trainwarden.collector.actions.evict.base import (
    Clock,
    EvictError,
    Eviction,
    EvictResult,
    tail_of,
)
from trainwarden.collector.actions.evict.command import check_template


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
            check_template(self.label_selector, ("run", "job_id"), "label_selector")
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

        clock = Clock(timeout_s)
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

    def _evict_pod(self, core: Any, pod: str, call: Any, clock: Clock, steps: list[str]) -> None:
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
    return EvictError(f"{what}: HTTP {exc.status}: {tail_of(str(detail))}", steps=steps)


REASON_ANNOTATION = "trainwarden.io/evict-reason"
