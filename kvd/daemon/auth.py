"""CurveZMQ on the peer plane: this daemon's key pair, the allow-list, the ZAP handler; and
the throwaway TLS identity that encrypts the data connections.

Each daemon has one identity, a CurveZMQ key pair (``kvd keygen`` writes it: ``NAME.key``
holds the public key, ``NAME.key_secret`` both, mode 0600). ``curve_secret_key_file`` names
this daemon's; ``curve_allowed_keys_file`` is the operator's one allow-list, one line per
daemon (its own line may be in it, so one file serves a whole cluster)::

    # public key (z85, 40 characters)       host:port of its peer socket
    rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7  10.0.0.2:14579

A peer that connects is admitted by the ZAP handler (RFC 27, answered on the daemon's loop)
only if its public key is on the list; refusals are counted in ``bad_messages["auth"]``.
The handler names the key as the connection's user id, and the peer plane takes a
``PeerHello`` only for the address the list gives that key: an admitted daemon cannot speak
for another. To dial a peer, its public key is looked up by address.

The data connections (host-memory bytes) are admitted by the per-link token handed out over
the CURVE-secured handshake. With ``encrypt_data`` they are TLS: each daemon makes a
self-signed certificate at start (``DataTls``), never written anywhere but a private
temporary file while it is loaded, and sends its SHA-256 fingerprint in its
``PeerHello``/``PeerWelcome``; the dialer pins that fingerprint, and the token, sent inside
TLS, authenticates the dialer. NCCL's connections are never encrypted.

Without keys anyone who reaches the peer port can link and move data: a daemon whose
``peer_host`` is not a loopback address refuses to start without them
(``check_exposure``), unless the operator says ``allow_unauthenticated_peers``.
"""

from __future__ import annotations

import contextlib
import datetime
import grp
import hashlib
import ipaddress
import logging
import os
import socket
import ssl
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.utils import z85

from kvd.config import Config
from kvd.errors import ConfigError

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"kvd"
KEY_CHARS = 40


@dataclass
class CurveKeys:
    public: bytes  # z85
    secret: bytes  # z85
    by_address: dict[str, bytes] = field(default_factory=dict)  # host:port -> key
    address_of: dict[bytes, str] = field(default_factory=dict)  # key -> host:port


def check_exposure(config: Config) -> None:
    """Refuse (ConfigError) a peer port beyond loopback without CurveZMQ keys, unless
    ``allow_unauthenticated_peers``; allowed, say so in the log. Before anything is bound:
    a mistake of the operator's is said at once, not after the pool is taken."""
    if config.curve_secret_key_file or is_loopback(config.peer_host):
        return
    if not config.allow_unauthenticated_peers:
        raise ConfigError(
            f"peer_host: {config.peer_host} is not a loopback address and no CurveZMQ keys "
            f"are set: anyone who reaches the peer port could link to this daemon and put, "
            f"pull and flood it. Set curve_secret_key_file and curve_allowed_keys_file "
            f"(kvd keygen), or, on a fully trusted network only, "
            f"allow_unauthenticated_peers = true")
    log.warning("peers are not authenticated: peer_host %s is not a loopback address and "
                "no CurveZMQ keys are set (allow_unauthenticated_peers)", config.peer_host)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or a name: every address it resolves to) is a
    loopback address; a name that does not resolve, or ZeroMQ's ``*``, is not."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(
        ipaddress.ip_address(str(address[0]).split("%")[0]).is_loopback
        for *_rest, address in found)


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
    keys.by_address, keys.address_of = read_allowed(allowed_file)
    return keys


def read_allowed(allowed_file: str) -> tuple[dict[str, bytes], dict[bytes, str]]:
    """The allow-list: each address's key and each key's address (ConfigError if the file
    cannot be read or a line is not ``<key> <host:port>``)."""
    by_address: dict[str, bytes] = {}
    address_of: dict[bytes, str] = {}
    try:
        with open(allowed_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"curve_allowed_keys_file: cannot read {allowed_file!r}: "
                          f"{exc}") from None
    for number, raw in enumerate(lines, 1):
        parts = raw.split()
        # '#' is also a z85 character: a key line is one whose first word has key length.
        if not parts or (parts[0].startswith("#") and len(parts[0]) != KEY_CHARS):
            continue
        if len(parts) > 2 and parts[2].startswith("#"):
            parts = parts[:2]
        key = parts[0].encode()
        if len(key) != KEY_CHARS or len(parts) != 2 or not _valid_z85(key) \
                or not _host_port(parts[1]):
            raise ConfigError(f"curve_allowed_keys_file: line {number} of {allowed_file!r} is "
                              "not '<40-character z85 public key> <host:port>'")
        if parts[1] in by_address and by_address[parts[1]] != key:
            raise ConfigError(f"curve_allowed_keys_file: line {number} of {allowed_file!r}: "
                              f"{parts[1]} has another key already")
        by_address[parts[1]] = key
        address_of[key] = parts[1]
    return by_address, address_of


def _valid_z85(key: bytes) -> bool:
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError):
        return False


def _host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def zap_answer(frames: Sequence[bytes], keys: CurveKeys,
               refused: Callable[[str, str], None]) -> list[bytes]:
    """libzmq's authentication request (ZAP, RFC 27) -> the reply: 200 with the peer's
    z85 public key as its user id when the key is on the allow-list, 400 otherwise
    (``refused(peer ip, why)`` is called)."""
    if len(frames) < 6:
        refused("?", "malformed ZAP request")
        return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500",
                b"malformed ZAP request", b"", b""]
    version, request_id, _domain, address, _identity, mechanism = frames[:6]
    peer = address.decode(errors="replace")
    if mechanism == b"CURVE" and len(frames) == 7 and len(frames[6]) == 32:
        client_key = z85.encode(frames[6])
        if client_key in keys.address_of:
            return [version, request_id, b"200", b"OK", client_key, b""]
        why = "public key not in curve_allowed_keys_file"
    else:
        why = f"mechanism {mechanism.decode(errors='replace')} not accepted"
    refused(peer, why)
    return [version, request_id, b"400", why.encode(), b"", b""]


class KeyFileExists(FileExistsError):
    """``write_keys`` found a key file of that name already: it overwrites no key."""


def write_keys(directory: str, name: str) -> tuple[str, str, str]:
    """Create ``NAME.key`` and ``NAME.key_secret`` (mode 0600) in ``directory`` (made if
    missing: mode 0750, group ``kvd`` where there is one, as docs/operations.md sets up
    /etc/kvd); returns both absolute paths and the public key (z85). Raises
    :class:`KeyFileExists`, writing nothing, if either file is there. The files are
    ZeroMQ's certificate format (``zmq.auth.load_certificate`` reads them)."""
    directory = os.path.abspath(directory)
    found = [path for path in (os.path.join(directory, name + suffix)
                               for suffix in (".key", ".key_secret"))
             if os.path.lexists(path)]
    if found:
        raise KeyFileExists(
            f"{' and '.join(found)} {'exists' if len(found) == 1 else 'exist'}: not "
            f"overwriting a key. To keep it, use it as it is; to replace it, remove "
            f"{name}.key and {name}.key_secret first (and update the allow-lists that name "
            f"its public key); or choose another --name or --dir")
    if not os.path.isdir(directory):
        os.makedirs(directory)
        os.chmod(directory, 0o750)
        with contextlib.suppress(KeyError, OSError):  # (no such group, or not ours to give)
            os.chown(directory, -1, grp.getgrnam("kvd").gr_gid)
    public, secret = (key.decode() for key in zmq.curve_keypair())
    made = f"made by kvd keygen on {datetime.date.today()}"
    paths = [os.path.join(directory, name + suffix) for suffix in (".key", ".key_secret")]
    for path, mode, about, keys in (
            (paths[1], 0o600, f"kvd secret key, {made}: the curve_secret_key_file of one "
                              "daemon, readable by its user alone",
             f'    public-key = "{public}"\n    secret-key = "{secret}"\n'),
            (paths[0], 0o644, f"kvd public key, {made}: its line on the allow-list "
                              "(curve_allowed_keys_file) is '<public-key> HOST:PORT'",
             f'    public-key = "{public}"\n')):
        # Made with its mode before the key goes in: no moment where others read a secret.
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
            f.write(f"#   {about}\n\nmetadata\ncurve\n{keys}")
    return paths[0], paths[1], public


# --------------------------------------------------------------------------- data TLS


@dataclass(frozen=True)
class DataTls:
    """This daemon's TLS identity for data connections, made at start."""

    server: ssl.SSLContext  # for data connections peers open to us
    client: ssl.SSLContext  # for ours (the peer's certificate is checked by fingerprint)
    fingerprint: bytes  # SHA-256 of our certificate (DER), told to peers in the handshake


def write_self_signed(path: str, name: str, days: int = 3650) -> bytes:
    """A fresh self-signed certificate (EC P-256) and its key, written to a new file
    ``path`` (mode 0600, PEM: what ``SSLContext.load_cert_chain`` reads); returns the
    certificate's SHA-256 fingerprint (of its DER form), which peers pin."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .sign(key, hashes.SHA256())
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


def make_data_tls() -> DataTls:
    """A fresh self-signed certificate and the contexts that use it."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    # ssl loads a key only from a file: a private one, removed at once.
    with tempfile.TemporaryDirectory(prefix="kvd-tls-") as tmp:
        path = os.path.join(tmp, "data.pem")
        fingerprint = write_self_signed(path, "kvd data")
        server.load_cert_chain(path)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE  # pinned by fingerprint after the handshake
    return DataTls(server=server, client=client, fingerprint=fingerprint)


def fingerprint_of(sock: ssl.SSLSocket) -> bytes:
    """SHA-256 of the certificate the other end of ``sock`` presented (b"" if none)."""
    der = sock.getpeercert(binary_form=True)
    return hashlib.sha256(der).digest() if der else b""
