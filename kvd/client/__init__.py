"""The client library: talk to the local kvd daemon over its ipc socket."""

from kvd.client.aio import AsyncKvdClient, AsyncTransfer
from kvd.client.base import Region, default_socket_path
from kvd.client.shm import shared_empty, shared_zeros
from kvd.client.sync import KvdClient, Transfer

__all__ = [
    "AsyncKvdClient",
    "AsyncTransfer",
    "KvdClient",
    "Region",
    "Transfer",
    "default_socket_path",
    "shared_empty",
    "shared_zeros",
]
