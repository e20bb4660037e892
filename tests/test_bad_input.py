"""Bad input on the local socket: each gets an error reply with a code, is counted, and the
daemon goes on serving (checked by a successful request after every case)."""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import os
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

import kvd
from kvd import AsyncKvdClient, shared_zeros
from kvd.client.lifeline import ClientLifeline
from kvd.daemon import local_server
from kvd.protocol import (
    MAX_BLOCKS_PER_OP,
    MAX_INLINE_BYTES,
    MAX_KEY_CHARS,
    MAX_PEER_MESSAGE_BYTES,
    MAX_TENSORS_PER_REGION,
    PROTOCOL_VERSION,
    ErrorReply,
    LayoutEntry,
    Offer,
    Pong,
    ShmTensor,
    StatsReply,
    Taken,
    Welcome,
    decode_reply,
    encode,
)
from tests.conftest import RunningDaemon, in_process_only, make_config, running_daemon

pack = msgspec.msgpack.encode


class RawClient:
    """A raw DEALER the daemon connected to through its lifeline, to send what the real
    client never would."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock: zmq.asyncio.Socket | None = None
        self.lifeline: ClientLifeline | None = None
        self.welcome: Welcome | None = None

    async def open(self) -> RawClient:
        self.lifeline = await asyncio.to_thread(ClientLifeline.connect, self.path, 5.0)
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        await asyncio.to_thread(self.lifeline.reach, zmq.Socket.shadow(self.sock.underlying),
                                5.0)
        return self

    async def write(self, *frames: bytes) -> None:
        assert self.sock is not None
        await self.sock.send_multipart(frames)

    async def reply(self) -> Any:
        assert self.sock is not None
        async with asyncio.timeout(5):
            return decode_reply(await self.sock.recv())

    async def send(self, payload: bytes) -> Any:
        """One message; its reply."""
        await self.write(payload)
        return await self.reply()

    async def hello(self, req_id: int = 1) -> None:
        assert self.lifeline is not None
        reply = await self.send(pack({"op": "hello", "req_id": req_id, "protocol_version":
                                      PROTOCOL_VERSION, "pid": os.getpid()}))
        assert isinstance(reply, Welcome), reply
        self.welcome = reply

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        if self.lifeline is not None:
            self.lifeline.close()


@pytest.fixture
async def raw(daemon: RunningDaemon) -> AsyncIterator[RawClient]:
    r = await RawClient(daemon.socket_path).open()
    await r.hello()
    yield r
    r.close()


async def still_serving(r: RawClient) -> None:
    reply = await r.send(pack({"op": "ping", "req_id": 99}))
    assert isinstance(reply, Pong)


async def bad_count(r: RawClient, reason: str) -> int:
    reply = await r.send(pack({"op": "stats", "req_id": 98}))
    assert isinstance(reply, StatsReply), reply
    return int(reply.stats["bad_messages"].get(reason, 0))


@pytest.mark.parametrize(
    ("payload", "req_id", "needle"),
    [
        (os.urandom(64), 0, "malformed"),
        (b"", 0, "malformed"),
        (pack({"op": "ping", "req_id": 5})[:-1], 0, "malformed"),  # truncated
        (pack({"op": "frobnicate", "req_id": 6}), 6, "Invalid value 'frobnicate'"),
        (pack({"op": "get", "req_id": 7, "key": 3, "region_id": 1, "blocks": b"\0\0\0\0",
               "timeout_s": 1}), 7, "Expected `str`"),
        # Block ids travel packed (4 bytes each); a list of ints is the old format.
        (pack({"op": "get", "req_id": 8, "key": "k", "region_id": 1, "blocks": [0],
               "timeout_s": 1}), 8, "Expected `bytes`, got `array`"),
        (pack({"op": "get", "req_id": 9, "key": "k", "region_id": 1, "blocks": b"\0\0\0\0",
               "timeout_s": 1e300}), 9, "<= 10000000"),
        (pack({"op": "offload", "req_id": 10, "key": "k", "region_id": 1,
               "blocks": b"\0\0\0\0\0\0"}), 10, "not a whole number of 4-byte block ids"),
        (pack({"op": "get", "req_id": 11, "key": "x" * 5000, "region_id": 1, "blocks": b"\0\0\0\0",
               "timeout_s": 1}), 11, "length <= 1024"),
        (pack({"op": "ping", "req_id": 12, "extra": 1}), 12, "unknown field"),
        (pack([1, 2, 3]), 0, "Expected `object`"),
        (pack({"op": "ping", "req_id": "one"}), 0, "Expected `int`"),
    ],
    ids=["random", "empty", "truncated", "unknown-op", "wrong-type", "blocks-as-list",
         "huge-timeout", "ragged-blocks", "huge-key", "extra-field", "not-a-map", "bad-req-id"],
)
@in_process_only  # the decoder's answers; `kvd serve` gets bad input in the tests below
async def test_malformed_messages(
    daemon: RunningDaemon, raw: RawClient, payload: bytes, req_id: int, needle: str
) -> None:
    before = await bad_count(raw, "malformed")
    reply = await raw.send(payload)
    assert isinstance(reply, ErrorReply)
    assert reply.code == "protocol" and reply.req_id == req_id
    assert needle in reply.message
    assert await bad_count(raw, "malformed") == before + 1
    await still_serving(raw)


async def test_oversized_messages_and_wrong_frame_counts(
        daemon: RunningDaemon, raw: RawClient) -> None:
    assert raw.welcome is not None and raw.welcome.max_message_bytes == 2**20
    # A message is one frame: two, or none, is answered and counted.
    for frames in ([pack({"op": "ping", "req_id": 5}), b"more"], []):
        if frames:
            await raw.write(*frames)
        else:  # (a DEALER sends no message without a frame: an empty delimiter only)
            await raw.write(b"", pack({"op": "ping", "req_id": 6}))
        reply = await raw.reply()
        assert isinstance(reply, ErrorReply) and "one frame" in reply.message, reply
    assert await bad_count(raw, "frames") == 2
    await still_serving(raw)
    # Over max_message_bytes (1 MiB, told in the welcome): ZeroMQ ends the connection
    # before the daemon holds the message, and nothing comes back on it; others are served.
    await raw.write(pack({"op": "ping", "req_id": 7, "pad": "x" * (2 * 2**20)}))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1):
            await raw.sock.recv()  # type: ignore[union-attr]
    r = await RawClient(daemon.socket_path).open()
    try:
        await r.hello()
        await still_serving(r)
    finally:
        r.close()


async def test_wrong_version_and_no_hello(daemon: RunningDaemon) -> None:
    r = await RawClient(daemon.socket_path).open()
    try:
        reply = await r.send(pack({"op": "ping", "req_id": 1}))
        assert isinstance(reply, ErrorReply) and reply.code == "daemon_unavailable"
        assert "Hello first" in reply.message
        reply = await r.send(pack({"op": "hello", "req_id": 2, "protocol_version": 999}))
        assert isinstance(reply, ErrorReply) and reply.code == "protocol"
        assert "999" in reply.message and str(PROTOCOL_VERSION) in reply.message
        await r.hello()
        assert await bad_count(r, "version") == 1
        assert await bad_count(r, "no_session") == 1
        reply = await r.send(pack({"op": "hello", "req_id": 3, "protocol_version":
                                   PROTOCOL_VERSION}))
        assert isinstance(reply, ErrorReply) and "already" in reply.message
        await still_serving(r)
    finally:
        r.close()


async def test_register_bad_segments(daemon: RunningDaemon, raw: RawClient) -> None:
    """CPU tensors name segments their session handed over (the segment socket): a segment
    never handed over, a wrong size for it, or a view past its end is refused."""
    from kvd.client.shm import segment_of, tensor_spec

    real = shared_zeros((4, 256), torch.float32)
    spec = tensor_spec(real)
    assert isinstance(spec, ShmTensor) and raw.lifeline is not None
    await asyncio.to_thread(raw.lifeline.hand_over, [segment_of(spec)], 5.0)

    def reg(req_id: int, **kw: Any) -> bytes:
        tensor = {"kind": "shm", "segment": spec.segment, "file_bytes": 4096,
                  "offset_bytes": 0, "shape": [4, 256], "stride": [256, 1], "dtype": "float32"}
        tensor.update(kw)
        return pack({"op": "register", "req_id": req_id, "name": f"r{req_id}",
                     "tensors": [tensor]})

    cases = [
        (reg(20, segment=spec.segment + 1_000_000), "was not handed to this daemon"),
        (reg(21, file_bytes=8192), "holds 4096 bytes, not 8192"),
        (reg(22, shape=[4, 512]), "extends to byte"),
        (reg(23, offset_bytes=2), "not aligned"),
        (reg(24, stride=[256]), "different lengths"),
    ]
    for payload, needle in cases:
        reply = await raw.send(payload)
        assert isinstance(reply, ErrorReply), reply
        assert reply.code == "bad_request", reply
        assert needle in reply.message, reply
        await still_serving(raw)
    reply = await raw.send(reg(25))
    assert reply.__struct_config__.tag == "registered", reply


def _segment(nbytes: int, seals: int) -> int:
    fd = os.memfd_create("kvd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _handoff(sock: socket.socket, payload: bytes, fds: list[int]) -> Taken:
    sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                 if fds else [])
    sock.settimeout(10)
    try:
        return msgspec.msgpack.decode(sock.recv(4096), type=Taken)
    finally:
        sock.settimeout(None)


async def test_segment_socket_refuses_what_is_not_a_sealed_segment_of_a_session(
        daemon: RunningDaemon, raw: RawClient, tmp_path: Any) -> None:
    """A session's lifeline takes only memfds sealed against shrinking (a truncated mapping
    would kill the daemon with SIGBUS), one per id, and a connection no hello claimed takes
    none; anything else is answered with the reason, counted, and the socket and the daemon
    go on."""
    assert raw.lifeline is not None
    stranger = await asyncio.to_thread(ClientLifeline.connect, daemon.socket_path, 5.0)
    sealed = _segment(4096, fcntl.F_SEAL_SHRINK)
    unsealed = _segment(4096, 0)
    empty = _segment(0, fcntl.F_SEAL_SHRINK)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
    os.ftruncate(plain, 4096)

    def handoff(ids: list[int]) -> bytes:
        return pack({"op": "segments", "segments": ids})

    cases: list[tuple[ClientLifeline, bytes, list[int], str]] = [
        (raw.lifeline, handoff([1]), [unsealed], "sealed against shrinking"),
        (raw.lifeline, handoff([1]), [plain], "sealed against shrinking"),
        (raw.lifeline, handoff([1]), [empty], "non-empty"),
        (stranger, handoff([1]), [sealed], "say hello on the ZeroMQ connection first"),
        (raw.lifeline, handoff([1, 2]), [sealed], "2 segment ids for 1 file descriptors"),
        (raw.lifeline, handoff([1]), [], "1 segment ids for 0"),
        (raw.lifeline, b"garbage", [sealed], "malformed message"),
        (raw.lifeline, handoff([1]), [sealed] * 70, "at most 64 descriptors"),
        (raw.lifeline, pack({"op": "segments", "token": b"t" * 32, "segments": [1]}),
         [sealed], "malformed message"),
        (stranger, pack({"op": "reach"}), [sealed], "a socket file owned by"),
        (raw.lifeline, pack({"op": "reach"}), [], "has its endpoint already"),
    ]
    try:
        for line, payload, fds, needle in cases:
            taken = await asyncio.to_thread(_handoff, line.sock, payload, fds)
            assert needle in taken.error, (needle, taken)
            await still_serving(raw)
        assert await bad_count(raw, "lifeline") == len(cases)
        taken = await asyncio.to_thread(_handoff, raw.lifeline.sock, handoff([7]), [sealed])
        assert taken.error == "", taken
    finally:
        stranger.close()
        for fd in (sealed, unsealed, empty, plain):
            os.close(fd)


async def test_semantic_errors_keep_serving(daemon: RunningDaemon) -> None:
    async with AsyncKvdClient(daemon.socket_path) as c:
        a = shared_zeros((8, 64), torch.float16)
        b = shared_zeros((8, 32), torch.float16)  # other block size
        ra = await c.register("a", [a])
        rb = await c.register("b", [b])
        cases: list[tuple[Any, type[kvd.KvdError], str]] = [
            (c.register("a", [a]), kvd.BadRequest, "already registered"),
            (c.register("c", [a, shared_zeros((7, 64), torch.float16)]),
             kvd.LayoutMismatch, "7 blocks"),
            (c.register("d", [a], block_dim=3), kvd.BadRequest, "block_dim"),
            (c.offload("k", ra, [8]), kvd.BadRequest, "out of range"),
            (c.offload("k", ra, []), kvd.BadRequest, "no blocks"),
            (c.offload("k", 999, [0]), kvd.BadRequest, "unknown region"),
            (c.get("k", ra, [0, 0], timeout_s=0), kvd.BadRequest, "repeat"),
            (c.get("k", ra, [3, 1, 3], timeout_s=0), kvd.BadRequest, "repeat"),
            # Checked by the client library before they are packed (4 bytes each).
            (c.offload("k", ra, [-1]), kvd.BadRequest, r"in \[0, 4294967295\]"),
            (c.offload("k", ra, [0, 2**32]), kvd.BadRequest, r"in \[0, 4294967295\]"),
            (c.offload("k", ra, [0, 2**70]), kvd.BadRequest, "integers"),
            (c.offload("k", ra, [1.5]),  # type: ignore[list-item]
             kvd.BadRequest, "integers, got 1-d float64"),
            (c.offload("k", ra, [True]), kvd.BadRequest, "integers, got 1-d bool"),
            (c.offload("k", ra, [[0, 1]]),  # type: ignore[list-item]
             kvd.BadRequest, "flat sequence"),
            (c.get("nope", ra, [0], timeout_s=0), kvd.UnknownKey, "nope"),
            (c.delete("nope"), kvd.UnknownKey, "nope"),
            (c.offload("k", ra, [0], ttl_s=10**6), kvd.BadRequest, "ttl_s"),
            (c.get("k", ra, [0], timeout_s=10**5), kvd.BadRequest, "timeout_s"),
            (c.put("k", ra, [0], to="elsewhere"), kvd.BadRequest, "host:port"),
        ]
        for coro, cls, needle in cases:
            with pytest.raises(cls, match=needle):
                result = await coro
                if isinstance(result, kvd.AsyncTransfer):
                    await result.wait(2)
            assert await c.ping() > 0
        await c.offload("k", ra, [0, 1])
        with pytest.raises(kvd.BadRequest, match="already exists"):
            await c.offload("k", ra, [2])
        with pytest.raises(kvd.LayoutMismatch, match="64"):
            await c.get("k", rb, [0, 1], timeout_s=1)
        with pytest.raises(kvd.BadRequest, match="holds 2 blocks"):
            await c.get("k", ra, [3], timeout_s=1)
        with pytest.raises(kvd.BadRequest, match="not in shared memory"):
            await c.register("e", [torch.zeros(4, 4)])
        stats = await c.stats()
        assert stats["op_errors"]["bad_request"] >= 8
        assert stats["keys"] == 1 and stats["regions"] == 2


async def test_a_new_client_on_a_reused_descriptor_keeps_its_session(
        daemon: RunningDaemon) -> None:
    """Clients come and go, and the next connection may get the descriptor number of one
    that just closed: the old connection's end must not end the new client's session."""
    for i in range(100):
        old = await RawClient(daemon.socket_path).open()
        await old.hello()
        old.close()
        new = await RawClient(daemon.socket_path).open()
        try:
            await new.hello()
            if i % 2:
                await asyncio.sleep(0.002)  # let the old connection's event arrive, if late
            reply = await new.send(pack({"op": "ping", "req_id": 2}))
            assert isinstance(reply, Pong), (i, reply)
        finally:
            new.close()


async def test_a_client_that_does_not_read_its_replies_is_cut_off(
        sock_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replies a client leaves unread pile up in the daemon only up to a bound: then its
    session ends, its lifeline is closed (it sees its daemon gone), and others are served
    as before."""
    monkeypatch.setattr(local_server, "_MAX_UNREAD_REPLIES", 500)
    async with running_daemon(make_config(sock_dir)) as d:
        greedy = await RawClient(d.socket_path).open()
        await greedy.hello()
        assert greedy.sock is not None and greedy.lifeline is not None
        greedy.sock.setsockopt(zmq.RCVHWM, 100)  # (ZeroMQ's queues hold few of them)
        stats = pack({"op": "stats", "req_id": 2})
        async with AsyncKvdClient(d.socket_path) as c:
            async with asyncio.timeout(30):
                while (await c.stats())["bad_messages"].get("unread_replies", 0) == 0:
                    for _ in range(200):  # replies that nobody reads
                        await greedy.write(stats)
                    await asyncio.sleep(0.01)
                while (await c.stats())["clients"] != 1:
                    await asyncio.sleep(0.05)
            assert await c.ping() > 0
        lifeline = greedy.lifeline.sock
        lifeline.settimeout(10)
        assert await asyncio.to_thread(lifeline.recv, 1) == b""  # cut off
        greedy.close()


def test_cuda_ipc_reference_counter_is_checked_before_torch_sees_it(tmp_path: Any) -> None:
    """torch's release of a CUDA IPC mapping decrements an int64 at the spec's offset in the
    shared-memory file it names, mapping REF_COUNTERS_PER_FILE counters unchecked: kvd
    refuses names that are not shm names, files too small, and offsets past the end
    (the GPU tests send such specs to a daemon)."""
    from kvd.errors import BadRequest
    from kvd.memory.cuda_ipc import REF_COUNTERS_PER_FILE, check_ref_counter
    from kvd.protocol import CudaIpcTensor

    name = f"/kvd-test-refcount-{os.getpid()}"
    path = "/dev/shm" + name
    with open(path, "wb") as f:
        f.truncate(REF_COUNTERS_PER_FILE * 8)
    small_name = f"/kvd-test-refcount-small-{os.getpid()}"
    with open("/dev/shm" + small_name, "wb") as f:
        f.truncate(4096)

    def spec(handle: bytes, offset: int = 0) -> CudaIpcTensor:
        return CudaIpcTensor(
            gpu_uuid="GPU-x", handle=b"h" * 66, storage_size_bytes=4096,
            storage_offset_bytes=0, ref_counter_handle=handle, ref_counter_offset=offset,
            event_handle=b"", event_sync_required=False, tensor_offset=0, shape=[4, 256],
            stride=[256, 1], dtype="float32")

    try:
        check_ref_counter(spec(name.encode(), REF_COUNTERS_PER_FILE - 1))  # torch's own kind
        refused = [
            (spec(name.encode(), REF_COUNTERS_PER_FILE), "past the"),
            (spec(b""), "needs its reference-counter handle"),
            (spec(b"kvd-no-slash"), "not a shared-memory name"),
            (spec(b"/../etc/passwd"), "not a shared-memory name"),
            (spec(b"/a\0b"), "not a shared-memory name"),
            (spec("/é".encode()), "not a shared-memory name"),
            (spec(b"/kvd-test-no-such-counter"), "No such file"),
            (spec(small_name.encode()), "at least"),
        ]
        for bad, needle in refused:
            with pytest.raises(BadRequest, match=needle):
                check_ref_counter(bad)
    finally:
        os.unlink(path)
        os.unlink("/dev/shm" + small_name)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
def test_reference_counter_file_of_another_user_is_refused_saying_why() -> None:
    """A GPU client of another user than the daemon's: torch made its reference-counter
    file mode 0600, which the daemon cannot open read-write; it refuses the registration
    saying that GPU clients must run as its user (CUDA IPC does not map memory between
    users, measured on the H200 host) instead of passing torch's failure on."""
    from kvd.errors import BadRequest
    from kvd.memory.cuda_ipc import REF_COUNTERS_PER_FILE, check_ref_counter
    from kvd.protocol import CudaIpcTensor

    daemon_uid, client_uid = 64101, 64102  # no accounts needed
    name = f"/kvd-test-users-{os.getpid()}"
    spec = CudaIpcTensor(
        gpu_uuid="GPU-x", handle=b"h" * 66, storage_size_bytes=4096, storage_offset_bytes=0,
        ref_counter_handle=name.encode(), ref_counter_offset=7, event_handle=b"",
        event_sync_required=False, tensor_offset=0, shape=[4, 256], stride=[256, 1],
        dtype="float32")

    def client() -> None:  # as torch does: shm_open(O_CREAT, 0600), then ftruncate
        fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, REF_COUNTERS_PER_FILE * 8)
        os.close(fd)
        check_ref_counter(spec)  # the daemon of the client's own user may open it

    def daemon() -> None:
        with pytest.raises(BadRequest, match=f"uid {daemon_uid}.* cannot open .*{name}.*"
                                             f"mode 0600.*must run as the daemon's user"):
            check_ref_counter(spec)

    try:
        assert _as_user(client_uid, client_uid, client) == ""
        assert _as_user(daemon_uid, daemon_uid, daemon) == ""
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink("/dev/shm" + name)


def _as_user(uid: int, gid: int, work: Callable[[], None]) -> str:
    """Run ``work`` in a forked child with these credentials; '' or the child's error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no exception may escape into pytest's copy of itself
        status = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            work()
        except BaseException as exc:  # reported to the parent
            os.write(write_end, f"{type(exc).__name__}: {exc}".encode())
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        error = r.read().decode()
    os.waitpid(pid, 0)
    return error


def test_the_largest_offer_fits_the_peer_sockets_message_limit() -> None:
    """MAX_PEER_MESSAGE_BYTES follows from the largest offer a peer may send: its bytes
    inline and every field at its bound. A larger limit lets a peer make the daemon hold
    more for nothing; a smaller one would end a legitimate peer's connection."""
    largest = Offer(
        transfer_id=2**63 - 1, key="\U0010ffff" * MAX_KEY_CHARS, src_dev="d" * 64,
        dst_dev="d" * 64, nbytes=2**62, num_blocks=MAX_BLOCKS_PER_OP,
        layout=[LayoutEntry(2**62, "float8_e4m3fn")] * MAX_TENSORS_PER_REGION, ttl_s=1e7,
        src_gpu=True, one_run=True, eager=True, channel=2**63 - 1, chunk_bytes=2**40,
        inline=memoryview(b"x" * MAX_INLINE_BYTES))
    size = len(encode(largest))
    print(f"the largest offer: {size} bytes, the limit {MAX_PEER_MESSAGE_BYTES}")
    assert MAX_PEER_MESSAGE_BYTES // 2 < size <= MAX_PEER_MESSAGE_BYTES
