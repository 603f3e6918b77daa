"""Rank and collector processes started warm: forked from a process that has already
imported what they import.

A drill's rank is ``python -m trainwarden.agent.demo_trainer ...`` with its own
environment. Started fresh, each one spends ~5 s of CPU before its first step: ``import
torch`` (~2.8 s) and torch._dynamo, which torch imports on the first ``Optimizer``
(~2 s). On this project's 2 cores that start-up, not the drills' steps, was most of the
end-to-end suite's CPU (``bench/results/test-suite-time-cpu-2vcpu.txt``).

So each test worker keeps one *warm* process (started on its first rank) that has
imported torch, torch._dynamo and torch.distributed and then waits. :func:`popen` asks it
to fork: the child takes the caller's environment, working directory, stdout and stderr
(passed as file descriptors), sets ``OMP_NUM_THREADS``' thread count, runs the module as
``__main__`` with ``runpy``, and exits as the interpreter does (an uncaught exception
to ``sys.excepthook``, then ``atexit`` handlers, the agent's last flush, non-daemon
threads joined). The warm process reaps it and sends its
exit code back; :class:`WarmProcess` is the ``subprocess.Popen`` subset the drills use.
The rank's own code is unchanged: what runs after the fork is what ``python -m`` runs.

Likewise ``trainwarden serve`` (``python -m trainwarden.collector.cli``), which the tests
start some 70 times (tests/conftest.py's ``start_serve``): its imports (FastAPI,
SQLAlchemy, Dash, uvicorn and the collector, ~1.5-2 s of CPU) are most of its start. Its
warm process imports those and not torch; each kind has its own (:data:`KINDS`).

What stays fresh: anything but ``python -m <module>`` of :data:`KINDS`, ``serve
--workers`` (a parent that forks its workers: started as users start it), a pipe for
stdout, and every run with ``TRAINWARDEN_TEST_WARM=0`` (the whole suite as before, to
check that a test does not depend on this). Trainers launched by torchrun, srun or
sbatch, and the CLI calls that tests of the CLI make, start as users start them.

``python -m tests.warm SOCKET KIND`` is the warm process itself.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Union

KINDS = {
    "trainwarden.agent.demo_trainer": "torch",
    "tests.e2e.hsdp_worker": "torch",
    "trainwarden.collector.cli": "collector",
}
"""The modules started warm, and the warm process each is forked from."""
_FRESH_ARGS = frozenset({"--workers"})  # serve --workers forks its own workers
_MAX_MESSAGE = 1 << 20


class WarmProcess:
    """A rank forked by the warm process: ``pid``, ``args``, ``returncode``, ``poll()``,
    ``wait(timeout)``, ``send_signal()``, ``terminate()`` and ``kill()``, as on ``Popen``."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn

    def _receive(self, timeout: float | None) -> bool:
        """Reads the exit message if it comes within ``timeout`` (None: wait for it)."""
        self._conn.settimeout(timeout)
        try:
            message = self._conn.recv(64)
        except (TimeoutError, BlockingIOError):
            return False
        if not message.startswith(b"exit "):
            raise RuntimeError(
                f"the warm launcher went away before rank pid {self.pid} exited"
                f" ({message!r}); see its log under {tempfile.gettempdir()}"
            )
        self.returncode = int(message.split()[1])
        self._conn.close()
        return True

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._receive(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this rank's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Process = Union["subprocess.Popen[bytes]", WarmProcess]


class _Launcher:
    """The client side of one warm process (one per test worker)."""

    def __init__(self, kind: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"trainwarden-warm-{kind}-"))
        self.socket = str(self.dir / "sock")
        self.log = self.dir / "warm.log"
        root = Path(__file__).resolve().parents[1]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.warm", self.socket, kind],
                cwd=root,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdin=subprocess.PIPE,  # its end of the pipe closes with this process
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        atexit.register(self.close)
        deadline = time.monotonic() + 180
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm launcher did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def close(self) -> None:
        """Ends the warm process (its stdin closes) and removes its folder."""
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def spawn(self, cmd: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> WarmProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.socket)
        request = {"module": cmd[2], "argv": cmd[3:], "env": env, "cwd": cwd}
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        reply = conn.recv(64)
        if not reply.startswith(b"pid "):
            log = self.log.read_text()
            raise RuntimeError(f"the warm launcher refused {cmd}: {reply!r}\n{log}")
        return WarmProcess(cmd, int(reply.split()[1]), conn)


_launchers: dict[str, _Launcher] = {}
_lock = threading.Lock()


def _fd(stream: Any, default: int) -> int | None:
    """A file descriptor for ``stream`` (None, an fd or a file); None if it has none."""
    if stream is None:
        return default
    if isinstance(stream, int) and stream >= 0:
        return stream
    fileno = getattr(stream, "fileno", None)
    return fileno() if fileno else None


def popen(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
) -> Process:
    """``subprocess.Popen(cmd, env=..., cwd=..., stdout=..., stderr=...)``, forked warm
    when ``cmd`` is ``[sys.executable, "-m", <one of KINDS>, ...]`` (see the module's
    docstring); a fresh process otherwise."""
    out = _fd(stdout, 1)
    err = out if stderr == subprocess.STDOUT else _fd(stderr, 2)
    kind = KINDS.get(cmd[2]) if len(cmd) >= 3 and cmd[:2] == [sys.executable, "-m"] else None
    warm = (
        os.environ.get("TRAINWARDEN_TEST_WARM", "1") != "0"
        and kind is not None
        and not _FRESH_ARGS.intersection(cmd)
        and out is not None
        and err is not None
    )
    if not warm:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
    assert kind is not None
    with _lock:
        launcher = _launchers.get(kind)
        if launcher is None or launcher.proc.poll() is not None:
            launcher = _launchers[kind] = _Launcher(kind)
    assert out is not None and err is not None
    return launcher.spawn(
        cmd, dict(os.environ if env is None else env), os.fspath(cwd or os.getcwd()), [out, err]
    )


def run(
    cmd: list[str], *, env: dict[str, str] | None = None, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, env=..., capture_output=True, text=True, timeout=...)``, the
    process started by :func:`popen` (its stdout and stderr through files); killed on a
    timeout, as ``subprocess.run`` does."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = popen(cmd, env=env, stdout=out, stderr=err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


# The warm process ------------------------------------------------------------------------


def _import(kind: str) -> None:
    """What a process of ``kind`` imports before its own work (and starts no thread)."""
    if kind == "torch":
        import torch._dynamo  # noqa: F401  (what the first Optimizer would import)
        import torch.distributed  # noqa: F401
        import torch.nn  # noqa: F401
        import torch.optim  # noqa: F401
    elif kind == "collector":  # serve's imports, its app's, and uvicorn's for serve's settings
        import httptools  # noqa: F401
        import psycopg  # noqa: F401
        import uvicorn.lifespan.on  # noqa: F401
        import uvicorn.loops.uvloop  # noqa: F401
        import uvicorn.protocols.http.httptools_impl  # noqa: F401
        import uvloop  # noqa: F401
        from sqlalchemy.dialects import postgresql, sqlite  # noqa: F401

        import trainwarden.collector.app  # noqa: F401
        import trainwarden.collector.cli.common  # noqa: F401
        import trainwarden.webui.app  # noqa: F401
    else:
        raise ValueError(f"no warm process of kind {kind!r}")


def _serve(path: str, kind: str) -> None:
    _import(kind)
    if threading.active_count() > 1:  # a fork would copy a thread's locks, not the thread
        names = [t.name for t in threading.enumerate()]
        raise RuntimeError(f"the {kind} imports started threads, so it cannot fork: {names}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for the name: ready
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "parent":  # the test worker has gone: so does this process
                return
            if key.data == "reap":
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 512):
                        pass
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        with contextlib.suppress(OSError):  # the caller may have stopped listening
                            conn.send(b"exit %d" % os.waitstatus_to_exitcode(status))
                        conn.close()
                continue
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 2)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                for other in (listener, *children.values()):
                    other.close()
                selector.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                conn.close()
                _child(request, fds)  # raises SystemExit: the interpreter exits as usual
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.send(b"pid %d" % pid)


def _child(request: dict[str, Any], fds: list[int]) -> None:
    import runpy

    torch = sys.modules.get("torch")  # a rank's warm process
    sys.stdin.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in {null, *fds}:
        if fd > 2:
            os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115  (fd 0, /dev/null, as Popen gives)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # python -m puts the working directory first
    threads = os.environ.get("OMP_NUM_THREADS")
    if torch is not None and threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    sys.argv = [request["module"], *request["argv"]]
    code: Any = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # uncaught: sys.excepthook, as the interpreter calls it (the
        sys.excepthook(*sys.exc_info())  # agent chains one to report the exception)
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "torch")
