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

import kvd
from kvd import AsyncKvdClient, shared_zeros
from kvd.daemon import local_server
from kvd.framing import HEADER, frame
from kvd.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    Pong,
    SegmentsTaken,
    ShmTensor,
    StatsReply,
    Welcome,
    decode_reply,
)
from tests.conftest import RunningDaemon, in_process_only, make_config, running_daemon

pack = msgspec.msgpack.encode


class RawClient:
    """A raw connection to the local socket, to send what the real client never would."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.welcome: Welcome | None = None

    async def open(self) -> RawClient:
        self.reader, self.writer = await asyncio.open_unix_connection(self.path)
        return self

    async def write(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self) -> Any:
        assert self.reader is not None
        async with asyncio.timeout(5):
            (n,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
            return decode_reply(await self.reader.readexactly(n))

    async def send(self, payload: bytes) -> Any:
        """One framed message; its reply."""
        await self.write(frame(payload))
        return await self.reply()

    async def hello(self) -> None:
        reply = await self.send(pack({"op": "hello", "req_id": 1, "protocol_version":
                                      PROTOCOL_VERSION, "pid": os.getpid()}))
        assert isinstance(reply, Welcome), reply
        self.welcome = reply

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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


async def test_oversized_and_split_messages(daemon: RunningDaemon, raw: RawClient) -> None:
    # Over max_message_bytes (1 MiB): an error reply with the req_id, then the stream is
    # still in step (the rest of the message was skipped, not taken for the next one).
    reply = await raw.send(pack({"op": "stats", "req_id": 4, "pad": "x" * (2 * 2**20)}))
    assert isinstance(reply, ErrorReply) and reply.req_id == 4
    assert "max_message_bytes" in reply.message
    assert await bad_count(raw, "too_large") == 1
    # A length that claims 4 GiB: refused at once, without waiting for (or holding) it;
    # what follows it in the stream is taken as part of it and skipped.
    await raw.write(HEADER.pack(2**32 - 1))
    reply = await raw.reply()
    assert isinstance(reply, ErrorReply) and reply.req_id == 0
    assert "4294967295 bytes" in reply.message
    raw.close()
    # Messages cut into pieces at every byte, and two in one write, are read as sent.
    r = await RawClient(daemon.socket_path).open()
    try:
        await r.hello()
        data = frame(pack({"op": "ping", "req_id": 5}))
        for i in range(len(data)):
            await r.write(data[i : i + 1])
            await asyncio.sleep(0)
        assert isinstance(await r.reply(), Pong)
        await r.write(frame(pack({"op": "ping", "req_id": 6})) +
                      frame(pack({"op": "ping", "req_id": 7})))
        assert [(await r.reply()).req_id for _ in range(2)] == [6, 7]
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
    from kvd.client.shm import hand_over, segment_of, tensor_spec

    real = shared_zeros((4, 256), torch.float32)
    spec = tensor_spec(real)
    assert isinstance(spec, ShmTensor) and raw.welcome is not None
    await asyncio.to_thread(hand_over, raw.welcome.segment_socket, raw.welcome.segment_token,
                            [segment_of(spec)], 5.0)

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


def _handoff(path: str, payload: bytes, fds: list[int]) -> SegmentsTaken:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                     if fds else [])
        return msgspec.msgpack.decode(sock.recv(4096), type=SegmentsTaken)


async def test_segment_socket_refuses_what_is_not_a_sealed_segment_of_a_session(
        daemon: RunningDaemon, raw: RawClient, tmp_path: Any) -> None:
    """The segment socket takes only memfds sealed against shrinking (a truncated mapping
    would kill the daemon with SIGBUS), for a live session's token, one per id; anything
    else is answered with the reason, counted, and the socket and the daemon go on."""
    assert raw.welcome is not None
    path, token = raw.welcome.segment_socket, raw.welcome.segment_token
    sealed = _segment(4096, fcntl.F_SEAL_SHRINK)
    unsealed = _segment(4096, 0)
    empty = _segment(0, fcntl.F_SEAL_SHRINK)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
    os.ftruncate(plain, 4096)

    def handoff(ids: list[int], tok: bytes = token) -> bytes:
        return pack({"token": tok, "segments": ids})

    cases: list[tuple[bytes, list[int], str]] = [
        (handoff([1]), [unsealed], "sealed against shrinking"),
        (handoff([1]), [plain], "sealed against shrinking"),
        (handoff([1]), [empty], "non-empty"),
        (handoff([1], b"\0" * 16), [sealed], "unknown session"),
        (handoff([1, 2]), [sealed], "2 segment ids for 1 file descriptors"),
        (handoff([1]), [], "1 segment ids for 0"),
        (b"garbage", [sealed], "malformed handoff"),
        (handoff([1]), [sealed] * 70, "at most 64 segments"),
        (handoff([1], b"short"), [sealed], "malformed handoff"),
    ]
    try:
        for payload, fds, needle in cases:
            taken = await asyncio.to_thread(_handoff, path, payload, fds)
            assert needle in taken.error, (needle, taken)
            await still_serving(raw)
        assert await bad_count(raw, "segments") == len(cases)
        taken = await asyncio.to_thread(_handoff, path, handoff([7]), [sealed])
        assert taken.error == "", taken
    finally:
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
    """Replies a client leaves unread pile up in the daemon only up to a bound: then the
    client's connection is closed, its session ends, and others are served as before."""
    monkeypatch.setattr(local_server, "_MAX_UNREAD_REPLY_BYTES", 64 * 1024)
    async with running_daemon(make_config(sock_dir)) as d:
        greedy = await RawClient(d.socket_path).open()
        await greedy.hello()
        stats = frame(pack({"op": "stats", "req_id": 2}))
        assert greedy.writer is not None
        greedy.writer.write(stats * 20000)  # ~30 MiB of replies that nobody reads
        async with AsyncKvdClient(d.socket_path) as c:
            async with asyncio.timeout(20):
                while (await c.stats())["bad_messages"].get("unread_replies", 0) == 0:
                    await asyncio.sleep(0.05)
                while (await c.stats())["clients"] != 1:
                    await asyncio.sleep(0.05)
            assert await c.ping() > 0
        assert greedy.reader is not None
        with pytest.raises(ConnectionError):  # cut off (reset: its requests were unread)
            async with asyncio.timeout(20):
                while await greedy.reader.read(1 << 20):
                    pass
                raise ConnectionResetError("closed")  # or a plain end of stream
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
