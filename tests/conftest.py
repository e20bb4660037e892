"""Real daemons for tests: in the test's loop, in a thread of its own, or as `kvd serve`.

Sockets live in short private temp dirs (a Unix socket path must stay under ~100 bytes).
Every fixture stops what it started within a bounded time, and checks that the daemon
ended cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
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
from kvd.errors import DaemonUnavailable


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Any]:
    # The daemon runs on uvloop in production; test it there too.
    return {"uvloop": uvloop.new_event_loop}


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
    subprocess (use the async client; both expose ``socket_path``)."""
    if request.param == "inproc":
        async with running_daemon(make_config(sock_dir)) as d:
            yield d
        return
    proc = ProcessDaemon(sock_dir)
    await asyncio.to_thread(proc.wait_ready)
    try:
        yield proc
    finally:
        code = await asyncio.to_thread(proc.stop)
        assert code == 0, f"daemon exit code {code}:\n{proc.log()}"


@contextlib.asynccontextmanager
async def running_daemon(config: Config) -> AsyncIterator[RunningDaemon]:
    stop = asyncio.Event()
    d = Daemon(config)
    task = asyncio.create_task(d.serve(shutdown_trigger=stop.wait))
    ready = asyncio.create_task(d.ready.wait())
    await asyncio.wait([task, ready], timeout=20, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()  # raise the startup error
    assert d.ready.is_set(), "daemon did not become ready"
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

    def start(self) -> ThreadDaemon:
        self._thread.start()
        assert self._started.wait(20), "daemon thread did not start"
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
    """`kvd serve` as a subprocess."""

    def __init__(self, sock_dir: str, *extra: str, env: dict[str, str] | None = None) -> None:
        self.socket_path = os.path.join(sock_dir, "kvd.sock")
        self.log_path = os.path.join(sock_dir, "daemon.log")
        cmd = [sys.executable, "-m", "kvd.cli", "serve", "--socket-path", self.socket_path,
               "--pool-size-bytes", "64MiB", "--log-level", "info", "--peer-port", "0",
               "--data-port", "0", "--http-port", "0", *extra]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env)

    def wait_ready(self, timeout_s: float = 30.0) -> ProcessDaemon:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited early:\n{self.log()}")
            if os.path.exists(self.socket_path):
                try:
                    with KvdClient(self.socket_path, timeout_s=1.0) as c:
                        c.ping()
                    return self
                except DaemonUnavailable:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready in {timeout_s}s:\n{self.log()}")

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(5)
        self._log.close()
        return code


def start_daemons(root: str, *names: str, extra: Sequence[str] = ()) -> list[ProcessDaemon]:
    """A ready `kvd serve` per name, each in its own folder under ``root``, node id = name."""
    daemons = []
    for name in names:
        path = os.path.join(root, name)
        os.makedirs(path)
        daemons.append(ProcessDaemon(path, "--node-id", name, *extra).wait_ready())
    return daemons


@pytest.fixture
def process_daemon(sock_dir: str) -> Iterator[ProcessDaemon]:
    d = ProcessDaemon(sock_dir).wait_ready()
    yield d
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
