"""kvd: a KV-cache transfer daemon for disaggregated LLM inference.

The public API is the client library and the error tree::

    import kvd
    with kvd.KvdClient() as client:
        kv = kvd.shared_zeros((num_blocks, block_size, heads, head_dim), torch.float16)
        region = client.register("layers", [kv])
        client.offload("req-1", region, [0, 1, 2])
"""

__version__ = "0.1.0"

from kvd.client import (
    AsyncKvdClient,
    AsyncTransfer,
    KvdClient,
    Region,
    Transfer,
    shared_empty,
    shared_zeros,
)
from kvd.errors import (
    BadRequest,
    Cancelled,
    ConfigError,
    DaemonUnavailable,
    Draining,
    KeyGone,
    KvdError,
    KvdTimeout,
    LayoutMismatch,
    PeerUnreachable,
    PoolExhausted,
    ProtocolError,
    TransferFailed,
    UnknownKey,
)
from kvd.protocol import Part, Share

__all__ = [
    "AsyncKvdClient",
    "AsyncTransfer",
    "BadRequest",
    "Cancelled",
    "ConfigError",
    "DaemonUnavailable",
    "Draining",
    "KeyGone",
    "KvdClient",
    "KvdError",
    "KvdTimeout",
    "LayoutMismatch",
    "Part",
    "PeerUnreachable",
    "PoolExhausted",
    "ProtocolError",
    "Region",
    "Share",
    "Transfer",
    "TransferFailed",
    "UnknownKey",
    "__version__",
    "shared_empty",
    "shared_zeros",
]
