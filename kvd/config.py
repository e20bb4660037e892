"""Typed, frozen daemon configuration.

Precedence, lowest first: built-in defaults < TOML file < ``KVD_*`` environment < CLI flags.

Every option is one field of :class:`Config`; the field's metadata says how to parse it
(string, integer, size, seconds, boolean) and how to check it. Adding an option is one line
in ``Config`` plus, if needed, one checker.

Sources
    * TOML file: flat keys (the field names) at the top level, no tables. The path comes from
      ``config_file=`` (``--config``) or, failing that, the ``KVD_CONFIG`` environment variable
      (an empty ``KVD_CONFIG`` counts as unset). TOML values must have the field's type: an
      integer for an integer, a number for seconds, a boolean for a boolean, a string for a
      string. Size fields (``*_bytes``) also take a size string such as ``"512MiB"``.
    * Environment: ``KVD_<FIELD_NAME_UPPER>``, e.g. ``KVD_POOL_SIZE_BYTES=2GiB``. Any other
      ``KVD_*`` variable except ``KVD_CONFIG`` is an error (it is almost always a typo).
    * CLI flags: ``--<field-name-with-dashes> VALUE``, parsed from text like the environment.

Text values
    * Sizes: a non-negative number with an optional unit, case-insensitive, optional spaces:
      ``B``; binary ``KiB MiB GiB TiB`` and bare ``K M G T`` (both 1024-based); decimal
      ``KB MB GB TB`` (1000-based). Fractions are allowed when the result is a whole number of
      bytes (``"1.5GiB"`` yes, ``"0.1KiB"`` no).
    * Booleans: ``true/false``, ``1/0``, ``yes/no``, ``on/off`` (case-insensitive).
    * Seconds: a finite float (``"30"``, ``"0.5"``).

Errors are one-line :class:`~kvd.errors.ConfigError`\\ s naming the key and the source, e.g.
``http_port: expected an integer, got 'abc' (from flag --http-port)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from kvd.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "MAX_SOCKET_PATH_BYTES",
    "Config",
    "add_config_arguments",
    "check_socket_path",
    "config_from_args",
    "fallback_socket_dir",
    "format_size",
    "load_config",
    "parse_size",
    "socket_dir_problem",
]

ENV_PREFIX = "KVD_"
CONFIG_ENV = "KVD_CONFIG"
# KVD_* variables that are not Config fields (everything else with the prefix is a typo).
_ENV_NON_FIELDS = frozenset({CONFIG_ENV})

# sun_path is 108 bytes with the NUL. Keep a margin.
MAX_SOCKET_PATH_BYTES = 100

LOG_LEVELS = ("debug", "info", "warning", "error")

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": 1024 * GiB,
    "tib": 1024 * GiB,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(r"\s*([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_INT_RE = re.compile(r"\s*[+-]?\d+\s*")
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


class _Invalid(Exception):
    """A value failed to parse or check; the message is the reason, without key or source."""


# --------------------------------------------------------------------------- value kinds


def _describe(value: object) -> str:
    """A short, one-line rendering of a bad value for an error message."""
    if isinstance(value, bool):
        text = f"boolean {str(value).lower()}"
    elif isinstance(value, str):
        text = repr(value)
    elif isinstance(value, (int, float)):
        text = f"{type(value).__name__} {value!r}"
    elif isinstance(value, list):
        text = f"array {value!r}"
    elif isinstance(value, dict):
        text = "table"
    else:
        text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= 80 else text[:77] + "..."


def _size_from_text(text: str) -> int:
    match = _SIZE_RE.fullmatch(text)
    if match is None or match.group(3).lower() not in _SIZE_UNITS:
        raise _Invalid(f"expected a size such as 4096, '64KiB', '1.5GiB' or '2GB', got {text!r}")
    sign, number, unit = match.groups()
    amount = Fraction(number) * _SIZE_UNITS[unit.lower()]
    if sign == "-" and amount != 0:
        raise _Invalid(f"must be >= 0, got {text.strip()}")
    if amount.denominator != 1:
        raise _Invalid(f"must be a whole number of bytes, got {text.strip()!r}")
    return int(amount)


def _size_from_value(value: object) -> int:
    if isinstance(value, str):
        return _size_from_text(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise _Invalid(f"must be >= 0, got {value}")
        return value
    raise _Invalid(f"expected an integer or a size string, got {_describe(value)}")


def _int_from_text(text: str) -> int:
    if _INT_RE.fullmatch(text) is None:
        raise _Invalid(f"expected an integer, got {text!r}")
    return int(text)


def _int_from_value(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _Invalid(f"expected an integer, got {_describe(value)}")


def _seconds(value: float) -> float:
    if not math.isfinite(value):
        raise _Invalid(f"expected a finite number of seconds, got {value}")
    return value


def _seconds_from_text(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _Invalid(f"expected a number of seconds, got {text!r}") from None
    return _seconds(value)


def _seconds_from_value(value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _seconds(float(value))
    raise _Invalid(f"expected a number of seconds, got {_describe(value)}")


def _bool_from_text(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise _Invalid(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {text!r}")


def _bool_from_value(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise _Invalid(f"expected a boolean, got {_describe(value)}")


def _str_from_text(text: str) -> str:
    return text


def _str_from_value(value: object) -> str:
    if isinstance(value, str):
        return value
    raise _Invalid(f"expected a string, got {_describe(value)}")


@dataclass(frozen=True)
class _Kind:
    """How one type of option is read: from text (env, CLI) and from a typed value (TOML)."""

    name: str
    from_text: Callable[[str], Any]
    from_value: Callable[[object], Any]


_STR = _Kind("string", _str_from_text, _str_from_value)
_INT = _Kind("integer", _int_from_text, _int_from_value)
_SIZE = _Kind("size", _size_from_text, _size_from_value)
_SECONDS = _Kind("seconds", _seconds_from_text, _seconds_from_value)
_BOOL = _Kind("boolean", _bool_from_text, _bool_from_value)


# --------------------------------------------------------------------------- checkers
# A checker takes the parsed value and returns it (possibly normalised) or raises _Invalid.

Check = Callable[[Any], Any]


def _at_least(low: float) -> Check:
    def check(value: Any) -> Any:
        if value < low:
            raise _Invalid(f"must be >= {low}, got {value}")
        return value

    return check


def _positive(value: Any) -> Any:
    if value <= 0:
        raise _Invalid(f"must be > 0, got {value}")
    return value


def _port(value: int) -> int:
    if not 0 <= value <= 65535:
        raise _Invalid(f"must be a port in 0..65535, got {value}")
    return value


def _power_of_two(value: int) -> int:
    if value <= 0 or value & (value - 1):
        raise _Invalid(f"must be a power of two, got {value}")
    return value


def _non_empty(value: str) -> str:
    if not value.strip():
        raise _Invalid("must not be empty")
    return value


def _no_whitespace(value: str) -> str:
    if any(ch.isspace() for ch in value):
        raise _Invalid(f"must not contain whitespace, got {value!r}")
    return value


def _log_level(value: str) -> str:
    level = value.strip().lower()
    if level not in LOG_LEVELS:
        raise _Invalid(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return level


def _one_of(*choices: str) -> Check:
    """A word from ``choices``, case-insensitive."""
    def check(value: str) -> str:
        choice = value.strip().lower()
        if choice not in choices:
            raise _Invalid(f"must be one of {', '.join(choices)}, got {value!r}")
        return choice
    return check


def _socket_path(value: str) -> str:
    """Make the path absolute (daemon and clients may run in different directories) and
    check that it fits in a Unix socket address."""
    path = os.path.abspath(value)
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise _Invalid(
            f"path {path!r} is {size} bytes, over the {MAX_SOCKET_PATH_BYTES}-byte limit "
            "for a Unix socket"
        )
    return path


# --------------------------------------------------------------------------- defaults


def default_socket_path(env: Mapping[str, str]) -> str:
    """Where a daemon listens by default: under $XDG_RUNTIME_DIR, else a per-user temp dir."""
    runtime_dir = env.get("XDG_RUNTIME_DIR", "")
    if runtime_dir and os.path.isabs(runtime_dir) and os.path.isdir(runtime_dir):
        return os.path.join(runtime_dir, "kvd", "kvd.sock")
    return os.path.join(fallback_socket_dir(), "kvd.sock")


def fallback_socket_dir() -> str:
    """The socket's directory without $XDG_RUNTIME_DIR: ``kvd-<uid>`` in the temporary
    directory, where any user can create it first (see :func:`socket_dir_problem`)."""
    return os.path.join(tempfile.gettempdir(), f"kvd-{os.getuid()}")


def socket_dir_problem(directory: str) -> str | None:
    """Why a daemon must not listen in ``directory``, an existing directory (None: it may).

    Whoever can change the socket's directory, or one above it, can move or replace the
    socket, and clients would then hand their tensors to whatever listens in its place. So
    the directory belongs to this user or to root, and not everyone may write to it; those
    above it belong to this user or root too, and are not writable by everyone unless
    sticky (as /tmp). The fallback directory (:func:`fallback_socket_dir`) is stricter: it
    is a real directory (no symbolic link), of this user, writable by it alone. Group
    write stays allowed elsewhere: an operator's directory may give the daemon's group
    that right on purpose.
    """
    euid = os.geteuid()
    if os.path.abspath(directory) == fallback_socket_dir():
        try:
            st = os.lstat(directory)
        except OSError as exc:
            return f"cannot inspect {directory!r}: {exc.strerror or exc}"
        fix = ("remove it, or set XDG_RUNTIME_DIR or socket_path to a directory of this "
               "user's")
        if not stat.S_ISDIR(st.st_mode):
            return f"{directory!r} is not a directory (a link, say): {fix}"
        if st.st_uid != euid:
            return (f"directory {directory!r} belongs to uid {st.st_uid}, not to this "
                    f"daemon's user (uid {euid}): that user could move or replace the "
                    f"socket; {fix}")
        if st.st_mode & 0o022:
            return (f"directory {directory!r} is writable by other users (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}): they could move or replace the "
                    f"socket; chmod go-w it, or {fix}")
    real = current = os.path.realpath(directory)
    while True:
        try:
            st = os.stat(current)
        except OSError as exc:
            return f"cannot inspect {current!r}: {exc.strerror or exc}"
        what = f"directory {current!r}" + ("" if current == real else
                                           " (above the socket's)")
        if st.st_uid not in (euid, 0):
            return (f"{what} belongs to uid {st.st_uid}, neither this daemon's user "
                    f"(uid {euid}) nor root: that user could move or replace the socket")
        if st.st_mode & stat.S_IWOTH and (current == real or not st.st_mode & stat.S_ISVTX):
            return (f"{what} is writable by every user (mode {stat.S_IMODE(st.st_mode):04o}): "
                    "anyone could move or replace the socket")
        up = os.path.dirname(current)
        if up == current:
            return None
        current = up


def _default_node_id(env: Mapping[str, str]) -> str:
    return socket.gethostname()


# --------------------------------------------------------------------------- the fields

_META = "kvd"


@dataclass(frozen=True)
class _Spec:
    kind: _Kind
    checks: tuple[Check, ...]
    default_from_env: Callable[[Mapping[str, str]], Any] | None = None

    def from_text(self, text: str) -> Any:
        return self._check(self.kind.from_text(text))

    def from_value(self, value: object) -> Any:
        return self._check(self.kind.from_value(value))

    def _check(self, value: Any) -> Any:
        for check in self.checks:
            value = check(value)
        return value


def _opt(default: Any, kind: _Kind, *checks: Check) -> Any:
    """A field with a fixed default."""
    return field(default=default, metadata={_META: _Spec(kind, checks)})


def _computed(fn: Callable[[Mapping[str, str]], Any], kind: _Kind, *checks: Check) -> Any:
    """A field whose default is computed from the environment when the config is loaded."""
    return field(
        default_factory=lambda: fn(os.environ),
        metadata={_META: _Spec(kind, checks, fn)},
    )


@dataclass(frozen=True)
class Config:
    """Every daemon option. Build it with :func:`load_config`; values are checked on
    construction, so ``dataclasses.replace(cfg, http_port=-1)`` raises too."""

    socket_path: str = _computed(default_socket_path, _STR, _non_empty, _socket_path)
    node_id: str = _computed(_default_node_id, _STR, _non_empty, _no_whitespace)
    peer_host: str = _opt("127.0.0.1", _STR, _non_empty)
    peer_port: int = _opt(14579, _INT, _port)
    data_port: int = _opt(14580, _INT, _port)
    advertise_host: str = _opt("", _STR)  # how peers reach us; empty: peer_host
    heartbeat_interval_s: float = _opt(1.0, _SECONDS, _positive)
    peer_grace_s: float = _opt(3.0, _SECONDS, _positive)
    peer_connect_timeout_s: float = _opt(5.0, _SECONDS, _positive)
    tcp_chunk_bytes: int = _opt(4 * MiB, _SIZE, _at_least(64 * KiB))
    nccl: bool = _opt(True, _BOOL)  # use NCCL between daemons when both have GPUs
    nccl_chunk_bytes: int = _opt(128 * MiB, _SIZE, _at_least(1 * MiB))
    nccl_max_channels: int = _opt(8, _INT, _at_least(1))  # communicators per GPU (LRU)
    nccl_init_timeout_s: float = _opt(30.0, _SECONDS, _positive)
    # When a peer link comes up, make the channels from its GPUs to ours now (NCCL init and
    # connection setup, ~0.5-0.7 s) instead of in its first transfer: "matching" pairs our
    # cuda:N with its cuda:N, "all" every pair (within nccl_max_channels), "off" none.
    nccl_warm_up: str = _opt("matching", _STR, _one_of("off", "matching", "all"))
    # Send GPU blocks over NCCL together with their OFFER when a channel to the peer exists
    # (the receiver always posts the matching receive): no ACCEPT round trip before the bytes.
    nccl_eager: bool = _opt(True, _BOOL)
    # Issue a transfer's NCCL calls from the event loop, and poll them there, when its
    # channel is idle and its blocks need no staging copy (see NcclChannel._start_inline):
    # two thread hand-offs fewer. Off: every job goes through the channel's thread.
    nccl_inline: bool = _opt(True, _BOOL)
    # Make each channel's calls on a blocking communicator split from the non-blocking one
    # (kvd/transport/nccl.py): ~110 us less per NCCL call; its connection is set up at
    # once, under a watchdog. Off: every call non-blocking, polled until accepted.
    nccl_blocking_calls: bool = _opt(True, _BOOL)
    gpu_staging_bytes: int = _opt(1 * GiB, _SIZE)  # per GPU: arrivals nobody waits for yet
    # Keep the event loop polling without sleeping for busy_poll_window_s after each
    # message (daemon/busy_poll.py): no wake-up per message, and a hot core. "auto": on
    # when the daemon sees a GPU (a node with cores to spare), off otherwise.
    busy_poll: str = _opt("auto", _STR, _one_of("auto", "on", "off"))
    busy_poll_window_s: float = _opt(0.02, _SECONDS, _at_least(0))
    # CurveZMQ on the peer plane (daemon/auth.py): this daemon's key pair, as kvd keygen
    # writes it (NAME.key_secret), and the allow-list of the daemons it talks to (one
    # "<public key> <host:port>" line each). Neither: the peer plane is open.
    curve_secret_key_file: str = _opt("", _STR)
    curve_allowed_keys_file: str = _opt("", _STR)
    # With CurveZMQ on, the TCP data connections (host memory) are TLS, pinned through the
    # CURVE-secured handshake; off: plain TCP (admitted by their token, not encrypted).
    # Without CurveZMQ they are plain. NCCL is never encrypted.
    encrypt_data: bool = _opt(True, _BOOL)
    peers: str = _opt("", _STR)  # comma-separated host:port kept linked; /readyz needs them
    http_host: str = _opt("127.0.0.1", _STR, _non_empty)
    http_port: int = _opt(9400, _INT, _port)
    pool_size_bytes: int = _opt(1 * GiB, _SIZE)
    pool_min_block_bytes: int = _opt(4096, _SIZE, _at_least(64), _power_of_two)
    pool_pin: bool = _opt(False, _BOOL)
    pool_prefault: bool = _opt(True, _BOOL)  # touch every page at start, not on first use
    drain_grace_s: float = _opt(30.0, _SECONDS, _at_least(0))
    max_ttl_s: float = _opt(86400.0, _SECONDS, _positive)
    put_ttl_s: float = _opt(300.0, _SECONDS, _positive)
    max_message_bytes: int = _opt(1 * MiB, _SIZE, _at_least(4096))
    max_wait_s: float = _opt(3600.0, _SECONDS, _positive)
    # Peers' pulls (wait_for_key_s) held at once until their key appears; past it, or at
    # 0, a pull of a key not here yet is refused at once and the puller asks again.
    max_waiting_pulls: int = _opt(4096, _INT, _at_least(0))
    log_level: str = _opt("info", _STR, _log_level)
    # A development aid: record timeline marks (kvd/timeline.py) and write them here on exit.
    timeline_dir: str = _opt("", _STR)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            try:
                value = _spec(f).from_value(getattr(self, f.name))
            except _Invalid as exc:
                raise ConfigError(f"{f.name}: {exc}") from None
            object.__setattr__(self, f.name, value)

    def as_dict(self) -> dict[str, Any]:
        """Field name -> value (plain Python types, JSON-serialisable)."""
        return dataclasses.asdict(self)


def _spec(f: dataclasses.Field[Any]) -> _Spec:
    spec: _Spec = f.metadata[_META]
    return spec


_FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}


# --------------------------------------------------------------------------- public helpers


def parse_size(text: str | int) -> int:
    """Parse a byte size: an int >= 0, or a string like ``"4096"``, ``"64KiB"``, ``"1.5GiB"``,
    ``"2GB"`` (decimal) or ``"512M"`` (bare letters are binary). Raises ConfigError."""
    try:
        return _size_from_value(text)
    except _Invalid as exc:
        raise ConfigError(str(exc)) from None


def format_size(size_bytes: int) -> str:
    """The shortest exact binary rendering: 1073741824 -> ``"1GiB"``, 1000 -> ``"1000"``."""
    for unit, factor in (("TiB", 1024 * GiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size_bytes and size_bytes % factor == 0:
            return f"{size_bytes // factor}{unit}"
    return str(size_bytes)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _one_line(text: str) -> str:
    return " ".join(text.split())


# Settings that are gone, and what replaced them.
_REMOVED = {
    "tls_cert_file": "curve_secret_key_file (the peer plane uses CurveZMQ; kvd keygen "
                     "writes the key pair)",
    "tls_key_file": "curve_secret_key_file (the peer plane uses CurveZMQ; kvd keygen "
                    "writes the key pair)",
    "tls_allowed_certs_file": "curve_allowed_keys_file (one '<public key> <host:port>' "
                              "line per daemon)",
    "tls_data": "encrypt_data",
}


def _unknown(key: str, source: str, candidates: list[str]) -> ConfigError:
    if key in _REMOVED:
        return ConfigError(f"{key!r} (from {source}) is gone: use {_REMOVED[key]}")
    hint = difflib.get_close_matches(key, candidates, n=1)
    suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
    return ConfigError(f"unknown key {key!r} (from {source}){suggestion}")


def _parse(name: str, source: str, parse: Callable[[Any], Any], raw: Any) -> Any:
    try:
        return parse(raw)
    except _Invalid as exc:
        raise ConfigError(f"{name}: {exc} (from {source})") from None


def _read_toml(path: str, origin: str) -> dict[str, Any]:
    where = f"config file {path!r}{origin}"
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text: {_one_line(str(exc))}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: invalid TOML: {_one_line(str(exc))}") from None


def check_socket_path(config: Config) -> None:
    """Raise ConfigError unless the daemon could bind ``config.socket_path``: its directory
    exists, is writable and no other user can replace the socket in it
    (:func:`socket_dir_problem`), or it can be created (the nearest existing ancestor is a
    writable directory). Creates nothing. :func:`load_config` runs this unless
    ``check_paths=False``."""
    problem = _socket_path_problem(config.socket_path)
    if problem:
        raise ConfigError(f"socket_path: {problem}")


def _writable_dir(path: str) -> bool:
    if os.access in os.supports_effective_ids:
        return os.access(path, os.W_OK | os.X_OK, effective_ids=True)
    return os.access(path, os.W_OK | os.X_OK)  # pragma: no cover


def _socket_path_problem(path: str) -> str | None:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass  # the walk below says which component is missing or in the way
    except OSError as exc:
        return f"cannot inspect {path!r}: {exc.strerror or exc}"
    else:
        if stat.S_ISDIR(st.st_mode):
            return f"{path!r} is a directory"
        if not stat.S_ISSOCK(st.st_mode):
            return f"{path!r} exists and is not a socket"
    parent = os.path.dirname(path)
    current = parent
    while True:
        if os.path.lexists(current):
            if not os.path.isdir(current):
                return f"{current!r} exists and is not a directory"
            if not _writable_dir(current):
                if current == parent:
                    return f"directory {current!r} is not writable"
                return f"cannot create directory {parent!r}: {current!r} is not writable"
            # (one still to create is checked once made: prepare_socket_dir)
            return socket_dir_problem(parent) if current == parent else None
        up = os.path.dirname(current)
        if up == current:  # pragma: no cover - the root always exists
            return f"no existing ancestor directory of {path!r}"
        current = up


# --------------------------------------------------------------------------- loading


def load_config(
    *,
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
    check_paths: bool = True,
) -> Config:
    """Build a Config: defaults < TOML file < ``KVD_*`` env < ``overrides`` (CLI values keyed by
    field name; ``None`` values are ignored; strings are parsed like env values, other values
    must have the field's type).

    The file is ``config_file``, else ``$KVD_CONFIG``, else none. ``env`` defaults to
    ``os.environ``. With ``check_paths`` (the default) the socket path must be usable by this
    process (see :func:`check_socket_path`); clients that only connect pass ``False``.
    """
    return _load(
        config_file=config_file,
        file_origin="",
        env=os.environ if env is None else env,
        overrides=overrides or {},
        check_paths=check_paths,
    )


def _load(
    *,
    config_file: str | None,
    file_origin: str,
    env: Mapping[str, str],
    overrides: Mapping[str, object],
    check_paths: bool,
) -> Config:
    names = list(_FIELDS)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    if config_file is None and env.get(CONFIG_ENV):
        config_file, file_origin = env[CONFIG_ENV], f" (from env {CONFIG_ENV})"
    if config_file is not None:
        source = f"file {config_file}"
        for key, raw in _read_toml(config_file, file_origin).items():
            if key not in _FIELDS:
                raise _unknown(key, source, names)
            spec = _spec(_FIELDS[key])
            values[key] = _parse(key, source, spec.from_value, raw)
            sources[key] = source

    env_names = {_env_var(name): name for name in names}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in _ENV_NON_FIELDS:
            continue
        source = f"env {var}"
        if var not in env_names:
            removed = var[len(ENV_PREFIX):].lower()
            if removed in _REMOVED:
                raise ConfigError(f"{var} (from env) is gone: use "
                                  f"{_env_var(_REMOVED[removed].split()[0])} "
                                  f"({_REMOVED[removed]})")
            hint = difflib.get_close_matches(var, list(env_names), n=1)
            suggestion = f"; did you mean {hint[0]}?" if hint else ""
            raise ConfigError(f"unknown variable {var} (from env){suggestion}")
        key, text = env_names[var], env[var]
        spec = _spec(_FIELDS[key])
        values[key] = _parse(key, source, spec.from_text, text)
        sources[key] = source

    for key, raw in overrides.items():
        if raw is None:
            continue
        if key not in _FIELDS:
            raise _unknown(key, "overrides", names)
        source = f"flag {_flag(key)}"
        spec = _spec(_FIELDS[key])
        if isinstance(raw, str):
            values[key] = _parse(key, source, spec.from_text, raw)
        else:
            values[key] = _parse(key, source, spec.from_value, raw)
        sources[key] = source

    for key, f in _FIELDS.items():
        spec = _spec(f)
        if key not in values and spec.default_from_env is not None:
            default = spec.default_from_env(env)
            values[key] = _parse(key, "default", spec.from_value, default)
            sources[key] = "default"

    config = Config(**values)
    if check_paths:
        problem = _socket_path_problem(config.socket_path)
        if problem:
            source = sources.get("socket_path", "default")
            raise ConfigError(f"socket_path: {problem} (from {source})")
    return config


# --------------------------------------------------------------------------- argparse


def _help(name: str, f: dataclasses.Field[Any]) -> str:
    spec = _spec(f)
    value: Any = f.default
    if spec.default_from_env is not None:
        default = "computed at start-up"
    elif spec.kind is _SIZE:
        default = format_size(value)
    elif spec.kind is _BOOL:
        default = str(value).lower()
    else:
        default = str(value)
    return f"{spec.kind.name}; default {default}; env {_env_var(name)}"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config PATH`` and one ``--<field-name>`` flag per Config field (all default
    ``None``, taken as text and parsed like environment values)."""
    group = parser.add_argument_group("configuration (flags > KVD_* env > config file)")
    group.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"TOML config file (flat keys); env {CONFIG_ENV}",
    )
    for name, f in _FIELDS.items():
        group.add_argument(
            _flag(name),
            dest=name,
            metavar=_spec(f).kind.name.upper(),
            type=str,
            default=None,
            help=_help(name, f),
        )


def config_from_args(
    args: argparse.Namespace,
    env: Mapping[str, str] | None = None,
    *,
    check_paths: bool = True,
) -> Config:
    """Load the config for a namespace parsed with :func:`add_config_arguments`."""
    config_file = getattr(args, "config", None)
    return _load(
        config_file=config_file,
        file_origin=" (from flag --config)" if config_file is not None else "",
        env=os.environ if env is None else env,
        overrides={name: getattr(args, name, None) for name in _FIELDS},
        check_paths=check_paths,
    )
