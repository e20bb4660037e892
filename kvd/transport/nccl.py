"""The NCCL binding kvd uses, through nccl4py (``nccl.core``), and nothing else of it.

Every call is bounded. Communicators are made non-blocking (``NCCLConfig(blocking=False)``):
init returns at once and leaves the communicator ``InProgress``; we poll
``get_async_error()`` back to ``Success`` before the next call (the next call fails
otherwise), against a deadline, and ``abort()`` on a timeout or an error. Completion of the
bytes is a CUDA event on the channel's stream, also polled against a deadline: NCCL does
not notice a peer that died on the same node (its kernel just never finishes), so these
deadlines and the peer plane's heartbeats are the only detectors. A communicator is never
destroyed from ``__del__``.

*Blocking calls* (``blocking_calls=True``, the daemons' default): a non-blocking
communicator's every send or recv starts a thread in NCCL that launches the kernel
(``group.cc``), ~110-130 us from call to settled on the H200 host against ~35-50 us for a
blocking one. So once the non-blocking communicator is up, it is split (``ncclCommSplit``,
polled through the parent, so still bounded) into a blocking child with shared resources,
and the first message on the child — the one that sets its connection up, ~95 ms — is sent
at once, under a watchdog. After that a call only queues a kernel: measured, a blocking
send to a SIGKILLed peer returns at once and ``abort()`` frees its kernel. The connection
setup is the one place a blocking call can wait on the peer; it is bounded two ways
(probe on 2x H200, NCCL 2.28.9): a peer that is alive but never answers is freed by
``ncclCommRevoke`` from the watchdog; a dead one by NCCL's socket retries, which kvd caps
(``NCCL_SOCKET_RETRY_CNT``/``_SLEEP_MSEC``, see ``bound_socket_retries``; with 3 x 50 ms
the call failed after 0.3 s instead of ~60 s). An abort from another thread while a call
is in progress revokes instead (outside the communicator's lock), and whichever of the two
threads finishes last aborts: never under a thread inside NCCL (that took the process down
in an earlier probe), and a call that returns during the ~0.5 s revoke does not wait for it.

Buffers must be contiguous ``uint8`` CUDA tensors (nccl4py does not check contiguity, and
sends ``numel()`` elements from ``data_ptr()``). nccl4py is imported on first use, so CPU
machines import kvd without it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvd import timeline
from kvd.errors import KvdError, KvdTimeout, PeerUnreachable, TransferFailed
from kvd.transport import gpu_copy

log = logging.getLogger(__name__)

_POLL_S = 0.0002
_SPIN_S = 0.00015  # poll without pausing this long: most NCCL calls settle within it
_YIELD_S = 0.02  # then yield the GIL between polls (sleep(0)) this long, then sleep


def _pause(started: float) -> None:
    """Between two polls. Measured on the 2x H200 host (a Firecracker microVM): a call
    settles 40-80 us after it returns when polled without pause, 80-120 us when each poll
    yields, because a ``sleep(0)`` costs ~56 us there; a 1 MiB send took 33 us end to end.
    So: spin briefly (holding the GIL for at most ``_SPIN_S``), then yield, and only sleep
    once a wait has lasted long enough that a sleep's granularity no longer matters."""
    waited = time.monotonic() - started
    if waited >= _SPIN_S:
        time.sleep(0 if waited < _YIELD_S else _POLL_S)


def nccl_available() -> bool:
    """nccl4py importable and a GPU present (the NCCL transport can be used)."""
    try:
        import nccl.core  # noqa: F401
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def nccl_version() -> str:
    import torch

    v = torch.cuda.nccl.version()
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


# NCCL retries a refused connection NCCL_SOCKET_RETRY_CNT times, sleeping k times
# NCCL_SOCKET_RETRY_SLEEP_MSEC before the k-th retry: by default ~60 s in all, during which
# a blocking call that connects to a dead peer cannot be interrupted. Between two kvd
# daemons a refusal means the peer is gone (its sockets listen before it hands out the
# addresses), so 10 x 20 ms (~1.1 s) is plenty. An operator's own setting wins.
SOCKET_RETRIES = {"NCCL_SOCKET_RETRY_CNT": "10", "NCCL_SOCKET_RETRY_SLEEP_MSEC": "20"}


def bound_socket_retries() -> None:
    """Cap NCCL's connection retries (``SOCKET_RETRIES``) unless the environment sets them;
    before NCCL's first use, which reads them once."""
    for name, value in SOCKET_RETRIES.items():
        os.environ.setdefault(name, value)


BLOCKING_CALLS_MIN_NCCL = "2.28"  # ncclCommRevoke, and the probes on 2.28.9


def blocking_calls_supported() -> bool:
    """The NCCL that nccl4py loaded is recent enough for blocking calls (the watchdog
    needs ``ncclCommRevoke`` to free a stuck connection setup)."""
    from nccl.bindings import nccl as nb

    return version_at_least(int(nb.get_version()), BLOCKING_CALLS_MIN_NCCL)


def version_at_least(code: int, wanted: str) -> bool:
    """NCCL's packed version (X*10000 + Y*100 + Z since 2.9; X*1000 + Y*100 + Z before)
    against "X.Y"."""
    major, minor = (code // 10000, code % 10000 // 100) if code >= 10000 else (
        code // 1000, code % 1000 // 100)
    want = tuple(int(x) for x in wanted.split("."))
    return (major, minor) >= want


def new_unique_id() -> bytes:
    """The 128 bytes rank 0 creates and sends to rank 1 over the peer plane."""
    import nccl.core as nc

    bound_socket_retries()
    return bytes(nc.get_unique_id())


class Communicator:
    """A 2-rank communicator with deadlines on everything (see the module's docstring)."""

    def __init__(self, comm: Any, name: str, parent: Any = None) -> None:
        self._comm = comm  # where the calls go: the blocking child, or the one communicator
        self._parent = parent  # the non-blocking communicator the child was split from
        self.name = name
        self.blocking = parent is not None  # calls are accepted when they return
        self.aborted = False
        self._state = threading.Lock()  # guards the three below and the abort
        self._caller: int | None = None  # the thread inside a call, if any
        # An abort that found a call in progress revokes first; whichever of the revoking
        # thread and the calling thread finishes last then aborts (see ``abort``).
        self._abort_deferred = False
        self._revoking = False

    @classmethod
    def init(cls, unique_id: bytes, rank: int, timeout_s: float, name: str,
             blocking_calls: bool = False, connect: Any = None) -> Communicator:
        """Join the 2-rank communicator ``unique_id`` as ``rank``; abort past the timeout.
        With ``blocking_calls`` (see the module's docstring) ``connect`` is the stream on
        which the child's first message (8 bytes, rank 0 to rank 1) sets its connection
        up; the peer must do the same. ``connect=None`` leaves it unconnected (tests)."""
        import nccl.core as nc

        bound_socket_retries()
        started = time.monotonic()
        deadline = started + timeout_s
        cfg = nc.NCCLConfig(blocking=False, comm_name=name)
        comm = cls(nc.Communicator.init(2, rank, nc.UniqueId.from_bytes(unique_id), cfg),
                   name)
        comm._settle(timeout_s, "init")
        if blocking_calls:
            comm = comm._split(rank, deadline)
            if connect is not None:
                try:
                    comm._connect(rank, connect, deadline)
                except BaseException:
                    comm.abort()
                    raise
        log.info("nccl communicator up name=%s rank=%d blocking_calls=%s in %.3fs", name,
                 rank, blocking_calls, time.monotonic() - started)
        return comm

    def _split(self, rank: int, deadline: float) -> Communicator:
        """The blocking child of this (non-blocking) communicator, which it polls."""
        import nccl.core as nc

        cfg = nc.NCCLConfig(blocking=True, split_share=True, comm_name=self.name + "/calls")
        try:
            child_comm = self._comm.split(color=0, key=rank, config=cfg)
        except Exception as exc:
            self.abort()
            raise TransferFailed(f"nccl split of {self.name} failed: {exc!r}") from None
        child = Communicator(child_comm, self.name, parent=self._comm)
        try:
            self._settle(max(deadline - time.monotonic(), 0.0), "split", abort=False)
            if not child_comm.is_valid:
                raise TransferFailed(f"nccl split of {self.name} made no communicator")
        except KvdError:
            child.abort()  # the child (if any) first, then the parent: it shares its resources
            raise
        return child

    def _connect(self, rank: int, stream: Any, deadline: float) -> None:
        """The child's first message, which waits for the peer's connection: a watchdog
        aborts (that is, revokes) it at the deadline."""
        import torch

        buf = torch.zeros(8, dtype=torch.uint8, device=torch.cuda.current_device())
        watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), self.abort)
        watchdog.daemon = True
        watchdog.start()
        try:
            self.start("send" if rank == 0 else "recv", [buf], 1 - rank, stream)
        finally:
            watchdog.cancel()
        self.wait(gpu_copy.recorded(stream), max(deadline - time.monotonic(), 0.0),
                  "connection setup")

    def _settle(self, timeout_s: float, what: str, abort: bool = True) -> None:
        """Poll until the last call is accepted (``Success``); abort on error or timeout
        (unless ``abort`` is False: the caller does)."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            try:
                if self.settled(what):
                    return
            except TransferFailed:
                if abort:
                    self.abort()
                raise
            if time.monotonic() > deadline:
                if abort:
                    self.abort()
                raise PeerUnreachable(f"nccl {what} on {self.name} did not complete within "
                                      f"{timeout_s:g}s (peer gone?); communicator aborted")
            _pause(started)

    def settled(self, what: str) -> bool:
        """One poll: has the last call been accepted? Raises ``TransferFailed`` on an
        error without aborting (an abort takes ~0.5 s: the caller decides where), and
        ``PeerUnreachable`` once the communicator was aborted."""
        from nccl.bindings import nccl as nb

        if self.aborted:
            raise PeerUnreachable(f"nccl communicator {self.name} was aborted")
        result = self._comm.get_async_error()
        if result == nb.Result.Success:
            return True
        if result != nb.Result.InProgress:
            raise TransferFailed(f"nccl {what} on {self.name} failed: {result}")
        return False

    def start(self, op: str, bufs: Sequence[Any], peer: int, stream: Any) -> None:
        """Issue ``op`` ("send" or "recv") of each buffer, in order, without waiting for
        the call to be accepted (see ``send``). Several buffers go as one NCCL group: one
        kernel moves them all, with no drain between messages (~35 us each on H200), and
        one call settles instead of one per buffer. The peer may issue the matching
        messages one by one or grouped otherwise: only their order and sizes must match."""
        if self.aborted:
            raise PeerUnreachable(f"nccl communicator {self.name} was aborted")
        import torch

        views = []
        for buf in bufs:
            if not (buf.is_cuda and buf.is_contiguous()):
                raise TransferFailed(f"nccl {op} needs a contiguous CUDA buffer")
            # The channels pass flat uint8 views already (chunks.BlockSet.direct, staging):
            # two more view calls cost ~10 us per transfer in a daemon on the GPU host.
            views.append(buf if buf.dtype == torch.uint8 and buf.dim() == 1
                         else buf.view(-1).view(dtype=torch.uint8))
        call = {"send": self._comm.send, "recv": self._comm.recv}[op]
        handle = int(stream.cuda_stream)
        self._enter()
        try:
            if len(views) == 1:
                call(views[0], peer, stream=handle)
            else:
                import nccl.core as nc

                nc.group_start()
                try:
                    for view in views:
                        call(view, peer, stream=handle)
                finally:
                    nc.group_end()
        except Exception as exc:
            if self._leave():
                raise PeerUnreachable(f"nccl {op} on {self.name} was stopped: "
                                      "communicator aborted") from None
            if isinstance(exc, KvdError):
                raise
            raise TransferFailed(f"nccl {op} on {self.name} failed: {exc!r}") from None
        if self._leave():
            raise PeerUnreachable(f"nccl {op} on {self.name}: communicator aborted")
        timeline.mark("nccl.returned")

    def _enter(self) -> None:
        with self._state:
            if self.aborted:
                raise PeerUnreachable(f"nccl communicator {self.name} was aborted")
            self._caller = threading.get_ident()

    def _leave(self) -> bool:
        """The call returned; True if the communicator was aborted meanwhile (it is
        aborted for real now, by this thread, if that abort had to wait for the call)."""
        with self._state:
            self._caller = None
            # While the revoke is still running its thread aborts when it ends: the caller
            # (the channel's worker, in a ~50 us call) does not wait for it.
            deferred = self._abort_deferred and not self._revoking
            if deferred:
                self._abort_deferred = False
            aborted = self.aborted
        if deferred:
            self._abort_now()
        return aborted

    def _call(self, op: str, buf: Any, peer: int, stream: Any, timeout_s: float,
              settle: bool) -> None:
        self.start(op, [buf], peer, stream)
        if settle:
            self._settle(timeout_s, op)

    def send(self, buf: Any, peer: int, stream: Any, timeout_s: float,
             settle: bool = True) -> None:
        """Enqueue a send on ``stream``; completion is an event on that stream. With
        ``settle=False`` the call may still be in progress (NCCL launches it from a thread
        of its own): call ``settle`` before the next call, and before queueing anything
        else on ``stream`` (it would land ahead of the send). Work on other streams may
        be queued in between, which is what the channels do."""
        self._call("send", buf, peer, stream, timeout_s, settle)

    def recv(self, buf: Any, peer: int, stream: Any, timeout_s: float,
             settle: bool = True) -> None:
        self._call("recv", buf, peer, stream, timeout_s, settle)

    def settle(self, timeout_s: float, what: str) -> None:
        """Wait until the last call is accepted (see ``send``)."""
        self._settle(timeout_s, what)

    def wait(self, event: Any, timeout_s: float, what: str) -> None:
        """Wait for ``event`` (recorded after the op) with a deadline; abort if it passes."""
        started = time.monotonic()
        deadline = started + timeout_s
        while not event.query():
            if self.aborted:
                break
            if time.monotonic() > deadline:
                self.abort()
                raise KvdTimeout(f"nccl {what} on {self.name} did not finish within "
                                 f"{timeout_s:g}s; communicator aborted")
            _pause(started)
        if self.aborted:  # an abort ends the kernels too: the event fires, the bytes did not
            raise PeerUnreachable(f"nccl {what} on {self.name}: communicator aborted")

    def abort(self) -> None:
        """Abort (idempotent, from any thread). Frees the stream's pending NCCL work; never
        blocks for long. While another thread is inside a call (only a blocking child's
        connection setup can take long) it revokes the communicator instead, which makes
        the call return, and that thread aborts."""
        with self._state:
            if self.aborted:
                return
            self.aborted = True
            revoke = self._caller is not None and self._caller != threading.get_ident()
            if revoke:
                self._abort_deferred = self._revoking = True
        if revoke:
            # Outside the lock: the revoke takes ~0.5 s, and a call that returns meanwhile
            # must not wait for it (the loop would stall that long).
            try:
                self._comm.revoke()  # the call returns (or its retries end)
            except Exception as exc:
                log.warning("nccl revoke of %s reported %r", self.name, exc)
            log.warning("nccl communicator %s revoked under a call in progress", self.name)
            with self._state:
                self._revoking = False
                # The call returned during the revoke: abort here. Still in it: it aborts
                # when it returns (never under a thread inside NCCL).
                revoke = self._abort_deferred and self._caller is None
                if revoke:
                    self._abort_deferred = False
            if not revoke:
                return
        self._abort_now()

    def _abort_now(self) -> None:
        started = time.monotonic()
        for comm in (self._comm, self._parent):  # the child first: it shares the parent's
            if comm is None:
                continue
            try:
                comm.abort()
            except Exception as exc:  # aborting a broken comm may complain; it is gone anyway
                log.warning("nccl abort of %s reported %r", self.name, exc)
        log.warning("nccl communicator aborted name=%s in %.3fs", self.name,
                    time.monotonic() - started)
