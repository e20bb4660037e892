"""TLS on the peer plane: this daemon's certificate, the peers it accepts, ``kvd keygen``.

Each daemon has a self-signed certificate and its private key (``kvd keygen`` makes both:
``NAME.crt``, ``NAME.key`` with mode 0600). ``tls_allowed_certs_file`` is a PEM bundle of
the certificates of the daemons it talks to (its own may be in it too: one bundle can
serve a whole cluster). Both ends of a peer connection present their certificate and
check the other's against the bundle (mutual TLS 1.3): a daemon whose certificate is not
in the bundle is refused, and counted in ``bad_messages["auth"]``. Certificates are pinned,
not named: there is no host name check, since peers are addressed by ``host:port``.

The data connections (host-memory bytes) are admitted by the per-link token handed out over
the authenticated handshake, and with ``tls_data`` (the default) are TLS with the same
contexts (``daemon/peers.py``). NCCL's connections are never encrypted.
"""

from __future__ import annotations

import datetime
import os
import ssl
from dataclasses import dataclass

from kvd.config import Config
from kvd.errors import ConfigError

_SETTINGS = ("tls_cert_file", "tls_key_file", "tls_allowed_certs_file")


@dataclass(frozen=True)
class TlsContexts:
    server: ssl.SSLContext  # for connections peers open to us
    client: ssl.SSLContext  # for connections we open


def load_tls(config: Config) -> TlsContexts | None:
    """The configured TLS contexts, or None when the peer plane runs without TLS."""
    values = {name: getattr(config, name) for name in _SETTINGS}
    if not any(values.values()):
        return None
    missing = [name for name, value in values.items() if not value]
    if missing:
        raise ConfigError(f"{missing[0]}: required with " + ", ".join(
            name for name, value in values.items() if value))
    return TlsContexts(server=_context(ssl.PROTOCOL_TLS_SERVER, **values),
                       client=_context(ssl.PROTOCOL_TLS_CLIENT, **values))


def _context(protocol: int, tls_cert_file: str, tls_key_file: str,
             tls_allowed_certs_file: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        ctx.load_cert_chain(tls_cert_file, tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert_file / tls_key_file: cannot load {tls_cert_file!r} with "
                          f"{tls_key_file!r}: {exc}") from None
    try:
        ctx.load_verify_locations(cafile=tls_allowed_certs_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_allowed_certs_file: cannot load {tls_allowed_certs_file!r}: "
                          f"{exc}") from None
    ctx.check_hostname = False  # pinned certificates, peers named by host:port
    ctx.verify_mode = ssl.CERT_REQUIRED
    # A peer's self-signed certificate in the bundle is trusted as it is (it is no CA).
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


def write_cert(directory: str, name: str, days: int = 3650) -> tuple[str, str]:
    """Create ``NAME.crt`` (self-signed, EC P-256) and ``NAME.key`` (mode 0600) in
    ``directory``; returns both paths. Needs the ``cryptography`` package."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ConfigError("kvd keygen needs the cryptography package: "
                          "pip install cryptography") from None
    cert_path = os.path.join(directory, name + ".crt")
    key_path = os.path.join(directory, name + ".key")
    for path in (cert_path, key_path):
        if os.path.exists(path):
            raise ConfigError(f"{path} exists; not overwriting a key")
    os.makedirs(directory, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvd {name}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path
