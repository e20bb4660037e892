"""A mesh of ``kvd serve`` daemons on one machine, deployed as an operator deploys them,
under a steady random load; what each daemon costs; a SIGKILL and restart; and one daemon
with many links.

Run: ``python benchmarks/mesh.py [--daemons N] [--seconds S] [--rate R] [--links L]
[--block-bytes B] [--workers W] [--skip-restart] [--skip-links] [--quick] [--json]``

* **Deployment**: each daemon has its identity from ``kvd keygen``, one allow-list names
  every daemon (its public key and peer address), ``encrypt_data`` is on, and its config
  file lists every other daemon in ``peers`` (kept linked from the start: every pair dials
  each other at once). Daemons are ``kvd serve`` (``kvd.cli.main``), forked from a
  process that imported kvd once, as tests/serve_forks.py does: torch's import alone is
  5 s of a core per daemon on the 2-core machine. ``CUDA_VISIBLE_DEVICES`` is empty: the
  mesh is the host-memory path (TCP, TLS).
* **Load** (benchmarks/mesh_load.py): ``--workers`` processes, each a client of every
  daemon, start transfers open-loop at ``--rate`` in all: fresh keys, random pairs, half
  put into a waiting get, half lend then pull, one ``--block-bytes`` block each, every
  destination byte checked. Latency runs from a transfer's due time to both its calls
  having returned (p50/p99/p999/max); control pings go to each daemon in turn beside it.
  ``start_lag_p99_ms`` says how late the workers started transfers: when it is large the
  machine, not kvd, set the pace.
* **Per daemon** (/proc, after the load): threads, descriptors, established TCP
  connections (its socket descriptors found in /proc/net/tcp and tcp6), RSS, and idle CPU
  (% of a core over ``--idle-s`` with no load; from each thread's schedstat).
* **Link losses**: the daemons' own "peer down" log lines (logged at warning), which give
  each loss's reason and outlive a restart (``links_lost`` in ``kvd status`` starts
  again), from start to the end of the load (the simultaneous dials of the mesh forming,
  and the load); refused hellos (``bad_messages``) are reported beside them.
* **Restart**: the last daemon is SIGKILLed; the time until no other daemon lists it as
  linked, then it is started again on the same ports and keys: the time until it answers,
  until it and every other daemon list each other again, and one checked transfer to it.
* **Many links**: one more daemon, with no peers configured, gets ``--links`` links from
  *fake peers* (benchmarks/mesh_fakes.py: one process per 250 links holding CurveZMQ
  links that say hello and stay, as a daemon does with a peer it sends nothing to: no
  data connection, no heartbeat after the first). Its threads, descriptors, TCP
  connections and idle CPU with no link and with the links give ``threads_per_link``,
  ``fds_per_link``, ``tcp_per_idle_link`` and ``idle_cpu_per_1000_links`` (idle CPU % of
  a core with 1000 links, extrapolated linearly from 0 and the links made). At
  ``max_peer_links`` (1,024 by default) kvd closes its least recently used idle link for a
  new one: the links made, and any refused, are reported. With ``--skip-links`` these
  figures come from the mesh (each daemon's ``daemons - 1`` links; ``per_link_source``
  says which).

The last line of stdout with ``--json`` is one JSON object with every figure, and
``goals``: each goal of the issue with its target and the measured value (reported, never
asserted). Every process started is killed when the run ends however it ends (the
daemons and workers also die with this process: PR_SET_PDEATHSIG), and the whole run is
bounded in time (``--deadline-s``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from mesh_load import LoadPlan, LoadResult, worker_main  # noqa: E402

FAKES_PER_PROCESS = 250
FAKE_PORT_BASE = 1025  # fake peers' listed addresses: below the ports daemons are given
POLL_S = 0.01


def die_with_parent() -> None:
    """In a child: SIGKILL when its parent dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the finally blocks that stop every process


# Listening ports come from below the kernel's ephemeral range (32768 and up by default):
# a port the kernel handed out for a bind to 0 and took back may be handed again, or be
# taken as the source port of one of the mesh's own connections before its daemon
# listens (64 daemons' 128 ports collided so). Each is checked free and given out once.
_next_port = iter(range(random.randrange(20000, 28000), 32768))


def free_port() -> int:
    for port in _next_port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port left below 32768")


# ------------------------------------------------------------------ launching kvd


class Launcher:
    """A child forked before anything else, after kvd and torch are imported: it forks
    one grandchild per ``kvd`` command asked for (``kvd.cli.main(argv)``), so each starts
    at once without importing torch again. It never starts a thread, so forking it is
    safe. Requests and answers are JSON lines on two pipes."""

    def __init__(self) -> None:
        import kvd.cli
        import kvd.daemon.service  # noqa: F401  (what `kvd serve` imports: torch with it)

        ask_r, ask_w = os.pipe()
        answer_r, answer_w = os.pipe()
        parent = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(ask_w)
            os.close(answer_r)
            code = 0
            try:
                _launcher_loop(parent, ask_r, answer_w)
            except BaseException:  # (the benchmark reads the launcher's end)
                code = 1
            os._exit(code)
        os.close(ask_r)
        os.close(answer_w)
        self._ask = os.fdopen(ask_w, "w")
        self._answers = os.fdopen(answer_r, "r")

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        self._ask.write(json.dumps(request) + "\n")
        self._ask.flush()
        if not select.select([self._answers], [], [], 60)[0]:
            raise RuntimeError("the launcher did not answer in 60 s")
        line = self._answers.readline()
        if not line:
            raise RuntimeError("the launcher ended")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, argv: list[str], log: str, env: dict[str, str]) -> int:
        """Start ``kvd ARGV`` with stdout and stderr to ``log``; its pid."""
        pid: int = self._request({"run": argv, "log": log, "env": env})["pid"]
        return pid

    def reap(self, pid: int) -> int:
        """Wait for a child that has ended (or been killed); its exit code."""
        code: int = self._request({"reap": pid})["code"]
        return code

    def close(self) -> None:
        """Ends the launcher (its children are stopped first). It is told so: the load
        workers, forked after it, hold its pipe too, so it would never see the pipe end."""
        with contextlib.suppress(OSError, ValueError):
            self._ask.write(json.dumps({"exit": True}) + "\n")
            self._ask.close()
        deadline = time.monotonic() + 10
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                break
            time.sleep(0.02)
        self._answers.close()


def _launcher_loop(parent: int, ask_fd: int, answer_fd: int) -> None:
    die_with_parent()
    if os.getppid() != parent:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    asks = os.fdopen(ask_fd, "r")
    answers = os.fdopen(answer_fd, "w")
    for line in asks:
        request = json.loads(line)
        if "exit" in request:
            break
        if "run" in request:
            pid = os.fork()
            if pid == 0:
                _become_kvd(request, (ask_fd, answer_fd))
            answer = {"pid": pid}
        else:
            try:
                _, status = os.waitpid(request["reap"], 0)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            except ChildProcessError:
                code = -1
            answer = {"code": code}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    # The benchmark is done: whatever is left dies with us (PR_SET_PDEATHSIG).


def _become_kvd(request: dict[str, Any], pipes: tuple[int, int]) -> None:
    """In the forked grandchild: ``kvd ARGV``; never returns."""
    code = 1
    try:
        os.setsid()  # (a ^C at the terminal is the benchmark's to handle)
        die_with_parent()
        for fd in pipes:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from kvd.cli import main

        sys.argv = ["kvd", *request["run"]]
        code = main(request["run"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def pid_alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ------------------------------------------------------------------ daemons


@dataclass
class Daemon:
    name: str
    root: str
    peer_port: int
    data_port: int
    public_key: str = ""
    pid: int = 0
    client: Any = None  # a kvd.KvdClient of this benchmark's, for status

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.peer_port}"

    @property
    def socket_path(self) -> str:
        return os.path.join(self.root, "kvd.sock")

    @property
    def config_path(self) -> str:
        return os.path.join(self.root, "kvd.toml")

    @property
    def log_path(self) -> str:
        return os.path.join(self.root, "daemon.log")

    def log_lines(self, text: str) -> list[str]:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return [line for line in f if text in line]
        return []

    def log_tail(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return f.read()[-1500:]
        return ""


class Fleet:
    """Every daemon of the run, its keys and config files, and the processes behind them."""

    def __init__(self, launcher: Launcher, root: str, env: dict[str, str]) -> None:
        self.launcher = launcher
        self.root = root
        self.env = env
        self.daemons: list[Daemon] = []

    def add(self, name: str) -> Daemon:
        root = os.path.join(self.root, name)
        os.makedirs(root)
        daemon = Daemon(name, root, free_port(), free_port())
        self.daemons.append(daemon)
        return daemon

    def keygen(self, daemons: list[Daemon]) -> None:
        """Each daemon's identity from ``kvd keygen`` (run together: each is a fork)."""
        keys_dir = os.path.join(self.root, "keys")
        runs = {}
        for d in daemons:
            log = os.path.join(d.root, "keygen.json")
            runs[d.name] = (d, log, self.launcher.run(
                ["keygen", "--dir", keys_dir, "--name", d.name, "--json"], log, self.env))
        for d, log, pid in runs.values():
            code = self.launcher.reap(pid)
            with open(log) as f:
                text = f.read()
            if code != 0:
                raise RuntimeError(f"kvd keygen for {d.name} failed ({code}): {text[-500:]}")
            d.public_key = json.loads(text.strip().splitlines()[-1])["public_key"]

    def configure(self, d: Daemon, allow_list: str, peers: list[Daemon], pool: str) -> None:
        """The daemon's config file, as an operator writes it."""
        keys_dir = os.path.join(self.root, "keys")
        lines = {
            "socket_path": d.socket_path, "node_id": d.name, "peer_host": "127.0.0.1",
            "peer_port": d.peer_port, "data_port": d.data_port, "http_port": 0,
            "peers": ",".join(p.address for p in peers),
            "curve_secret_key_file": os.path.join(keys_dir, f"{d.name}.key_secret"),
            "curve_allowed_keys_file": allow_list, "encrypt_data": True,
            "pool_size_bytes": pool, "log_level": "warning"}
        with open(d.config_path, "w") as f:
            for key, value in lines.items():
                f.write(f"{key} = {json.dumps(value)}\n")

    def start(self, daemons: list[Daemon]) -> None:
        for d in daemons:
            d.pid = self.launcher.run(["serve", "--config", d.config_path], d.log_path, self.env)

    def wait_ready(self, daemons: list[Daemon], timeout_s: float) -> None:
        import kvd

        deadline = time.monotonic() + timeout_s
        for d in daemons:
            while True:
                if not pid_alive(d.pid):
                    raise RuntimeError(f"daemon {d.name} exited at start: {d.log_tail()}")
                if os.path.exists(d.socket_path):
                    with contextlib.suppress(kvd.KvdError):
                        client = kvd.KvdClient(d.socket_path, name="mesh-watch", timeout_s=30)
                        client.connect(timeout_s=1.0)
                        d.client = client
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon {d.name} not ready in {timeout_s:g}s: "
                                       f"{d.log_tail()}")
                time.sleep(0.05)

    def kill(self, d: Daemon) -> None:
        """SIGKILL, as a crash; reaped by the launcher."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGKILL)
        self.launcher.reap(d.pid)
        with contextlib.suppress(Exception):
            d.client.close()
        d.client = None

    def stop_all(self, grace_s: float = 10.0) -> None:
        for d in self.daemons:
            if d.client is not None:
                with contextlib.suppress(Exception):
                    d.client.close()
                d.client = None
        live = [d for d in self.daemons if d.pid and pid_alive(d.pid)]
        for d in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(d.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(pid_alive(d.pid) for d in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        for d in live:
            if pid_alive(d.pid):
                print(f"warning: {d.name} did not stop in {grace_s:g}s: killed", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(d.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.launcher.reap(d.pid)
            d.pid = 0


def linked_to(d: Daemon) -> set[str]:
    """The addresses ``d`` holds a live link to."""
    links = d.client.stats(timeout_s=10.0)["peer"]["links"]
    return {link["address"] for link in links if link["alive"]}


def wait_until(test: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``test()`` held, polled; None if it never did within the timeout."""
    start = time.monotonic()
    while True:
        if test():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(POLL_S)


# ------------------------------------------------------------------ /proc


def established_tcp_inodes() -> set[int]:
    inodes = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "01":  # TCP_ESTABLISHED
                    inodes.add(int(fields[9]))
    return inodes


def cpu_s(pid: int) -> float:
    """CPU time of every thread of ``pid`` (schedstat: nanoseconds, not 10 ms ticks)."""
    total = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    return total / 1e9


def process_figures(pid: int) -> dict[str, float]:
    """Threads, descriptors, established TCP connections, RSS (MiB)."""
    tcp_inodes = established_tcp_inodes()
    fds = tcp = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            fds += 1
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and int(target[8:-1]) in tcp_inodes:
                    tcp += 1
    rss_kib = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    threads = len(os.listdir(f"/proc/{pid}/task")) if pid_alive(pid) else 0
    return {"threads": threads, "fds": fds, "tcp": tcp, "rss_mib": round(rss_kib / 1024, 1)}


def idle_cpu_pct(pids: list[int], window_s: float) -> list[float]:
    """Each process's CPU over ``window_s`` of nothing asked of it, in % of a core."""
    before = [cpu_s(p) for p in pids]
    t0 = time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - t0
    return [round(100 * (cpu_s(p) - b) / elapsed, 2) for p, b in zip(pids, before, strict=True)]


# ------------------------------------------------------------------ figures


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def latency_figures(prefix: str, values: list[float]) -> dict[str, Any]:
    return {f"{prefix}p50_ms": quantile(values, 0.5), f"{prefix}p99_ms": quantile(values, 0.99),
            f"{prefix}p999_ms": quantile(values, 0.999),
            f"{prefix}max_ms": round(max(values), 3) if values else None}


def merge(results: list[LoadResult]) -> LoadResult:
    total = LoadResult()
    for r in results:
        total.put_ms += r.put_ms
        total.pull_ms += r.pull_ms
        total.ping_ms += r.ping_ms
        total.lag_ms += r.lag_ms
        total.errors += r.errors
        total.first_errors += r.first_errors
        total.bytes_checked += r.bytes_checked
        total.started += r.started
    return total


def loss_reasons(lines: list[str]) -> dict[str, int]:
    """"peer down" log lines counted by their reason, addresses and numbers taken out."""
    reasons: Counter[str] = Counter()
    for line in lines:
        reason = line.split("peer down", 1)[1].split(": ", 1)[-1].strip()
        reasons[re.sub(r"[0-9]+(\.[0-9]+)*(:[0-9]+)?", "N", reason)] += 1
    return dict(reasons)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the run


@dataclass
class Run:
    args: argparse.Namespace
    fleet: Fleet
    workers: list[tuple[BaseProcess, Connection]]
    out: dict[str, Any] = field(default_factory=dict)
    mesh: list[Daemon] = field(default_factory=list)
    hub: Daemon | None = None  # the many-links daemon
    fakes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    started_at: float = 0.0  # when the daemons were started

    # ---------------------------------------------------------------- setting up

    def deploy(self) -> None:
        args, fleet = self.args, self.fleet
        self.mesh = [fleet.add(f"mesh-{i}") for i in range(args.daemons)]
        self.hub = None if args.skip_links else fleet.add("hub")
        fleet.keygen(fleet.daemons)
        allow_list = os.path.join(fleet.root, "keys", "peers.txt")
        with open(allow_list, "w") as f:
            f.write("# every daemon of the mesh: its public key and peer address\n")
            for d in self.mesh:
                f.write(f"{d.public_key} {d.address}\n")
        for d in self.mesh:
            fleet.configure(d, allow_list, [p for p in self.mesh if p is not d], args.pool)
        if self.hub is not None:
            fleet.configure(self.hub, self.write_fake_keys(self.hub), [], "16MiB")
        self.started_at = time.monotonic()
        fleet.start(fleet.daemons)
        fleet.wait_ready(fleet.daemons, 60 + 2 * len(fleet.daemons))
        self.out["start_s"] = round(time.monotonic() - self.started_at, 2)
        say(f"{len(fleet.daemons)} daemons ready in {self.out['start_s']} s")

    def write_fake_keys(self, hub: Daemon) -> str:
        """The hub's allow-list: itself and one key per fake peer, each with an address
        of its own (the fakes' keys are made here: they are not deployed daemons)."""
        import zmq

        used = {d.peer_port for d in self.fleet.daemons}
        ports = (p for p in range(FAKE_PORT_BASE, 65536) if p not in used)
        allow_list = os.path.join(hub.root, "allowed.txt")
        self.fake_keys: list[str] = []
        with open(allow_list, "w") as f:
            f.write(f"{hub.public_key} {hub.address}\n")
            for _ in range(self.args.links):
                public, secret = (k.decode() for k in zmq.curve_keypair())
                address = f"127.0.0.1:{next(ports)}"
                f.write(f"{public} {address}\n")
                self.fake_keys.append(f"{public} {secret} {address}\n")
        return allow_list

    # ---------------------------------------------------------------- the mesh

    def form_mesh(self) -> None:
        everyone = {d.address for d in self.mesh}

        def complete() -> bool:
            return all(linked_to(d) >= everyone - {d.address} for d in self.mesh)

        took = wait_until(complete, 20 + len(self.mesh))
        # (from the daemons' start: they link while the others are still starting)
        self.out["mesh_linked_s"] = (None if took is None
                                     else round(time.monotonic() - self.started_at, 3))
        self.out["mesh_links"] = sum(len(linked_to(d)) for d in self.mesh)
        say(f"mesh: {self.out['mesh_links']} links of {len(self.mesh) * (len(self.mesh) - 1)}"
            f" in {self.out['mesh_linked_s']} s")

    def load(self) -> None:
        args = self.args
        share = args.rate / len(self.workers)
        for i, (_, conn) in enumerate(self.workers):
            conn.send(LoadPlan(
                worker=i, sockets=[d.socket_path for d in self.mesh],
                addresses=[d.address for d in self.mesh], rate=share,
                workers=len(self.workers), seconds=args.seconds,
                block_bytes=args.block_bytes, slots=args.slots, pull_share=0.5,
                timeout_s=args.timeout_s))
        wait_s = 60 + 5 * len(self.mesh)
        for _, conn in self.workers:  # each has connected and registered everywhere
            if not conn.poll(wait_s):
                raise RuntimeError(f"a load worker was not ready in {wait_s:g}s")
            if (answer := conn.recv()) != "ready":
                raise RuntimeError(str(answer))
        start_at = time.monotonic() + 0.2
        for _, conn in self.workers:
            conn.send(start_at)
        say(f"load: {args.rate:g} transfers/s of {args.block_bytes} B for {args.seconds:g} s "
            f"from {len(self.workers)} workers")
        results = []
        wait_s = 60 + args.seconds + args.timeout_s
        for _, conn in self.workers:
            if not conn.poll(wait_s):
                raise RuntimeError(f"a load worker did not answer in {wait_s:g}s")
            answer = conn.recv()
            if isinstance(answer, str):
                raise RuntimeError(answer)
            results.append(answer)
        r = merge(results)
        done = r.put_ms + r.pull_ms
        out = self.out
        out.update(latency_figures("", done))
        out.update(latency_figures("put_", r.put_ms))
        out.update(latency_figures("pull_", r.pull_ms))
        out.update({"transfers": len(done), "transfers_started": r.started,
                    "rate_achieved": round(len(done) / args.seconds, 1),
                    "errors": sum(r.errors.values()), "errors_by_type": dict(r.errors),
                    "first_errors": r.first_errors[:5], "bytes_checked": r.bytes_checked,
                    "ping_p50_ms": quantile(r.ping_ms, 0.5),
                    "ping_p99_ms": quantile(r.ping_ms, 0.99),
                    "ping_max_ms": round(max(r.ping_ms), 3) if r.ping_ms else None,
                    "pings": len(r.ping_ms), "start_lag_p99_ms": quantile(r.lag_ms, 0.99)})
        say(f"load: {len(done)} transfers, p50 {out['p50_ms']} p99 {out['p99_ms']} "
            f"p999 {out['p999_ms']} max {out['max_ms']} ms; ping p99 {out['ping_p99_ms']} ms;"
            f" errors {out['errors']} {dict(r.errors) or ''}; start lag p99 "
            f"{out['start_lag_p99_ms']} ms")

    def measure_daemons(self) -> None:
        """Each daemon's figures with no load (the hub's with no link yet)."""
        daemons = self.mesh + ([self.hub] if self.hub else [])
        time.sleep(0.5)  # (the load's last replies settle)
        cpu = idle_cpu_pct([d.pid for d in daemons], self.args.idle_s)
        rows = []
        for d, pct in zip(daemons, cpu, strict=True):
            status = d.client.stats(timeout_s=10.0)
            rows.append({"name": d.name, **process_figures(d.pid), "idle_cpu_pct": pct,
                         "links": len([x for x in status["peer"]["links"] if x["alive"]]),
                         "gc_longest_pause_ms": round(1e3 * status["gc"]["longest_pause_s"], 2),
                         # (its CPU time: the collector's own work, the rest waiting for a core)
                         "gc_longest_pause_cpu_ms": round(
                             1e3 * status["gc"].get("longest_pause_cpu_s", 0.0), 2),
                         "gc_collections": status["gc"]["collections"],
                         "refused_hellos": status["peer"]["bad_messages"]})
        mesh_rows = [row for row in rows if row["name"] != "hub"]
        say("daemon      links threads  fds  tcp  rss MiB  idle CPU %  longest GC ms")
        for row in rows:
            say(f"{row['name']:<11} {row['links']:>5} {row['threads']:>7} {row['fds']:>4} "
                f"{row['tcp']:>4} {row['rss_mib']:>8} {row['idle_cpu_pct']:>11} "
                f"{row['gc_longest_pause_ms']:>14}")
        out = self.out
        out["per_daemon"] = mesh_rows
        for figure in ("threads", "fds", "tcp", "rss_mib", "idle_cpu_pct"):
            values = [row[figure] for row in mesh_rows]
            out[f"mesh_{figure}_max"] = max(values)
            out[f"mesh_{figure}_mean"] = round(sum(values) / len(values), 2)
        longest = max(mesh_rows, key=lambda row: row["gc_longest_pause_ms"])
        out["gc_longest_pause_ms"] = longest["gc_longest_pause_ms"]
        out["gc_longest_pause_cpu_ms"] = longest["gc_longest_pause_cpu_ms"]
        out["gc_full_collections_max"] = max(row["gc_collections"][2] for row in mesh_rows)
        refused: Counter[str] = Counter()
        for row in mesh_rows:
            refused.update({k: v for k, v in row["refused_hellos"].items() if v})
        out["refused_hellos"] = dict(refused)
        losses = [line for d in self.mesh for line in d.log_lines("peer down")]
        out["link_losses"] = len(losses)
        out["link_loss_reasons"] = loss_reasons(losses)
        if self.hub is not None:
            self.hub_idle = next(row for row in rows if row["name"] == "hub")
        if len(self.mesh) > 1:  # the mesh's per-link figures, for --skip-links
            links = len(self.mesh) - 1
            self.mesh_per_link = {
                "threads": out["mesh_threads_mean"] / links, "fds": out["mesh_fds_mean"] / links,
                "tcp": out["mesh_tcp_mean"] / links, "cpu": out["mesh_idle_cpu_pct_mean"] / links}

    # ---------------------------------------------------------------- restart

    def restart(self) -> None:
        victim, others = self.mesh[-1], self.mesh[:-1]
        losses_before = sum(len(d.log_lines("peer down")) for d in self.mesh)
        say(f"restart: SIGKILL {victim.name}")
        t_kill = time.monotonic()
        self.fleet.kill(victim)

        def gone() -> bool:
            return all(victim.address not in linked_to(d) for d in others)

        seen = wait_until(gone, 20)
        self.out["restart_seen_gone_s"] = None if seen is None else round(seen, 3)
        t_start = time.monotonic()
        self.fleet.start([victim])
        self.fleet.wait_ready([victim], 60)
        self.out["restart_ready_s"] = round(time.monotonic() - t_start, 3)
        everyone = {d.address for d in self.mesh}

        def relinked() -> bool:
            return (linked_to(victim) >= everyone - {victim.address}
                    and all(victim.address in linked_to(d) for d in others))

        took = wait_until(relinked, 30)
        self.out["restart_relinked_s"] = (None if took is None
                                          else round(time.monotonic() - t_start, 3))
        self.out["restart_down_s"] = (None if took is None
                                      else round(time.monotonic() - t_kill, 3))
        self.out["restart_transfer_ok"] = self.checked_transfer(others[0], victim)
        self.out["restart_link_losses"] = (
            sum(len(d.log_lines("peer down")) for d in self.mesh) - losses_before)
        say(f"restart: others saw it gone in {self.out['restart_seen_gone_s']} s; it answered"
            f" {self.out['restart_ready_s']} s after its start, linked with all again at "
            f"{self.out['restart_relinked_s']} s; a transfer to it: "
            f"{'checked' if self.out['restart_transfer_ok'] else 'FAILED'}")

    def checked_transfer(self, src: Daemon, dst: Daemon) -> bool:
        """One put from ``src`` into a get waiting on ``dst``, its bytes checked."""
        import torch

        import kvd

        n = self.args.block_bytes
        a = kvd.shared_zeros((1, n), torch.uint8)
        b = kvd.shared_zeros((1, n), torch.uint8)
        a.copy_(torch.randint(0, 256, (1, n), dtype=torch.uint8))
        try:
            ra = src.client.register("mesh-check", [a], timeout_s=10)
            rb = dst.client.register("mesh-check", [b], timeout_s=10)
            get = dst.client.start_get("mesh-restart", rb, [0], timeout_s=20,
                                       sender=src.address)
            src.client.put("mesh-restart", ra, [0], to=dst.address, timeout_s=20).wait(20)
            get.wait(20)
        except kvd.KvdError as exc:
            say(f"restart: the transfer to {dst.name} failed: {exc!r}")
            return False
        ok = bool(torch.equal(a, b))
        if ok:
            self.out["bytes_checked"] = self.out.get("bytes_checked", 0) + n
        return ok

    # ---------------------------------------------------------------- many links

    def many_links(self) -> None:
        hub = self.hub
        assert hub is not None
        keys = [self.fake_keys[i:i + FAKES_PER_PROCESS]
                for i in range(0, len(self.fake_keys), FAKES_PER_PROCESS)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        for i, lines in enumerate(keys):
            path = os.path.join(hub.root, f"fakes-{i}.txt")
            with open(path, "w") as f:
                f.writelines(lines)
            self.fakes.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "mesh_fakes.py"), path, hub.address,
                 hub.public_key], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                preexec_fn=die_with_parent))
        say(f"links: {self.args.links} fake peers dialling {hub.name}")
        linked = refused = failed = 0
        reasons: Counter[str] = Counter()
        wait_s = 30 + self.args.links / 10
        for proc in self.fakes:
            assert proc.stdout is not None
            if not select.select([proc.stdout], [], [], wait_s)[0]:
                raise RuntimeError(f"fake peers did not report in {wait_s:g}s")
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"fake peers ended ({proc.wait(5)})")
            report = json.loads(line)
            linked += report["linked"]
            refused += report["refused"]
            failed += report["failed"]
            reasons.update(report["reasons"])
        took = wait_until(lambda: len(linked_to(hub)) >= linked, 10)
        time.sleep(1.0)  # (the data connections attach; a heartbeat goes round)
        made = len(linked_to(hub))
        idle = idle_cpu_pct([hub.pid], self.args.idle_s)[0]
        busy = process_figures(hub.pid)
        base = self.hub_idle
        out = self.out
        out.update({"links_peers": "fake", "links_requested": self.args.links,
                    "links_made": made, "links_refused": refused, "links_failed": failed,
                    # (made, then gone by the time of measuring: the hub's "peer down")
                    "links_lost": max(0, linked - made),
                    "links_refusal_reasons": dict(reasons),
                    "links_settled": took is not None,
                    "hub_no_links": {k: base[k] for k in ("threads", "fds", "tcp", "rss_mib",
                                                          "idle_cpu_pct")},
                    "hub_with_links": {**busy, "idle_cpu_pct": idle}})
        if made:
            out["threads_per_link"] = round((busy["threads"] - base["threads"]) / made, 3)
            out["fds_per_link"] = round((busy["fds"] - base["fds"]) / made, 3)
            out["tcp_per_idle_link"] = round((busy["tcp"] - base["tcp"]) / made, 3)
            out["rss_mib_per_link"] = round((busy["rss_mib"] - base["rss_mib"]) / made, 4)
            out["idle_cpu_per_1000_links"] = round(
                base["idle_cpu_pct"] + (idle - base["idle_cpu_pct"]) * 1000 / made, 2)
            out["threads_at_1000_links"] = round(base["threads"]
                                                 + out["threads_per_link"] * 1000)
        out["per_link_source"] = "links case (fake peers)"
        say(f"links: {made} made of {self.args.links} ({refused} refused {dict(reasons)}, "
            f"{failed} failed); threads {base['threads']} -> {busy['threads']}, fds "
            f"{base['fds']} -> {busy['fds']}, tcp {base['tcp']} -> {busy['tcp']}, idle CPU "
            f"{base['idle_cpu_pct']} -> {idle} % of a core")

    def per_link_from_mesh(self) -> None:
        per = getattr(self, "mesh_per_link", None)
        self.out["per_link_source"] = ("mesh (each daemon's figures over its links, "
                                       "baseline not subtracted)" if per else "none")
        if per:
            self.out["threads_per_link"] = round(per["threads"], 3)
            self.out["fds_per_link"] = round(per["fds"], 3)
            self.out["tcp_per_idle_link"] = round(per["tcp"], 3)
            self.out["idle_cpu_per_1000_links"] = round(per["cpu"] * 1000, 2)

    def stop_fakes(self) -> None:
        for proc in self.fakes:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in self.fakes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()
        self.fakes = []


def goals(out: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The issue's goals beside what this run measured (at its own scale: say so)."""
    def goal(target: str, measured: Any, ok: bool | None, at: str) -> dict[str, Any]:
        return {"target": target, "measured": measured, "met": ok, "measured_at": at}

    def at_most(value: Any, limit: float) -> bool | None:
        return None if value is None else bool(value <= limit)

    mesh_at = f"{args.daemons} daemons, {args.rate:g} transfers/s"
    links_at = (f"{out.get('links_made')} links" if not args.skip_links
                else f"mesh, {args.daemons - 1} links each")
    return {
        "mesh_p999": goal("<= 10 ms (64 daemons, 2000/s)", out.get("p999_ms"),
                          at_most(out.get("p999_ms"), 10), mesh_at),
        "mesh_max": goal("<= 25 ms (64 daemons, 2000/s)", out.get("max_ms"),
                         at_most(out.get("max_ms"), 25), mesh_at),
        "threads_at_1000_links": goal("<= 64", out.get("threads_at_1000_links"),
                                      at_most(out.get("threads_at_1000_links"), 64),
                                      f"extrapolated from {links_at}"),
        "tcp_per_idle_link": goal("1", out.get("tcp_per_idle_link"),
                                  at_most(out.get("tcp_per_idle_link"), 1), links_at),
        "idle_cpu_per_1000_links": goal("<= 2 % of a core", out.get("idle_cpu_per_1000_links"),
                                        at_most(out.get("idle_cpu_per_1000_links"), 2),
                                        f"extrapolated from {links_at}"),
        "link_losses": goal("0 (mesh of 96)", out.get("link_losses"),
                            at_most(out.get("link_losses"), 0), f"{args.daemons} daemons"),
    }


@contextlib.contextmanager
def started_workers(count: int) -> Iterator[list[tuple[BaseProcess, Connection]]]:
    """Load workers, forked now (no thread or ZeroMQ context exists yet here)."""
    ctx = multiprocessing.get_context("fork")
    workers: list[tuple[BaseProcess, Connection]] = []
    try:
        for _ in range(count):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(theirs,), daemon=True)
            proc.start()
            theirs.close()
            workers.append((proc, mine))
        yield workers
    finally:
        stop_workers(workers)


def stop_workers(workers: list[tuple[BaseProcess, Connection]]) -> None:
    """Idle workers end when told; one still loading (the run was stopped) is killed at
    once: its clients' daemons are stopped next, and it must not hold them up."""
    for _worker, conn in workers:
        with contextlib.suppress(OSError):
            conn.send(None)
    deadline = time.monotonic() + 2
    for worker, conn in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join(5)
        conn.close()
    workers.clear()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--daemons", type=int, help="daemons in the mesh (default 8; --quick 3)")
    ap.add_argument("--seconds", type=float, help="load duration (default 10; --quick 2)")
    ap.add_argument("--rate", type=float, help="transfers/s in all (default 200; --quick 60)")
    ap.add_argument("--links", type=int, help="fake peers of the many-links daemon "
                                              "(default 64; --quick 16)")
    ap.add_argument("--block-bytes", type=int, default=65536, help="bytes per transfer")
    ap.add_argument("--workers", type=int, help="load processes (default 2)")
    ap.add_argument("--slots", type=int, default=16,
                    help="blocks per daemon per worker, each side (transfers in flight)")
    ap.add_argument("--pool", default="64MiB", help="each mesh daemon's host pool")
    ap.add_argument("--idle-s", type=float, help="idle CPU window (default 5; --quick 1)")
    ap.add_argument("--timeout-s", type=float, default=20.0, help="per transfer")
    ap.add_argument("--skip-restart", action="store_true")
    ap.add_argument("--skip-links", action="store_true")
    ap.add_argument("--deadline-s", type=float, help="the whole run's bound (default: from "
                                                     "the sizes)")
    ap.add_argument("--quick", action="store_true", help="a smoke run (the test's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    q = args.quick
    args.daemons = args.daemons or (3 if q else 8)
    args.seconds = args.seconds or (2.0 if q else 10.0)
    args.rate = args.rate or (60.0 if q else 200.0)
    args.links = args.links if args.links is not None else (16 if q else 64)
    args.workers = args.workers or 2
    args.idle_s = args.idle_s or (1.0 if q else 5.0)
    if args.daemons < 2 or args.block_bytes < 8 or args.block_bytes % 8:
        ap.error("--daemons must be at least 2, --block-bytes a multiple of 8")
    if args.links < 1:
        args.skip_links = True
    args.deadline_s = args.deadline_s or (
        120 + 3 * args.daemons + args.seconds + args.timeout_s + args.links / 5)
    return args


def main() -> int:
    args = parse_args()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, exit_on_signal)
    signal.alarm(int(args.deadline_s))  # (SIGALRM: the run is over, however far it got)
    launcher = Launcher()  # (imports kvd and torch; forks before any thread exists)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env = {k: v for k, v in env.items() if not k.startswith("KVD_")}
    with (tempfile.TemporaryDirectory(prefix="kvd-mesh-") as root,
          started_workers(args.workers) as workers):
        fleet = Fleet(launcher, root, env)
        run = Run(args, fleet, workers)
        out = run.out
        out.update({"daemons": args.daemons, "seconds": args.seconds, "rate_target": args.rate,
                    "block_bytes": args.block_bytes, "workers": args.workers,
                    "encrypt_data": True, "curve": True})
        try:
            run.deploy()
            run.form_mesh()
            run.load()
            run.measure_daemons()
            if not args.skip_restart:
                run.restart()
            if args.skip_links:
                run.per_link_from_mesh()
            else:
                run.many_links()
        finally:
            stop_workers(workers)
            run.stop_fakes()
            fleet.stop_all()
            launcher.close()
            signal.alarm(0)
    out["goals"] = goals(out, args)
    for name, g in out["goals"].items():
        say(f"goal {name}: {g['target']}; measured {g['measured']} ({g['measured_at']})")
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
