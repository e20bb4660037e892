"""A client's lifeline: its connection to the daemon's segment socket.

The client connects before it says hello and presents the token the daemon answers with
(``Lifeline``) in its ``Hello``: the session then lives as long as this connection. The
daemon sees a client that dies by its closing; the client sees a daemon that dies the same
way (``gone``), since ZeroMQ's DEALER would only reconnect, silently. The shared-memory
segments of the client's CPU tensors travel on it too: ZeroMQ cannot carry file
descriptors (``hand_over``: ``SegmentHandoff`` with ``SCM_RIGHTS``, one ``SegmentsTaken``
back). See ``kvd/daemon/lifelines.py`` for the daemon's end.
"""

from __future__ import annotations

import array
import contextlib
import select
import socket
from collections.abc import Iterator, Sequence

import msgspec

from kvd.client.shm import Segment
from kvd.errors import BadRequest, DaemonUnavailable, KvdTimeout
from kvd.protocol import MAX_SEGMENTS_PER_HANDOFF, Lifeline, SegmentHandoff, SegmentsTaken

_MAX_ANSWER_BYTES = 4096
# A daemon's replies and the end of its lifeline travel apart: its last replies (a drain's
# report, say) may come just after the lifeline closed. A client takes them until its
# DEALER's connection has ended too (all of them are in then), or for this long at most
# before it fails its calls.
LAST_WORDS_S = 2.0
_lifeline_decoder = msgspec.msgpack.Decoder(Lifeline)
_taken_decoder = msgspec.msgpack.Decoder(SegmentsTaken)


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
        """Connect to the segment socket at ``path`` and read the token (blocking, within
        ``timeout_s``); ``DaemonUnavailable`` if no daemon is there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
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
        fds = array.array("i", [seg.fd for seg in segments])
        try:
            self.sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError as exc:
            raise DaemonUnavailable(f"cannot hand segments to the daemon at {self.path}: "
                                    f"{exc.strerror or exc}") from None

    def answer(self, data: bytes) -> None:
        """Check a handoff's answer: ``BadRequest`` if the daemon refused the segments."""
        if not data:
            raise DaemonUnavailable(f"the daemon at {self.path} closed the connection")
        try:
            taken = _taken_decoder.decode(data)
        except msgspec.DecodeError:
            raise DaemonUnavailable(f"the daemon's segment socket {self.path} answered "
                                    "something else") from None
        if taken.error:
            raise BadRequest(f"the daemon refused the segments: {taken.error}")

    def hand_over(self, segments: Sequence[Segment], timeout_s: float) -> None:
        """Give the daemon a descriptor of each segment, blocking until the session has
        them."""
        for batch in handoff_batches(segments):
            self.send_handoff(batch)
            try:
                if not select.select([self.sock], [], [], timeout_s)[0]:
                    raise KvdTimeout(f"the daemon's segment socket {self.path} did not "
                                     f"answer within {timeout_s:g}s")
                data = self.sock.recv(_MAX_ANSWER_BYTES, socket.MSG_DONTWAIT)
            except OSError as exc:
                raise DaemonUnavailable(f"the daemon at {self.path} closed the connection: "
                                        f"{exc.strerror or exc}") from None
            self.answer(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
