"""The NCCL binding kvd uses, through nccl4py (``nccl.core``), and nothing else of it.

Every call is bounded: communicators are non-blocking (``NCCLConfig(blocking=False)``), so
init, send and recv return at once and leave the communicator ``InProgress``; we poll
``get_async_error()`` back to ``Success`` before the next call (the next call fails
otherwise), against a deadline, and ``abort()`` on a timeout or an error. Completion of the
bytes is a CUDA event on the channel's stream, also polled against a deadline: NCCL does
not notice a peer that died on the same node (its kernel just never finishes), so these
deadlines and the peer plane's heartbeats are the only detectors. A communicator is never
destroyed from ``__del__``.

Buffers must be contiguous ``uint8`` CUDA tensors (nccl4py does not check contiguity, and
sends ``numel()`` elements from ``data_ptr()``). nccl4py is imported on first use, so CPU
machines import kvd without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvd import timeline
from kvd.errors import KvdTimeout, PeerUnreachable, TransferFailed

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


def new_unique_id() -> bytes:
    """The 128 bytes rank 0 creates and sends to rank 1 over the peer plane."""
    import nccl.core as nc

    return bytes(nc.get_unique_id())


class Communicator:
    """A 2-rank non-blocking communicator with deadlines on everything."""

    def __init__(self, comm: Any, name: str) -> None:
        self._comm = comm
        self.name = name
        self.aborted = False

    @classmethod
    def init(cls, unique_id: bytes, rank: int, timeout_s: float, name: str) -> Communicator:
        """Join the 2-rank communicator ``unique_id`` as ``rank``; abort past the timeout."""
        import nccl.core as nc

        cfg = nc.NCCLConfig(blocking=False, comm_name=name)
        comm = cls(nc.Communicator.init(2, rank, nc.UniqueId.from_bytes(unique_id), cfg),
                   name)
        started = time.monotonic()
        comm._settle(timeout_s, "init")
        log.info("nccl communicator up name=%s rank=%d in %.3fs", name, rank,
                 time.monotonic() - started)
        return comm

    def _settle(self, timeout_s: float, what: str) -> None:
        """Poll until the last call is accepted (``Success``); abort on error or timeout."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            try:
                if self.settled(what):
                    return
            except TransferFailed:
                self.abort()
                raise
            if time.monotonic() > deadline:
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
        timeline.mark("nccl.returned")

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
        """Abort (idempotent). Frees the stream's pending NCCL work; never blocks for long."""
        if self.aborted:
            return
        self.aborted = True
        started = time.monotonic()
        try:
            self._comm.abort()
        except Exception as exc:  # aborting a broken comm may complain; it is gone anyway
            log.warning("nccl abort of %s reported %r", self.name, exc)
        log.warning("nccl communicator aborted name=%s in %.3fs", self.name,
                    time.monotonic() - started)
