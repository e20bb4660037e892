"""A client's lifeline: its connection to the daemon's ``socket_path``, the door.

The client connects first, and the daemon answers with a token (``Lifeline``). Then
``reach`` makes the client's DEALER: bound in a directory only this process's user may
enter, its socket file handed over as an ``O_PATH`` descriptor (``Reach``) and unlinked at
once. The daemon's ROUTER connects through that descriptor with the token as routing id,
and nobody else can connect at all. The hello on the DEALER then opens a session, which
lives as long as the lifeline. The daemon sees a client that dies by its closing; the
client sees a daemon that dies the same way (``gone``), since a ZeroMQ connection ends
silently. The shared-memory segments of the client's CPU tensors travel on it too: ZeroMQ
cannot carry file descriptors (``hand_over``: ``SegmentHandoff`` with ``SCM_RIGHTS``, one
``Taken`` back). See ``kvd/daemon/lifelines.py`` for the daemon's end.
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import zmq

from kvd.client.shm import Segment
from kvd.errors import BadRequest, DaemonUnavailable, KvdTimeout
from kvd.protocol import MAX_SEGMENTS_PER_HANDOFF, Lifeline, Reach, SegmentHandoff, Taken

_MAX_ANSWER_BYTES = 4096
# A daemon's replies and the end of its lifeline travel apart: its last replies (a drain's
# report, say) may come just after the lifeline closed. A client takes them until its
# DEALER's connection has ended too (all of them are in then), or for this long at most
# before it fails its calls.
LAST_WORDS_S = 2.0
_lifeline_decoder = msgspec.msgpack.Decoder(Lifeline)
_taken_decoder = msgspec.msgpack.Decoder(Taken)


def handoff_batches(segments: Sequence[Segment]) -> Iterator[Sequence[Segment]]:
    """``segments`` cut into handoffs (at most ``MAX_SEGMENTS_PER_HANDOFF`` each)."""
    for start in range(0, len(segments), MAX_SEGMENTS_PER_HANDOFF):
        yield segments[start:start + MAX_SEGMENTS_PER_HANDOFF]


class ClientLifeline:
    """The connection, and the token its session's hello presents."""

    def __init__(self, sock: socket.socket, token: bytes, path: str) -> None:
        self.sock = sock
        self.token = token
        self.path = path

    @classmethod
    def connect(cls, path: str, timeout_s: float) -> ClientLifeline:
        """Connect to the daemon's socket at ``path`` and read the token (blocking, within
        ``timeout_s``); ``DaemonUnavailable`` if no daemon is there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        deadline = time.monotonic() + timeout_s
        sock.settimeout(timeout_s)
        try:
            while True:
                try:
                    sock.connect(path)
                    break
                except BlockingIOError:  # its backlog is full: a flood the daemon sheds
                    if time.monotonic() > deadline:
                        raise TimeoutError from None
                    time.sleep(0.002)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            data = sock.recv(_MAX_ANSWER_BYTES)
            token = _lifeline_decoder.decode(data).token
        except (OSError, msgspec.DecodeError) as exc:
            sock.close()
            what = ("did not answer in time" if isinstance(exc, TimeoutError) else
                    getattr(exc, "strerror", None) or str(exc) or "closed at once")
            raise DaemonUnavailable(f"cannot connect to kvd daemon at {path}: {what}") from None
        # Blocking from now on: ``gone`` asks without waiting (MSG_DONTWAIT), and a
        # socket timeout would make every call wait first.
        sock.settimeout(None)
        return cls(sock, token, path)

    def fileno(self) -> int:
        return self.sock.fileno()

    def reach(self, sock: zmq.Socket[Any], timeout_s: float) -> None:
        """Bind the DEALER ``sock`` where only the daemon can reach it, and wait until the
        daemon's connection is up (blocking, within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        # A directory only this user may enter (0700): nobody else can connect to the
        # socket file in it. The daemon connects through the descriptor handed over (it
        # may run as another user: the file itself lets anyone who reaches it connect),
        # and the file goes at once: the descriptor is the only way in left.
        private = tempfile.mkdtemp(prefix="kvd-")
        try:
            path = os.path.join(private, "s")
            try:
                sock.bind(f"ipc://{path}")
            except zmq.ZMQError as exc:
                raise DaemonUnavailable(f"cannot bind the client's endpoint at {path}: "
                                        f"{exc}") from None
            os.chmod(path, 0o666)
            endpoint = os.open(path, os.O_PATH | os.O_CLOEXEC)
        finally:
            shutil.rmtree(private, ignore_errors=True)
        try:
            self._send(msgspec.msgpack.encode(Reach()), [endpoint])
        finally:
            os.close(endpoint)
        self.answer(self._receive(max(0.0, deadline - time.monotonic())))
        # The DEALER may send once the daemon's connection is attached.
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not sock.poll(left_ms, zmq.POLLOUT):
            raise KvdTimeout(f"the daemon at {self.path} did not connect within "
                             f"{timeout_s:g}s")

    def gone(self) -> bool:
        """Whether the daemon closed it (without waiting; an answer waiting is not)."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def send_handoff(self, segments: Sequence[Segment]) -> None:
        """Send one handoff (at most ``MAX_SEGMENTS_PER_HANDOFF`` segments)."""
        payload = msgspec.msgpack.encode(SegmentHandoff(segments=[seg.id for seg in segments]))
        self._send(payload, [seg.fd for seg in segments])

    def _send(self, payload: bytes, fds: list[int]) -> None:
        rights = array.array("i", fds)
        try:
            self.sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        except OSError as exc:
            raise DaemonUnavailable(f"cannot hand descriptors to the daemon at {self.path}: "
                                    f"{exc.strerror or exc}") from None

    def _receive(self, timeout_s: float) -> bytes:
        """The next answer (blocking, within ``timeout_s``). ``poll``, not ``select``: the
        descriptor's number may be past select's 1024 in a process with many open."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        try:
            if not poller.poll(timeout_s * 1000):
                raise KvdTimeout(f"the daemon's socket {self.path} did not answer within "
                                 f"{timeout_s:g}s")
            return self.sock.recv(_MAX_ANSWER_BYTES, socket.MSG_DONTWAIT)
        except OSError as exc:
            raise DaemonUnavailable(f"the daemon at {self.path} closed the connection: "
                                    f"{exc.strerror or exc}") from None

    def answer(self, data: bytes) -> None:
        """Check a handoff's answer: ``BadRequest`` if the daemon refused the segments."""
        if not data:
            raise DaemonUnavailable(f"the daemon at {self.path} closed the connection")
        try:
            taken = _taken_decoder.decode(data)
        except msgspec.DecodeError:
            raise DaemonUnavailable(f"the daemon's socket {self.path} answered "
                                    "something else") from None
        if taken.error:
            raise BadRequest(f"the daemon refused: {taken.error}")

    def hand_over(self, segments: Sequence[Segment], timeout_s: float) -> None:
        """Give the daemon a descriptor of each segment, blocking until the session has
        them."""
        for batch in handoff_batches(segments):
            self.send_handoff(batch)
            self.answer(self._receive(timeout_s))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
