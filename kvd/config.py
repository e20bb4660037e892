"""Typed, frozen daemon configuration: operator settings, and development settings apart.

Every setting is one field of :class:`Config`; the field's metadata says how to parse it
(kvd/settings_values.py), how to check it, and what it is for, in one line: ``kvd serve``'s
flags and docs/operations.md's table are made from it (:func:`add_config_arguments`,
:func:`operator_settings_markdown`). Adding a setting is one line in ``Config``.

**Operator settings** are what an operator decides: addresses, sizes of the memory given to
the daemon, keys, timeouts and bounds, the log level. Precedence, lowest first: built-in
defaults < TOML file (flat keys; ``config_file=``, ``--config``, else ``KVD_CONFIG``) <
``KVD_<KEY>`` environment < ``--<key>`` flags (docs/operations.md, "The config file", says
what each accepts). A ``KVD_*`` variable close to a setting's name (a typo), or naming one
that is gone, is an error; one like none is another program's, ignored with a warning. A
client command reads only the socket path, with the same precedence
(:func:`client_socket_path`).

**Development settings** (chunk sizes, code-path switches) are for measuring the daemon,
not for operators: none is a config key, a ``KVD_<KEY>`` variable or a flag (each of those
is refused with a pointer here). They come from one place, the ``KVD_DEV`` environment
variable: ``key=value`` items separated by commas, read with the same parsers and checks,
e.g. ``KVD_DEV=nccl_eager=false,nccl_chunk_bytes=64MiB``. Code that builds a ``Config``
itself (a test) may ``dataclasses.replace`` them.

Errors are one-line :class:`~kvd.errors.ConfigError`\\ s naming the key and the source, e.g.
``http_port: expected an integer, got 'abc' (from flag --http-port)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvd.errors import ConfigError
from kvd.settings_socket import (
    MAX_SOCKET_PATH_BYTES,
    SOCKET_PATH,
    default_socket_path,
    fallback_socket_dir,
    socket_dir_problem,
    socket_path_problem,
)
from kvd.settings_values import (
    BOOL,
    BOOLEANS_IN_WORDS,
    INT,
    NO_WHITESPACE,
    NON_EMPTY,
    PORT,
    POSITIVE,
    POWER_OF_TWO,
    SECONDS,
    SIZE,
    SIZES_IN_WORDS,
    STR,
    Check,
    GiB,
    InvalidValue,
    KiB,
    Kind,
    MiB,
    Spec,
    at_least,
    format_size,
    one_of,
    parse_size,
)
from kvd.timeline import ENV as TIMELINE_ENV

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

log = logging.getLogger(__name__)

__all__ = ["CONFIG_ENV", "DEVELOPMENT_SETTINGS", "DEV_ENV", "ENV_PREFIX", "MAX_SOCKET_PATH_BYTES",
           "OPERATOR_SETTINGS", "Config", "add_config_arguments", "check_socket_path",
           "client_socket_path", "config_from_args", "default_socket_path",
           "development_overrides", "fallback_socket_dir", "format_size", "load_config",
           "operator_settings_markdown", "parse_size", "settings_from_args",
           "socket_dir_problem"]

ENV_PREFIX = "KVD_"
CONFIG_ENV = "KVD_CONFIG"
DEV_ENV = "KVD_DEV"
# KVD_* variables that are not settings of their own (everything else with the prefix is a
# typo). KVD_TIMELINE_DIR is read by kvd/timeline.py itself, at daemon start: the marks are a
# development aid, not a setting.
_ENV_NON_FIELDS = frozenset({CONFIG_ENV, DEV_ENV, TIMELINE_ENV})

LOG_LEVELS = ("debug", "info", "warning", "error")


# --------------------------------------------------------------------------- the fields

_META = "kvd"


def _opt(default: Any, kind: Kind, *checks: Check, help: str, allowed: str = "",
         metavar: str = "", shown: str = "") -> Any:
    """An operator setting with a fixed default (``shown``: what an empty one means)."""
    return field(default=default,
                 metadata={_META: Spec(kind, checks, help, allowed=allowed, metavar=metavar,
                                       default_text=shown)})


def _computed(fn: Callable[[Mapping[str, str]], Any], shown: str, kind: Kind, *checks: Check,
              help: str, allowed: str = "", metavar: str = "") -> Any:
    """An operator setting whose default is computed from the environment when the config is
    loaded (``shown``: that default in words)."""
    return field(
        default_factory=lambda: fn(os.environ),
        metadata={_META: Spec(kind, checks, help, default_from_env=fn, default_text=shown,
                               allowed=allowed, metavar=metavar)},
    )


def _dev(default: Any, kind: Kind, *checks: Check, help: str) -> Any:
    """A development setting: set only through ``KVD_DEV``."""
    return field(default=default, metadata={_META: Spec(kind, checks, help, dev=True)})


def _default_node_id(env: Mapping[str, str]) -> str:
    return socket.gethostname()


_A_FILE = "a file path, or empty"


@dataclass(frozen=True)
class Config:
    """Every daemon setting. Build it with :func:`load_config`; values are checked on
    construction, so ``dataclasses.replace(cfg, http_port=-1)`` raises too."""

    # ---- addresses
    socket_path: str = _computed(
        default_socket_path, "$XDG_RUNTIME_DIR/kvd/kvd.sock, else /tmp/kvd-UID/kvd.sock",
        STR, NON_EMPTY, SOCKET_PATH,
        help="local clients' socket (mode 0660); no other user may write to its directory")
    node_id: str = _computed(
        _default_node_id, "the host name", STR, NON_EMPTY, NO_WHITESPACE,
        help="this daemon's name in peers' logs, metrics and `kvd peers`; unique in the "
             "cluster", allowed="text without whitespace", metavar="NAME")
    peer_host: str = _opt("127.0.0.1", STR, NON_EMPTY, allowed="a host name or IP address",
                          metavar="HOST", help="where the peer and data ports listen")
    peer_port: int = _opt(14579, INT, PORT, help="peers' control connections (ZeroMQ)")
    data_port: int = _opt(14580, INT, PORT,
                          help="peers' data connections (host-memory bytes, TCP)")
    advertise_host: str = _opt("", STR, allowed="a host name or IP address, or empty",
                               metavar="HOST", shown="none (peer_host is told)",
                               help="the host peers are told to use, when not peer_host")
    peers: str = _opt("", STR, allowed="host:port items separated by commas, or empty",
                      metavar="HOST:PORT,...", shown="none",
                      help="peers kept linked from the start; /readyz waits for them")
    http_host: str = _opt("127.0.0.1", STR, NON_EMPTY, allowed="a host name or IP address",
                          metavar="HOST",
                          help="where /metrics, /healthz, /readyz and /v1/* listen "
                               "(no authentication)")
    http_port: int = _opt(9400, INT, PORT, help="the HTTP port")
    # ---- keys
    curve_secret_key_file: str = _opt(
        "", STR, allowed=_A_FILE, metavar="FILE", shown="none (peers are not authenticated)",
        help="this daemon's CurveZMQ secret key (from `kvd keygen`); set with "
             "curve_allowed_keys_file, or neither")
    curve_allowed_keys_file: str = _opt(
        "", STR, allowed=_A_FILE, metavar="FILE", shown="none (peers are not authenticated)",
        help="the daemons this one talks to: one line each, its public key and host:port")
    encrypt_data: bool = _opt(True, BOOL,
                              help="with CurveZMQ keys, TLS on the data connections; the "
                                   "same on every daemon (NCCL is never encrypted)")
    allow_unauthenticated_peers: bool = _opt(
        False, BOOL,
        help="start with peer_host off loopback and no CurveZMQ keys (anyone who reaches "
             "the peer port can then link and move data): a fully trusted network only")
    # ---- memory given to the daemon
    pool_size_bytes: int = _opt(1 * GiB, SIZE,
                                help="host memory pool for keys and early arrivals, taken "
                                     "at start")
    nccl: bool = _opt(True, BOOL,
                      help="move GPU memory between daemons over NCCL when both have GPUs "
                           "and nccl4py (false: GPU memory does not leave this node)")
    gpu_staging_bytes: int = _opt(1 * GiB, SIZE,
                                  help="per GPU, taken at start: NCCL arrivals nobody waits "
                                       "for yet (0: none, they go to the host pool)")
    nccl_channel_memory_bytes: int = _opt(
        2 * GiB, SIZE, help="per GPU, the memory NCCL channels may hold: ~34 MiB each, plus "
                            "its staging once used (up to 256 MiB); past it the least "
                            "recently used idle one is closed")
    # ---- bounds on what clients and peers may ask for
    max_message_bytes: int = _opt(1 * MiB, SIZE, at_least(4096, "4KiB"),
                                  help="the longest request a local client may send")
    max_ttl_s: float = _opt(86400.0, SECONDS, POSITIVE,
                            help="the longest time to live a client may give a key")
    put_ttl_s: float = _opt(300.0, SECONDS, POSITIVE,
                            help="how long data put before anyone asked for it is kept")
    max_wait_s: float = _opt(3600.0, SECONDS, POSITIVE,
                             help="the longest timeout a client may give a request")
    max_peer_links: int = _opt(1024, INT, at_least(1),
                               help="links to other daemons, ours and theirs together; a new "
                                    "one at the bound closes the least recently used idle "
                                    "one (each holds a connection and a descriptor or two)")
    max_waiting_pulls: int = _opt(4096, INT, at_least(0),
                                  help="peers' pulls held until their key appears; past it "
                                       "(or at 0) refused at once, and the puller asks again")
    # ---- timeouts
    heartbeat_interval_s: float = _opt(1.0, SECONDS, POSITIVE,
                                       help="a peer link in use sends a heartbeat this often "
                                            "(idle ones are probed by TCP keepalives)")
    peer_grace_s: float = _opt(3.0, SECONDS, POSITIVE,
                               help="a peer silent this long is dead and its transfers fail "
                                    "(keep it >= 2 x heartbeat_interval_s)")
    peer_connect_timeout_s: float = _opt(5.0, SECONDS, POSITIVE,
                                         help="a peer connection or handshake not done by "
                                              "then fails")
    peer_data_idle_s: float = _opt(60.0, SECONDS, POSITIVE,
                                   help="a data connection unused this long is closed (the "
                                        "next transfer opens another)")
    nccl_init_timeout_s: float = _opt(30.0, SECONDS, POSITIVE,
                                      help="an NCCL communicator not up by then is aborted")
    drain_grace_s: float = _opt(30.0, SECONDS, at_least(0),
                                help="on SIGTERM or `kvd drain`, how long in-flight work may "
                                     "finish before it is cancelled")
    log_level: str = _opt("info", STR, one_of(*LOG_LEVELS),
                          help="the least severe log lines written (to stderr)")

    # ---- development settings (KVD_DEV only; docs/architecture.md)
    tcp_chunk_bytes: int = _dev(4 * MiB, SIZE, at_least(64 * KiB, "64KiB"),
                                help="bytes per chunk on a data connection")
    nccl_chunk_bytes: int = _dev(128 * MiB, SIZE, at_least(1 * MiB, "1MiB"),
                                 help="NCCL message size for gathered blocks (two staging "
                                      "buffers of it per channel)")
    # When a peer link comes up, make the channels from its GPUs to ours now (NCCL init and
    # connection setup, ~0.5-0.7 s) instead of in its first transfer: "matching" pairs our
    # cuda:N with its cuda:N, "all" every pair (within nccl_channel_memory_bytes), "off" none.
    nccl_warm_up: str = _dev("matching", STR, one_of("off", "matching", "all"),
                             help="channels made when a peer links")
    # Send GPU blocks over NCCL together with their OFFER when a channel to the peer exists
    # (the receiver always posts the matching receive): no ACCEPT round trip before the bytes.
    nccl_eager: bool = _dev(True, BOOL, help="GPU blocks go out with their offer")
    # Make each channel's calls on a blocking communicator split from the non-blocking one
    # (kvd/transport/nccl.py): ~110 us less per NCCL call; its connection is set up at
    # once, under a watchdog. Off: every call non-blocking, polled until accepted.
    nccl_blocking_calls: bool = _dev(True, BOOL,
                                     help="NCCL calls on a blocking split communicator")
    pool_min_block_bytes: int = _dev(4096, SIZE, at_least(64), POWER_OF_TWO,
                                     help="the host pool's and GPU staging's smallest block")
    pool_prefault: bool = _dev(True, BOOL,
                               help="touch every pool page at start, not on first use")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            try:
                value = _spec(f).from_value(getattr(self, f.name))
            except InvalidValue as exc:
                raise ConfigError(f"{f.name}: {exc}") from None
            object.__setattr__(self, f.name, value)

    def as_dict(self) -> dict[str, Any]:
        """Field name -> value (plain Python types, JSON-serialisable)."""
        return dataclasses.asdict(self)


def _spec(f: dataclasses.Field[Any]) -> Spec:
    spec: Spec = f.metadata[_META]
    return spec


_FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}
_OPERATOR = {name: f for name, f in _FIELDS.items() if not _spec(f).dev}
_DEVELOPMENT = {name: f for name, f in _FIELDS.items() if _spec(f).dev}
OPERATOR_SETTINGS = frozenset(_OPERATOR)
DEVELOPMENT_SETTINGS = frozenset(_DEVELOPMENT)


def development_overrides(config: Config) -> dict[str, Any]:
    """The development settings of ``config`` that differ from their defaults (what a
    daemon should log at start: a measurement, not an operator's configuration)."""
    return {name: getattr(config, name) for name, f in _DEVELOPMENT.items()
            if getattr(config, name) != f.default}


# --------------------------------------------------------------------------- helpers


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _closest(word: str, names: list[str]) -> list[str]:
    """The real names ``word`` most likely misspells: those it begins (a word of three
    characters or more, at most three names), else those most alike (difflib's ratio, at
    least 0.6), else none."""
    if len(word) >= 3:
        starting = [name for name in names if name.startswith(word)]
        if 0 < len(starting) <= 3:
            return starting
    scores = {name: difflib.SequenceMatcher(None, word, name).ratio() for name in names}
    best = max(scores.values(), default=0.0)
    return [name for name, score in scores.items() if score == best] if best >= 0.6 else []


def _did_you_mean(choices: list[str]) -> str:
    if not choices:
        return ""
    either = choices[0] if len(choices) == 1 else \
        f"{', '.join(choices[:-1])} or {choices[-1]}"
    return f"; did you mean {either}?"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _default_text(f: dataclasses.Field[Any]) -> str:
    spec = _spec(f)
    value: Any = f.default
    if spec.default_text:
        return spec.default_text
    if spec.kind is SIZE:
        return format_size(value)
    if spec.kind is BOOL:
        return str(value).lower()
    if spec.kind is SECONDS:
        return f"{value:g}"
    return str(value)


# Settings that are gone: what to do instead ("use KEY ..." names the one that replaced it).
_REMOVED = {
    "tls_cert_file": "use curve_secret_key_file (the peer plane uses CurveZMQ; kvd keygen "
                     "writes the key pair)",
    "tls_key_file": "use curve_secret_key_file (the peer plane uses CurveZMQ; kvd keygen "
                    "writes the key pair)",
    "tls_allowed_certs_file": "use curve_allowed_keys_file (one '<public key> <host:port>' "
                              "line per daemon)",
    "tls_data": "use encrypt_data",
    "pool_pin": "remove it: the host pool is pinned where the daemon sees a GPU",
    "nccl_max_channels": "use nccl_channel_memory_bytes (the GPU memory NCCL channels may "
                         "hold, per GPU; docs/operations.md, \"A fleet\", gives a channel's "
                         "cost)",
}
# Development settings that are gone (``KVD_DEV`` items), and what is there instead.
_DEV_REMOVED = {
    "nccl_inline": "NCCL jobs run on their channel's worker thread only",
    "busy_poll": "the loop spins where the daemon sees a GPU, and not elsewhere",
    "busy_poll_window_s": "the loop spins for a fixed window (kvd/daemon/service.py)",
    "timeline_dir": f"set {TIMELINE_ENV}=DIR in the daemon's environment (kvd/timeline.py)",
}


def _gone(key: str, source: str, var: str = "") -> ConfigError:
    """Setting ``key`` is gone (read from ``source``; ``var``: as that variable)."""
    advice = _REMOVED[key]
    replacement = advice.split()[1] if advice.startswith("use ") else ""
    if var and replacement in _FIELDS:
        advice = f"use {_env_var(replacement)} ({replacement}){advice[4 + len(replacement):]}"
    return ConfigError(f"{var or repr(key)} (from {'env' if var else source}) is gone: {advice}")


def _development_setting(key: str, source: str) -> ConfigError:
    return ConfigError(
        f"{key!r} (from {source}) is a development setting, not an operator one: for a "
        f"measurement set {DEV_ENV}={key}=VALUE (docs/architecture.md, development settings)")


def _operator_spec(key: str, source: str) -> Spec:
    """The spec of operator setting ``key`` from ``source`` (a file, a flag); anything else
    raises, with a pointer for a development setting or one that is gone."""
    if key in _OPERATOR:
        return _spec(_OPERATOR[key])
    if key in _DEVELOPMENT:
        raise _development_setting(key, source)
    if key in _REMOVED:
        raise _gone(key, source)
    suggestion = _did_you_mean([repr(name) for name in _closest(key, list(_OPERATOR))])
    raise ConfigError(f"unknown key {key!r} (from {source}){suggestion}")


def _parse(name: str, source: str, parse: Callable[[Any], Any], raw: Any) -> Any:
    try:
        return parse(raw)
    except InvalidValue as exc:
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
    """ConfigError unless the daemon could bind ``config.socket_path``
    (``socket_path_problem``). :func:`load_config` checks it unless ``check_paths=False``."""
    problem = socket_path_problem(config.socket_path)
    if problem:
        raise ConfigError(f"socket_path: {problem}")


# --------------------------------------------------------------------------- loading


def load_config(*, config_file: str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, object] | None = None, check_paths: bool = True
                ) -> Config:
    """Build a Config (module doc). ``overrides`` are flag values keyed by field name
    (``None``: unset; strings are parsed like env values, other values must have the field's
    type); ``env`` defaults to ``os.environ``. With ``check_paths`` the socket path must be
    usable by this process (:func:`check_socket_path`); clients that only connect pass False.
    """
    return _load(config_file, "", env, overrides or {}, check_paths)[0]


def _from_file(config_file: str, origin: str) -> dict[str, tuple[Any, str]]:
    source = f"file {config_file}"
    return {key: (_parse(key, source, _operator_spec(key, source).from_value, raw), source)
            for key, raw in _read_toml(config_file, origin).items()}


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    values: dict[str, tuple[Any, str]] = {}
    env_names = {_env_var(name): name for name in _OPERATOR}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in _ENV_NON_FIELDS:
            continue
        source = f"env {var}"
        key = var[len(ENV_PREFIX):].lower()
        if var not in env_names:
            if key in _DEVELOPMENT:
                raise _development_setting(key, source)
            if key in _REMOVED:
                raise _gone(key, source, var)
            if key in _DEV_REMOVED:
                raise ConfigError(f"{var} (from env) is gone: {_DEV_REMOVED[key]}")
            # (matched without the prefix, which every name shares)
            suggestion = _did_you_mean([_env_var(name) for name in _closest(key, list(_OPERATOR))])
            if not suggestion:  # like no setting of ours: another program's variable
                log.warning("ignoring %s (from env): not a kvd setting", var)
                continue
            raise ConfigError(f"unknown variable {var} (from env){suggestion}")
        values[key] = (_parse(key, source, _spec(_OPERATOR[key]).from_text, env[var]), source)
    return values


def _from_overrides(overrides: Mapping[str, object]) -> dict[str, tuple[Any, str]]:
    values: dict[str, tuple[Any, str]] = {}
    for key, raw in overrides.items():
        if raw is None:
            continue
        source = f"flag {_flag(key)}" if key in _FIELDS else "overrides"
        spec = _operator_spec(key, source)
        parse = spec.from_text if isinstance(raw, str) else spec.from_value
        values[key] = (_parse(key, source, parse, raw), source)
    return values


def _from_dev_env(text: str) -> dict[str, tuple[Any, str]]:
    """``KVD_DEV``'s ``key=value,key=value`` items: development settings only."""
    source = f"env {DEV_ENV}"
    values: dict[str, tuple[Any, str]] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, equals, raw = (part.strip() for part in item.partition("="))
        if not equals or not key:
            raise ConfigError(f"{DEV_ENV}: expected key=value items separated by commas, "
                              f"got {item.strip()!r}")
        if key in _OPERATOR:
            raise ConfigError(f"{key!r} (from {source}) is an operator setting: set it with "
                              f"{_env_var(key)}, {_flag(key)} or the config file")
        if key in _DEV_REMOVED:
            raise ConfigError(f"{key!r} (from {source}) is gone: {_DEV_REMOVED[key]}")
        if key not in _DEVELOPMENT:
            hint = difflib.get_close_matches(key, list(_DEVELOPMENT), n=1)
            suggestion = (f"; did you mean {hint[0]!r}?" if hint else
                          f"; there are {', '.join(_DEVELOPMENT)}")
            raise ConfigError(f"unknown development setting {key!r} (from {source}){suggestion}")
        if key in values:
            raise ConfigError(f"{key!r} is set twice (from {source})")
        values[key] = (_parse(key, source, _spec(_DEVELOPMENT[key]).from_text, raw), source)
    return values


def _load(config_file: str | None, file_origin: str, env: Mapping[str, str] | None,
          overrides: Mapping[str, object], check_paths: bool) -> tuple[Config, dict[str, str]]:
    """The config, and where each setting not at its fixed default came from."""
    env = os.environ if env is None else env
    if config_file is None and env.get(CONFIG_ENV):
        config_file, file_origin = env[CONFIG_ENV], f" (from env {CONFIG_ENV})"
    found: dict[str, tuple[Any, str]] = {}  # key -> (value, source); later sources win
    if config_file is not None:
        found.update(_from_file(config_file, file_origin))
    found.update(_from_env(env))
    found.update(_from_overrides(overrides))
    found.update(_from_dev_env(env.get(DEV_ENV, "")))
    for key, f in _FIELDS.items():
        spec = _spec(f)
        if key not in found and spec.default_from_env is not None:
            default = spec.default_from_env(env)
            found[key] = (_parse(key, "default", spec.from_value, default), "default")

    config = Config(**{key: value for key, (value, _source) in found.items()})
    if check_paths:
        problem = socket_path_problem(config.socket_path)
        if problem:
            source = found["socket_path"][1]
            raise ConfigError(f"socket_path: {problem} (from {source})")
    return config, {key: source for key, (_value, source) in found.items()}


# --------------------------------------------------------------------------- for the CLI and docs


def client_socket_path(flag: str | None, config_file: str | None = None,
                       env: Mapping[str, str] | None = None) -> str:
    """The socket a client command (``kvd ping``, ``status``, ...) connects to: ``flag``
    (``--socket-path``), else ``KVD_SOCKET_PATH``, else ``socket_path`` in the config file
    (``config_file``, else ``$KVD_CONFIG``), else the default. Nothing else is read: the
    daemon's other settings, in the environment or the file, are not a client's business,
    and a stray or misspelt one does not stop a client."""
    env = os.environ if env is None else env
    spec = _spec(_FIELDS["socket_path"])
    var = _env_var("socket_path")
    if flag is not None:
        return str(_parse("socket_path", "flag --socket-path", spec.from_text, flag))
    if var in env:
        return str(_parse("socket_path", f"env {var}", spec.from_text, env[var]))
    origin = " (from flag --config)"
    if config_file is None and env.get(CONFIG_ENV):
        config_file, origin = env[CONFIG_ENV], f" (from env {CONFIG_ENV})"
    if config_file is not None:
        table = _read_toml(config_file, origin)
        if "socket_path" in table:
            return str(_parse("socket_path", f"file {config_file}", spec.from_value,
                              table["socket_path"]))
    return str(_parse("socket_path", "default", spec.from_value, default_socket_path(env)))


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None, *,
                     check_paths: bool = True) -> Config:
    """Load the config for a namespace parsed with :func:`add_config_arguments`."""
    return settings_from_args(args, env, check_paths=check_paths)[0]


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None, *,
                       check_paths: bool = True) -> tuple[Config, dict[str, str]]:
    """:func:`config_from_args`, and where each setting came from (``file PATH``, ``env
    VAR``, ``flag --name``; a setting not named is at its default)."""
    config_file = getattr(args, "config", None)
    origin = " (from flag --config)" if config_file is not None else ""
    flags = {name: getattr(args, name, None) for name in _FIELDS}
    return _load(config_file, origin, env, flags, check_paths)


def _help(name: str, f: dataclasses.Field[Any]) -> str:
    spec = _spec(f)
    return (f"{spec.help} [{spec.allowed_values()}; default {_default_text(f)}; "
            f"env {_env_var(name)}]").replace("%", "%%")  # (argparse formats help with %)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config PATH`` and one ``--<field-name>`` flag per operator setting (all default
    ``None``, taken as text and parsed like environment values). A development setting's
    flag is there but hidden, so that using it gets the pointer to ``KVD_DEV``."""
    group = parser.add_argument_group(
        "operator settings (flags > KVD_<KEY> env > config file > defaults)",
        f"Config-file keys are the flags' names with _; {SIZES_IN_WORDS}; "
        f"{BOOLEANS_IN_WORDS}.")
    group.add_argument("--config", metavar="PATH", default=None,
                       help=f"TOML config file, flat keys [env {CONFIG_ENV}]")
    for name, f in _FIELDS.items():
        spec = _spec(f)
        group.add_argument(_flag(name), dest=name, metavar=spec.value_name(), type=str,
                           default=None,
                           help=argparse.SUPPRESS if spec.dev else _help(name, f))


def operator_settings_markdown() -> str:
    """The operator settings as the Markdown table in docs/operations.md (a test keeps the
    two the same: regenerate it from here after changing a setting)."""
    rows = ["| key | allowed values | default | what it sets |", "| --- | --- | --- | --- |"]
    for name, f in _OPERATOR.items():
        spec = _spec(f)
        default = _default_text(f)
        if not spec.default_text:
            default = f"`{default}`"
        rows.append(f"| `{name}` | {spec.allowed_values()} | {default} | {spec.help} |")
    return "\n".join(rows) + "\n"
