"""The daemon's parts as they come up, and what its servers need from the daemon.

``Daemon`` (service.py) composes everything. The parts it starts one after the other
(engine, peer plane, transfers, local socket) are held in ``DaemonParts``, which the
metrics read at scrape time; each is None until it is up. The servers that answer for the
whole daemon get plain callables, never the daemon itself: ``Status`` (the one status
report, assembled by ``Daemon.status``), ``ReadyCheck`` (why it is not ready) and
``DrainRequest`` (``kvd drain`` over the local socket).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (types only: these modules import nothing of this one)
    from kvd.daemon.engine import Engine
    from kvd.daemon.local_server import LocalServer
    from kvd.daemon.peers import PeerPlane
    from kvd.daemon.transfer.transfers import PeerTransfers

Status = Callable[[], dict[str, Any]]
ReadyCheck = Callable[[], list[str]]
DrainRequest = Callable[[float | None], Awaitable[dict[str, Any]]]


@dataclass
class DaemonParts:
    engine: Engine | None = None
    peers: PeerPlane | None = None
    transfers: PeerTransfers | None = None
    local: LocalServer | None = None
