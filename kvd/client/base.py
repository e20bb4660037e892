"""What the sync and the async client share: building requests, reading replies.

Both clients are thin I/O shells over ``RequestBuilder``: each method builds one request
here (so validation, defaults and timeouts are written once) and maps the reply with
``result_of``. The async client is the reference; the sync client has the same methods,
arguments and results (and their docstrings).

What both promise: every call has a timeout. A call that ends before its reply (its timeout
runs out, its task is cancelled or its thread interrupted), a transfer's ``cancel`` and
closing the client stop the request in the daemon, and return only once the daemon says it
has ended: no more bytes land in (or are read from) its blocks. Where the daemon does not
say so within the client's timeout, the client drops its connection (``unconfirmed``): the
daemon then stops every request of the session before it releases the regions.
"""

from __future__ import annotations

import array
import itertools
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import zmq

from kvd.client.lifeline import ClientLifeline
from kvd.client.shm import Segment, mark_ready, segment_of, tensor_spec
from kvd.errors import (
    BadRequest,
    ConfigError,
    DaemonUnavailable,
    KvdError,
    KvdTimeout,
    ProtocolError,
    error_from_code,
)
from kvd.loop_socket import monitor_event
from kvd.protocol import (
    ALL,
    PROTOCOL_VERSION,
    WHOLE,
    Bye,
    Cancel,
    Delete,
    Done,
    Drain,
    ErrorReply,
    Get,
    Hello,
    LayoutEntry,
    Lend,
    Offload,
    Part,
    Ping,
    Pong,
    Publish,
    Pull,
    Put,
    Register,
    Registered,
    Release,
    Reload,
    Renew,
    Reply,
    Share,
    ShmTensor,
    Stats,
    StatsReply,
    Unpublish,
    Unregister,
    Welcome,
    decode_reply,
    encode,
    pack_block_ids,
)

log = logging.getLogger(__name__)

# Extra time a client waits for the reply of an operation that has its own server-side
# timeout (get, put), so the daemon's precise error arrives before the client gives up.
REPLY_MARGIN_S = 5.0
HELLO_TIMEOUT_S = 5.0
# How long closing waits for the daemon to close the session when no request is in flight
# (with requests in flight: the client's timeout, as they must stop first).
BYE_TIMEOUT_S = 5.0


def default_socket_path() -> str:
    """The socket a daemon with default settings listens on (``KVD_SOCKET_PATH`` wins).

    ``ConfigError`` when that is in the fallback directory (``kvd-<uid>`` in the temporary
    directory) and the daemon would refuse it: any user can make that directory first, and
    a socket of theirs in it would get this client's tensors."""
    from kvd.config import default_socket_path as from_config
    from kvd.config import fallback_socket_dir, socket_dir_problem

    explicit = os.environ.get("KVD_SOCKET_PATH")
    if explicit:
        return os.path.abspath(explicit)  # as the daemon reads it
    path = from_config(os.environ)
    directory = os.path.dirname(path)
    if directory == fallback_socket_dir() and os.path.lexists(directory):
        problem = socket_dir_problem(directory)
        if problem:
            raise ConfigError(f"default socket path {path}: {problem}")
    return path


@dataclass(frozen=True)
class Region:
    """A registered region, as the client sees it."""

    region_id: int
    name: str
    num_blocks: int
    layout: tuple[LayoutEntry, ...]
    tensors: tuple[Any, ...] = field(repr=False, compare=False)
    gpus: tuple[int, ...] = ()  # GPUs its tensors live on (their reads are ordered by events)


class Call(NamedTuple):
    """One request ready to send, how long to wait for its reply, and what it returns.
    (A named tuple: one is made per call, and a frozen dataclass costs microseconds.)"""

    msg: Any
    timeout_s: float
    kind: str  # "nbytes" | "region" | "rtt" | "stats" | "welcome" | "none" (result_of)
    tensors: tuple[Any, ...] = ()


# Replies larger than this are dropped (with a warning), not buffered: a stats reply is a
# few KiB, everything else less than one.
MAX_REPLY_BYTES = 64 * 1024 * 1024


def decode_replies(payloads: Iterable[bytes]) -> Iterator[Reply]:
    """The replies among messages; oversized or undecodable ones are dropped with a
    warning (a client must not die of one bad reply)."""
    for payload in payloads:
        if len(payload) > MAX_REPLY_BYTES:
            log.warning("dropping a reply of %d bytes (over %d)", len(payload), MAX_REPLY_BYTES)
            continue
        try:
            yield decode_reply(payload)
        except ProtocolError as exc:
            log.warning("dropping undecodable reply: %s", exc)


def open_connection(socket_path: str, timeout_s: float
                    ) -> tuple[ClientLifeline, zmq.Socket[Any], zmq.Socket[Any]]:
    """The lifeline to the daemon at ``socket_path``, a DEALER its ROUTER has connected to
    (``ClientLifeline.reach``), and the DEALER's monitor (``ended_by``). Blocking, within
    ``timeout_s``."""
    lifeline = ClientLifeline.connect(socket_path, timeout_s)
    # (the process's context for clients: one I/O thread, made on first use)
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        lifeline.reach(sock, timeout_s)
    except BaseException:
        monitor.close(linger=0)
        sock.close()
        lifeline.close()
        raise
    return lifeline, sock, monitor


def ended_by(event: list[bytes]) -> bool:
    """Whether a DEALER monitor's event says its connection ended: every reply the daemon
    sent before is in the DEALER then (one connection delivers in order)."""
    parsed = monitor_event(event)
    return parsed is not None and parsed[0] == zmq.EVENT_DISCONNECTED


_MAX_BLOCK_ID = 2**32 - 1
# array("I") is the wire's packing (4 bytes, little-endian) on the machines kvd runs on.
_ARRAY_PACKS = array.array("I").itemsize == 4 and sys.byteorder == "little"


def _blocks(blocks: Iterable[int]) -> bytes:
    """Block ids packed for the wire (``protocol.pack_block_ids``), checked here: a flat
    sequence of integers in [0, 2**32). A list, a range, a numpy array or a torch tensor
    (any device); 1024 ids cost ~6 us from a list, ~2 us from an array."""
    if isinstance(blocks, list | tuple) and _ARRAY_PACKS and blocks and (
            type(blocks[0]) is not bool):
        # array checks each is an int in [0, 2**32) in C (numpy took ~26 us for 1024 ids).
        # Anything it refuses goes the numpy way below, which says what is wrong.
        try:
            return array.array("I", blocks).tobytes()
        except (OverflowError, TypeError):
            pass
    if isinstance(blocks, range):
        ids = np.arange(blocks.start, blocks.stop, blocks.step, dtype=np.int64)
    else:
        if hasattr(blocks, "detach"):  # a torch tensor, wherever it lives
            blocks = blocks.detach().cpu().numpy()
        try:
            ids = np.asarray(blocks if isinstance(blocks, (list, tuple, np.ndarray))
                             else list(blocks))
        except (OverflowError, TypeError, ValueError) as exc:
            raise BadRequest(f"block ids must be integers: {exc}") from None
    if ids.size == 0:
        return b""  # the daemon says so ("no blocks given")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise BadRequest(f"block ids must be a flat sequence of integers, got "
                         f"{ids.ndim}-d {ids.dtype}")
    if ids.min() < 0 or ids.max() > _MAX_BLOCK_ID:
        raise BadRequest(f"block ids must be in [0, {_MAX_BLOCK_ID}], got "
                         f"{int(ids.min())}..{int(ids.max())}")
    return pack_block_ids(ids)


def _region_id(region: Region | int) -> int:
    return region.region_id if isinstance(region, Region) else int(region)


def _reading(region: Region | int) -> int:
    """The id of a region the daemon is about to read; its GPU writes so far come first.
    (A bare id carries no tensors: the caller then orders its writes itself.)"""
    if isinstance(region, Region):
        if region.gpus:
            mark_ready(region.gpus)
        return region.region_id
    return int(region)


class RequestBuilder:
    def __init__(self, socket_path: str | None, name: str, timeout_s: float) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.name = name
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._handed: set[int] = set()  # the segments the session holds
        self._max_message_bytes = 0  # the daemon's, told in its welcome (0: not yet)

    def welcomed(self, welcome: Welcome) -> None:
        """A new session: none of our segments yet."""
        self._handed = set()
        self._max_message_bytes = welcome.max_message_bytes

    def encode(self, call: Call) -> bytes:
        """``call``'s message for the wire; ``BadRequest`` if it is longer than the daemon
        reads (its connection would end)."""
        payload = encode(call.msg)
        if self._max_message_bytes and len(payload) > self._max_message_bytes:
            raise BadRequest(f"a request of {len(payload)} bytes is longer than the daemon "
                             f"reads (max_message_bytes {self._max_message_bytes}): "
                             "fewer blocks or tensors per call")
        return payload

    def segments_to_hand(self, call: Call) -> list[Segment]:
        """The shared-memory segments a register call needs that this session lacks."""
        needed: dict[int, Segment] = {}
        for spec in call.msg.tensors:
            if isinstance(spec, ShmTensor) and spec.segment not in self._handed:
                needed[spec.segment] = segment_of(spec)
        return list(needed.values())

    def handed(self, segments: Sequence[Segment]) -> None:
        self._handed.update(seg.id for seg in segments)

    def _t(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    def check_socket(self) -> None:
        from kvd.daemon.socket_files import daemon_starting

        if starting := daemon_starting(self.socket_path):
            raise DaemonUnavailable(f"{starting}; it answers once it is ready")
        if not os.path.exists(self.socket_path):
            raise DaemonUnavailable(
                f"no kvd daemon at {self.socket_path} (socket missing); start one with "
                "`kvd serve` or set KVD_SOCKET_PATH"
            )

    def disconnected(self) -> DaemonUnavailable:
        return DaemonUnavailable(
            f"kvd daemon at {self.socket_path} closed the connection (it stopped or "
            "restarted; registrations are gone): create a new client"
        )

    def unavailable(self, what: str, waited_s: float) -> KvdError:
        if not os.path.exists(self.socket_path):
            return DaemonUnavailable(f"kvd daemon at {self.socket_path} went away ({what})")
        return KvdTimeout(f"{what}: no reply from kvd daemon at {self.socket_path} "
                          f"within {waited_s:g}s")

    # ---- requests

    def hello_timeout(self, timeout_s: float | None) -> float:
        # A live daemon answers hello in microseconds: a stale socket file with nobody
        # behind it should not cost the whole request timeout.
        return min(self.timeout_s, HELLO_TIMEOUT_S) if timeout_s is None else timeout_s

    def hello(self, timeout_s: float | None) -> Call:
        msg = Hello(req_id=next(self._ids), protocol_version=PROTOCOL_VERSION,
                    pid=os.getpid(), name=self.name)
        return Call(msg, self.hello_timeout(timeout_s), "welcome")

    def bye(self, in_flight: bool) -> Call:
        """The daemon answers once it has closed the session: its requests ended, no more
        bytes move in its blocks."""
        wait_s = self.timeout_s if in_flight else min(self.timeout_s, BYE_TIMEOUT_S)
        return Call(Bye(req_id=next(self._ids)), wait_s, "none")

    def ping(self, timeout_s: float | None) -> Call:
        return Call(Ping(req_id=next(self._ids)), self._t(timeout_s), "rtt")

    def stats(self, timeout_s: float | None) -> Call:
        return Call(Stats(req_id=next(self._ids)), self._t(timeout_s), "stats")

    def register(self, name: str, tensors: Sequence[Any], block_dim: int,
                 timeout_s: float | None) -> Call:
        if not tensors:
            raise BadRequest("register needs at least one tensor")
        specs = [tensor_spec(t, i) for i, t in enumerate(tensors)]
        msg = Register(req_id=next(self._ids), name=name, tensors=specs, block_dim=block_dim)
        return Call(msg, self._t(timeout_s), "region", tuple(tensors))

    def unregister(self, region: Region | int, timeout_s: float | None) -> Call:
        msg = Unregister(req_id=next(self._ids), region_id=_region_id(region))
        return Call(msg, self._t(timeout_s), "none")

    def offload(self, key: str, region: Region | int, blocks: Iterable[int],
                ttl_s: float | None, timeout_s: float | None) -> Call:
        msg = Offload(req_id=next(self._ids), key=key, region_id=_reading(region),
                      blocks=_blocks(blocks), ttl_s=ttl_s)
        return Call(msg, self._t(timeout_s), "nbytes")

    def get(self, key: str, region: Region | int, blocks: Iterable[int],
            timeout_s: float | None, share: Share = ALL, into: Part = WHOLE,
            sender: str | None = None) -> Call:
        wait_s = self._t(timeout_s)
        msg = Get(req_id=next(self._ids), key=key, region_id=_region_id(region),
                  blocks=_blocks(blocks), timeout_s=wait_s, share=share, into=into,
                  sender=sender or "")
        return Call(msg, wait_s + REPLY_MARGIN_S, "nbytes")

    def renew(self, key: str, src: str, ttl_s: float, timeout_s: float | None) -> Call:
        wait_s = self._t(timeout_s)
        msg = Renew(req_id=next(self._ids), key=key, src=src, ttl_s=ttl_s, timeout_s=wait_s)
        return Call(msg, wait_s + REPLY_MARGIN_S, "nbytes")

    def release(self, key: str, src: str, timeout_s: float | None, skip: int = 0) -> Call:
        wait_s = self._t(timeout_s)
        msg = Release(req_id=next(self._ids), key=key, src=src, timeout_s=wait_s, skip=skip)
        return Call(msg, wait_s + REPLY_MARGIN_S, "nbytes")

    def put(self, key: str, region: Region | int, blocks: Iterable[int], to: str | None,
            ttl_s: float | None, timeout_s: float | None) -> Call:
        wait_s = self._t(timeout_s)
        msg = Put(req_id=next(self._ids), key=key, region_id=_reading(region),
                  blocks=_blocks(blocks), to=to or "", ttl_s=ttl_s, timeout_s=wait_s)
        return Call(msg, wait_s + REPLY_MARGIN_S, "nbytes")

    def pull(self, key: str, src: str, region: Region | int, blocks: Iterable[int],
             timeout_s: float | None, wait_for_key_s: float = 0.0, share: Share = ALL,
             into: Part = WHOLE) -> Call:
        wait_s = self._t(timeout_s)
        if not 0.0 <= wait_for_key_s <= wait_s:
            raise BadRequest(f"wait_for_key_s must be between 0 and the timeout "
                             f"({wait_s:g}s), not {wait_for_key_s!r}")
        msg = Pull(req_id=next(self._ids), key=key, src=src, region_id=_region_id(region),
                   blocks=_blocks(blocks), timeout_s=wait_s, wait_for_key_s=wait_for_key_s,
                   share=share, into=into)
        return Call(msg, wait_s + REPLY_MARGIN_S, "nbytes")

    def publish(self, key: str, region: Region | int, blocks: Iterable[int],
                ttl_s: float | None, timeout_s: float | None) -> Call:
        msg = Publish(req_id=next(self._ids), key=key, region_id=_reading(region),
                      blocks=_blocks(blocks), ttl_s=ttl_s)
        return Call(msg, self._t(timeout_s), "nbytes")

    def lend(self, key: str, region: Region | int, blocks: Iterable[int], ttl_s: float,
             timeout_s: float | None) -> Call:
        msg = Lend(req_id=next(self._ids), key=key, region_id=_reading(region),
                   blocks=_blocks(blocks), ttl_s=ttl_s)
        # A read that began just before the TTL still ends before the reply.
        return Call(msg, ttl_s + self._t(timeout_s) + REPLY_MARGIN_S, "nbytes")

    def unpublish(self, key: str, timeout_s: float | None) -> Call:
        return Call(Unpublish(req_id=next(self._ids), key=key), self._t(timeout_s), "none")

    def delete(self, key: str, timeout_s: float | None) -> Call:
        return Call(Delete(req_id=next(self._ids), key=key), self._t(timeout_s), "none")

    def drain(self, grace_s: float | None, timeout_s: float | None) -> Call:
        wait_s = self._t(timeout_s)
        return Call(Drain(req_id=next(self._ids), grace_s=grace_s), wait_s, "stats")

    def reload(self, timeout_s: float | None) -> Call:
        return Call(Reload(req_id=next(self._ids)), self._t(timeout_s), "stats")

    def cancel(self, target: int, timeout_s: float | None) -> Call:
        """The daemon answers once ``target`` has ended (its own reply goes first)."""
        return Call(Cancel(req_id=next(self._ids), target=target), self._t(timeout_s), "none")

    def unconfirmed(self, target: int, why: str) -> DaemonUnavailable:
        """The error of a client that stopped waiting for request ``target`` without the
        daemon's word that it ended (logged here): the client drops its connection, and
        says what that leaves."""
        err = DaemonUnavailable(
            f"kvd daemon at {self.socket_path} did not confirm that request {target} "
            f"stopped ({why}): the connection is closed and the registrations are gone. The "
            "daemon stops the client's requests before it releases the regions, but until "
            "then bytes may still move in that request's blocks: create a new client")
        log.warning("%s", err.message)
        return err

    def no_hello(self, exc: Exception) -> DaemonUnavailable:
        return DaemonUnavailable(f"kvd daemon at {self.socket_path} did not answer hello: {exc}")


class ClientShell:
    """What both clients are around their ``RequestBuilder``: the public attributes."""

    _b: RequestBuilder
    node_id: str  # the daemon's, and its epoch: told in its welcome
    epoch: int

    @property
    def socket_path(self) -> str:
        return self._b.socket_path

    @property
    def name(self) -> str:
        return self._b.name

    def _welcomed(self, welcome: Welcome) -> None:
        self.node_id, self.epoch = welcome.node_id, welcome.epoch
        self._b.welcomed(welcome)


def refusal(reply: Reply) -> str:
    """Why a cancel's ``reply`` does not confirm its target ended ("": it does)."""
    return "" if isinstance(reply, Done) else getattr(reply, "message", type(reply).__name__)


def stoppable(call: Call) -> bool:
    """Whether ``call`` runs as a task in the daemon that a ``Cancel`` stops (a get, put,
    pull, lend, offload, register ...), as opposed to one answered at once."""
    return call.kind not in ("none", "rtt", "stats", "welcome")


def result_of(call: Call, reply: Reply, rtt_s: float) -> Any:
    """The value a client method returns for ``reply``; errors are raised as their class."""
    if isinstance(reply, ErrorReply):
        raise error_from_code(reply.code, reply.message)
    if call.kind == "nbytes" and isinstance(reply, Done):
        return reply.nbytes
    if call.kind == "none" and isinstance(reply, Done):
        return None
    if call.kind == "rtt" and isinstance(reply, Pong):
        return rtt_s
    if call.kind == "stats" and isinstance(reply, StatsReply):
        return reply.stats
    if call.kind == "welcome" and isinstance(reply, Welcome):
        return reply
    if call.kind == "region" and isinstance(reply, Registered):
        msg = call.msg
        gpus = tuple(sorted({t.device.index for t in call.tensors
                             if getattr(t, "is_cuda", False)}))
        return Region(reply.region_id, msg.name, reply.num_blocks, tuple(reply.layout),
                      call.tensors, gpus)
    raise KvdError(f"unexpected reply {type(reply).__name__} to {type(call.msg).__name__}")
