"""Eviction backends against real parts: a two-node Slurm cluster on this host, real
scripts for the command backend, and a local HTTP server that answers the Kubernetes API
calls the Kubernetes backend makes (no cluster here: its calls are what is tested)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from trainwarden.collector.actions.evict import (
    CommandBackend,
    EvictError,
    Eviction,
    KubernetesBackend,
    SlurmBackend,
    load_backend,
)

from ...slurm import SlurmCluster, slurm_cluster

REASON = "trainwarden: FatalXid XID 79 on rank 1"

# Each task prints the environment a trainer reads, then trains (sleeps) until killed.
TASK = """\
import json, os, time
keys = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURMD_NODENAME", "SLURM_RESTART_COUNT")
print(json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with slurm_cluster() as c:
        yield c


@pytest.fixture
def slurm(cluster: SlurmCluster) -> SlurmCluster:
    cluster.reset()
    return cluster


def backend(cluster: SlurmCluster, **kwargs: Any) -> SlurmBackend:
    return SlurmBackend(env={"SLURM_CONF": str(cluster.conf)}, **kwargs)


def tasks(cluster: SlurmCluster, job: str) -> list[dict[str, str | None]]:
    return [json.loads(line) for line in cluster.output(job).splitlines() if line.startswith("{")]


def start_training(cluster: SlurmCluster, tmp_path: Path) -> str:
    """A requeueable job that may run on 1 or 2 nodes: Slurm gives it both when both are
    free, and after an eviction it runs again on the one that is left."""
    (tmp_path / "task.py").write_text(TASK)
    job = cluster.sbatch(
        "--requeue",
        "-N1-2",
        "--open-mode=append",  # keep the first attempt's lines after the requeue
        script=f"srun --ntasks-per-node=1 {sys.executable} {tmp_path / 'task.py'}",
    )
    cluster.wait_for("2 tasks on node1 and node2", lambda: len(tasks(cluster, job)) == 2)
    assert cluster.job_nodes(job) == ["node1", "node2"]
    return job


# -- Slurm --------------------------------------------------------------------------------


def test_slurm_drains_the_node_and_requeues_the_job_without_it(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    job = start_training(slurm, tmp_path)

    t0 = time.monotonic()
    result = backend(slurm).evict(Eviction(node="node2", reason=REASON, run="wrap"))
    took = time.monotonic() - t0
    print(f"\nSlurm eviction (drain + requeue through scontrol): {took:.2f} s")
    assert result.backend == "slurm" and result.node == "node2"
    assert result.steps == (
        f"scontrol update NodeName=node2 State=DRAIN 'Reason={REASON}'",
        f"squeue -h -w node2 -t CF,R,S -o '%i|%j' -> {job}",
        f"scontrol requeuehold {job}",
        f"scontrol update JobId={job} ExcNodeList=node2",
        f"scontrol release {job}",
    )
    assert slurm.node_state("node2") in ("draining", "drained")
    assert slurm.node_reason("node2") == REASON
    assert slurm.node_state("node1") != "drained"
    shown = slurm.job(job)
    assert shown["ExcNodeList"] == "node2"
    assert shown["Restarts"] == "1"
    assert shown["JobState"] in ("COMPLETING", "PENDING", "RUNNING")
    assert "held" not in shown["Reason"].lower(), shown  # released: it starts by itself

    # Slurm holds a requeued job back for cred_expire (5 s here, 120 s by default).
    slurm.wait_for("the requeued job's task", lambda: len(tasks(slurm, job)) == 3, timeout=20)
    assert slurm.job_nodes(job) == ["node1"]
    assert slurm.node_state("node2") == "drained"
    first = sorted(tasks(slurm, job)[:2], key=lambda t: str(t["SLURM_PROCID"]))
    assert [(t["SLURM_PROCID"], t["SLURMD_NODENAME"], t["SLURM_NTASKS"]) for t in first] == [
        ("0", "node1", "2"),
        ("1", "node2", "2"),
    ]
    assert tasks(slurm, job)[2] == {
        "SLURM_JOB_ID": job,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURMD_NODENAME": "node1",
        "SLURM_RESTART_COUNT": "1",
    }


def test_slurm_with_a_job_id_and_requeue_off_only_drains(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    job = slurm.sbatch("--requeue", "-N1-2", wrap="sleep 300")
    slurm.wait_job(job, "RUNNING")

    result = backend(slurm, requeue=False).evict(
        Eviction(node="node2", reason="drill\nsecond line", run="r", job_id=job)
    )

    assert result.steps == (
        "scontrol update NodeName=node2 State=DRAIN 'Reason=drill second line'",
    )
    assert slurm.node_state("node2") == "draining"  # the job still runs there
    assert slurm.node_reason("node2") == "drill second line"
    assert slurm.job_state(job) == "RUNNING"
    assert slurm.job_nodes(job) == ["node1", "node2"]


def test_slurm_finds_the_runs_job_among_the_jobs_on_the_node(slurm: SlurmCluster) -> None:
    gpt = slurm.sbatch("--requeue", "-N1-2", "--oversubscribe", "-J", "gpt", wrap="sleep 300")
    slurm.wait_job(gpt, "RUNNING")
    other = slurm.sbatch(
        "--requeue", "-w", "node2", "--oversubscribe", "-J", "other", wrap="sleep 300"
    )
    slurm.wait_job(other, "RUNNING")

    with pytest.raises(EvictError, match=r"2 jobs run on node2 and none is named 'bert': "):
        backend(slurm).evict(Eviction(node="node2", reason=REASON, run="bert"))
    result = backend(slurm).evict(Eviction(node="node2", reason=REASON, run="gpt"))

    assert f"squeue -h -w node2 -t CF,R,S -o '%i|%j' -> {gpt}" in result.steps
    assert f"scontrol requeuehold {gpt}" in result.steps
    assert slurm.job(gpt)["Restarts"] == "1"
    assert slurm.job_state(other) == "RUNNING"  # not the run's job: left alone


def test_slurm_job_that_may_not_be_requeued(slurm: SlurmCluster) -> None:
    job = slurm.sbatch("--no-requeue", "-N1-2", wrap="sleep 300")
    slurm.wait_job(job, "RUNNING")
    with pytest.raises(
        EvictError,
        match=rf"`scontrol requeuehold {job}` exited 1: Requested operation is presently disabled",
    ) as err:
        backend(slurm).evict(Eviction(node="node2", reason=REASON, run="r", job_id=job))
    assert len(err.value.steps) == 1  # the drain
    assert slurm.node_state("node2") == "draining"
    assert slurm.job_state(job) == "RUNNING"


def test_slurm_a_second_node_of_a_requeued_job_is_added_to_the_exclusions(
    slurm: SlurmCluster,
) -> None:
    job = slurm.sbatch("--requeue", "-N1-2", wrap="sleep 300")
    slurm.wait_job(job, "RUNNING")
    backend(slurm).evict(Eviction(node="node2", reason=REASON, run="r", job_id=job))
    result = backend(slurm).evict(Eviction(node="node1", reason=REASON, run="r", job_id=job))
    assert result.steps[-1] == f"scontrol update JobId={job} ExcNodeList=node2,node1"
    assert slurm.job(job)["ExcNodeList"] == "node2,node1"
    assert slurm.job(job)["Restarts"] == "1"  # requeued once


def test_slurm_unknown_node_fails_in_slurms_words(slurm: SlurmCluster) -> None:
    with pytest.raises(
        EvictError,
        match=r"^`scontrol update NodeName=node9 State=DRAIN 'Reason=.*'` exited 1: "
        r"slurm_update error: Invalid node name specified$",
    ) as err:
        backend(slurm).evict(Eviction(node="node9", reason=REASON, run="r"))
    assert err.value.steps == ()
    assert [slurm.node_state(n) for n in slurm.nodes] == ["idle", "idle"]


def test_slurm_unknown_job_fails_after_the_drain(slurm: SlurmCluster) -> None:
    with pytest.raises(EvictError, match="Invalid job id specified") as err:
        backend(slurm).evict(Eviction(node="node2", reason=REASON, run="r", job_id="999999"))
    # The bad node is drained whatever happens next; the error lists that it was.
    assert slurm.node_state("node2") == "drained"
    assert err.value.steps == (f"scontrol update NodeName=node2 State=DRAIN 'Reason={REASON}'",)


def test_slurm_wrong_scontrol_path() -> None:
    b = SlurmBackend(scontrol="/nonexistent/scontrol")
    with pytest.raises(EvictError, match="cannot run '/nonexistent/scontrol': No such file"):
        b.evict(Eviction(node="node2", reason=REASON, run="r", job_id="12"))


def test_slurm_hanging_command_is_killed_at_the_timeout(tmp_path: Path) -> None:
    pids, returned = tmp_path / "pids", tmp_path / "returned"
    hang = tmp_path / "scontrol"
    # The script and a child of its own both hold the output pipes; either, if it outlived
    # its 60 s, would say so in `returned`.
    hang.write_text(
        f"#!/bin/sh\n(sleep 60; touch {returned}) &\necho $$ $! > {pids}\n"
        f"sleep 60\ntouch {returned}\n"
    )
    hang.chmod(0o755)

    with pytest.raises(EvictError, match=r"timed out after 1 s \(killed\)"):
        SlurmBackend(scontrol=str(hang)).evict(
            Eviction(node="node2", reason=REASON, run="r", job_id="12"), timeout_s=1
        )
    assert not returned.exists()  # it returned while both still hung: it did not wait on them
    for pid in pids.read_text().split():
        deadline = time.monotonic() + 2  # SIGKILL was sent; its delivery takes a moment
        while _alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(int(pid)), f"pid {pid} of the timed-out command still runs"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


# -- command ------------------------------------------------------------------------------


def recorder(tmp_path: Path, body: str = "") -> Path:
    script = tmp_path / "evict.sh"
    script.write_text(
        f'#!/bin/sh\nprintf \'%s\\n\' "$@" > {tmp_path}/argv\necho "$TW_SITE" > {tmp_path}/env\n'
        + body
    )
    script.chmod(0o755)
    return script


def test_command_fills_the_templates_without_a_shell(tmp_path: Path) -> None:
    script = recorder(tmp_path, "echo drained $1\n")
    b = load_backend(
        {
            "backend": "command",
            "argv": [
                str(script),
                "{node}",
                "--reason={reason}",
                "{run}",
                "{job_id}",
                "{ranks}",
                "{{x}}",
            ],
            "env": {"TW_SITE": "lab"},
        }
    )
    e = Eviction(
        node="node2", reason="xid 79; $(touch pwned)", run="gpt-7b", job_id="12", ranks=(3, 5)
    )

    result = b.evict(e)

    assert (tmp_path / "argv").read_text().splitlines() == [
        "node2",
        "--reason=xid 79; $(touch pwned)",
        "gpt-7b",
        "12",
        "3,5",
        "{x}",
    ]
    assert not (tmp_path / "pwned").exists()
    assert (tmp_path / "env").read_text() == "lab\n"
    assert result.backend == "command"
    assert result.output == "drained node2"
    assert result.steps == (
        f"{script} node2 '--reason=xid 79; $(touch pwned)' gpt-7b 12 3,5 '{{x}}'",
    )


def test_command_unknown_job_id_is_an_empty_argument(tmp_path: Path) -> None:
    script = recorder(tmp_path)
    CommandBackend([str(script), "{job_id}", "{node}"]).evict(Eviction("n1", "r", "run"))
    assert (tmp_path / "argv").read_text().splitlines() == ["", "n1"]


def test_command_nonzero_exit_is_an_error_with_stderr(tmp_path: Path) -> None:
    script = recorder(tmp_path, "echo 'node n1 is not ours' >&2\nexit 3\n")
    with pytest.raises(EvictError, match=r"evict.sh n1` exited 3: node n1 is not ours$"):
        CommandBackend([str(script), "{node}"]).evict(Eviction("n1", "r", "run"))


def test_command_timeout_is_honoured(tmp_path: Path) -> None:
    script = recorder(tmp_path, f"sleep 30\ntouch {tmp_path}/returned\n")
    with pytest.raises(EvictError, match=r"timed out after 0.5 s"):
        CommandBackend([str(script)]).evict(Eviction("n1", "r", "run"), timeout_s=0.5)
    assert not (tmp_path / "returned").exists()  # it returned while the command still hung


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["evict", "{host}"], r"argv\[1\]: unknown placeholder \{host\}"),
        (["evict", "{node.name}"], r"argv\[1\]: unknown placeholder \{node.name\}"),
        (["evict", "{node:>9}"], r"argv\[1\]: \{node\} takes no format spec"),
        (["evict", "{node"], r"argv\[1\]: .*write \{\{ for a literal brace"),
        ("evict {node}", r"argv: must be a non-empty list"),
        ([], r"argv: must be a non-empty list"),
    ],
)
def test_command_bad_templates_are_rejected_at_load(argv: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_backend({"backend": "command", "argv": argv})


# -- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"backend": "lsf"}, r"backend: must be one of slurm, command, kubernetes, got 'lsf'"),
        ({"argv": ["x"]}, r"backend: must be one of"),
        ({"backend": "slurm", "partition": "gpu"}, r"partition: unknown option for backend slurm"),
        ({"backend": "slurm", "requeue": "yes"}, r"requeue: must be true or false"),
        (
            {"backend": "slurm", "env": {"SLURM_CONF": 1}},
            r"env: must be a mapping of names to strings",
        ),
        ({"backend": "command"}, r"argv: required"),
        ({"backend": "kubernetes"}, r"namespace: required"),
        (
            {"backend": "kubernetes", "namespace": "t", "label_selector": "job={job}"},
            r"label_selector: unknown placeholder \{job\}",
        ),
        (
            {"backend": "kubernetes", "namespace": "t", "grace_period_s": -1},
            r"grace_period_s: must be an integer >= 0",
        ),
    ],
)
def test_load_backend_names_the_bad_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_backend(spec)


def test_load_backend_slurm() -> None:
    b = load_backend({"backend": "slurm", "scontrol": "/opt/slurm/bin/scontrol", "requeue": False})
    assert isinstance(b, SlurmBackend)
    assert (b.name, b.scontrol, b.squeue, b.requeue) == (
        "slurm",
        "/opt/slurm/bin/scontrol",
        "squeue",
        False,
    )


@pytest.mark.parametrize("node", ["", "node[1-2]", "node1,node2", "node 2", "-h", "a=b"])
def test_eviction_refuses_anything_but_one_node_name(node: str) -> None:
    with pytest.raises(ValueError, match="is not one node name"):
        Eviction(node=node, reason="r", run="run")


def test_eviction_reason_is_one_short_line() -> None:
    e = Eviction(node="n1", reason="XID 79\n  on rank 3\t" + "x" * 300, run="run")
    assert e.reason.startswith("XID 79 on rank 3 xxx")
    assert len(e.reason) == 200 and e.reason.endswith("...")


# -- Kubernetes (its API calls, against a local server) -----------------------------------


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
