"""The daemon's life: start up, serve until told to stop, drain, shut down.

Startup acquires in order (the socket path's claim, the HTTP port, the peer ports, the
host pool, GPU kernels and staging, the copy worker, the engine, the local socket, then the
peer plane starts reading) on an ``AsyncExitStack``, so teardown runs in reverse whatever
failed: every port is claimed before the pool is taken. The daemon composes its
parts through constructor arguments; the servers that answer for the whole daemon get its
``status`` and ``drain_on_request`` as callables. ``serve`` takes an
injectable ``shutdown_trigger`` (tests pass ``event.wait``); without one it installs
SIGTERM/SIGINT handlers: the first signal drains (refuse new work, finish in-flight within
``drain_grace_s``, exit 0), a second one forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from kvd import __version__, timeline
from kvd.config import (
    Config,
    check_socket_path,
    development_overrides,
    format_size,
    socket_dir_problem,
)
from kvd.daemon.auth import check_exposure
from kvd.daemon.descriptors import PER_LIFELINE, PER_SEGMENT, DescriptorBudget
from kvd.daemon.engine import Engine
from kvd.daemon.gc_pauses import GcPauses, freeze_startup
from kvd.daemon.http import HttpServer
from kvd.daemon.local_server import MAX_SEGMENTS_PER_SESSION, LocalServer
from kvd.daemon.metrics import Metrics
from kvd.daemon.notify import Notifier, StartupSteps
from kvd.daemon.peers import PeerPlane
from kvd.daemon.socket_files import PathClaim
from kvd.daemon.transfer.nccl_links import NcclLinks
from kvd.daemon.transfer.transfers import PeerTransfers
from kvd.errors import ConfigError, Draining
from kvd.loop_socket import new_context
from kvd.memory.pool import HostPool
from kvd.transport.local import CopyWorker
from kvd.transport.nccl import (
    BLOCKING_CALLS_MIN_NCCL,
    blocking_calls_supported,
    nccl_available,
    nccl_version,
)

log = logging.getLogger(__name__)

# How long the loop spins after each message where the daemon sees a GPU (busy_poll.py):
# 20 ms covers the gaps between the messages of a flow of transfers, and an idle daemon
# stops within it. Without a GPU it does not spin: on a 2-core machine the spinning loop
# slowed TCP transfers, their threads waiting for the GIL (docs/architecture.md).
BUSY_POLL_WINDOW_S = 0.02


def busy_poll_window_s(sees_gpu: bool) -> float:
    """How long the loop spins after a message; 0: never (daemon/busy_poll.py)."""
    window = BUSY_POLL_WINDOW_S if sees_gpu else 0.0
    log.info("busy poll %s", f"{window * 1e3:g} ms after each message" if window else "off")
    return window

ShutdownTrigger = Callable[[], Awaitable[Any]]

# How long the stop waits for the loop's leftovers (the thread pool's last jobs, which join
# threads with their own bounds of 5-10 s) before the process exits without them.
FINISH_TIMEOUT_S = 10.0

# A host pool this large reports how far its pages are touched at every tenth; a smaller
# one is taken in about a second, and its start and end lines say enough.
POOL_PROGRESS_FROM_BYTES = 2**30


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        # Changes at every start so peers (and clients) can tell a restart from a blip.
        self.epoch = time.time_ns()
        self.ready = asyncio.Event()
        self.forced = False
        # The parts, as they come up (the metrics read them at scrape time).
        self.engine: Engine | None = None
        self.peers: PeerPlane | None = None
        self.transfers: PeerTransfers | None = None
        self.local: LocalServer | None = None
        self.metrics = Metrics()
        self.metrics.attach(self)
        self.gc_pauses = GcPauses()
        self.notifier = Notifier()
        self.steps = StartupSteps(self.notifier)
        self.http: HttpServer | None = None
        self.pool_allocated = False
        self._pool_taking = False
        self._pool_parts: dict[str, list[float]] = {}  # part -> [first, last] report
        self.drained = asyncio.Event()
        self.drain_report: dict[str, Any] = {}
        self._grace_s: float | None = None
        self._signals = 0
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._stopping_at = 0.0  # time.monotonic() when the drain began

    async def serve(self, shutdown_trigger: ShutdownTrigger | None = None, *,
                    owns_loop: bool = False) -> None:
        """Start, serve, drain, stop. ``owns_loop`` (``run``: the loop and the process
        are the daemon's alone): what start-up made is frozen for the garbage collector
        once the daemon is ready (``gc_pauses``); and the loop's own leftovers (tasks,
        the thread pool's last jobs: a lost link's channels closing, an NCCL teardown)
        are finished too, within ``FINISH_TIMEOUT_S``, so that nothing of the daemon's
        runs after "kvd stopped" and the process exits right after it."""
        with contextlib.ExitStack() as outer:
            await self._serve(outer, shutdown_trigger, owns_loop)
            if owns_loop:
                await self._finish_loop()
        log.info("kvd stopped%s", f" ({time.monotonic() - self._stopping_at:.2f}s after "
                                  "the stop began)" if self._stopping_at else "")

    async def _finish_loop(self) -> None:
        """What ``asyncio.run`` does after its coroutine, bounded: without a bound, a
        straggling job of the thread pool would hold the exit after "kvd stopped"."""
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=FINISH_TIMEOUT_S)
        await loop.shutdown_asyncgens()
        began = time.monotonic()
        pool = asyncio.ensure_future(loop.shutdown_default_executor())
        forced = asyncio.ensure_future(self._force.wait())  # a second signal: no more waiting
        await asyncio.wait([pool, forced], timeout=FINISH_TIMEOUT_S,
                           return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not pool.done():  # (the process exits anyway: its threads go with it)
            pool.cancel()
            log.warning("blocking work still running %.1fs after the stop: not waited for",
                        time.monotonic() - began)

    async def _serve(self, outer: contextlib.ExitStack,
                     shutdown_trigger: ShutdownTrigger | None, owns_process: bool) -> None:
        async with contextlib.AsyncExitStack() as stack:
            await self._startup(stack)
            loop = asyncio.get_running_loop()
            if shutdown_trigger is None:
                # Installed until serve returns, so a second signal during teardown is
                # still ours (it forces the exit) and not the default action.
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    outer.callback(_force_exit_on, loop, sig)
                loop.add_signal_handler(signal.SIGHUP, self._on_hangup)  # (the unit's reload)
                outer.callback(loop.remove_signal_handler, signal.SIGHUP)
                trigger: Awaitable[Any] = self._stop.wait()
            else:
                trigger = _first(shutdown_trigger(), self._stop.wait())
            if owns_process:
                self.gc_pauses.frozen_objects = freeze_startup()
            self.gc_pauses.install()  # (from here on: pauses while serving)
            outer.callback(self.gc_pauses.remove)
            self.ready.set()
            assert self.peers is not None and self.http is not None
            self.steps.line(
                f"kvd ready node={self.config.node_id} epoch={self.epoch} "
                f"socket={self.config.socket_path} peer={self.peers.address} "
                f"http={self.http.address} pool={self.config.pool_size_bytes}B "
                f"gc_frozen={self.gc_pauses.frozen_objects}")
            self.notifier.ready(f"serving on {self.config.socket_path}, peers on "
                                f"{self.peers.address}")
            self.notifier.start_watchdog()
            await trigger
            self._stopping_at = time.monotonic()
            self.notifier.stopping("draining")
            self.drain_report = await self.drain(
                self.config.drain_grace_s if self._grace_s is None else self._grace_s)
            self.drained.set()

    async def drain_on_request(self, grace_s: float | None) -> dict[str, Any]:
        """``kvd drain``: drain as on SIGTERM, and report once in-flight work is done."""
        log.info("drain requested over the local socket (grace %.1fs%s)",
                 self.config.drain_grace_s if grace_s is None else grace_s,
                 ": drain_grace_s" if grace_s is None else ", as asked")
        self._grace_s = grace_s
        self._stop.set()
        await self.drained.wait()
        return self.drain_report

    def reload(self) -> dict[str, Any]:
        """``kvd reload`` and SIGHUP: read the allow-list again (``PeerPlane.reload_keys``).
        What changed; ConfigError if there is nothing to reload or the file is not valid."""
        if self.peers is None:
            raise ConfigError("this daemon has no peer plane: there is nothing to reload")
        return self.peers.reload_keys()

    def _on_hangup(self) -> None:
        try:
            self.reload()
        except ConfigError as err:  # (the list is kept as it was)
            log.error("SIGHUP: reload failed, the allow-list is kept as it was: %s", err)

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("signal %s: draining (grace %.1fs); send again to force exit",
                     signal.Signals(sig).name, self.config.drain_grace_s)
            self._stop.set()
        else:
            log.warning("second signal: forcing exit")
            self.forced = True
            self._force.set()

    async def _startup(self, stack: contextlib.AsyncExitStack) -> None:
        steps = self.steps
        _raise_open_file_limit()
        steps.begin("claiming the socket path")
        check_socket_path(self.config)
        check_exposure(self.config)  # (peer_host off loopback needs keys, or a yes)
        _prepare_socket_dir(self.config.socket_path)
        # The socket path is ours before anything is allocated: a second daemon on it is
        # refused here, and removes nothing of the first one's (socket_files.py).
        claim = PathClaim(self.config.socket_path)
        claim.take()
        stack.callback(claim.release)  # last: after the sockets are removed
        steps.tell.append(claim.say)  # (clients that come early are told: socket_files.py)
        steps.done(f"socket path claimed: {self.config.socket_path}")
        if tuning := development_overrides(self.config):
            log.warning("development settings (KVD_DEV): %s",
                        ", ".join(f"{k}={v}" for k, v in tuning.items()))
        if timeline.start_from_environment():  # KVD_TIMELINE_DIR: a development aid
            stack.callback(timeline.stop)
        # HTTP first: /healthz answers and /readyz says why not while the pool is taken.
        steps.begin("starting HTTP")
        self.http = HttpServer(self.config, self.metrics.registry, self.status,
                               self.not_ready_reasons)
        await self.http.start()
        stack.push_async_callback(self.http.close)
        stack.push_async_callback(self.notifier.close)
        steps.done(f"http listening on {self.http.address}")
        # Asked once: it decides the pool's pinning and whether the loop busy-polls.
        steps.begin("looking for a GPU")
        sees_gpu = await asyncio.to_thread(torch.cuda.is_available)
        steps.done("a GPU is seen: the host pool is pinned" if sees_gpu
                   else "no GPU seen: the host pool is not pinned")
        budget = DescriptorBudget.from_limit()
        _report_limits(budget, pinned=sees_gpu)
        steps.begin("looking for NCCL")
        gpus, nccl_said = await asyncio.to_thread(self._nccl_gpus)
        steps.done(nccl_said)
        # The ports before the pool: one in use fails the start before it takes memory.
        # (Read from once the daemon serves; the local socket's path is claimed already.)
        steps.begin("claiming the peer ports")
        # One ZeroMQ context, one I/O thread, for the local socket and the peer plane.
        zmq_context = new_context()
        stack.callback(zmq_context.destroy, 0)  # (after the planes closed their sockets)
        peers = PeerPlane(self.config, zmq_context, self.epoch, gpus=gpus,
                          nccl_blocking_calls=bool(gpus) and self._blocking_calls())
        stack.push_async_callback(peers.close)  # (a start that fails before the pool's)
        peers.listen()
        steps.done(f"peer ports claimed: {peers.address}, data port {peers.data_port}")
        # Pinned where the daemon sees a GPU: host <-> GPU copies of pinned memory run at
        # PCIe speed (~55 GB/s on H200, against 6-13 GB/s pageable).
        pool = await self._take_pool(pin=sees_gpu)
        stack.callback(pool.close)
        if gpus:
            steps.begin(f"loading GPU kernels on {', '.join(gpus)}", announce=True)
            await asyncio.to_thread(_warm_kernels, gpus)
            steps.done(f"GPU kernels loaded on {', '.join(gpus)}")
        gpu_pools: dict[str, HostPool] = {}
        if gpus and self.config.gpu_staging_bytes:
            size = format_size(self.config.gpu_staging_bytes)
            steps.begin(f"allocating GPU staging: {size} on each of {', '.join(gpus)}",
                        announce=True)
            for dev in gpus:
                gpu_pools[dev] = await asyncio.to_thread(
                    HostPool, self.config.gpu_staging_bytes, self.config.pool_min_block_bytes,
                    device=dev)
            steps.done(f"GPU staging allocated: {size} on each of {', '.join(gpus)}")
        steps.begin("starting the engine and the peer plane")
        worker = CopyWorker("kvd-copy-local")
        stack.callback(worker.stop, 30.0)
        engine = self.engine = Engine(
            self.config, pool, worker, self.metrics, gpu_pools,
            busy_poll_window_s(sees_gpu))
        self.peers = peers
        nccl = NcclLinks(self.config, peers) if gpus else None
        remote = self.transfers = PeerTransfers(engine, peers, nccl)
        peers.handle_with(remote)
        engine.remote = remote
        stack.push_async_callback(peers.close)  # (before the pool's: links end first)
        if nccl is not None:
            stack.push_async_callback(nccl.close)  # before the peer plane: CHANNEL_DOWN goes out
        local = self.local = LocalServer(self.config, engine, zmq_context, self.epoch,
                                               self.status, budget, self.drain_on_request,
                                               self.reload)
        stack.push_async_callback(local.close)
        steps.done("engine and peer plane set up")
        steps.begin("opening the local socket")
        await local.bind()
        steps.done(f"local socket listening at {self.config.socket_path}")
        steps.begin("opening the peer socket")
        peers.start()
        steps.done(f"peer socket listening at {peers.address}")
        steps.tell.remove(claim.say)
        claim.say("")

    async def _take_pool(self, pin: bool) -> HostPool:
        """The host pool, taken in a worker thread while the loop answers HTTP (and
        ``/readyz`` says how far it is); its steps, and where their time went, logged."""
        size = self.config.pool_size_bytes
        touch = self.config.pool_prefault or pin
        self.steps.begin(
            f"allocating the host pool: {format_size(size)}, "
            f"{'pinned' if pin else 'not pinned'}, "
            f"{'every page touched' if touch else 'pages touched as used'}", announce=True)
        self._pool_taking = True
        ticking = asyncio.ensure_future(_tick(self.steps))
        try:
            pool = await asyncio.to_thread(
                HostPool, size, self.config.pool_min_block_bytes, pin=pin,
                prefault=self.config.pool_prefault, progress=self._pool_progress)
        finally:
            ticking.cancel()
            self._pool_taking = False
        parts = "".join(f", {part} {last - first:.2f}s"
                        for part, (first, last) in self._pool_parts.items())
        self.steps.done(f"host pool allocated: {format_size(size)}, "
                        f"{'pinned' if pool.pinned else 'not pinned'}{parts}")
        self.pool_allocated = True
        return pool

    def _pool_progress(self, part: str, done: int, total: int) -> None:
        """``HostPool``'s progress (in its worker thread): the times of each part, a line
        at every tenth of the touching of a large pool, one when the pinning starts."""
        now = time.monotonic()
        self._pool_parts.setdefault(part, [now, now])[1] = now
        if part == "touching":
            text = (f"host pool: touching pages {done * 100 // max(total, 1)}% "
                    f"({format_size(done)} of {format_size(total)})")
            tenth = done * 10 // max(total, 1) if total >= POOL_PROGRESS_FROM_BYTES else None
            if tenth is None or tenth > 0:  # (0%: the step's own first line says it)
                self.steps.progress(text, tenth)
        elif done < total:
            self.steps.progress(f"host pool: pinning {format_size(total)} (cudaHostRegister)")

    def _nccl_gpus(self) -> tuple[list[str], str]:
        """The GPUs NCCL channels may use (all visible ones, when NCCL is there and wanted),
        and that in words."""
        if not self.config.nccl:
            return [], "nccl off (nccl = false)"
        if not nccl_available():
            return [], "nccl not available"
        gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return gpus, f"nccl {nccl_version()}, GPUs for channels: {', '.join(gpus) or 'none'}"

    def _blocking_calls(self) -> bool:
        """``nccl_blocking_calls``, where the loaded NCCL can bound its one wait (see
        ``transport.nccl.blocking_calls_supported``); said in the log either way."""
        if not self.config.nccl_blocking_calls:
            log.info("nccl calls: non-blocking (nccl_blocking_calls = false)")
            return False
        try:
            supported = blocking_calls_supported()
        except Exception as exc:  # nccl4py's version query: never a reason not to start
            log.warning("nccl calls: non-blocking: the loaded NCCL's version could not be "
                        "read (%r)", exc)
            return False
        if not supported:
            log.warning("nccl calls: non-blocking: the loaded NCCL %s is older than %s, "
                        "which blocking calls need (ncclCommRevoke)", nccl_version(),
                        BLOCKING_CALLS_MIN_NCCL)
            return False
        log.info("nccl calls: blocking, with peers that say so too")
        return True

    # ------------------------------------------------------------ what operators see

    def not_ready_reasons(self) -> list[str]:
        reasons = []
        if self._pool_taking:
            where = self.steps.progress_text.removeprefix("host pool: ")
            reasons.append(f"host pool being allocated: {where or 'started'}")
        elif not self.pool_allocated:
            reasons.append("host pool not allocated yet")
        if self.local is None or self.peers is None or not self.ready.is_set():
            reasons.append("listeners not up yet")
        if self.engine is not None and self.engine.draining:
            reasons.append("draining")
        if self.peers is not None:
            for address in self.peers.configured:
                link = self.peers.links.get(address)
                if link is None or not link.alive:
                    reasons.append(f"configured peer {address} unreachable")
        return reasons

    def status(self) -> dict[str, Any]:
        """The daemon's status report (``kvd status``, ``/v1/status``, the Stats request):
        assembled here, from each part's own figures."""
        engine, local, peers, transfers = self.engine, self.local, self.peers, self.transfers
        started = self.epoch / 1e9  # (the epoch is the start's time)
        facts = {"node_id": self.config.node_id, "epoch": self.epoch, "version": __version__,
                 "started_at": started, "uptime_s": round(time.time() - started, 3)}
        if engine is None or local is None:
            return {**facts, "starting": True}
        status = engine.stats()
        status.update(local.stats())
        status.update(facts)
        if peers is not None and transfers is not None:
            status["peer"] = peers.stats()
            status["transfers"] = transfers.stats()
        status["http"] = self.http.address if self.http is not None else ""
        status["gc"] = self.gc_pauses.stats()
        status["ready"] = not self.not_ready_reasons()
        return status

    async def drain(self, grace_s: float) -> dict[str, Any]:
        """Refuse new work, let in-flight requests finish within ``grace_s``."""
        assert self.engine is not None and self.local is not None
        started = time.monotonic()
        engine = self.engine
        engine.draining = True
        failed_waiters = 0
        for waiter in engine.store.all_waiters():
            if not waiter.delivering and not waiter.future.done():
                waiter.settle(Draining("daemon is draining"))
                failed_waiters += 1
        failed_pulls = 0
        if self.transfers is not None:
            failed_pulls = self.transfers.refuse_waiting_pulls(Draining(
                f"{self.config.node_id} is draining: no pull waits for a key any more"))
        pending = self.local.pending_tasks()
        if self.transfers is not None:  # bytes arriving from peers finish too
            pending += self.transfers.pending_tasks()
        left: list[asyncio.Task[Any]] = []
        if pending:
            log.info("draining: waiting for %d requests (grace %.1fs)", len(pending), grace_s)
            done_waiting = asyncio.ensure_future(asyncio.wait(pending, timeout=grace_s))
            await _first(done_waiting, self._force.wait())
            left = [t for t in pending if not t.done()]
            if left:
                log.warning("drain grace over: cancelling %d requests", len(left))
                for t in left:
                    t.cancel()
                await asyncio.wait(left, timeout=5.0)
        return {"in_flight_at_start": len(pending), "finished": len(pending) - len(left),
                "cancelled": len(left), "gets_refused": failed_waiters,
                "pulls_refused": failed_pulls,
                "waited_s": round(time.monotonic() - started, 3)}


async def _first(*aws: Awaitable[Any]) -> None:
    """Wait until the first of ``aws`` completes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _tick(steps: StartupSteps) -> None:
    """While a long step runs in a worker thread: where it stands, after a quiet while."""
    while True:
        await asyncio.sleep(1.0)
        steps.tick()


def _force_exit_on(loop: asyncio.AbstractEventLoop, sig: int) -> None:
    """After serve: the loop's handler goes, and a signal during the rest of the exit
    (closing the loop, joining its executor, the interpreter's teardown) still forces the
    exit, with the forced exit's code, instead of killing the process by the default
    action (exit code -15)."""
    loop.remove_signal_handler(sig)
    signal.signal(sig, lambda _sig, _frame: os._exit(130))


def run(config: Config, shutdown_trigger: ShutdownTrigger | None = None) -> int:
    """Run a daemon on uvloop until it stops; the process exit code."""
    import uvloop

    # The loop and the channel threads hand the GIL back and forth around every chunk;
    # the default 5 ms switch interval would add that much latency to each hand-off.
    sys.setswitchinterval(0.0005)
    daemon = Daemon(config)
    # Not uvloop.run: its teardown joins the loop's thread pool without a bound, after
    # "kvd stopped"; serve(owns_loop=True) finishes the loop's leftovers within one.
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(daemon.serve(shutdown_trigger, owns_loop=True))
    finally:
        loop.close()
    return 130 if daemon.forced else 0


def _prepare_socket_dir(path: str) -> None:
    """Create the socket's directory, and refuse one that another user could change
    (``socket_dir_problem``: checked once it exists, so one made meanwhile by someone else
    is caught too). First thing at startup: an unusable path is a config error before
    anything else happens."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o750, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"socket_path: cannot create the directory of {path}: "
                          f"{exc.strerror}") from None
    if problem := socket_dir_problem(directory):
        raise ConfigError(f"socket_path: {problem}")


def _raise_open_file_limit() -> None:
    """Take the hard limit on open files as the soft one: each client segment costs the
    daemon two descriptors while mapped (its own, and the mapping's), and the soft
    default (1024 outside systemd) would cap a node at a few hundred CPU tensors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.info("open files limit %d (was %d)", want, soft)


# Below this, the daemon's clients could not hold one session at its segment bound.
_FEWEST_CLIENT_DESCRIPTORS = PER_LIFELINE + PER_SEGMENT * MAX_SEGMENTS_PER_SESSION


def _report_limits(budget: DescriptorBudget, pinned: bool) -> None:
    """Log the limits the daemon relies on, and warn where they are too low for it."""
    memlock, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    shown = "unlimited" if memlock == resource.RLIM_INFINITY else format_size(memlock)
    log.info("limits: open files %d (clients may hold %d descriptors, %d kept for the "
             "daemon), locked memory %s", budget.limit, budget.capacity, budget.reserve,
             shown)
    if budget.capacity < _FEWEST_CLIENT_DESCRIPTORS:
        log.warning("open files limit %d is low: clients may hold %d descriptors, fewer "
                    "than one session's %d segments need (%d); raise LimitNOFILE (the "
                    "systemd unit sets 65536)", budget.limit, budget.capacity,
                    MAX_SEGMENTS_PER_SESSION, _FEWEST_CLIENT_DESCRIPTORS)
    if pinned and memlock != resource.RLIM_INFINITY:
        log.warning("locked memory limit %s: NCCL's network transports register memory "
                    "under it; set LimitMEMLOCK=infinity (docker: --ulimit memlock=-1)",
                    shown)


def _warm_kernels(gpus: list[str]) -> None:
    """``gpu_copy.warm_up`` on each GPU before any NCCL kernel can run (see there why)."""
    from kvd.transport import gpu_copy

    for dev in gpus:
        gpu_copy.warm_up(torch.device(dev))
