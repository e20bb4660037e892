"""The processes of the example: two kvd daemons, the prefill and decode workers (prefill on
daemon 1, decode on daemon 2), and the proxy. Each runs as a subprocess with its log in the
run's directory; ``Cluster.close()`` stops every one of them (SIGTERM, wait, SIGKILL).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvd import KvdClient
from kvd.errors import KvdError

HERE = os.path.dirname(os.path.abspath(__file__))
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Proc:
    """A subprocess with its output in ``<root>/<name>.log``."""

    def __init__(self, name: str, cmd: list[str], root: str, env: dict[str, str]) -> None:
        self.name, self.cmd, self.env = name, cmd, env
        self.log_path = os.path.join(root, f"{name}.log")
        self._terminated = False
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def failed(self, what: str) -> RuntimeError:
        return RuntimeError(f"{self.name} {what} (exit code {self.popen.poll()}); its log "
                            f"{self.log_path} ends:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def terminate(self) -> None:
        """SIGTERM, once: a second one would cut a graceful shutdown short."""
        if self.alive() and not self._terminated:
            self._terminated = True
            self.popen.terminate()

    def stop(self, timeout_s: float = 15.0) -> int:
        self.terminate()
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait(10)


@dataclass
class Daemon:
    proc: Proc
    socket_path: str
    peer_address: str = ""


def start_daemon(root: str, name: str) -> Daemon:
    home = os.path.join(root, name)
    os.makedirs(home, exist_ok=True)
    sock = os.path.join(home, "kvd.sock")
    cmd = [sys.executable, "-m", "kvd.cli", "serve", "--socket-path", sock,
           "--peer-port", "0", "--data-port", "0", "--http-port", "0",
           "--pool-size-bytes", "256MiB", "--log-level", "warning"]
    return Daemon(Proc(f"kvd-{name}", cmd, root, child_env()), sock)


def wait_daemon(d: Daemon, timeout_s: float = START_TIMEOUT_S) -> Daemon:
    """Wait until the daemon answers; learn its peer address."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not d.proc.alive():
            raise d.proc.failed("exited during startup")
        if os.path.exists(d.socket_path):
            try:
                with KvdClient(d.socket_path, timeout_s=2.0) as c:
                    d.peer_address = c.stats()["peer"]["address"]
                return d
            except KvdError:
                pass
        time.sleep(0.05)
    raise d.proc.failed(f"not ready within {timeout_s:g}s")


def daemon_stats(d: Daemon) -> dict[str, Any]:
    with KvdClient(d.socket_path, timeout_s=5.0) as c:
        return c.stats()


def start_worker(kind: str, root: str, name: str, port: int, daemon: Daemon, model_dir: str,
                 device: str) -> Proc:
    cmd = [sys.executable, os.path.join(HERE, f"{kind}_worker.py"), "--port", str(port),
           "--socket", daemon.socket_path, "--model-dir", model_dir, "--device", device]
    return Proc(name, cmd, root, child_env(KVD_SOCKET_PATH=daemon.socket_path))


def start_proxy(root: str, port: int, prefill_urls: list[str],
                decode: list[tuple[str, str]], kv_timeout_s: float) -> Proc:
    cmd = [sys.executable, os.path.join(HERE, "proxy.py"), "--port", str(port),
           "--kv-timeout-s", str(kv_timeout_s)]
    for url in prefill_urls:
        cmd += ["--prefill", url]
    for url, peer in decode:
        cmd += ["--decode", f"{url}={peer}"]
    return Proc("proxy", cmd, root, child_env())


def wait_healthy(url: str, proc: Proc, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until ``GET url/healthz`` answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise proc.failed("exited during startup")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise proc.failed(f"did not answer {url}/healthz within {timeout_s:g}s")


@dataclass
class WorkerProc:
    kind: str
    name: str
    port: int
    daemon: Daemon
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Cluster:
    """``prefill_workers`` prefill workers on daemon p1, ``decode_workers`` decode workers on
    daemon p2, one proxy over all of them. Use as a context manager."""

    root: str
    model_dir: str
    device: str = "cpu"
    kv_timeout_s: float = 5.0
    prefill_workers: int = 1
    decode_workers: int = 1
    daemons: list[Daemon] = field(default_factory=list)
    workers: list[WorkerProc] = field(default_factory=list)
    proxy: Proc | None = None
    proxy_url: str = ""

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.daemons = [start_daemon(self.root, "p1"), start_daemon(self.root, "p2")]
        for d in self.daemons:
            wait_daemon(d)
        p1, p2 = self.daemons
        self.workers = (
            [WorkerProc("prefill", f"prefill{i}", free_port(), p1)
             for i in range(self.prefill_workers)]
            + [WorkerProc("decode", f"decode{i}", free_port(), p2)
               for i in range(self.decode_workers)])
        for w in self.workers:
            self._start_worker(w)
        port = free_port()
        self.proxy_url = f"http://127.0.0.1:{port}"
        self.proxy = start_proxy(self.root, port, [w.url for w in self.of("prefill")],
                                 [(w.url, w.daemon.peer_address) for w in self.of("decode")],
                                 self.kv_timeout_s)
        for w in self.workers:
            assert w.proc is not None
            wait_healthy(w.url, w.proc)
        wait_healthy(self.proxy_url, self.proxy)

    def of(self, kind: str) -> list[WorkerProc]:
        return [w for w in self.workers if w.kind == kind]

    def _start_worker(self, w: WorkerProc) -> None:
        w.proc = start_worker(w.kind, self.root, w.name, w.port, w.daemon, self.model_dir,
                              self.device)

    def kill_worker(self, w: WorkerProc) -> None:
        """SIGKILL: no goodbye to its daemon, which notices the closed connection."""
        if w.proc is not None:
            w.proc.kill()

    def restart_worker(self, w: WorkerProc) -> None:
        """Kill it and start it again on the same port (it registers its blocks anew)."""
        self.kill_worker(w)
        self._start_worker(w)
        assert w.proc is not None
        wait_healthy(w.url, w.proc)

    def close(self) -> dict[str, int]:
        """Stop everything: the proxy, the workers, then the daemons; exit codes by name."""
        codes: dict[str, int] = {}
        procs = [self.proxy, *(w.proc for w in self.workers)]
        for group in (procs, [d.proc for d in self.daemons]):
            live = [p for p in group if p is not None]
            for p in live:
                p.terminate()
            for p in live:
                codes[p.name] = p.stop()
        return codes
