"""CurveZMQ on the peer plane: this daemon's key pair, the allow-list, the ZAP handler.

Keys come from ``kvd keygen`` (pyzmq's certificate format: ``NAME.key`` holds the public
key, ``NAME.key_secret`` both). ``curve_secret_key_file`` names this daemon's secret
certificate; ``curve_allowed_keys_file`` lists the peers it talks to, one per line::

    # comment lines start with '#' followed by a space
    # public key (z85, 40 chars)              address (needed to connect to that peer)
    rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7  10.0.0.2:14579
    Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID

A peer connecting to us is admitted by the ZAP handler only if its public key is on the
list (refusals are counted); to connect to a peer we need its public key, looked up by
address. The data connections are plain TCP: they are admitted by the per-link token
handed out over the authenticated handshake, and are not encrypted.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

from kvd.config import Config
from kvd.errors import ConfigError

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
KEY_CHARS = 40


@dataclass
class CurveKeys:
    public: bytes
    secret: bytes
    allowed: set[bytes] = field(default_factory=set)  # z85 public keys
    by_address: dict[str, bytes] = field(default_factory=dict)


def load_keys(config: Config) -> CurveKeys | None:
    """The configured keys, or None when the peer plane runs without CurveZMQ."""
    secret_file, allowed_file = config.curve_secret_key_file, config.curve_allowed_keys_file
    if not secret_file:
        if allowed_file:
            raise ConfigError("curve_allowed_keys_file: set, but curve_secret_key_file is not")
        return None
    if not allowed_file:
        raise ConfigError("curve_allowed_keys_file: required with curve_secret_key_file")
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"curve_secret_key_file: cannot read {secret_file!r}: {exc}") from None
    if not secret:
        raise ConfigError(f"curve_secret_key_file: {secret_file!r} holds no secret key "
                          "(give the .key_secret file)")
    keys = CurveKeys(public=public, secret=secret)
    try:
        with open(allowed_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"curve_allowed_keys_file: cannot read {allowed_file!r}: "
                          f"{exc.strerror}") from None
    for number, raw in enumerate(lines, 1):
        parts = raw.split()
        # '#' is also a z85 character: a key line is one whose first word has key length.
        if not parts or (parts[0].startswith("#") and len(parts[0]) != KEY_CHARS):
            continue
        if len(parts) > 2 and parts[2].startswith("#"):
            parts = parts[:2]
        key = parts[0].encode()
        if len(key) != KEY_CHARS or len(parts) > 2 or not _valid_z85(key):
            raise ConfigError(f"curve_allowed_keys_file: line {number} of {allowed_file!r} is "
                              "not '<40-char z85 public key> [host:port]'")
        keys.allowed.add(key)
        if len(parts) == 2:
            keys.by_address[parts[1]] = key
    return keys


def _valid_z85(key: bytes) -> bool:
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError):
        return False


class ZapHandler:
    """Answers libzmq's authentication requests for the peer socket (ZAP, RFC 27)."""

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys,
                 bad_messages: dict[str, int]) -> None:
        self.keys = keys
        self.bad_messages = bad_messages
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)

    def handle_pending(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        if mechanism == b"CURVE" and len(frames) >= 7:
            client_key = z85.encode(frames[6])
            if client_key in self.keys.allowed:
                return [version, request_id, b"200", b"OK", client_key, b""]
            reason = "key not on the allow-list"
        else:
            reason = f"mechanism {mechanism.decode(errors='replace')} not accepted"
        self.bad_messages["auth"] = self.bad_messages.get("auth", 0) + 1
        log.warning("peer refused at the handshake from=%s: %s",
                    address.decode(errors="replace"), reason)
        return [version, request_id, b"400", reason.encode(), b"", b""]

    def close(self) -> None:
        self.sock.close(linger=0)


def write_keys(directory: str, name: str) -> tuple[str, str, str]:
    """Create ``NAME.key`` and ``NAME.key_secret`` in ``directory``; returns both paths and
    the public key."""
    os.makedirs(directory, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if os.path.exists(os.path.join(directory, name + suffix)):
            raise ConfigError(f"{os.path.join(directory, name + suffix)} exists; not "
                              "overwriting a key")
    public_file, secret_file = zmq.auth.create_certificates(directory, name)
    os.chmod(secret_file, 0o600)
    public, _ = zmq.auth.load_certificate(public_file)
    return public_file, secret_file, public.decode()
