"""Real daemons for tests: in the test's loop, in a thread of its own, or as `kvd serve`.

Sockets live in short private temp dirs (a Unix socket path must stay under ~100 bytes).
Every fixture stops what it started within a bounded time, whatever fails, and checks that
the daemon ended cleanly. A `kvd serve` not ready in time is killed on the spot; at the
end of the session any `kvd serve` the tests started and left running is killed and fails
the run (``no_daemon_left_behind``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop

from kvd.client import KvdClient
from kvd.config import Config, load_config
from kvd.daemon.service import Daemon
from kvd.errors import KvdError
from tests.serve_forks import Forks

# Where every ProcessDaemon comes from (see serve_forks.py): started at its first use,
# ended with the session.
FORKS = Forks()

# How long a `kvd serve` may take to answer its first ping: generous (under the
# per-test timeout), as a loaded machine (the 2-core CI under a full suite) can take tens
# of seconds to import torch and allocate a pool. A daemon that exits fails at once.
READY_TIMEOUT_S = 90.0
# Every process the tests start inherits this variable, set to the session's pid: how the
# end of the session finds the daemons they left behind, even those whose parent is gone.
# (Not a KVD_* name: the daemon would warn that it ignores it.)
_SESSION_MARK = "PYTEST_KVD_SESSION"
os.environ[_SESSION_MARK] = str(os.getpid())


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Any]:
    # The daemon runs on uvloop in production; test it there too.
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session", autouse=True)
def no_daemon_left_behind() -> Iterator[None]:
    """The safety net, at the end of the session: a `kvd serve` the tests started that
    still runs is a leak. It is killed, and the run fails naming it (an error at the
    teardown of the last test), so that the test that left it gets fixed."""
    yield
    FORKS.close()
    leaked = leaked_daemons()
    for pid, _ in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if leaked:
        lines = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in leaked)
        pytest.fail(f"{len(leaked)} `kvd serve` started by the tests still ran at the end of "
                    f"the session (killed now):\n{lines}", pytrace=False)


def leaked_daemons() -> list[tuple[int, str]]:
    """(pid, command line) of each live `kvd serve` started in this session (its
    environment carries the session's mark), this process's descendants or not."""
    mark = f"{_SESSION_MARK}={os.environ.get(_SESSION_MARK, '')}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (os.getpid(), FORKS.pid):
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if not _is_serve(argv):
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue  # exited, not yet reaped: holds nothing
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append((int(name), b" ".join(argv).decode(errors="replace").strip()))
    return found


def tagged_processes(var: str, tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of each live process whose environment has ``var=tag``: how a
    benchmark's test finds every process its run started, descendants or not."""
    want = f"{var}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue  # (ended; its parent reaps it)
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found.append((int(name), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, IndexError):
            continue
    return found


def reap_tagged(var: str, tag: str, wait_s: float = 10.0) -> list[tuple[int, str]]:
    """What a run tagged ``var=tag`` left behind after ``wait_s`` (a child may still be
    exiting): killed now, and returned for the assertion."""
    deadline = time.monotonic() + wait_s
    left = tagged_processes(var, tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = tagged_processes(var, tag)
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    return left


def _is_serve(argv: list[bytes]) -> bool:
    """`python -m kvd.cli serve ...`, `.../kvd serve ...`, or one forked by FORKS (which
    shows the command line of the process it was forked from)."""
    if b"tests.serve_forks" in argv:
        return True
    for i, arg in enumerate(argv[:-1]):
        if (arg == b"kvd.cli" or arg.endswith(b"/kvd") or arg == b"kvd") and \
                argv[i + 1] == b"serve":
            return True
    return False


@pytest.fixture
def sock_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvd-t-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_config(sock_dir: str, **overrides: Any) -> Config:
    values: dict[str, Any] = {
        "socket_path": os.path.join(sock_dir, "kvd.sock"),
        "pool_size_bytes": 64 * 2**20,
        "drain_grace_s": 10.0,
        "peer_port": 0,
        "data_port": 0,
        "http_port": 0,
    }
    values.update(overrides)
    return load_config(env={}, overrides=values)


def free_port() -> int:
    """A port free now, for a daemon that must know it before it starts (an allow-list
    names it). Below the kernel's ephemeral range (ip_local_port_range, 32768 and up):
    a port from bind(0) is one a running daemon's next outgoing connection may take
    before the new daemon binds it (seen in CI: "Address already in use")."""
    while True:
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@dataclass
class RunningDaemon:
    daemon: Daemon
    config: Config

    @property
    def socket_path(self) -> str:
        return self.config.socket_path


@pytest.fixture(params=["inproc", "process"])
async def daemon(request: Any, sock_dir: str) -> AsyncIterator[Any]:
    """A daemon in the test's own event loop, then the same tests against `kvd serve` as a
    subprocess (use the async client; both expose ``socket_path``). A test marked
    ``in_process_only`` takes the first only."""
    if request.param == "inproc":
        async with running_daemon(make_config(sock_dir)) as d:
            yield d
        return
    proc = ProcessDaemon(sock_dir)
    try:
        await asyncio.to_thread(proc.wait_ready)
        yield proc
    finally:
        code = await asyncio.to_thread(proc.stop)
    assert code == 0, f"daemon exit code {code}:\n{proc.log()}"


# For a test of what the daemon's rules do with a request, which a second process changes
# nothing in (the wire, the engine and the pool are the same code either way): the
# `daemon` fixture's daemon in the test's loop only. Tests of what crosses processes (the
# segments' memory, the timing of cancels and of concurrent clients, the socket as `kvd
# serve` sets it up) keep both. Each `kvd serve` costs a second or two of start-up.
in_process_only = pytest.mark.parametrize("daemon", ["inproc"], indirect=True)


@contextlib.asynccontextmanager
async def running_daemon(config: Config) -> AsyncIterator[RunningDaemon]:
    stop = asyncio.Event()
    d = Daemon(config)
    task = asyncio.create_task(d.serve(shutdown_trigger=stop.wait))
    ready = asyncio.create_task(d.ready.wait())
    try:
        await asyncio.wait([task, ready], timeout=READY_TIMEOUT_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raise the startup error
        assert d.ready.is_set(), f"daemon not ready in {READY_TIMEOUT_S:g}s"
    except BaseException:
        ready.cancel()
        task.cancel()  # (startup is cancellable: its exit stack releases what it took)
        await asyncio.wait([task], timeout=30)
        raise
    try:
        yield RunningDaemon(d, config)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


class ThreadDaemon:
    """A daemon on its own uvloop in a thread, for the blocking client."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.socket_path = config.socket_path
        self.daemon: Daemon | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvd-test-daemon")

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.daemon = Daemon(self.config)
            serve = asyncio.create_task(self.daemon.serve(shutdown_trigger=self._stop.wait))
            ready = asyncio.create_task(self.daemon.ready.wait())
            await asyncio.wait([serve, ready], return_when=asyncio.FIRST_COMPLETED)
            self._started.set()
            await serve

        try:
            uvloop.run(main())
        except BaseException as exc:
            self._error = exc
            self._started.set()

    def start(self, wait: bool = True) -> ThreadDaemon:
        """Start its thread; with ``wait``, return once it is ready (``wait_ready``)."""
        self._thread.start()
        return self.wait_ready() if wait else self

    def wait_ready(self) -> ThreadDaemon:
        if not self._started.wait(READY_TIMEOUT_S):
            self.stop()
            raise AssertionError(f"daemon thread not ready in {READY_TIMEOUT_S:g}s")
        if self._error:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "daemon thread did not stop"
        if self._error:
            raise self._error


@pytest.fixture
def thread_daemon(sock_dir: str) -> Iterator[ThreadDaemon]:
    d = ThreadDaemon(make_config(sock_dir)).start()
    yield d
    d.stop()


class ProcessDaemon:
    """`kvd serve` as a process of its own (forked by FORKS), its log in ``sock_dir``.
    Whoever starts one stops it (``stop``) whatever fails, from the moment it is created:
    ``wait_ready`` kills it when it fails.

    ``socket_path``: its socket (default: ``kvd.sock`` in ``sock_dir``), given with
    ``--socket-path``, or not (``socket_flag=False``: where the daemon finds it by default,
    from ``env``). ``open_files``: its limit on open files (soft and hard)."""

    def __init__(self, sock_dir: str, *extra: str, env: dict[str, str] | None = None,
                 socket_path: str | None = None, socket_flag: bool = True,
                 open_files: int | None = None) -> None:
        self.socket_path = socket_path or os.path.join(sock_dir, "kvd.sock")
        self.log_path = os.path.join(sock_dir, "daemon.log")
        where = ["--socket-path", self.socket_path] if socket_flag else []
        argv = ["serve", *where, "--pool-size-bytes", "64MiB", "--log-level", "info",
                "--peer-port", "0", "--data-port", "0", "--http-port", "0", *extra]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        full_env.update(env or {})
        self.proc = FORKS.spawn(argv, full_env, self.log_path, open_files)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> ProcessDaemon:
        """Until it answers a ping; if it exits first, or does not answer within
        ``timeout_s``, it is killed and this raises with its log."""
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop(timeout_s=0)
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no socket file yet"
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited early ({self.proc.returncode}):\n"
                                     f"{self.log()}")
            if os.path.exists(self.socket_path):
                try:
                    with KvdClient(self.socket_path, timeout_s=5.0) as c:
                        c.ping()
                    return
                except KvdError as exc:  # not listening yet, or too busy to answer in time
                    last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon not ready in {timeout_s:g}s (last: {last}):\n"
                                     f"{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def peer_address(self) -> str:
        """host:port of its peer socket, as other daemons reach it."""
        with KvdClient(self.socket_path) as c:
            return str(c.stats()["peer"]["address"])

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, and SIGKILL after ``timeout_s`` (0: at once); its exit code."""
        if self.proc.poll() is None and timeout_s > 0:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(30)
        return code


def start_daemons(root: str, *names: str, extra: Sequence[str] = (),
                  env: dict[str, str] | None = None) -> list[ProcessDaemon]:
    """A ready `kvd serve` per name, each in its own folder under ``root``, node id = name,
    ``env`` added to its environment (started together, then waited for; if one fails, all
    are stopped)."""
    daemons: list[ProcessDaemon] = []
    try:
        for name in names:
            path = os.path.join(root, name)
            os.makedirs(path)
            daemons.append(ProcessDaemon(path, "--node-id", name, *extra, env=env))
        for d in daemons:
            d.wait_ready()
    except BaseException:
        for d in daemons:
            d.stop(timeout_s=0)
        raise
    return daemons


@pytest.fixture
def process_daemon(sock_dir: str) -> Iterator[ProcessDaemon]:
    d = ProcessDaemon(sock_dir)
    try:
        d.wait_ready()
        yield d
    finally:
        code = d.stop()
    assert code == 0, f"daemon exit code {code}:\n{d.log()}"


def wait_until(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval_s)
