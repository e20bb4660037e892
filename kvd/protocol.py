"""Messages between clients and the daemon: typed msgspec Structs encoded as msgpack.

Every message is one ZeroMQ frame holding one tagged Struct (behind the client's routing
id at the daemon's ROUTER). A client's first message is ``Hello`` with the protocol
version and its lifeline's token (``Lifeline``); the daemon checks them before anything
else. Every request carries a ``req_id`` chosen by the client and gets exactly
one reply with the same ``req_id``: a typed result or an ``ErrorReply`` with a wire code
from ``kvd.errors``. Long operations (``Get``, ``Put``) are ordinary requests whose reply
comes late; a client can ``Cancel`` one by its ``req_id``.

Bulk data never travels in these messages: the daemon maps the client's tensors once
(``Register``) and moves bytes itself. Decoding is validated against the union of request
types, so malformed input fails at decode with a message; nothing is unpickled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np
from msgspec import Meta, Struct

from kvd.errors import ProtocolError

# Protocol versions (bump on any incompatible change to a message below):
#   1 — 2026-11: Hello/Register(shm)/Offload/Get/Put(local)/Publish/Cancel/Stats.
#   2 — 2026-11: peer plane (PeerHello .. PullRequest), Pull, Put to another daemon.
#   3 — 2026-11: NCCL fields in Offer/Accept, ChannelDown.
#   4 — 2026-11: Lend (publish for one reader, replied when the blocks are free again).
#   5 — 2026-11: ChannelWarm (NCCL channels made when a peer link comes up).
#   6 — 2026-11: eager NCCL sends (channel and chunk size in Offer).
#   7 — 2026-11: block ids travel packed (``BlockIds``: little-endian uint32 bytes).
#   8 — 2026-11: the handshake's ``nccl_blocking_calls``.
#   9 — 2026-12: a pull may wait for its key at the source (``wait_for_key_s``).
#  10 — 2026-12: CPU tensors live in sealed memfd segments handed over as descriptors
#        (``SegmentHandoff``); ``ShmTensor`` names a segment, not a path.
#  11 — 2026-12: ZeroMQ frames; a session opens with its lifeline's token (``Lifeline``).
#  12 — 2026-12: small host transfers carry their bytes in the OFFER (``Offer.inline``),
#        answered XFER_DONE / BUSY / REFUSE without an ACCEPT.
#  13 — 2026-12: the lifeline is the door: the client hands over its DEALER's endpoint
#        (``Reach``) and the daemon's ROUTER connects to it, the token as routing id
#        (``Hello.lifeline`` is gone); ``Taken``; ``Welcome.max_message_bytes``.
#  14 — 2026-12: a pull or get takes a share of a key (``Share``) into a part of its
#        blocks (``into``).
#  15 — 2026-12: leases (``Renew``, ``Release``; ``LeaseRenew``, ``LeaseRelease``,
#        ``LeaseAnswer`` between daemons); ``Get.sender``.
#  16 — 2026-12: a release may keep a key's tail (``Release.skip``, ``LeaseRelease.skip``),
#        and a put of it sends only those blocks (``Offer.first``).
#  17 — 2026-12: ``Reload`` (the allow-list read again); a hello refused because the pair
#        is linked already, or both dialled at once, says ``linked_already``.
PROTOCOL_VERSION = 17

# The most bytes an OFFER carries itself (``Offer.inline``): below this, a transfer's own
# round through the data connection's threads costs more than the bytes' copy on the loops.
MAX_INLINE_BYTES = 64 * 1024
# The longest message a peer may send (the peer sockets' ZMQ_MAXMSGSIZE: a longer one ends
# its connection at its header). The longest is an OFFER with its bytes inline and every
# field at its bound (MAX_TENSORS_PER_REGION layout entries, a key of MAX_KEY_CHARS
# four-byte characters): 168,250 bytes encoded, tested.
MAX_PEER_MESSAGE_BYTES = 256 * 1024

MAX_KEY_CHARS = 1024
MAX_NAME_CHARS = 256
MAX_TENSORS_PER_REGION = 4096
MAX_DIMS = 8
MAX_BLOCKS_PER_OP = 1 << 20
MAX_PARTS = 64  # a block is read in at most this many parts (tensor-parallel ranks)

# Shared-memory segments the client library creates for CPU tensors are memfds with this
# name prefix (seen in /proc/<pid>/fd and /proc/<pid>/maps), sealed against shrinking, and
# handed to the daemon as file descriptors (``SegmentHandoff`` on the lifeline,
# daemon/lifelines.py).
SHM_PREFIX = "kvd-"
MAX_SEGMENTS_PER_HANDOFF = 64  # file descriptors in one message (SCM_RIGHTS allows 253)
SEGMENT_TOKEN_BYTES = 16

ReqId = Annotated[int, Meta(ge=1, le=2**63 - 1)]
Key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY_CHARS)]
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
NonNeg = Annotated[int, Meta(ge=0, le=2**62)]
# Block ids travel packed, 4 bytes each, little-endian unsigned (``pack_block_ids``): a
# list of 1024 ints took ~20 us to decode and ~17 us more to become the daemon's index
# array, on the critical path of every request and several times that in a daemon woken
# between transfers (docs/architecture.md); packed bytes decode in ~1 us, viewed in place.
BLOCK_ID_BYTES = 4
BLOCK_ID_DTYPE = np.dtype("<u4")
BlockIds = Annotated[bytes, Meta(max_length=MAX_BLOCKS_PER_OP * BLOCK_ID_BYTES)]
Seconds = Annotated[float, Meta(ge=0.0, le=10.0**7)]
DType = Literal[
    "float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32",
    "int64", "float8_e4m3fn", "float8_e5m2", "bool",
]


def pack_block_ids(ids: np.ndarray[Any, Any]) -> bytes:
    """Block ids (a 1-D array of integers, each in [0, 2**32)) as ``BlockIds``."""
    return ids.astype(BLOCK_ID_DTYPE, copy=False).tobytes()


class _Msg(Struct, tag_field="op", frozen=True, forbid_unknown_fields=True):
    pass


class _Request(_Msg, frozen=True):
    """A request: its ``req_id``, chosen by the client, comes back in its one reply."""

    req_id: ReqId


class _WithBlocks(_Request, frozen=True):
    """A request naming blocks of a region (``blocks``: packed ``BlockIds``)."""

    if TYPE_CHECKING:
        blocks: bytes

    def __post_init__(self) -> None:
        # Raised while decoding, this is a validation error: a malformed request.
        if len(self.blocks) % BLOCK_ID_BYTES:
            raise ValueError(f"blocks: {len(self.blocks)} bytes is not a whole number of "
                             f"{BLOCK_ID_BYTES}-byte block ids")

    @property
    def ids(self) -> np.ndarray[Any, Any]:
        """The block ids as int64 (the dtype torch indexes with)."""
        return np.frombuffer(self.blocks, dtype=BLOCK_ID_DTYPE).astype(np.int64)


class _KeyBlocks(_WithBlocks, frozen=True):
    """A request about ``key`` and blocks of one of the client's regions (all of them but
    ``Pull``, whose ``src`` comes before ``region_id``)."""

    key: Key
    region_id: NonNeg
    blocks: BlockIds


# ---------------------------------------------------------------- tensors and regions


class ShmTensor(Struct, tag="shm", tag_field="kind", frozen=True, forbid_unknown_fields=True):
    """A CPU tensor inside a shared-memory segment the client handed to the daemon.

    ``segment`` is the segment's id in the client's ``SegmentHandoff``; ``shape``/``stride``
    are in elements, ``offset_bytes`` is where element 0 sits in the segment, whose size
    the client states as ``file_bytes`` (checked against the segment's own)."""

    segment: Annotated[int, Meta(ge=1, le=2**62)]
    file_bytes: NonNeg
    offset_bytes: NonNeg
    shape: Annotated[list[NonNeg], Meta(min_length=1, max_length=MAX_DIMS)]
    stride: Annotated[list[NonNeg], Meta(min_length=1, max_length=MAX_DIMS)]
    dtype: DType


class CudaIpcTensor(Struct, tag="cuda_ipc", tag_field="kind", frozen=True,
                    forbid_unknown_fields=True):
    """A CUDA tensor shared through CUDA IPC: the fields of torch's ``reduce_tensor`` as
    plain bytes and ints (never pickled). The daemon maps the device by GPU UUID, since
    the two processes may see different ``CUDA_VISIBLE_DEVICES``."""

    gpu_uuid: Annotated[str, Meta(min_length=1, max_length=64)]
    handle: Annotated[bytes, Meta(min_length=1, max_length=256)]
    storage_size_bytes: NonNeg
    storage_offset_bytes: NonNeg
    ref_counter_handle: Annotated[bytes, Meta(max_length=4096)]
    ref_counter_offset: NonNeg
    event_handle: Annotated[bytes, Meta(max_length=256)]
    event_sync_required: bool
    tensor_offset: NonNeg  # in elements
    shape: Annotated[list[NonNeg], Meta(min_length=1, max_length=MAX_DIMS)]
    stride: Annotated[list[NonNeg], Meta(min_length=1, max_length=MAX_DIMS)]
    dtype: DType
    # The client's interprocess CUDA event for this GPU: it records it on its stream before
    # every request that reads the region, and the daemon's reads wait for it.
    ready_event: Annotated[bytes, Meta(max_length=256)] = b""


TensorSpec = ShmTensor | CudaIpcTensor


class LayoutEntry(Struct, frozen=True, array_like=True):
    """Per tensor of a region: how many bytes one block holds, and its dtype."""

    bytes_per_block: NonNeg
    dtype: DType


class Part(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Part ``index`` of ``count`` equal byte ranges of each block, in every tensor: with a
    KV layout that keeps a block's heads outermost, one tensor-parallel rank's heads.
    ``Part(0, 1)`` is the whole block."""

    index: Annotated[int, Meta(ge=0, lt=MAX_PARTS)] = 0
    count: Annotated[int, Meta(ge=1, le=MAX_PARTS)] = 1

    def __post_init__(self) -> None:
        if self.index >= self.count:
            raise ValueError(f"part {self.index} of {self.count}")


WHOLE = Part()


class Share(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What one read takes of a key: ``part`` of each block, of the blocks from ``skip``
    on (the reader holds the ones before: a prefix it has cached). ``readers``: how many
    reads take each part. A lent key is done once every part of that cut has been read
    that many times (several tensor-parallel ranks read one lender, each its heads, or
    each all of a latent cache that every rank holds)."""

    part: Part = WHOLE
    skip: Skip = 0
    readers: Annotated[int, Meta(ge=1, le=MAX_PARTS)] = 1


ALL = Share()
# A number of a key's first blocks (``Share.skip``, ``Release.skip``, ``Offer.first``).
Skip = Annotated[int, Meta(ge=0, lt=MAX_BLOCKS_PER_OP)]


# ---------------------------------------------------------------- requests


# The name the `kvd` command's client says in its hello: the daemon logs its sessions (one
# per `kvd status`, `kvd ping`) at debug level.
CLI_CLIENT_NAME = "kvd-cli"


class Hello(_Request, tag="hello", frozen=True):
    protocol_version: int
    pid: NonNeg = 0
    name: Annotated[str, Meta(max_length=MAX_NAME_CHARS)] = ""


class Bye(_Request, tag="bye", frozen=True):
    """End the session; answered once it is closed (no more bytes move in its blocks)."""


class Ping(_Request, tag="ping", frozen=True):
    """Answered by ``Pong``."""


class Register(_Request, tag="register", frozen=True):
    name: Name
    tensors: Annotated[list[TensorSpec], Meta(min_length=1, max_length=MAX_TENSORS_PER_REGION)]
    block_dim: Annotated[int, Meta(ge=0, lt=MAX_DIMS)] = 0


class Unregister(_Request, tag="unregister", frozen=True):
    region_id: NonNeg


class Offload(_KeyBlocks, tag="offload", frozen=True):
    """Copy blocks into this daemon's host pool under ``key``."""

    ttl_s: Seconds | None = None


class Get(_KeyBlocks, tag="get", frozen=True):
    """Wait (up to ``timeout_s``) for ``key`` and write it into these blocks."""

    timeout_s: Seconds
    share: Share = ALL  # as in Pull
    into: Part = WHOLE  # as in Pull
    # The daemon that puts ``key`` here (its peer address), when the caller knows it: the
    # get then fails at once (PeerUnreachable) if that daemon cannot be reached, or its
    # link is lost, while nothing has come. Empty: no such watch.
    sender: Annotated[str, Meta(max_length=MAX_NAME_CHARS)] = ""


class Put(_KeyBlocks, tag="put", frozen=True):
    """Send blocks to daemon ``to`` under ``key``; replied once the receiver has the bytes."""

    to: Annotated[str, Meta(max_length=MAX_NAME_CHARS)] = ""
    ttl_s: Seconds | None = None
    timeout_s: Seconds = 30.0


class Pull(_WithBlocks, tag="pull", frozen=True):
    """Ask daemon ``src`` for its published (or offloaded) ``key``, into these blocks."""

    key: Key
    src: Name
    region_id: NonNeg
    blocks: BlockIds
    timeout_s: Seconds
    # How long ``src`` may wait for ``key`` to appear (be published, lent or stored) before
    # it answers that it has no such key; 0: answer at once. At most ``timeout_s``.
    wait_for_key_s: Seconds = 0.0
    share: Share = ALL  # what of the key this pull takes
    into: Part = WHOLE  # which part of each of ``blocks`` it lands in


class Publish(_KeyBlocks, tag="publish", frozen=True):
    """Offer blocks under ``key`` without copying them; gets and peers read them in place."""

    ttl_s: Seconds | None = None


class Lend(_KeyBlocks, tag="lend", frozen=True):
    """Publish blocks in place for exactly one reader (a get here or a peer's pull). The
    reply comes when the daemon no longer touches the blocks: ``Done(nbytes)`` with the
    bytes that reader took, or 0 when nobody did before ``ttl_s`` or a cancel."""

    ttl_s: Seconds


class Renew(_Request, tag="renew", frozen=True):
    """The reader of ``key``, lent at daemon ``src`` (a peer address, or this daemon),
    asks that it be kept at least ``ttl_s`` more (at most ``max_ttl_s``): its lender's
    lease is extended, never shortened. Only a lent key is renewed."""

    key: Key
    src: Name
    ttl_s: Seconds
    timeout_s: Seconds = 10.0


class Release(_Request, tag="release", frozen=True):
    """The reader of ``key``, lent or pushed at daemon ``src`` (or to be), will not come:
    the key is dropped there now (its lend answers 0 bytes), pulls and gets waiting for it
    fail, a lend or put of it that comes later answers 0 at once (sending nothing), and
    bytes of it that arrive there are refused. A published or offloaded key is not
    released.

    ``skip`` (not 0): the reader has the key's first ``skip`` blocks (a prefix it has
    cached) and will still read the rest: the key is not dropped, and a put of it from
    ``src`` to another daemon, if it comes later, sends only its blocks from ``skip`` on
    (all of them skipped: it answers 0 at once). A key held already is left as it is."""

    key: Key
    src: Name
    timeout_s: Seconds = 10.0
    skip: Skip = 0


class Unpublish(_Request, tag="unpublish", frozen=True):
    key: Key


class Delete(_Request, tag="delete", frozen=True):
    """Free a stored (offloaded or arrived) key now."""

    key: Key


class Cancel(_Request, tag="cancel", frozen=True):
    """Cancel this client's pending request ``target``."""

    target: ReqId


class Stats(_Request, tag="stats", frozen=True):
    """Answered by ``StatsReply``."""


class Drain(_Request, tag="drain", frozen=True):
    """Stop taking new work, let in-flight work finish (within ``grace_s``), then exit;
    replied with a report once the in-flight work is done."""

    grace_s: Seconds | None = None


class Reload(_Request, tag="reload", frozen=True):
    """Read the allow-list again (as on SIGHUP); answered by ``StatsReply`` with what
    changed, or an error (the list kept as it was)."""


Request = (
    Hello | Bye | Ping | Register | Unregister | Offload | Get | Put | Pull | Publish | Lend
    | Unpublish | Delete | Cancel | Stats | Drain | Reload | Renew | Release
)

# ---------------------------------------------------------------- replies


class Welcome(_Msg, tag="welcome", frozen=True):
    req_id: int
    protocol_version: int
    node_id: str
    epoch: int
    daemon_version: str
    # The longest request the daemon reads: a longer one ends the client's connection
    # inside ZeroMQ, so the client refuses it before it is sent.
    max_message_bytes: int


class Done(_Msg, tag="done", frozen=True):
    """Success with nothing to return but how many bytes moved."""

    req_id: int
    nbytes: int = 0


class Pong(_Msg, tag="pong", frozen=True):
    req_id: int
    node_id: str
    epoch: int
    draining: bool


class Registered(_Msg, tag="registered", frozen=True):
    req_id: int
    region_id: int
    num_blocks: int
    layout: list[LayoutEntry]


class StatsReply(_Msg, tag="stats_reply", frozen=True):
    req_id: int
    stats: dict[str, Any]


class ErrorReply(_Msg, tag="error", frozen=True):
    req_id: int
    code: str
    message: str


Reply = Welcome | Done | Pong | Registered | StatsReply | ErrorReply

# ---------------------------------------------------------------- the lifeline


class Lifeline(Struct, frozen=True, forbid_unknown_fields=True):
    """The daemon's first message on a connection to ``socket_path`` (the client's
    *lifeline*): the token that becomes the routing id of the client's DEALER on the
    daemon's ROUTER once ``Reach`` is taken. The session lives as long as the connection:
    a client that dies closes it, and so does a daemon."""

    token: Annotated[bytes, Meta(min_length=SEGMENT_TOKEN_BYTES, max_length=SEGMENT_TOKEN_BYTES)]


class Reach(Struct, tag="reach", tag_field="op", frozen=True, forbid_unknown_fields=True):
    """Sent with one file descriptor (``SCM_RIGHTS``): an ``O_PATH`` descriptor of the
    socket file the client's DEALER is bound to, in a directory only the client can enter
    (the file may be unlinked already). The daemon's ROUTER connects through it, and
    nobody else can: the daemon listens on no ZeroMQ endpoint for its clients."""


class SegmentHandoff(Struct, tag="segments", tag_field="op", frozen=True,
                     forbid_unknown_fields=True):
    """Shared-memory segments handed over on a session's lifeline, sent with ``sendmsg``
    and one file descriptor per segment id (``SCM_RIGHTS``), in order: they become the
    session's."""

    segments: Annotated[list[Annotated[int, Meta(ge=1, le=2**62)]],
                        Meta(min_length=1, max_length=MAX_SEGMENTS_PER_HANDOFF)]


LifelineRequest = Reach | SegmentHandoff


class Taken(Struct, frozen=True, forbid_unknown_fields=True):
    """The answer to a ``LifelineRequest``: empty ``error`` when the daemon took it."""

    error: str = ""


# ---------------------------------------------------------------- peer plane
#
# Daemon to daemon, over the peer socket (TCP). Every message about a transfer carries
# its ``transfer_id``. A push: sender OFFER -> receiver ACCEPT | BUSY | REFUSE; the bytes
# follow on the channel's data connection; receiver XFER_DONE | XFER_FAILED. A pull is a
# PULL from the receiver, answered by the owner with an OFFER of the same transfer_id.

TransferId = Annotated[int, Meta(ge=1, le=2**63 - 1)]
Token = Annotated[bytes, Meta(min_length=16, max_length=64)]
Device = Annotated[str, Meta(min_length=1, max_length=64)]


class _PeerMsg(Struct, tag_field="op", frozen=True, forbid_unknown_fields=True):
    pass


class _Intro(_PeerMsg, frozen=True):
    """What a daemon says of itself when a peer connection opens."""

    protocol_version: int
    node_id: Name
    epoch: NonNeg
    address: Name  # host:port
    data_port: Annotated[int, Meta(ge=0, le=65535)]
    data_token: Token  # the token a peer presents on our data port
    devices: Annotated[list[Device], Meta(max_length=64)]
    # Channels to this daemon may make their calls on a blocking communicator split from
    # the non-blocking one (both ends must split: a channel uses it when both say so).
    nccl_blocking_calls: bool = False
    # SHA-256 of the TLS certificate this daemon's data port presents (encrypt_data under
    # CurveZMQ); empty: its data port speaks plain TCP.
    data_fingerprint: Annotated[bytes, Meta(max_length=32)] = b""
    # This daemon's host pool: the most one put to it can hold (0: not told).
    pool_capacity_bytes: NonNeg = 0


class PeerHello(_Intro, tag="peer_hello", frozen=True):
    """First message on a peer connection; answered by ``PeerWelcome``."""


class PeerWelcome(_Intro, tag="peer_welcome", frozen=True):
    """The answer to ``PeerHello``: the same facts, of the daemon that answers."""


class Heartbeat(_PeerMsg, tag="heartbeat", frozen=True):
    """Sent on a link with work in flight; ``ask``: answer with one (a daemon with no work
    on the link sends none of its own, and the asker must hear it all the same)."""

    epoch: NonNeg
    ask: bool = False


ChannelId = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class _OfTransfer(_PeerMsg, frozen=True):
    transfer_id: TransferId


class _Failure(_OfTransfer, frozen=True):
    """The transfer failed: the error's wire code and message."""

    code: Annotated[str, Meta(max_length=64)]
    message: Annotated[str, Meta(max_length=4096)]


class Offer(_OfTransfer, tag="offer", frozen=True):
    """``src_dev``: the sender's device for an NCCL channel ("cuda:N"), or "cpu" when it
    has no NCCL; ``src_gpu``: the bytes are in GPU memory (they cannot go over TCP);
    ``one_run``: each tensor's blocks are one contiguous run (NCCL can send them as is);
    ``eager``: the bytes follow on the TCP data connection without waiting for an ACCEPT
    (the receiver discards them if it answers BUSY or REFUSE). ``channel`` (not 0): the
    sender has already queued the bytes on that NCCL channel, cut at ``chunk_bytes``; the
    receiver must queue the matching receive on it whatever it answers (into staging and
    dropped unless it ACCEPTs), or, if it has no such channel, answer CHANNEL_DOWN and BUSY
    (the sender then offers again without a channel). ``inline`` (not empty): the bytes
    themselves, in wire order, for host memory of at most ``MAX_INLINE_BYTES``; the
    receiver stores them and answers XFER_DONE (or BUSY / REFUSE), no ACCEPT."""

    key: Key
    src_dev: Device
    dst_dev: Device
    nbytes: NonNeg
    num_blocks: Annotated[int, Meta(ge=1, le=MAX_BLOCKS_PER_OP)]
    layout: Annotated[list[LayoutEntry], Meta(min_length=1, max_length=MAX_TENSORS_PER_REGION)]
    ttl_s: Seconds | None = None
    src_gpu: bool = False
    one_run: bool = False
    eager: bool = False
    channel: ChannelId = 0
    chunk_bytes: Annotated[int, Meta(ge=0, le=2**40)] = 0
    # Decoded as a view of the received message, not a copy of it: the receiver copies
    # the bytes once, into their destination.
    inline: Annotated[memoryview, Meta(max_length=MAX_INLINE_BYTES)] = memoryview(b"")
    first: Skip = 0


class Accept(_OfTransfer, tag="accept", frozen=True):
    """``channel`` 0: the bytes go over TCP. Otherwise over the NCCL channel with that id
    between ``src_dev`` and ``dst_dev``; ``nccl_uid`` is its ncclUniqueId, so a sender
    that does not have that channel yet joins it. ``chunk_bytes``: how both ends cut the
    bytes into NCCL messages (``transport.chunks.plan_chunks``); the receiver decides."""

    dst_dev: Device = "cpu"
    channel: ChannelId = 0
    nccl_uid: Annotated[bytes, Meta(max_length=128)] = b""
    chunk_bytes: Annotated[int, Meta(ge=0, le=2**40)] = 0


class Busy(_OfTransfer, tag="busy", frozen=True):
    retry_after_s: Seconds


class Refuse(_Failure, tag="refuse", frozen=True):
    """The receiver will not take this transfer (bad offer, layout, unknown key)."""


class XferDone(_OfTransfer, tag="xfer_done", frozen=True):
    nbytes: NonNeg


class XferFailed(_Failure, tag="xfer_failed", frozen=True):
    """The receive ended without the bytes (it failed, or was cancelled)."""


class XferCancel(_OfTransfer, tag="xfer_cancel", frozen=True):
    """The other side gave up on this transfer; stop it if it has not started."""


class PullRequest(_OfTransfer, tag="pull_request", frozen=True):
    key: Key
    dst_dev: Device
    num_blocks: Annotated[int, Meta(ge=1, le=MAX_BLOCKS_PER_OP)]
    layout: Annotated[list[LayoutEntry], Meta(min_length=1, max_length=MAX_TENSORS_PER_REGION)]
    wait_for_key_s: Seconds = 0.0  # as in Pull: the owner holds the request until then
    share: Share = ALL  # as in Pull


class ChannelDown(_PeerMsg, tag="channel_down", frozen=True):
    """An NCCL channel failed (or was evicted) on one side: the other aborts its end."""

    channel: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    reason: Annotated[str, Meta(max_length=4096)]


class ChannelWarm(_PeerMsg, tag="channel_warm", frozen=True):
    """The receiver made the NCCL channel ``channel`` from the sender's ``src_dev`` to its
    ``dst_dev`` ahead of any transfer: the sender joins it as rank 0, and both ends move
    one small message on it first, which sets up NCCL's connections."""

    channel: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    nccl_uid: Annotated[bytes, Meta(min_length=128, max_length=128)]
    src_dev: Device
    dst_dev: Device


CallId = Annotated[int, Meta(ge=1, le=2**63 - 1)]


class LeaseRenew(_PeerMsg, tag="lease_renew", frozen=True):
    """A reader asks the daemon that lent ``key`` to keep it ``ttl_s`` more (``Renew``);
    answered by ``LeaseAnswer`` with the same ``call_id``."""

    call_id: CallId
    key: Key
    ttl_s: Seconds


class LeaseRelease(_PeerMsg, tag="lease_release", frozen=True):
    """A reader tells the daemon that lent ``key`` that it will not come (``Release``),
    or, ``skip`` not 0, that it needs only the key's blocks from ``skip`` on; answered by
    ``LeaseAnswer``."""

    call_id: CallId
    key: Key
    skip: Skip = 0


class LeaseAnswer(_PeerMsg, tag="lease_answer", frozen=True):
    """The answer to a ``LeaseRenew`` or ``LeaseRelease``: ``code`` empty when done, else
    the error's wire code and message."""

    call_id: CallId
    code: Annotated[str, Meta(max_length=64)] = ""
    message: Annotated[str, Meta(max_length=4096)] = ""


class PeerError(_PeerMsg, tag="peer_error", frozen=True):
    """Reply to a message the daemon could not take (not tied to a transfer)."""

    code: Annotated[str, Meta(max_length=64)]
    message: Annotated[str, Meta(max_length=4096)]


PeerMessage = (
    PeerHello | PeerWelcome | Heartbeat | Offer | Accept | Busy | Refuse | XferDone
    | XferFailed | XferCancel | PullRequest | ChannelDown | ChannelWarm | PeerError
    | LeaseRenew | LeaseRelease | LeaseAnswer
)

# ---------------------------------------------------------------- codec

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_loose_decoder = msgspec.msgpack.Decoder()
_peer_decoder = msgspec.msgpack.Decoder(PeerMessage)


def encode(msg: _Msg | _PeerMsg) -> bytes:
    return _encoder.encode(msg)


# msgspec decodes (and skips) nested arrays and maps recursively, and stops with
# RecursionError at the interpreter's recursion limit (~1000 levels), even inside a field
# it would refuse. No message of ours nests more than a few levels: deeper is malformed.
_TOO_DEEP = "nested too deeply"
_T = TypeVar("_T")


def _decode(decoder: msgspec.msgpack.Decoder[_T], what: str, data: bytes | memoryview) -> _T:
    """Decode and validate one message; anything malformed is a ProtocolError."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ProtocolError(f"malformed {what}: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"malformed {what}: {_TOO_DEEP}") from None


def decode_request(data: bytes | memoryview) -> Request:
    return _decode(_request_decoder, "request", data)


def decode_reply(data: bytes | memoryview) -> Reply:
    return _decode(_reply_decoder, "reply", data)


def decode_peer(data: bytes | memoryview) -> PeerMessage:
    return _decode(_peer_decoder, "peer message", data)


def salvage_req_id(data: bytes | memoryview) -> int:
    """Best effort: the req_id of a message that failed validation, so the error reply
    reaches the caller that is waiting for it. Plain msgpack to builtins; 0 if none (or
    if it nests too deeply to read)."""
    try:
        obj = _loose_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return 0
    if isinstance(obj, dict):
        req_id = obj.get("req_id")
        if isinstance(req_id, int) and not isinstance(req_id, bool) and 0 < req_id < 2**63:
            return req_id
    return 0
