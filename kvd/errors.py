"""The kvd error tree.

Every error a caller can see is a ``KvdError`` with a stable wire ``code`` and a
``retriable`` flag. The daemon replies with the code and a message; the client maps
the code back to the same class, so ``except PoolExhausted`` works on both sides.
Low-level exceptions (sockets, OS, torch, msgspec) are translated at the I/O edge and
never reach a caller bare.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base of every kvd error."""

    code: str = "error"
    retriable: bool = False

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__name__)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(KvdError):
    """A configuration value is unknown, of the wrong type, or unusable."""

    code = "config"


class ProtocolError(KvdError):
    """A message could not be decoded, or spoke the wrong protocol version."""

    code = "protocol"


class BadRequest(KvdError):
    """A well-formed request that asks for something invalid (range, name, size)."""

    code = "bad_request"


class KvdTimeout(KvdError, TimeoutError):
    """A deadline passed before the operation completed."""

    code = "timeout"
    retriable = True


class PeerUnreachable(KvdError):
    """A peer daemon is down, restarted, or never answered."""

    code = "peer_unreachable"
    retriable = True


class LayoutMismatch(KvdError):
    """Two regions (or a key and a region) do not share one block layout."""

    code = "layout_mismatch"


class PoolExhausted(KvdError):
    """No free memory of the requested size in the host pool (or staging)."""

    code = "pool_exhausted"
    retriable = True


class UnknownKey(KvdError):
    """No stored or published key by that name."""

    code = "unknown_key"


class KeyGone(UnknownKey):
    """The key was there and is gone: taken by its one reader, expired, or withdrawn. A
    pull for it is answered at once, since waiting would not bring it back."""

    code = "key_gone"


class Cancelled(KvdError):
    """The operation was cancelled before it completed."""

    code = "cancelled"


class TransferFailed(KvdError):
    """A transfer failed on the data plane."""

    code = "transfer_failed"


class DaemonUnavailable(KvdError):
    """The local daemon cannot be reached, or is shutting down."""

    code = "daemon_unavailable"
    retriable = True


class Draining(DaemonUnavailable):
    """The daemon is draining: it refuses new work and finishes what is in flight."""

    code = "draining"


class InvalidFree(KvdError):
    """Memory returned to an allocator that it did not hand out (or twice)."""

    code = "invalid_free"


class InternalError(KvdError):
    """A bug in the daemon; the request failed but the daemon keeps serving."""

    code = "internal"


def _all_subclasses(cls: type[KvdError]) -> list[type[KvdError]]:
    out: list[type[KvdError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[str, type[KvdError]] = {KvdError.code: KvdError}
for _cls in _all_subclasses(KvdError):
    ERRORS_BY_CODE[_cls.code] = _cls


def error_from_code(code: str, message: str) -> KvdError:
    """Rebuild the error a daemon reported; an unknown code becomes a plain KvdError."""
    cls = ERRORS_BY_CODE.get(code, KvdError)
    err = cls(message)
    if cls is KvdError and code != KvdError.code:
        err = KvdError(f"[{code}] {message}")
    return err
