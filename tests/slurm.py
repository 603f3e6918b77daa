"""A real two-node Slurm cluster on this host, for tests and drills.

``slurm_cluster()`` starts munged, slurmctld and one slurmd per node (``slurmd -N
node1``, ``slurmd -N node2``, each on its own port) in a temporary directory, waits
until every node is idle (well under a second), yields a :class:`SlurmCluster`, and
stops everything afterwards. It follows /work/shared/RECIPES.md ("A two-node Slurm
cluster on one host"), with these choices:

- Every daemon runs in the foreground as our child (``-D`` / ``-F``): we know each pid
  and read no pid file. munged is our own instance with its own socket and key, so a
  munged already running on the host (or its stale socket) does not matter; Slurm
  finds ours through ``AuthInfo=socket=...``.
- Ports are picked free at start and the state lives in a fresh directory, so an
  earlier run cannot collide with this one. What an earlier run left running (it was
  killed before its cleanup) is killed at the next start: every process of a cluster
  has that cluster's ``SLURM_CONF`` in its environment, which names its directory.
- ``KillWait=2`` and ``cred_expire=5``: Slurm holds a requeued job back for
  ``cred_expire`` + 1 s (120 s by default), here 6 s. ``sched_interval=1``: a job
  whose hold ends is started within a second (the default main loop waits 60 s).

Needs root (the daemons run as root, munged as the ``munge`` user). If the binaries are
missing, :func:`slurm_cluster` fails the test and names the packages to install: it
never skips.

Use it from a test module through a fixture of the scope you need::

    @pytest.fixture(scope="module")
    def cluster() -> Iterator[SlurmCluster]:
        with slurm_cluster() as c:
            yield c

A job over both nodes whose tasks run Python (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURMD_NODENAME`` set per task). ``-N1-2`` with no task options gets both nodes when
both are free (``--ntasks-per-node=1`` on sbatch would make Slurm pick one), and after an
eviction it runs again on the node that is left::

    job = cluster.sbatch("--requeue", "-N1-2", "--open-mode=append",
                         script=f"srun --ntasks-per-node=1 {sys.executable} train.py")
    cluster.wait_job(job, "RUNNING")
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

INSTALL = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
BINARIES = ("slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "sbatch", "scancel", "munged")
PREFIX = "tw-slurm-"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing_binaries() -> list[str]:
    found = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=found) is None]


def require_slurm() -> None:
    """Fail (never skip) the calling test when Slurm or munge is not installed."""
    missing = missing_binaries()
    if missing:
        pytest.fail(
            f"Slurm is not installed here (missing: {', '.join(missing)}). "
            f"Install it with: {INSTALL}  (scripts/test.sh does this).",
            pytrace=False,
        )
    if os.geteuid() != 0:
        pytest.fail(
            "the Slurm test cluster needs root (slurmd runs jobs as their user, munged as "
            "the munge user); run the tests as root",
            pytrace=False,
        )


@dataclass
class SlurmCluster:
    """A running cluster. Every command needs ``env`` (it carries ``SLURM_CONF``)."""

    base: Path
    conf: Path
    nodes: tuple[str, ...]
    env: dict[str, str]
    user: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    # -- commands -------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 20.0) -> str:
        """Run a Slurm command with this cluster's env; its stdout (stripped)."""
        r = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and r.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {r.returncode}: {(r.stderr or r.stdout).strip()}"
            )
        return r.stdout.strip()

    def sbatch(
        self,
        *args: str,
        script: str | None = None,
        wrap: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Submit a batch job; returns its id. ``script`` is the body of a bash script, or
        ``wrap`` one command; ``args`` are sbatch options. The job starts in ``self.base``,
        writes ``self.base/job-<id>.out`` (see :meth:`output`) and gets this process's
        environment plus ``env`` (sbatch exports the submitter's environment)."""
        if (script is None) == (wrap is None):
            raise ValueError("give script= or wrap=")
        argv = ["sbatch", "--parsable", f"--chdir={self.base}"]
        argv += [f"--output={self.base}/job-%j.out", *args]
        if wrap is not None:
            argv.append(f"--wrap={wrap}")
        r = subprocess.run(
            argv,
            input="" if script is None else "#!/bin/bash\n" + script + "\n",
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=20,
        )
        if r.returncode != 0:
            raise RuntimeError(f"sbatch exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def node_state(self, name: str) -> str:
        """sinfo's long state of one node: idle, mixed, allocated, draining, drained, ...
        (a trailing ``*`` means the node does not answer)."""
        return self.run("sinfo", "-h", "-N", "-n", name, "-o", "%T")

    def node_reason(self, name: str) -> str:
        return self.run("sinfo", "-h", "-N", "-n", name, "-o", "%E")

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``: JobState, NodeList, ExcNodeList, Restarts, ..."""
        out = self.run("scontrol", "show", "job", "-o", job_id)
        fields: dict[str, str] = {}
        # Values may contain spaces only in the last fields (Command, WorkDir...); the
        # keys we need come first and hold no spaces.
        for m in re.finditer(r"(\w+(?::\w+)?)=(\S*)", out):
            fields.setdefault(m.group(1), m.group(2))
        return fields

    def job_state(self, job_id: str) -> str:
        return self.job(job_id)["JobState"]

    def job_nodes(self, job_id: str) -> list[str]:
        """The nodes the job runs on now (expanded), [] while pending."""
        nodelist = self.job(job_id).get("NodeList", "(null)")
        if nodelist in ("", "(null)"):
            return []
        return self.run("scontrol", "show", "hostnames", nodelist).split()

    def output(self, job_id: str) -> str:
        path = self.base / f"job-{job_id}.out"
        return path.read_text() if path.exists() else ""

    # -- waiting --------------------------------------------------------------------

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if check():
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:g} s waiting for {what}\n{self.describe()}"
                )
            time.sleep(0.1)

    def wait_job(self, job_id: str, state: str, timeout: float = 15.0) -> None:
        self.wait_for(f"job {job_id} {state}", lambda: self.job_state(job_id) == state, timeout)

    def wait_idle(self, timeout: float = 15.0) -> None:
        self.wait_for(
            "all nodes idle",
            lambda: set(self.run("sinfo", "-h", "-N", "-o", "%T").split()) == {"idle"},
            timeout,
        )

    def describe(self) -> str:
        """What an assertion message needs: sinfo, squeue and the daemons' log tails."""
        parts = []
        for argv in (("sinfo", "-N", "-o", "%N %T %E"), ("squeue", "-o", "%i %T %N %r")):
            try:
                parts.append(self.run(*argv, check=False, timeout=5))
            except subprocess.TimeoutExpired:
                parts.append(f"{argv[0]}: timed out")
        for log in sorted(self.base.glob("*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-8:]))
        return "\n".join(parts)

    def reset(self) -> None:
        """Cancel every job and return every node to idle (between tests)."""
        self.run("scancel", f"--user={self.user}", check=False)
        self.wait_for("no jobs", lambda: not self.run("squeue", "-h", "-o", "%i"), 30)
        for node in self.nodes:
            if "drain" in self.node_state(node) or "down" in self.node_state(node):
                self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
        self.wait_idle()


# -- start and stop ---------------------------------------------------------------------


def _slurm_conf(base: Path, nodes: Sequence[str], user: str, extra: str) -> str:
    ctld_port = _free_port()
    lines = [
        "ClusterName=trainwarden",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={base}/munge/munge.socket,cred_expire=5",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=1",
        "SchedulerType=sched/backfill",
        "KillWait=2",
        "MinJobAge=300",
        "SchedulerParameters=sched_interval=1,bf_interval=1",
        "MessageTimeout=5",
        "SlurmdTimeout=30",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        f"StateSaveLocation={base}/state",
        f"SlurmdSpoolDir={base}/spool/%n",
        f"SlurmctldPidFile={base}/slurmctld.pid",
        f"SlurmdPidFile={base}/slurmd-%n.pid",
        f"SlurmctldLogFile={base}/slurmctld.log",
        f"SlurmdLogFile={base}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for node in nodes:
        lines.append(
            f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname=localhost Port={_free_port()} "
            "CPUs=1 RealMemory=500 State=UNKNOWN"
        )
    lines.append(
        # OverSubscribe=YES: jobs that ask with --oversubscribe may share a node's CPU.
        f"PartitionName=main Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=YES"
    )
    return "\n".join(lines) + "\n" + extra


def _processes_of(bases: Callable[[Path], bool]) -> list[int]:
    """Pids whose environment names a cluster directory ``bases`` selects.

    Every process of a cluster carries its ``SLURM_CONF``: the daemons (we start them
    with it), the slurmstepds (they inherit slurmd's) and the job's tasks (sbatch
    exports the submitter's environment). So this finds what ``scontrol shutdown``
    leaves behind, and nothing else: the directory name is unique to one run.
    """
    tmp = re.escape(tempfile.gettempdir().encode())
    pattern = re.compile(
        rb"SLURM_CONF=(" + tmp + rb"/" + PREFIX.encode() + rb"[^/\0]+)/slurm\.conf"
    )
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            m = pattern.search((proc / "environ").read_bytes())
        except OSError:
            continue  # gone, or not ours to read
        if m and bases(Path(m.group(1).decode())):
            found.append(int(proc.name))
    return found


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _stop_leftovers() -> None:
    """Stop what earlier runs left running (a run killed before its cleanup, or jobs
    that outlived their slurmd): the processes of every cluster directory whose owner
    (the process that started it, recorded in ``owner``) is gone."""

    def stale(base: Path) -> bool:
        try:
            owner = int((base / "owner").read_text())
        except (OSError, ValueError):
            # No owner yet: another test process (a parallel worker) may have just made
            # it and not written its owner; a cluster left without one is old.
            try:
                return time.time() - base.stat().st_mtime > 60
            except OSError:
                return True  # removed already: nobody owns it
        return not Path(f"/proc/{owner}").exists()

    _kill(_processes_of(stale))
    for base in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
        if stale(base):
            shutil.rmtree(base, ignore_errors=True)


def _start(
    cluster: SlurmCluster,
    name: str,
    argv: list[str],
    log: Path,
    user: pwd.struct_passwd | None = None,
) -> None:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            env=cluster.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=None if user is None else user.pw_uid,
            group=None if user is None else user.pw_gid,
            extra_groups=None if user is None else [],
        )
    cluster.procs[name] = proc


def _start_munged(cluster: SlurmCluster, munge_user: str | None) -> None:
    mdir = cluster.base / "munge"
    mdir.mkdir()
    mdir.chmod(0o711)  # clients must reach the socket; munged checks this
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(128))  # a fresh key: this cluster trusts only itself
    key.chmod(0o400)
    pw = pwd.getpwnam(munge_user) if munge_user is not None else None
    if pw is not None:
        for p in (mdir, key):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    argv = [
        "munged",
        "-F",
        f"--socket={mdir}/munge.socket",
        f"--key-file={key}",
        f"--pid-file={mdir}/munged.pid",
        f"--log-file={mdir}/munged.log",
        f"--seed-file={mdir}/munged.seed",
        "--num-threads=2",
    ]
    _start(cluster, "munged", argv, cluster.base / "munged.out", user=pw)
    socket_path = mdir / "munge.socket"
    deadline = time.monotonic() + 10
    while not socket_path.exists():
        _check_alive(cluster)
        if time.monotonic() > deadline:
            raise RuntimeError(f"munged did not create {socket_path} in 10 s")
        time.sleep(0.05)


def _check_alive(cluster: SlurmCluster) -> None:
    for name, proc in cluster.procs.items():
        if proc.poll() is not None:
            logs = []
            for log in sorted(cluster.base.glob("**/*.log")) + sorted(cluster.base.glob("*.out")):
                logs.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-10:]))
            raise RuntimeError(f"{name} exited with {proc.returncode}\n" + "\n".join(logs))


def _wait(cluster: SlurmCluster, what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        _check_alive(cluster)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"timed out after {timeout:g} s waiting for {what}\n{cluster.describe()}"
            )
        time.sleep(0.05)


def _shutdown(cluster: SlurmCluster) -> None:
    # Jobs first: slurmstepd and the job's tasks outlive "scontrol shutdown".
    with suppress(Exception):
        cluster.run("scancel", f"--user={cluster.user}", check=False, timeout=5)
        deadline = time.monotonic() + 5
        while cluster.run("squeue", "-h", "-o", "%i", timeout=5) and time.monotonic() < deadline:
            time.sleep(0.1)
    with suppress(Exception):
        cluster.run("scontrol", "shutdown", check=False, timeout=5)
    deadline = time.monotonic() + 5
    # slurmctld and the slurmds exit on "scontrol shutdown"; munged last (they need it).
    for name, proc in cluster.procs.items():
        if name == "munged":
            continue
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    munged = cluster.procs.get("munged")
    if munged is not None and munged.poll() is None:
        munged.terminate()
        try:
            munged.wait(5)
        except subprocess.TimeoutExpired:
            munged.kill()
            munged.wait(5)
    _kill(_processes_of(lambda base: base == cluster.base))


@contextmanager
def slurm_cluster(
    nodes: Sequence[str] = ("node1", "node2"), extra_conf: str = ""
) -> Iterator[SlurmCluster]:
    """Start a Slurm cluster with one single-CPU slurmd per name in ``nodes``."""
    require_slurm()
    _stop_leftovers()
    base = Path(tempfile.mkdtemp(prefix=PREFIX))
    base.chmod(0o755)  # munged (as the munge user) must reach its own subfolder
    (base / "owner").write_text(str(os.getpid()))
    user = pwd.getpwuid(os.geteuid()).pw_name
    for sub in ("state", *(f"spool/{n}" for n in nodes)):
        (base / sub).mkdir(parents=True)
    conf = base / "slurm.conf"
    conf.write_text(_slurm_conf(base, nodes, user, extra_conf))
    path = os.environ.get("PATH", "/usr/bin:/bin")
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": f"{path}:/usr/sbin:/sbin"}
    # A Slurm job's environment would otherwise leak into ours (tests run inside a job).
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["SLURM_CONF"] = str(conf)
    cluster = SlurmCluster(base=base, conf=conf, nodes=tuple(nodes), env=env, user=user)
    try:
        _start_munged(cluster, "munge" if user == "root" else None)
        _start(
            cluster, "slurmctld", ["slurmctld", "-D", "-c", "-f", str(conf)], base / "slurmctld.out"
        )
        _wait(
            cluster,
            "scontrol ping to say UP",
            lambda: "UP" in cluster.run("scontrol", "ping", check=False),
            15,
        )
        for node in nodes:
            _start(
                cluster,
                f"slurmd {node}",
                ["slurmd", "-D", "-f", str(conf), "-N", node],
                base / f"slurmd-{node}.out",
            )
        _wait(
            cluster,
            "every node idle",
            lambda: cluster.run("sinfo", "-h", "-N", "-o", "%T").split() == ["idle"] * len(nodes),
            15,
        )
        yield cluster
    finally:
        _shutdown(cluster)
        shutil.rmtree(base, ignore_errors=True)
