"""An eviction backend loaded from its configuration (each bad field named), and what an
``Eviction`` takes: one node name, and its reason as one short line."""

from __future__ import annotations

from typing import Any

import pytest

from trainwarden.collector.actions.evict import Eviction, SlurmBackend, load_backend


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
