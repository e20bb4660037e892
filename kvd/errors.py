"""The kvd error tree.

Every error a caller can see is a ``KvdError`` with a stable wire ``code`` and a
``retriable`` flag. The daemon replies with the code and a message; the client maps
the code back to the same class, so ``except PoolExhausted`` works on both sides.
Low-level exceptions (sockets, OS, torch, msgspec) are translated at the I/O edge and
never reach a caller bare.
"""

from __future__ import annotations

from typing import Any


class KvdError(Exception):
    """Base of every kvd error. A subclass names its wire code, and whether it is retriable
    where that differs from its parent's, in its class line: it is then in
    ``ERRORS_BY_CODE`` (one without a code of its own travels as its parent)."""

    code: str = "error"
    retriable: bool = False

    def __init_subclass__(cls, code: str = "", retriable: bool | None = None,
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if retriable is not None:
            cls.retriable = retriable
        if code:
            cls.code = code
            ERRORS_BY_CODE[code] = cls

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__name__)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


ERRORS_BY_CODE: dict[str, type[KvdError]] = {KvdError.code: KvdError}


class ConfigError(KvdError, code="config"):
    """A configuration value is unknown, of the wrong type, or unusable."""


class ProtocolError(KvdError, code="protocol"):
    """A message could not be decoded, or spoke the wrong protocol version."""


class BadRequest(KvdError, code="bad_request"):
    """A well-formed request that asks for something invalid (range, name, size)."""


class KvdTimeout(KvdError, TimeoutError, code="timeout", retriable=True):
    """A deadline passed before the operation completed."""


class PeerUnreachable(KvdError, code="peer_unreachable", retriable=True):
    """A peer daemon is down, restarted, or never answered."""


class LinkedAlready(PeerUnreachable, code="linked_already"):
    """A peer refused our hello: it is linked with us already, or dialling us too, and
    its link is the pair's (between daemons; the dialler takes that link instead)."""


class LayoutMismatch(KvdError, code="layout_mismatch"):
    """Two regions (or a key and a region) do not share one block layout."""


class PoolExhausted(KvdError, code="pool_exhausted", retriable=True):
    """No free memory of the requested size in the host pool (or staging)."""


class UnknownKey(KvdError, code="unknown_key"):
    """No stored or published key by that name."""


class KeyGone(UnknownKey, code="key_gone"):
    """The key was there and is gone: taken by its one reader, expired, or withdrawn. A
    pull for it is answered at once, since waiting would not bring it back."""


class Cancelled(KvdError, code="cancelled"):
    """The operation was cancelled before it completed."""


class TransferFailed(KvdError, code="transfer_failed"):
    """A transfer failed on the data plane."""


class DaemonUnavailable(KvdError, code="daemon_unavailable", retriable=True):
    """The local daemon cannot be reached, or is shutting down."""


class Draining(DaemonUnavailable, code="draining"):
    """The daemon is draining: it refuses new work and finishes what is in flight."""


class InvalidFree(KvdError, code="invalid_free"):
    """Memory returned to an allocator that it did not hand out (or twice)."""


class InternalError(KvdError, code="internal"):
    """A bug in the daemon; the request failed but the daemon keeps serving."""


def error_from_code(code: str, message: str) -> KvdError:
    """Rebuild the error a daemon reported; an unknown code becomes a plain KvdError."""
    cls = ERRORS_BY_CODE.get(code, KvdError)
    err = cls(message)
    if cls is KvdError and code != KvdError.code:
        err = KvdError(f"[{code}] {message}")
    return err
