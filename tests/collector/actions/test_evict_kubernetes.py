"""The Kubernetes eviction backend against a local HTTP server that answers the API calls
it makes (no cluster here: its calls are what is tested): cordon, list the run's pods on
the node, evict them through the Eviction API; errors and timeouts."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from trainwarden.collector.actions.evict import (
    EvictError,
    Eviction,
    KubernetesBackend,
    load_backend,
)

from .evict_helpers import REASON


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str | None
    body: Any


class KubeAPI:
    """Just enough of the Kubernetes API: nodes (GET, PATCH), pods (LIST with
    fieldSelector spec.nodeName and labelSelector k=v), pods/{name}/eviction (POST).
    ``refuse`` holds pod names whose first eviction a PodDisruptionBudget refuses."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.nodes: dict[str, dict[str, Any]] = {
            n: {"metadata": {"name": n, "annotations": {}}, "spec": {}} for n in ("node1", "node2")
        }
        self.pods = [
            pod("train-0", "node1", {"run": "gpt"}),
            pod("train-1", "node2", {"run": "gpt"}),
            pod("train-2", "node2", {"run": "gpt"}, phase="Succeeded"),
            pod("other-0", "node2", {"run": "other"}),
        ]
        self.refuse: set[str] = set()
        self.hang = threading.Event()  # set: every answer waits until released
        self.released = threading.Event()
        self.returned = threading.Event()  # a held answer was released (or waited 10 s)
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                api.calls.append(
                    Call(
                        self.command,
                        url.path,
                        parse_qs(url.query),
                        self.headers.get("Content-Type"),
                        body,
                    )
                )
                if api.hang.is_set():
                    api.released.wait(10)
                    api.returned.set()
                    return
                status, answer = api.answer(
                    self.command, url.path.split("/"), parse_qs(url.query), body
                )
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_POST = _handle

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(
        self, method: str, parts: list[str], query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        # /api/v1/nodes/{name}
        if parts[1:4] == ["api", "v1", "nodes"]:
            node = self.nodes.get(parts[4])
            if node is None:
                return 404, status(404, "NotFound", f'nodes "{parts[4]}" not found')
            if method == "PATCH":
                node["spec"].update(body["spec"])
                node["metadata"]["annotations"].update(body["metadata"]["annotations"])
            return 200, {"kind": "Node", "apiVersion": "v1", **node}
        # /api/v1/namespaces/{ns}/pods[/{name}/eviction]
        if len(parts) == 6 and method == "GET":
            on = query["fieldSelector"][0].removeprefix("spec.nodeName=")
            key, _, value = query.get("labelSelector", ["="])[0].partition("=")
            items = [
                p
                for p in self.pods
                if p["spec"]["nodeName"] == on
                and (not key or p["metadata"]["labels"].get(key) == value)
            ]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        if len(parts) == 8 and parts[7] == "eviction" and method == "POST":
            if parts[6] in self.refuse:
                self.refuse.discard(parts[6])
                return 429, status(
                    429,
                    "TooManyRequests",
                    "Cannot evict pod as it would violate the pod's disruption budget.",
                )
            return 201, status(201, "", "", success=True)
        return 404, status(404, "NotFound", "the server could not find the requested resource")

    def __enter__(self) -> KubeAPI:
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def pod(name: str, node: str, labels: dict[str, str], phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "train", "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "trainer:1"}]},
        "status": {"phase": phase},
    }


def status(code: int, reason: str, message: str, success: bool = False) -> dict[str, Any]:
    if success:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "code": code,
        }
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@pytest.fixture
def kube() -> Iterator[KubeAPI]:
    with KubeAPI() as api:
        yield api


def eviction_body(name: str, grace: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": "train"},
    }
    if grace is not None:
        body["deleteOptions"] = {"gracePeriodSeconds": grace}
    return body


def test_kubernetes_cordons_and_evicts_the_runs_pods_on_the_node(kube: KubeAPI) -> None:
    kube.refuse.add("train-1")  # the PodDisruptionBudget says no once, then yes
    b = load_backend(
        {
            "backend": "kubernetes",
            "namespace": "train",
            "label_selector": "run={run}",
            "grace_period_s": 30,
            "host": kube.url,
            "token": "s3cret",
        }
    )

    result = b.evict(Eviction(node="node2", reason=REASON, run="gpt", job_id="12"))

    calls = [(c.method, c.path, c.query, c.body) for c in kube.calls]
    evict: tuple[str, str, dict[str, list[str]], Any] = (
        "POST",
        "/api/v1/namespaces/train/pods/train-1/eviction",
        {},
        eviction_body("train-1", 30),
    )
    assert calls == [
        ("GET", "/api/v1/nodes/node2", {}, None),
        (
            "PATCH",
            "/api/v1/nodes/node2",
            {},
            {
                "metadata": {"annotations": {"trainwarden.io/evict-reason": REASON}},
                "spec": {"unschedulable": True},
            },
        ),
        (
            "GET",
            "/api/v1/namespaces/train/pods",
            {"fieldSelector": ["spec.nodeName=node2"], "labelSelector": ["run=gpt"]},
            None,
        ),
        evict,  # 429
        evict,
    ]
    assert kube.calls[1].content_type == "application/strategic-merge-patch+json"
    assert kube.nodes["node2"]["spec"] == {"unschedulable": True}
    assert result.backend == "kubernetes"
    assert result.steps == (
        "cordon node2 (spec.unschedulable=true, trainwarden.io/evict-reason)",
        "pods of train/run=gpt on node2: train-1",
        "evict pod train/train-1 (policy/v1 Eviction)",
    )


def test_kubernetes_unknown_node_fails_in_the_apis_words(kube: KubeAPI) -> None:
    b = KubernetesBackend("train", host=kube.url)
    with pytest.raises(EvictError, match=r'GET node node9: HTTP 404: nodes "node9" not found'):
        b.evict(Eviction(node="node9", reason=REASON, run="gpt"))
    assert [c.method for c in kube.calls] == ["GET"]


def test_kubernetes_without_selector_evicts_every_pod_of_the_namespace_on_the_node(
    kube: KubeAPI,
) -> None:
    kube.nodes["node2"]["spec"]["unschedulable"] = True
    result = KubernetesBackend("train", host=kube.url).evict(
        Eviction(node="node2", reason=REASON, run="gpt")
    )
    posts = [(c.path, c.body) for c in kube.calls if c.method == "POST"]
    assert posts == [
        ("/api/v1/namespaces/train/pods/train-1/eviction", eviction_body("train-1")),
        ("/api/v1/namespaces/train/pods/other-0/eviction", eviction_body("other-0")),
    ]
    assert kube.calls[2].query == {"fieldSelector": ["spec.nodeName=node2"]}
    assert result.steps[0] == "node node2 was already cordoned"


def test_kubernetes_timeout_is_honoured(kube: KubeAPI) -> None:
    kube.hang.set()
    with pytest.raises(EvictError, match=r"GET node node2: timed out after 0.5 s"):
        KubernetesBackend("train", host=kube.url).evict(
            Eviction(node="node2", reason=REASON, run="gpt"), timeout_s=0.5
        )
    assert not kube.returned.is_set()  # it returned while the API server still held it


def test_kubernetes_unreachable_api_server() -> None:
    from ...net import free_port

    b = KubernetesBackend("train", host=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(
        EvictError, match=r"GET node node2: NewConnectionError: .*Connection refused"
    ):
        b.evict(Eviction(node="node2", reason=REASON, run="gpt"), timeout_s=5)
