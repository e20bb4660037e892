"""The floor: kvd's design with nothing of kvd in it, to measure what the design itself costs.

The same processes as kvd's (two daemons, each an asyncio loop on uvloop, and the clients
in the benchmark's own process), the same ZeroMQ sockets (a client's DEALER on a daemon's
``local`` ROUTER over ``ipc://``, daemon a's DEALER on daemon b's ``peer`` ROUTER over
``tcp://``), the same messages in the same order, encoded and decoded with kvd's own msgspec
Structs (``kvd.protocol``: the same bytes on the wire, the same validation), and the same
byte movement; and nothing else: no tasks, futures, machine, metrics, store, leases, timers
or checks. Each socket's ``zmq.FD`` is in the loop (``add_reader``); a read takes messages
until ``zmq.EVENTS`` shows none, and every socket a handler sent on is read again before
the loop sleeps (a send can take the edge that announced a message: see kvd/loop_socket.py).
Each message is handled where it is read, and its replies go out in the same callback.

The messages, hop by hop (kvd's, found in kvd/client, daemon/local_server.py, daemon/engine.py
and daemon/transfer/{machine,transfers}.py, and seen in the daemons' timeline marks
with ``tools/timeline.py [--pull]``; ``python floor.py hops`` times each hop of the floor's).
tx and rx are the sending and receiving clients, a and b their daemons:

  put -> waiting get, at most 64 KiB (``MAX_INLINE_BYTES``: the bytes ride in the offer)
    before the clock   rx -> b   Get                ipc   b holds it as the waiting get
    1                  tx -> a   Put                ipc
    2                  a  -> b   Offer + the bytes  tcp   b copies them into the get's blocks
    3                  b  -> rx  Done (the get's)   ipc
    4                  b  -> a   XferDone           tcp
    5                  a  -> tx  Done (the put's)   ipc   the clock stops: both have returned

  put -> waiting get, larger (one TCP data connection a -> b, a worker thread at each end)
    1  tx -> a Put;  2  a -> b Offer (eager), and a's data thread writes a header and the
    bytes on the data connection at once;  3  b -> a Accept, and b's data thread reads the
    bytes straight into the get's blocks, then hands back to b's loop;  4  b -> rx Done;
    5  b -> a XferDone;  6  a -> tx Done.

  lend -> pull, at most 64 KiB
    1  tx -> a Lend (a holds the key);  2  rx -> b Pull;  3  b -> a PullRequest (tcp);
    4  a -> b Offer + the bytes, under the pull's transfer id;  5  b -> rx Done (the pull's:
    the clock stops);  6  b -> a XferDone;  7  a -> tx Done (the lend's, after the clock).

  lend -> pull, larger
    1-3 as above;  4  a -> b Offer (eager) and the bytes on the data connection;  5  b -> a
    Accept;  6  b -> a XferDone, once the bytes are in;  7  b -> rx Done (the pull's);
    8  a -> tx Done (the lend's).

  one GPU (``--device cuda``; one daemon, both clients on it, regions by CUDA IPC)
    before the clock rx -> d Get;  1  tx -> d Put;  d launches one copy (``copy_`` for a
    whole contiguous tensor, else one launch of kvd's gather/scatter kernel) and records an
    event, polled at every turn of the loop;  2  d -> tx Done (the put's);  3  d -> rx Done
    (the get's). (kvd's order, from reading daemon/engine.py: the put's coroutine replies in
    the turn its copy is seen done, the get's task a turn later.)

Where kvd makes per transfer what the floor makes once, the floor's choice is the design's
cheapest: on the GPU the kernel's block maps are cached per block list (the benchmark's
repeat), and the client's writes are ordered by the benchmark's own synchronize, not by an
interprocess event. The data connection carries a 16-byte header per transfer, then the
bytes in calls of 4 MiB (kvd's ``tcp_chunk_bytes``), with no header per chunk.

Run by benchmarks/peers.py (``Floor``) as ``python floor.py serve NAME DIR``: the daemon
reads one JSON command a line on stdin and answers one JSON line on stdout (first
``{"local": ..., "peer": ..., "data": ...}``, its endpoints): ``dial {peer, data}`` (a:
connect to b), ``map {region, tensors | cuda}``, ``unmap {region}``; stdin's end stops it.
``python floor.py hops [--json]`` times each hop of a 4 KiB put and pull (from its send to
its receipt), and round trips through the floor's own sockets and loops beside raw pyzmq's
(benchmarks/control_plane.py's echo server) over ipc and tcp, alternated, in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import mmap
import os
import queue
import random
import select
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import zmq

from kvd.protocol import (
    MAX_INLINE_BYTES,
    Accept,
    Done,
    ErrorReply,
    Get,
    Heartbeat,
    LayoutEntry,
    Lend,
    Offer,
    Ping,
    Pong,
    Pull,
    PullRequest,
    Put,
    Reply,
    XferDone,
    decode_peer,
    decode_reply,
    decode_request,
    encode,
)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workers import recv_views, send_views  # noqa: E402  (scatter-gather socket I/O)

EVENTS, POLLIN, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
DATA_HEADER = struct.Struct("!QQ")  # transfer id, bytes: once per transfer on the stream
# Bytes per send or receive call on the data connection (kvd's tcp_chunk_bytes): 64 MiB
# moved at 3.2 GB/s median in 2 or 4 MiB calls, 2.8 in 16 MiB ones, 2.3 in one call
# per transfer (alternated, 50 each).
CHUNK_BYTES = 4 << 20
STOP = object()
MARKS_ENV = "FLOOR_MARKS_DIR"  # where each process writes its hop marks (``hops``)


def new_id() -> int:
    return random.getrandbits(62) + 1  # as kvd's transfer ids (msgpack sizes alike)


def pack_ids(ids: Sequence[int]) -> bytes:
    """Block ids as the wire carries them (kvd's client packs a list the same way)."""
    return array("I", ids).tobytes()


def unpack_ids(blocks: bytes) -> list[int]:
    ids = array("I")
    ids.frombytes(blocks)
    return ids.tolist()


class Marks:
    """Hop marks of one process (only with ``FLOOR_MARKS_DIR`` set): (time, event)."""

    def __init__(self, role: str) -> None:
        self.dir = os.environ.get(MARKS_ENV, "")
        self.role = role
        self.marks: list[tuple[float, str]] | None = [] if self.dir else None

    def write(self) -> None:
        if self.marks is not None:
            with open(os.path.join(self.dir, f"{self.role}.json"), "w") as f:
                json.dump(self.marks, f)


# ------------------------------------------------------------------ the daemon


@dataclass(eq=False)
class Region:
    """Mapped tensors of one client: host memory (``mem``: one view per tensor) or GPU
    tensors (``gpu``); ``block`` bytes per block in every tensor (as the benchmark's)."""

    layout: list[LayoutEntry]
    block: int
    mem: list[memoryview]
    gpu: list[Any]

    def views(self, ids: list[int]) -> list[memoryview]:
        """The blocks in wire order: tensor by tensor, block by block."""
        b = self.block
        return [m[i * b:(i + 1) * b] for m in self.mem for i in ids]

    def nbytes(self, ids: list[int]) -> int:
        return self.block * len(ids) * len(self.layout)


@dataclass(eq=False)
class Waiting:
    """A client's request the daemon answers later: its routing id, req_id and blocks."""

    ident: bytes
    req_id: int
    region: Region
    ids: list[int]
    key: str = ""


class Sock:
    """A ZeroMQ socket read on the loop: ``read`` hands each message waiting to
    ``on_message`` (a ROUTER's with its routing id, a DEALER's with b""). Frames are
    copied both ways (64 transfers in flight cost the daemons 155 µs of CPU each so;
    166 received as ``zmq.Frame``s, 234 sent without a copy). Plain ints as flags:
    pyzmq's enum members cost a microsecond more per use (kvd/loop_socket.py)."""

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[bytes, bytes], None],
                 routed: bool) -> None:
        self.sock = sock
        self.on_message = on_message
        self.routed = routed
        self.sent = False  # sent on since last read: read again before the loop sleeps

    def read(self) -> None:
        sock, on_message = self.sock, self.on_message
        recv, get = sock.recv, sock.get
        while cast(int, get(EVENTS)) & POLLIN:
            ident = recv(NOBLOCK) if self.routed else b""
            on_message(ident, recv(NOBLOCK))

    def send(self, payload: bytes, ident: bytes = b"") -> None:
        if ident:
            self.sock.send(ident, SNDMORE | NOBLOCK)
        self.sock.send(payload, NOBLOCK)
        self.sent = True


class Daemon:
    """One floor daemon: the handlers of each message, and the loop's entry points."""

    def __init__(self, name: str, root: str) -> None:
        import uvloop

        self.name = name
        self.loop = uvloop.new_event_loop()
        self.ctx: zmq.Context[Any] = zmq.Context(io_threads=1)  # as kvd's (loop_socket)
        self.marks = Marks(name)
        self.local = self._sock(zmq.ROUTER, self.on_local)
        self.local.sock.bind(f"ipc://{root}/floor-{name}.sock")
        self.router = self._sock(zmq.ROUTER, self.on_router)  # peers dial it
        self.router.sock.bind("tcp://127.0.0.1:0")
        self.dealer: Sock | None = None  # ours to b (daemon a)
        self.socks = [self.local, self.router]
        self.peer_ident = b""  # a's DEALER on our ROUTER (daemon b)
        self.regions: dict[int, Region] = {}
        self.gets: dict[str, Waiting] = {}  # waiting gets by key
        self.lent: dict[str, Waiting] = {}
        self.pull_asks: dict[str, PullRequest] = {}  # pull requests before their lend
        self.pulls: dict[int, Waiting] = {}  # our pulls by transfer id
        self.sends: dict[int, Waiting] = {}  # puts and lends sent, by transfer id
        self.data_listener = socket.create_server(("127.0.0.1", 0))
        self.data_out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.data_in: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.data_sock: socket.socket | None = None
        self.dialing = False
        self.pings: list[float] = []  # ping_peer's send times
        self.ping_count = 0
        self.stdin_buf = b""
        self.gpu_maps: dict[tuple[int, bytes], Any] = {}
        self.gpu_ready = False
        self.local_handlers: dict[type, Callable[[bytes, Any], None]] = {
            Put: self.on_put, Get: self.on_get, Lend: self.on_lend, Pull: self.on_pull,
            Ping: self.on_ping}
        self.peer_handlers: dict[type, Callable[[Any], None]] = {
            Offer: self.on_offer, Accept: self.on_accept, XferDone: self.on_xfer_done,
            PullRequest: self.on_pull_request, Heartbeat: self.on_heartbeat}

    def _sock(self, kind: int, on_message: Callable[[bytes, bytes], None]) -> Sock:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        found = Sock(sock, on_message, kind == zmq.ROUTER)
        self.loop.add_reader(sock.getsockopt(zmq.FD), self.entry, found.read)
        return found

    def entry(self, fn: Callable[..., None], *args: Any) -> None:
        """Every way into the daemon: ``fn``, then every socket sent on is read again."""
        try:
            fn(*args)
            while True:
                sent = [s for s in self.socks if s.sent]
                if not sent:
                    return
                for s in sent:
                    s.sent = False
                    s.read()
        except BaseException:
            traceback.print_exc()
            os._exit(3)  # a bug: the benchmark sees the daemon gone, with this log

    def mark(self, what: str) -> None:
        if self.marks.marks is not None:
            self.marks.marks.append((time.perf_counter(), what))

    # ---- sending

    def to_client(self, ident: bytes, msg: Reply) -> None:
        if self.marks.marks is not None:
            self.mark(f"send {msg.__struct_config__.tag}")
        self.local.send(encode(msg), ident)

    def to_peer(self, msg: Any) -> None:
        if self.marks.marks is not None:
            self.mark(f"send {msg.__struct_config__.tag}")
        if self.dealer is not None:
            self.dealer.send(encode(msg))
        else:
            self.router.send(encode(msg), self.peer_ident)

    # ---- reading

    def on_local(self, ident: bytes, payload: bytes) -> None:
        msg = decode_request(payload)
        if self.marks.marks is not None:
            self.mark(f"recv {msg.__struct_config__.tag}")
        handler = self.local_handlers.get(type(msg))
        if handler is None:
            self.to_client(ident, ErrorReply(req_id=msg.req_id, code="bad_request",
                                             message="the floor does not do that"))
            return
        handler(ident, msg)

    def on_router(self, ident: bytes, payload: bytes) -> None:
        if not self.peer_ident:
            self.peer_ident = ident
        self.on_peer(ident, payload)

    def on_peer(self, _ident: bytes, payload: bytes) -> None:
        msg = decode_peer(payload)
        if self.marks.marks is not None:
            self.mark(f"recv {msg.__struct_config__.tag}")
        handler = self.peer_handlers.get(type(msg))
        if handler is None:
            raise RuntimeError(f"the floor does not expect {msg!r}")
        handler(msg)

    # ---- a client's requests

    def on_ping(self, ident: bytes, msg: Ping) -> None:
        """The benchmark's fence: every request it sent before is in."""
        self.to_client(ident, Pong(req_id=msg.req_id, node_id=self.name, epoch=1,
                                   draining=False))

    def on_get(self, ident: bytes, msg: Get) -> None:
        """The benchmark's gets wait for their put (it fences before the put goes)."""
        self.gets[msg.key] = Waiting(ident, msg.req_id, self.regions[msg.region_id],
                                     unpack_ids(msg.blocks))

    def on_put(self, ident: bytes, msg: Put) -> None:
        region, ids = self.regions[msg.region_id], unpack_ids(msg.blocks)
        put = Waiting(ident, msg.req_id, region, ids)
        if not msg.to:  # into a get waiting here
            get = self.gets.pop(msg.key)
            self.copy_local(put, get)
            return
        tid = new_id()
        self.sends[tid] = put
        self.offer(tid, msg.key, region, ids, msg.ttl_s)

    def on_lend(self, ident: bytes, msg: Lend) -> None:
        lend = Waiting(ident, msg.req_id, self.regions[msg.region_id],
                       unpack_ids(msg.blocks), msg.key)
        ask = self.pull_asks.pop(msg.key, None)
        if ask is None:
            self.lent[msg.key] = lend
        else:
            self.serve(ask, lend)

    def on_pull(self, ident: bytes, msg: Pull) -> None:
        region, ids = self.regions[msg.region_id], unpack_ids(msg.blocks)
        tid = new_id()
        self.pulls[tid] = Waiting(ident, msg.req_id, region, ids)
        self.to_peer(PullRequest(transfer_id=tid, key=msg.key, dst_dev="cpu",
                                 num_blocks=len(ids), layout=region.layout,
                                 wait_for_key_s=msg.wait_for_key_s, share=msg.share))

    # ---- the sender's side (a)

    def offer(self, tid: int, key: str, region: Region, ids: list[int],
              ttl_s: float | None) -> None:
        """The bytes in the offer, or behind it on the data connection (eager)."""
        views = region.views(ids)
        nbytes = region.nbytes(ids)
        if nbytes <= MAX_INLINE_BYTES:
            self.to_peer(Offer(transfer_id=tid, key=key, src_dev="cpu", dst_dev="any",
                               nbytes=nbytes, num_blocks=len(ids), layout=region.layout,
                               ttl_s=ttl_s, inline=views[0] if len(views) == 1
                               else memoryview(b"".join(views))))
            return
        self.to_peer(Offer(transfer_id=tid, key=key, src_dev="cpu", dst_dev="any",
                           nbytes=nbytes, num_blocks=len(ids), layout=region.layout,
                           ttl_s=ttl_s, eager=True))
        self.data_out.put((tid, nbytes, views))

    def on_pull_request(self, msg: PullRequest) -> None:
        lend = self.lent.pop(msg.key, None)
        if lend is None:
            self.pull_asks[msg.key] = msg  # its lend comes next
        else:
            self.serve(msg, lend)

    def serve(self, ask: PullRequest, lend: Waiting) -> None:
        self.sends[ask.transfer_id] = lend
        self.offer(ask.transfer_id, ask.key, lend.region, lend.ids, None)

    def on_accept(self, msg: Accept) -> None:
        pass  # the bytes went with the offer

    def on_xfer_done(self, msg: XferDone) -> None:
        sent = self.sends.pop(msg.transfer_id)
        self.to_client(sent.ident, Done(req_id=sent.req_id, nbytes=msg.nbytes))

    # ---- the receiver's side (b)

    def on_offer(self, offer: Offer) -> None:
        tid = offer.transfer_id
        pull = self.pulls.pop(tid, None)
        get = self.gets.pop(offer.key, None) if pull is None else None
        into = pull or get
        if into is None:
            raise RuntimeError(f"an offer of key {offer.key!r} with no get or pull waiting")
        views = into.region.views(into.ids)
        if offer.inline:
            copy_in(offer.inline, views)
            self.landed(tid, offer.nbytes, pull, get)
            return
        self.data_in.put((tid, offer.nbytes, views, pull, get))
        self.to_peer(Accept(transfer_id=tid))

    def received(self, tid: int, nbytes: int, pull: Waiting | None, get: Waiting | None
                 ) -> None:
        """The data thread has the bytes of ``tid`` in place (called on the loop)."""
        self.landed(tid, nbytes, pull, get, streamed=True)

    def landed(self, tid: int, nbytes: int, pull: Waiting | None, get: Waiting | None,
               streamed: bool = False) -> None:
        """The bytes are in: the replies, in kvd's order (a get's first; a pull's first
        when its bytes came in the offer, after the XferDone when they streamed)."""
        if get is not None:
            self.to_client(get.ident, Done(req_id=get.req_id, nbytes=nbytes))
        if pull is not None and not streamed:
            self.to_client(pull.ident, Done(req_id=pull.req_id, nbytes=nbytes))
        self.to_peer(XferDone(transfer_id=tid, nbytes=nbytes))
        if pull is not None and streamed:
            self.to_client(pull.ident, Done(req_id=pull.req_id, nbytes=nbytes))

    # ---- one GPU: a put into a get waiting on this daemon

    def copy_local(self, put: Waiting, get: Waiting) -> None:
        nbytes = put.region.nbytes(put.ids)
        if put.region.gpu:
            self.copy_gpu(put, get, nbytes)
            return
        copy_in(memoryview(b"".join(put.region.views(put.ids))), get.region.views(get.ids))
        self.copied(put, get, nbytes)

    def copy_gpu(self, put: Waiting, get: Waiting, nbytes: int) -> None:
        """One launch on the GPU, then an event polled at every turn of the loop."""
        import torch

        src, dst = put.region.gpu, get.region.gpu
        whole = (len(src) == len(dst) == 1 and put.ids == get.ids
                 and put.ids == list(range(len(src[0]))))
        if whole:
            dst[0].copy_(src[0], non_blocking=True)
        else:
            from kvd.transport import gpu_copy

            reader = self.block_map(put.region, put.ids)
            writer = self.block_map(get.region, get.ids)
            gpu_copy.copy(0, reader.pieces(), src=reader, dst=writer)
        event = torch.cuda.Event()
        event.record()  # on the current stream, the copy's (nothing else runs on this GPU)
        self.mark("launched")

        def poll() -> None:
            if event.query():
                self.mark("copied")
                self.copied(put, get, nbytes)
            else:
                self.loop.call_soon(self.entry, poll)

        self.loop.call_soon(self.entry, poll)

    def block_map(self, region: Region, ids: list[int]) -> Any:
        """The kernel's map of these blocks, made on first use (the benchmark repeats its
        block lists)."""
        import numpy as np

        from kvd.transport.gpu_copy import BlockMap

        key = (id(region), pack_ids(ids))
        found = self.gpu_maps.get(key)
        if found is None:
            found = self.gpu_maps[key] = BlockMap(region.gpu, np.array(ids, np.int64),
                                                  region.gpu[0].device)
        return found

    def copied(self, put: Waiting, get: Waiting, nbytes: int) -> None:
        self.to_client(put.ident, Done(req_id=put.req_id, nbytes=nbytes))
        self.to_client(get.ident, Done(req_id=get.req_id, nbytes=nbytes))

    # ---- the data connection's threads

    def send_data(self, sock: socket.socket) -> None:
        """a's data thread: each queued transfer's header and bytes, in offer order."""
        while (job := self.data_out.get()) is not STOP:
            tid, nbytes, views = job
            send_views(sock, [memoryview(DATA_HEADER.pack(tid, nbytes))])
            for chunk in chunks(views):
                send_views(sock, chunk)

    def receive_data(self) -> None:
        """b's data thread: each offered transfer's bytes, in offer order, straight into
        their blocks; then the loop is told."""
        try:
            sock, _ = self.data_listener.accept()
        except OSError:
            return  # closed before a dialled
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.data_sock = sock
        header = memoryview(bytearray(DATA_HEADER.size))
        try:
            while (job := self.data_in.get()) is not STOP:
                tid, nbytes, views, pull, get = job
                recv_views(sock, [header])
                if DATA_HEADER.unpack(header) != (tid, nbytes):
                    raise RuntimeError(f"data connection: {DATA_HEADER.unpack(header)} "
                                       f"where transfer {tid} of {nbytes} bytes was due")
                for chunk in chunks(views):
                    recv_views(sock, chunk)
                self.loop.call_soon_threadsafe(self.entry, self.received, tid, nbytes,
                                               pull, get)
        except OSError:
            return  # the daemon stops (its socket shut down under the thread)
        except BaseException:  # (EOFError: a's end closed in the middle of a transfer)
            traceback.print_exc()
            os._exit(3)  # as entry: the benchmark sees the daemon gone, with this log

    # ---- set-up, on stdin

    def on_stdin(self) -> None:
        data = os.read(sys.stdin.fileno(), 65536)
        if not data:
            self.loop.stop()
            return
        self.stdin_buf += data
        while b"\n" in self.stdin_buf:
            line, self.stdin_buf = self.stdin_buf.split(b"\n", 1)
            cmd = json.loads(line)
            answer = getattr(self, f"cmd_{cmd.pop('op')}")(**cmd)
            if answer is not None:
                say(answer)

    def cmd_dial(self, peer: str, data: int) -> None:
        """Daemon a: the link to b (its DEALER on b's ROUTER, a hello and its answer) and
        the data connection a -> b."""
        self.dealer = self._sock(zmq.DEALER, self.on_peer)
        self.dealer.sock.connect(peer)
        self.socks.append(self.dealer)
        sock = socket.create_connection(("127.0.0.1", data))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.data_sock = sock
        self.dialing = True
        self.to_peer(Heartbeat(epoch=1))  # answered once b has our routing id
        self.start_thread(self.send_data, sock)

    def on_heartbeat(self, msg: Heartbeat) -> None:
        if self.dealer is None:
            self.to_peer(Heartbeat(epoch=msg.epoch))  # (b) the link is up; or a ping
        elif self.dialing:
            self.dialing = False
            say({})
        elif self.pings:
            self.pings.append(time.perf_counter())
            if len(self.pings) > self.ping_count:
                t = self.pings
                self.pings = []
                say({"rtt_us": [(b - a) * 1e6 for a, b in itertools.pairwise(t)]})
            else:
                self.to_peer(Heartbeat(epoch=2))

    def cmd_ping_peer(self, count: int) -> None:
        """Daemon a: ``count`` round trips to b, one at a time, loop to loop (for
        ``hops``); answered with each one's µs."""
        self.ping_count = count
        self.pings = [time.perf_counter()]
        self.to_peer(Heartbeat(epoch=2))

    def cmd_map(self, region: int, block: int, tensors: list[dict[str, Any]] | None = None,
                cuda: list[str] | None = None) -> dict[str, Any]:
        """Host memory (a file and where the tensor lies in it), or CUDA IPC specs."""
        if cuda:
            gpu = self.open_gpu(cuda)
            self.regions[region] = Region([LayoutEntry(block, "uint8")] * len(gpu), block,
                                          [], gpu)
            return {}
        mem = []
        for t in tensors or []:
            with open(t["path"], "r+b") as f:
                mm = mmap.mmap(f.fileno(), 0)
            mem.append(memoryview(mm)[t["offset"]:t["offset"] + t["nbytes"]])
        self.regions[region] = Region([LayoutEntry(block, "uint8")] * len(mem), block, mem, [])
        return {}

    def open_gpu(self, specs: list[str]) -> list[Any]:
        import torch

        from kvd.memory.cuda_ipc import open_cuda_tensor
        from kvd.protocol import CudaIpcTensor
        from kvd.transport import gpu_copy

        tensors = [open_cuda_tensor(msgspec.json.decode(s, type=CudaIpcTensor), torch.uint8)
                   for s in specs]
        if not self.gpu_ready:
            if not gpu_copy.available():
                raise RuntimeError("kvd's gather/scatter kernel is not usable here (no triton)")
            torch.cuda.set_device(tensors[0].device)  # (its current stream: the copies')
            gpu_copy.warm_up(tensors[0].device)  # Triton's compile, and direct launches
            self.gpu_ready = True
        return tensors

    def cmd_unmap(self, region: int) -> dict[str, Any]:
        gone = self.regions.pop(region, None)
        self.gpu_maps = {k: v for k, v in self.gpu_maps.items() if k[0] != id(gone)}
        return {}

    def start_thread(self, fn: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=fn, args=args, name=f"floor-{self.name}-data")
        thread.start()
        self.threads.append(thread)

    def run(self) -> None:
        self.start_thread(self.receive_data)
        self.loop.add_reader(sys.stdin.fileno(), self.entry, self.on_stdin)
        say({"local": self.local.sock.getsockopt_string(zmq.LAST_ENDPOINT),
             "peer": self.router.sock.getsockopt_string(zmq.LAST_ENDPOINT),
             "data": self.data_listener.getsockname()[1]})
        try:
            self.loop.run_forever()
        finally:
            self.data_out.put(STOP)
            self.data_in.put(STOP)
            for conn in (self.data_sock, self.data_listener):
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
                    conn.close()
            for t in self.threads:
                t.join(10)
            for s in self.socks:
                s.sock.close(linger=0)
            self.ctx.term()
            self.marks.write()


def chunks(views: list[memoryview]) -> Iterator[list[memoryview]]:
    """``views`` cut into runs of ``CHUNK_BYTES`` (the last may be shorter), none empty."""
    run: list[memoryview] = []
    room = CHUNK_BYTES
    for view in views:
        while len(view):
            take = view[:room]
            run.append(take)
            room -= len(take)
            view = view[len(take):]
            if not room:
                yield run
                run, room = [], CHUNK_BYTES
    if run:
        yield run


def copy_in(data: memoryview, views: list[memoryview]) -> None:
    """``data`` (the bytes in wire order) into ``views``."""
    at = 0
    for view in views:
        n = len(view)
        view[:] = data[at:at + n]
        at += n


def say(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------ the benchmark's side


class Client:
    """A client's DEALER on a floor daemon's local ROUTER: requests out, replies in; a
    blocking ``recv``, as bare pyzmq goes (kvd's sync client polls the same socket)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, timeout_s: float,
                 marks: Marks | None = None, name: str = "") -> None:
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        self.marks = marks if marks is not None and marks.marks is not None else None
        self.name = name

    def next_id(self) -> int:
        return next(self.ids)

    def send(self, msg: Any) -> None:
        if self.marks is not None:
            self.marks.marks.append(  # type: ignore[union-attr]
                (time.perf_counter(), f"send {msg.__struct_config__.tag}"))
        self.sock.send(encode(msg))

    def reply(self) -> Reply:
        try:
            reply = decode_reply(self.sock.recv())
        except zmq.Again:
            raise RuntimeError("no reply from the floor daemon in time") from None
        if self.marks is not None:
            self.marks.marks.append(  # type: ignore[union-attr]
                (time.perf_counter(), f"recv {reply.__struct_config__.tag}@{self.name}"))
        return reply

    def done(self, count: int = 1) -> list[int]:
        """The bytes of the next ``count`` replies, each a Done."""
        out = []
        for _ in range(count):
            reply = self.reply()
            if not isinstance(reply, Done):
                raise RuntimeError(f"floor: {reply!r}")
            out.append(reply.nbytes)
        return out

    def fence(self) -> None:
        """Return once the daemon has read every request sent before (a ping's answer)."""
        self.send(Ping(req_id=self.next_id()))
        reply = self.reply()
        if not isinstance(reply, Pong):
            raise RuntimeError(f"floor: {reply!r} where the fence's pong was due")

    def close(self) -> None:
        self.sock.close(linger=0)


Spawn = Callable[..., "subprocess.Popen[bytes]"]


class Floor:
    """The floor's daemons (a and b; on the GPU, one: a) and this process's clients (tx
    on a, rx on b). ``spawn(cmd, env, **popen_args)`` starts a process (the benchmark's
    own, which cleans up after it)."""

    def __init__(self, root: str, spawn: Spawn, device: str = "cpu",
                 timeout_s: float = 60.0) -> None:
        self.root, self.spawn, self.device, self.timeout_s = root, spawn, device, timeout_s
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.ctx: zmq.Context[Any] | None = None
        self.regions = itertools.count(1)
        self.marks = Marks("client")
        self.hello: dict[str, dict[str, Any]] = {}

    def start(self) -> None:
        self.hello = hello = {name: self.daemon(name)
                              for name in (("a", "b") if self.device == "cpu" else ("a",))}
        if "b" in hello:
            self.ask("a", "dial", peer=hello["b"]["peer"], data=hello["b"]["data"])
        self.ctx = zmq.Context(io_threads=1)
        b = "b" if "b" in hello else "a"
        self.tx = Client(self.ctx, hello["a"]["local"], self.timeout_s, self.marks, "tx")
        self.rx = Client(self.ctx, hello[b]["local"], self.timeout_s, self.marks, "rx")
        self.tx.fence()
        self.rx.fence()

    def daemon(self, name: str) -> dict[str, Any]:
        log_path = os.path.join(self.root, f"floor-{name}.log")
        with open(log_path, "wb") as log:
            self.daemons[name] = self.spawn(
                [sys.executable, os.path.abspath(__file__), "serve", name, self.root],
                dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        return self.read(name, 120.0)

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return list(self.daemons.values())

    def read(self, name: str, timeout_s: float) -> dict[str, Any]:
        proc = self.daemons[name]
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else b""
        if not line:
            tail = ""
            with contextlib.suppress(OSError), open(
                    os.path.join(self.root, f"floor-{name}.log"), errors="replace") as f:
                tail = f.read()[-1500:]
            state = "no answer" if not ready else f"exited (code {proc.wait(5)})"
            raise RuntimeError(f"floor daemon {name}: {state}: {tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, name: str, op: str, **args: Any) -> dict[str, Any]:
        proc = self.daemons[name]
        assert proc.stdin is not None
        proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        proc.stdin.flush()
        return self.read(name, self.timeout_s)

    def map(self, daemon: str, tensors: list[Any]) -> int:
        """Map ``tensors`` (the benchmark's: block-first uint8, from ``kvd.shared_empty``
        on the host) in a daemon, as a client's register would; the region's id."""
        from kvd.client.shm import cuda_tensor_spec, segment_of, tensor_spec
        from kvd.protocol import ShmTensor

        region = next(self.regions)
        block = int(tensors[0][0].numel())
        if tensors[0].is_cuda:
            specs = [msgspec.json.encode(cuda_tensor_spec(t)).decode() for t in tensors]
            self.ask(daemon, "map", region=region, block=block, cuda=specs)
            return region
        mapped = []
        for t in tensors:
            spec = tensor_spec(t)
            assert isinstance(spec, ShmTensor)
            mapped.append({"path": f"/proc/{os.getpid()}/fd/{segment_of(spec).fd}",
                           "offset": spec.offset_bytes, "nbytes": t.numel()})
        self.ask(daemon, "map", region=region, block=block, tensors=mapped)
        return region

    def unmap(self, daemon: str, region: int) -> None:
        self.ask(daemon, "unmap", region=region)

    @property
    def receiver(self) -> str:
        return "b" if "b" in self.daemons else "a"

    def address(self, name: str) -> str:
        """Daemon ``name``'s peer address (host:port), as a put's ``to`` or a pull's
        ``src`` names it ("" on the GPU: the get waits on a, the put stays there)."""
        if "b" not in self.daemons:
            return ""
        return str(self.hello[name]["peer"]).removeprefix("tcp://")

    # ---- requests, as kvd's client sends them (block ids packed per call)

    def gets(self, keys: list[str], region: int, ids: list[list[int]]) -> None:
        rx = self.rx
        for key, blocks in zip(keys, ids, strict=True):
            rx.send(Get(req_id=rx.next_id(), key=key, region_id=region,
                        blocks=pack_ids(blocks), timeout_s=60.0))

    def puts(self, keys: list[str], region: int, ids: list[list[int]]) -> None:
        tx, to = self.tx, self.address("b")
        for key, blocks in zip(keys, ids, strict=True):
            tx.send(Put(req_id=tx.next_id(), key=key, region_id=region,
                        blocks=pack_ids(blocks), to=to, timeout_s=60.0))

    def lends(self, keys: list[str], region: int, ids: list[list[int]]) -> None:
        tx = self.tx
        for key, blocks in zip(keys, ids, strict=True):
            tx.send(Lend(req_id=tx.next_id(), key=key, region_id=region,
                         blocks=pack_ids(blocks), ttl_s=60.0))

    def pulls(self, keys: list[str], region: int, ids: list[list[int]]) -> None:
        rx, src = self.rx, self.address("a")
        for key, blocks in zip(keys, ids, strict=True):
            rx.send(Pull(req_id=rx.next_id(), key=key, src=src, region_id=region,
                         blocks=pack_ids(blocks), timeout_s=60.0, wait_for_key_s=10.0))

    def close(self) -> None:
        if self.ctx is not None:
            self.tx.close()
            self.rx.close()
            self.ctx.term()
            self.ctx = None
        for proc in self.daemons.values():
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # their end
        for proc in self.daemons.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.marks.write()


# ------------------------------------------------------------------ ``hops``


def put_once(f: Floor, key: str, src: int, dst: int, ids: list[int]) -> float:
    """A put into a get waiting on b, timed as benchmarks/peers.py times kvd's."""
    f.gets([key], dst, [ids])
    f.rx.fence()
    t0 = time.perf_counter()
    f.puts([key], src, [ids])
    f.rx.done()
    f.tx.done()
    return time.perf_counter() - t0


def pull_once(f: Floor, key: str, src: int, dst: int, ids: list[int]) -> float:
    """A lend on a, then a pull from b, timed to the pull's return (the lend's after)."""
    t0 = time.perf_counter()
    f.lends([key], src, [ids])
    f.pulls([key], dst, [ids])
    f.rx.done()
    took = time.perf_counter() - t0
    f.tx.done()
    return took


HOPS = {
    "put": [("client", "send put", "a", "recv put", "tx -> a  Put (ipc)"),
            ("a", "send offer", "b", "recv offer", "a -> b   Offer + bytes (tcp)"),
            ("b", "send done", "client", "recv done@rx", "b -> rx  Done (ipc)"),
            ("b", "send xfer_done", "a", "recv xfer_done", "b -> a   XferDone (tcp)"),
            ("a", "send done", "client", "recv done@tx", "a -> tx  Done (ipc)")],
    "pull": [("client", "send lend", "a", "recv lend", "tx -> a  Lend (ipc)"),
             ("client", "send pull", "b", "recv pull", "rx -> b  Pull (ipc)"),
             ("b", "send pull_request", "a", "recv pull_request",
              "b -> a   PullRequest (tcp)"),
             ("a", "send offer", "b", "recv offer", "a -> b   Offer + bytes (tcp)"),
             ("b", "send done", "client", "recv done@rx", "b -> rx  Done (ipc)"),
             ("b", "send xfer_done", "a", "recv xfer_done", "b -> a   XferDone (tcp)"),
             ("a", "send done", "client", "recv done@tx", "a -> tx  Done (ipc)")],
    # One GPU, one daemon (d): "send done/1" is its first Done of each transfer (the put's).
    "gpu put": [("client", "send put", "a", "recv put", "tx -> d   Put (ipc)"),
                ("a", "recv put", "a", "launched", "d: the copy launched, its event recorded"),
                ("a", "launched", "a", "copied", "d: the event polled until done"),
                ("a", "send done/1", "client", "recv done@tx", "d -> tx  Done (ipc)"),
                ("a", "send done/2", "client", "recv done@rx", "d -> rx  Done (ipc)")],
}


def hop_times(marks: dict[str, list[tuple[float, str]]], flow: str, skip: int
              ) -> list[tuple[str, float]]:
    """Per hop of ``flow``: the median µs from its send to its receipt (the n-th send of
    a message with the n-th receipt: transfers run one at a time)."""
    out = []
    for sender, sent, receiver, got, label in HOPS[flow]:
        sent, _, nth = sent.partition("/")  # (the n-th of two such marks per transfer)
        a = [t for t, what in marks[sender] if what == sent]
        a = (a[int(nth) - 1::2] if nth else a)[skip:]
        b = [t for t, what in marks[receiver] if what == got][skip:]
        if len(a) == len(b) and a:
            out.append((label, statistics.median((y - x) * 1e6 for x, y in zip(a, b,
                                                                             strict=True))))
    return out


def round_trips(f: Floor, root: str, iterations: int, rounds: int = 20
                ) -> dict[str, float]:
    """Median µs of round trips, alternated in ``rounds`` slices: raw pyzmq's, as
    benchmarks/control_plane.py measures them (its ROUTER echo server in a process of its
    own, ping and pong sizes; a blocking DEALER client over ipc and tcp, and over ipc one
    read on uvloop through ``zmq.FD``), and the floor's own: a client's Ping to daemon a
    and its Pong (ipc; the daemon's side on its loop), and daemon a's Heartbeat to b and
    back (tcp; both sides on their loops)."""
    import uvloop

    sys.path.insert(0, os.path.dirname(HERE))
    from control_plane import (
        ZmqAsync,
        message_sizes,
        payloads,
        start_echo,
        stop_echo,
        zmq_echo_server,
    )

    msg = payloads(message_sizes("floor-a", 1), "ping")[0]
    endpoints = {"ipc": f"ipc://{root}/echo.sock", "tcp": f"tcp://127.0.0.1:{free_port()}"}
    echoes = [start_echo(zmq_echo_server, e) for e in endpoints.values()]
    ctx: zmq.Context[Any] = zmq.Context()
    socks = {}
    for transport, endpoint in endpoints.items():
        socks[transport] = sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)

    def raw_sync(sock: zmq.Socket[Any], n: int) -> list[float]:
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.send(msg)
            sock.recv()
            lat.append((time.perf_counter() - t0) * 1e6)
        return lat

    async def raw_async(n: int) -> list[float]:
        raw = ZmqAsync(ctx, endpoints["ipc"])
        try:
            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                await raw.rtt(msg)
                lat.append((time.perf_counter() - t0) * 1e6)
            return lat
        finally:
            raw.close()

    def floor_ipc(n: int) -> list[float]:
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            f.tx.fence()
            lat.append((time.perf_counter() - t0) * 1e6)
        return lat

    runs: dict[str, Callable[[int], list[float]]] = {
        "raw_ipc": lambda n: raw_sync(socks["ipc"], n),
        "raw_ipc_async": lambda n: uvloop.run(raw_async(n)),
        "raw_tcp": lambda n: raw_sync(socks["tcp"], n),
        "floor_ipc": floor_ipc,
        "floor_tcp": lambda n: [float(x) for x in f.ask("a", "ping_peer", count=n)["rtt_us"]],
    }
    got: dict[str, list[float]] = {name: [] for name in runs}
    try:
        per = max(1, iterations // rounds)
        for _ in range(rounds):
            for name, run in runs.items():
                got[name] += run(per + per // 5)[per // 5:]  # (each slice warms up first)
    finally:
        for sock in socks.values():
            sock.close()
        ctx.term()
        for echo in echoes:
            stop_echo(echo)
    return {name: round(statistics.median(lat), 1) for name, lat in got.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hops_main(args: argparse.Namespace) -> int:
    """Each hop of the floor's 4 KiB put and pull, beside raw pyzmq round trips; on one
    GPU (``--device cuda``), each hop of a 1 MiB put into a get waiting on its daemon."""
    import torch

    from kvd import shared_zeros

    gpu = args.device == "cuda"

    root = tempfile.mkdtemp(prefix="kvd-floor-", dir="/tmp")
    marks_dir = os.path.join(root, "marks")
    os.makedirs(marks_dir)
    os.environ[MARKS_ENV] = marks_dir
    report: dict[str, Any] = {}
    flows = ("gpu put",) if gpu else ("put", "pull")
    for flow in flows:
        for name in os.listdir(marks_dir):
            os.unlink(os.path.join(marks_dir, name))
        f = Floor(root, lambda cmd, env, **kw: subprocess.Popen(cmd, env=env, **kw),
                  args.device)
        if gpu:
            src = [torch.full((1, 2**20), 7, dtype=torch.uint8, device="cuda")]
            dst = [torch.zeros((1, 2**20), dtype=torch.uint8, device="cuda")]
        else:
            src = [shared_zeros((1, 4096), torch.uint8).fill_(7)]
            dst = [shared_zeros((1, 4096), torch.uint8)]
        try:
            f.start()
            r_src, r_dst = f.map("a", src), f.map(f.receiver, dst)
            once = pull_once if flow == "pull" else put_once
            totals = [once(f, f"floor-{flow}-{i}", r_src, r_dst, [0]) * 1e6
                      for i in range(args.warmup + args.repeat)][args.warmup:]
            if flow == "put":
                report["rtt_p50_us"] = round_trips(f, root, args.repeat * 5)
            if not bool((dst[0] == 7).all()):
                raise RuntimeError(f"{flow}: the bytes did not arrive")
        finally:
            f.close()
        marks = {}
        for role in ("client", "a", "b")[:2 if gpu else 3]:
            with open(os.path.join(marks_dir, f"{role}.json")) as fh:
                marks[role] = [(t, what) for t, what in json.load(fh)]
        hops = hop_times(marks, flow, args.warmup)
        report[flow] = {"total_p50_us": round(statistics.median(totals), 1),
                        "hops_p50_us": {label: round(us, 1) for label, us in hops}}
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    if not gpu:
        rtt = report["rtt_p50_us"]
        print("round trips, µs p50, alternated: raw pyzmq (control_plane.py's echo) ipc "
              f"{rtt['raw_ipc']:.0f} (client on uvloop: {rtt['raw_ipc_async']:.0f}), tcp "
              f"{rtt['raw_tcp']:.0f}; the floor's: a client's ping to its daemon (ipc, the "
              f"daemon on uvloop) {rtt['floor_ipc']:.0f}, daemon to daemon (tcp, both on "
              f"uvloop) {rtt['floor_tcp']:.0f}")
    print(f"the floor, {'1 MiB on one GPU' if gpu else '4 KiB'}, {args.repeat} transfers "
          "each, µs p50, each hop from its send to its receipt:")
    for flow in flows:
        r = report[flow]
        hops = r["hops_p50_us"]
        print(f"{flow}: total {r['total_p50_us']:.0f}, sum of hops "
              f"{sum(hops.values()):.0f}")
        for label, us in hops.items():
            print(f"  {us:7.1f}  {label}")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="one floor daemon (run by benchmarks/peers.py)")
    serve.add_argument("name")
    serve.add_argument("root")
    hops = sub.add_parser("hops", help="time each hop of a 4 KiB put and pull (or, with "
                          "--device cuda, of a 1 MiB put on one GPU)")
    hops.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    hops.add_argument("--repeat", type=int, default=400)
    hops.add_argument("--warmup", type=int, default=40)
    hops.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.cmd == "hops":
        return hops_main(args)
    Daemon(args.name, args.root).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
