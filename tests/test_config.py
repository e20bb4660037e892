"""Tests for kvd.config: defaults, precedence, parsing, errors, argparse glue, and the
development settings kept apart from the operator's (KVD_DEV)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvd import KvdClient
from kvd.cli import build_parser
from kvd.config import (
    DEVELOPMENT_SETTINGS,
    MAX_SOCKET_PATH_BYTES,
    OPERATOR_SETTINGS,
    Config,
    add_config_arguments,
    check_socket_path,
    client_socket_path,
    config_from_args,
    development_overrides,
    format_size,
    load_config,
    operator_settings_markdown,
    parse_size,
)
from kvd.errors import ConfigError, KvdError
from tests.conftest import ProcessDaemon

REPO = Path(__file__).resolve().parent.parent

GiB = 1024**3
MiB = 1024**2


@pytest.fixture
def sock(tmp_path: Path) -> str:
    """A usable socket path (its directory does not exist yet but can be created)."""
    return str(tmp_path / "run" / "kvd.sock")


def load(
    sock: str,
    *,
    env: dict[str, str] | None = None,
    config_file: str | None = None,
    overrides: dict[str, object] | None = None,
) -> Config:
    """load_config with a usable socket path unless the env names one."""
    return load_config(
        config_file=config_file,
        env={"KVD_SOCKET_PATH": sock, **(env or {})},
        overrides=overrides,
    )


def config_error(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message, message
    return message


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- defaults


def test_defaults_with_xdg_runtime_dir(tmp_path: Path) -> None:
    cfg = load_config(env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert cfg.socket_path == str(tmp_path / "kvd" / "kvd.sock")
    assert not (tmp_path / "kvd").exists()  # nothing created
    assert cfg.node_id == socket.gethostname()
    assert cfg.as_dict() == {
        "socket_path": str(tmp_path / "kvd" / "kvd.sock"),
        "node_id": socket.gethostname(),
        "peer_host": "127.0.0.1",
        "peer_port": 14579,
        "http_host": "127.0.0.1",
        "http_port": 9400,
        "pool_size_bytes": GiB,
        "pool_min_block_bytes": 4096,
        "drain_grace_s": 30.0,
        "max_ttl_s": 86400.0,
        "put_ttl_s": 300.0,
        "data_port": 14580,
        "advertise_host": "",
        "heartbeat_interval_s": 1.0,
        "peer_grace_s": 3.0,
        "peer_connect_timeout_s": 5.0,
        "tcp_chunk_bytes": 4 * 2**20,
        "nccl": True,
        "nccl_chunk_bytes": 128 * 2**20,
        "nccl_channel_memory_bytes": 2 * 2**30,
        "nccl_init_timeout_s": 30.0,
        "nccl_warm_up": "matching",
        "nccl_eager": True,
        "nccl_blocking_calls": True,
        "gpu_staging_bytes": 2**30,
        "curve_secret_key_file": "",
        "curve_allowed_keys_file": "",
        "encrypt_data": True,
        "allow_unauthenticated_peers": False,
        "pool_prefault": True,
        "peers": "",
        "max_message_bytes": MiB,
        "max_wait_s": 3600.0,
        "max_waiting_pulls": 4096,
        "max_peer_links": 1024,
        "peer_data_idle_s": 60.0,
        "log_level": "info",
    }


@pytest.mark.parametrize("xdg", [None, "", "missing", "relative/dir", "file"])
def testdefault_socket_path_without_usable_xdg(tmp_path: Path, xdg: str | None) -> None:
    env: dict[str, str] = {}
    if xdg == "missing":
        env["XDG_RUNTIME_DIR"] = str(tmp_path / "nope")
    elif xdg == "file":
        env["XDG_RUNTIME_DIR"] = write(tmp_path / "f", "")
    elif xdg is not None:
        env["XDG_RUNTIME_DIR"] = xdg
    cfg = load_config(env=env)
    expected = os.path.join(tempfile.gettempdir(), f"kvd-{os.getuid()}", "kvd.sock")
    assert cfg.socket_path == expected


def test_default_is_computed_at_load_time(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert load_config(env={"XDG_RUNTIME_DIR": str(a)}).socket_path.startswith(str(a))
    assert load_config(env={"XDG_RUNTIME_DIR": str(b)}).socket_path.startswith(str(b))


def test_config_is_frozen(sock: str) -> None:
    cfg = load(sock)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.http_port = 1  # type: ignore[misc]


def test_direct_construction_is_validated(sock: str) -> None:
    cfg = load(sock)
    assert dataclasses.replace(cfg, log_level="DEBUG").log_level == "debug"
    with pytest.raises(ConfigError, match=r"^http_port: must be a port in 0\.\.65535"):
        dataclasses.replace(cfg, http_port=70000)


# --------------------------------------------------------------------------- precedence


def test_precedence_file_env_overrides(tmp_path: Path, sock: str) -> None:
    path = write(
        tmp_path / "kvd.toml",
        'http_port = 1001\npeer_port = 2001\nlog_level = "debug"\npool_size_bytes = "2GiB"\n',
    )
    env = {"KVD_PEER_PORT": "2002", "KVD_LOG_LEVEL": "warning", "KVD_SOCKET_PATH": sock}
    overrides = {"log_level": "error", "http_port": None}

    cfg = load_config(config_file=path, env=env, overrides=overrides)
    assert cfg.http_port == 1001  # file only (override None is ignored)
    assert cfg.peer_port == 2002  # env beats file
    assert cfg.log_level == "error"  # override beats env beats file
    assert cfg.pool_size_bytes == 2 * GiB  # file only
    assert cfg.max_wait_s == 3600.0  # default falls through
    assert cfg.socket_path == sock

    cfg = load_config(config_file=path, env=env, overrides={"peer_port": "3003"})
    assert cfg.peer_port == 3003
    assert cfg.log_level == "warning"


def test_config_file_from_kvd_config_env(tmp_path: Path, sock: str) -> None:
    path = write(tmp_path / "kvd.toml", "http_port = 1234\n")
    assert load(sock, env={"KVD_CONFIG": path}).http_port == 1234
    # an explicit config_file wins over KVD_CONFIG
    other = write(tmp_path / "other.toml", "http_port = 4321\n")
    assert load(sock, env={"KVD_CONFIG": path}, config_file=other).http_port == 4321
    # an empty KVD_CONFIG counts as unset
    assert load(sock, env={"KVD_CONFIG": ""}).http_port == 9400


def test_overrides_accept_typed_values(sock: str) -> None:
    cfg = load(
        sock,
        overrides={"http_port": 0, "encrypt_data": False, "max_ttl_s": 5,
                   "pool_size_bytes": 8192},
    )
    assert (cfg.http_port, cfg.encrypt_data, cfg.max_ttl_s, cfg.pool_size_bytes) == (
        0,
        False,
        5.0,
        8192,
    )
    assert isinstance(cfg.max_ttl_s, float)


def test_toml_types(tmp_path: Path, sock: str) -> None:
    path = write(
        tmp_path / "kvd.toml",
        "\n".join(
            [
                f'socket_path = "{sock}"',
                'node_id = "node-7"',
                "pool_size_bytes = 1_048_576",
                'gpu_staging_bytes = "64KiB"',
                "encrypt_data = false",
                "drain_grace_s = 0",
                "max_ttl_s = 1.5",
                'log_level = "WARNING"',
            ]
        ),
    )
    cfg = load_config(config_file=path, env={})
    assert cfg.node_id == "node-7"
    assert cfg.pool_size_bytes == MiB
    assert cfg.gpu_staging_bytes == 64 * 1024
    assert cfg.encrypt_data is False
    assert cfg.drain_grace_s == 0.0 and isinstance(cfg.drain_grace_s, float)
    assert cfg.max_ttl_s == 1.5
    assert cfg.log_level == "warning"


def test_relative_socket_path_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(env={"KVD_SOCKET_PATH": "kvd.sock"})
    assert cfg.socket_path == str(tmp_path / "kvd.sock")


# --------------------------------------------------------------------------- parsing tables


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        (4096, 4096),
        (0, 0),
        ("  4096  ", 4096),
        ("512B", 512),
        ("64KiB", 64 * 1024),
        ("64kib", 64 * 1024),
        ("64K", 64 * 1024),
        ("64k", 64 * 1024),
        ("64KB", 64_000),
        ("512MiB", 512 * MiB),
        ("512M", 512 * MiB),
        ("512MB", 512_000_000),
        ("1GiB", GiB),
        ("1 GiB", GiB),
        ("1G", GiB),
        ("2GB", 2_000_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("1TiB", 1024 * GiB),
        ("1T", 1024 * GiB),
        ("1TB", 10**12),
        ("+8", 8),
        ("-0", 0),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "expected a size"),
        ("abc", "expected a size"),
        ("1XB", "expected a size"),
        ("1 G iB", "expected a size"),
        ("GiB", "expected a size"),
        ("1e9", "expected a size"),
        ("0.1KiB", "whole number of bytes"),
        ("1.5", "whole number of bytes"),
        ("-5", "must be >= 0, got -5"),
        ("-1GiB", "must be >= 0"),
        (-5, "must be >= 0, got -5"),
        (True, "expected an integer or a size string"),
        (1.5, "expected an integer or a size string"),
    ],
)
def test_parse_size_errors(text: str | int, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        parse_size(text)


@pytest.mark.parametrize(
    ("size", "text"), [(0, "0"), (1000, "1000"), (4096, "4KiB"), (GiB, "1GiB"), (3 * MiB, "3MiB")]
)
def test_format_size_round_trips(size: int, text: str) -> None:
    assert format_size(size) == text
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        ("On", True),
        (" on ", True),
        ("false", False),
        ("False", False),
        ("0", False),
        ("no", False),
        ("off", False),
    ],
)
def test_bool_parsing(sock: str, text: str, expected: bool) -> None:
    assert load(sock, env={"KVD_ENCRYPT_DATA": text}).encrypt_data is expected
    assert load(sock, overrides={"encrypt_data": text}).encrypt_data is expected


@pytest.mark.parametrize("text", ["", "2", "y", "enable", "truee"])
def test_bool_parsing_errors(sock: str, text: str) -> None:
    message = config_error(env={"KVD_ENCRYPT_DATA": text, "KVD_SOCKET_PATH": sock})
    assert message.startswith("encrypt_data: expected a boolean")
    assert message.endswith("(from env KVD_ENCRYPT_DATA)")


def test_env_values_parse(sock: str) -> None:
    cfg = load(
        sock,
        env={
            "KVD_POOL_SIZE_BYTES": "2GiB",
            "KVD_HTTP_PORT": " 0 ",
            "KVD_DRAIN_GRACE_S": "0.25",
            "KVD_NODE_ID": "gpu-node-3",
            "KVD_LOG_LEVEL": "DEBUG",
            "PATH": "/usr/bin",  # unrelated variables are ignored
            "kvd_lowercase": "ignored",
        },
    )
    assert cfg.pool_size_bytes == 2 * GiB
    assert cfg.http_port == 0
    assert cfg.drain_grace_s == 0.25
    assert cfg.node_id == "gpu-node-3"
    assert cfg.log_level == "debug"


# --------------------------------------------------------------------------- errors


def test_unknown_key_in_file(tmp_path: Path, sock: str) -> None:
    path = write(tmp_path / "kvd.toml", "pool_sise_bytes = 5\n")
    message = config_error(config_file=path, env={"KVD_SOCKET_PATH": sock})
    assert message.startswith(f"unknown key 'pool_sise_bytes' (from file {path})")
    assert "did you mean 'pool_size_bytes'" in message


@pytest.mark.parametrize(("removed", "replacement"), [
    ("tls_cert_file", "curve_secret_key_file"), ("tls_key_file", "curve_secret_key_file"),
    ("tls_allowed_certs_file", "curve_allowed_keys_file"), ("tls_data", "encrypt_data"),
    ("nccl_max_channels", "nccl_channel_memory_bytes")])
def test_a_removed_key_says_what_replaced_it(tmp_path: Path, sock: str, removed: str,
                                             replacement: str) -> None:
    path = write(tmp_path / "kvd.toml", f'{removed} = "x"\n')
    message = config_error(config_file=path, env={"KVD_SOCKET_PATH": sock})
    assert f"'{removed}'" in message and "is gone" in message and replacement in message
    message = config_error(env={"KVD_SOCKET_PATH": sock, f"KVD_{removed.upper()}": "x"})
    assert replacement in message, message


def test_curve_settings_come_together(tmp_path: Path, sock: str) -> None:
    import zmq.auth

    from kvd.daemon.auth import load_keys, write_keys

    def keys(**overrides: str) -> object:
        return load_keys(load_config(env={"KVD_SOCKET_PATH": sock}, overrides=overrides))

    assert keys() is None  # neither: an open peer plane
    with pytest.raises(ConfigError, match="curve_secret_key_file is not"):
        keys(curve_allowed_keys_file=str(tmp_path / "allowed"))
    with pytest.raises(ConfigError, match="curve_allowed_keys_file: required"):
        keys(curve_secret_key_file=str(tmp_path / "a.key_secret"))
    public_file, secret_file, public = write_keys(str(tmp_path), "a")
    allowed = tmp_path / "allowed"
    with pytest.raises(ConfigError, match="cannot read"):
        keys(curve_secret_key_file=secret_file, curve_allowed_keys_file=str(allowed))
    with pytest.raises(ConfigError, match="holds no secret key"):
        keys(curve_secret_key_file=public_file, curve_allowed_keys_file=str(allowed))
    other, _ = zmq.curve_keypair()
    allowed.write_text(f"# cluster\n{public} 10.0.0.1:14579\n\n"
                       f"{other.decode()} 10.0.0.2:14579  # b\n")
    found = keys(curve_secret_key_file=secret_file, curve_allowed_keys_file=str(allowed))
    assert found is not None
    assert found.by_address == {"10.0.0.1:14579": public.encode(),  # type: ignore[attr-defined]
                                "10.0.0.2:14579": other}
    assert zmq.auth.load_certificate(secret_file)[0] == public.encode()
    for line in (f"{public}", f"{public} nohost", "tooshort 10.0.0.3:1",
                 f"{other.decode()} 10.0.0.1:14579"):  # (an address with two keys)
        allowed.write_text(f"{public} 10.0.0.1:14579\n{line}\n")
        with pytest.raises(ConfigError, match="line 2"):
            keys(curve_secret_key_file=secret_file, curve_allowed_keys_file=str(allowed))
    assert oct(os.stat(secret_file).st_mode)[-3:] == "600"


@pytest.mark.parametrize(("key", "suggestion"), [
    ("pool", "; did you mean 'pool_size_bytes'?"),
    ("http", "; did you mean 'http_host' or 'http_port'?"),
    ("port", "; did you mean 'peer_port', 'data_port' or 'http_port'?"),
    ("peer", "; did you mean 'peers'?"),
    ("x", ""),
    ("foo", ""),
])
def test_an_unknown_key_gets_the_closest_real_names_or_none(tmp_path: Path, sock: str,
                                                            key: str, suggestion: str) -> None:
    path = write(tmp_path / "kvd.toml", f"{key} = 1\n")
    assert config_error(config_file=path, env={"KVD_SOCKET_PATH": sock}) == \
        f"unknown key '{key}' (from file {path}){suggestion}"
    var = f"KVD_{key.upper()}"
    as_variables = re.sub(r"'(\w+)'", lambda m: f"KVD_{m.group(1).upper()}", suggestion)
    if not suggestion:  # like no setting: another program's variable, ignored
        assert load(sock, env={var: "1"}) == load(sock)
        return
    assert config_error(env={"KVD_SOCKET_PATH": sock, var: "1"}) == \
        f"unknown variable {var} (from env){as_variables}"


def test_a_client_reads_the_socket_path_and_nothing_else(tmp_path: Path) -> None:
    """Flag > KVD_SOCKET_PATH > the config file's socket_path > the default; the daemon's
    other settings, good or bad, in the environment or the file, are not read."""
    toml = write(tmp_path / "kvd.toml", 'socket_path = "from-file.sock"\nbogus = 1\n'
                                        'pool_size_bytes = "lots"\n')
    junk = {"KVD_FOO": "1", "KVD_POOL_SIZE_BYTES": "lots", "KVD_DEV": "x"}
    assert client_socket_path("flag.sock", toml, {**junk, "KVD_SOCKET_PATH": "env.sock"}) == \
        os.path.abspath("flag.sock")
    assert client_socket_path(None, toml, {**junk, "KVD_SOCKET_PATH": "env.sock"}) == \
        os.path.abspath("env.sock")
    assert client_socket_path(None, toml, junk) == os.path.abspath("from-file.sock")
    assert client_socket_path(None, None, {**junk, "KVD_CONFIG": toml}) == \
        os.path.abspath("from-file.sock")
    assert client_socket_path(None, None, {**junk, "XDG_RUNTIME_DIR": str(tmp_path)}) == \
        str(tmp_path / "kvd" / "kvd.sock")
    with pytest.raises(ConfigError, match=r"config file .*missing.toml' \(from env KVD_CONFIG\)"
                                          r": cannot read"):
        client_socket_path(None, None, {"KVD_CONFIG": str(tmp_path / "missing.toml")})
    with pytest.raises(ConfigError, match="socket_path: must not be empty"):
        client_socket_path(None, None, {"KVD_SOCKET_PATH": ""})


def test_every_operator_setting_names_its_value_and_its_default_in_words() -> None:
    for f in dataclasses.fields(Config):
        spec = f.metadata["kvd"]
        if spec.dev:
            continue
        assert spec.value_name() not in ("TEXT", "STRING", "INTEGER", "BOOLEAN"), f.name
        if f.default == "":
            assert spec.default_text, f"{f.name}: what its empty default means, in words"


def test_table_in_file_is_unknown_key(tmp_path: Path, sock: str) -> None:
    path = write(tmp_path / "kvd.toml", "[kvd]\nhttp_port = 5\n")
    message = config_error(config_file=path, env={"KVD_SOCKET_PATH": sock})
    assert message.startswith(f"unknown key 'kvd' (from file {path})")


def test_unknown_env_var(sock: str) -> None:
    message = config_error(env={"KVD_POOL_SISE_BYTES": "1GiB", "KVD_SOCKET_PATH": sock})
    assert "KVD_POOL_SISE_BYTES" in message
    assert "(from env)" in message
    assert "did you mean KVD_POOL_SIZE_BYTES" in message


def test_unknown_override(sock: str) -> None:
    message = config_error(env={"KVD_SOCKET_PATH": sock}, overrides={"http_prot": "1"})
    assert message.startswith("unknown key 'http_prot' (from overrides)")


@pytest.mark.parametrize(
    ("line", "key", "reason"),
    [
        ('http_port = "9400"', "http_port", "expected an integer, got '9400'"),
        ("http_port = true", "http_port", "expected an integer, got boolean true"),
        ("http_port = 94.0", "http_port", "expected an integer, got float 94.0"),
        ("http_port = [1, 2]", "http_port", "expected an integer, got array"),
        ("encrypt_data = 1", "encrypt_data", "expected a boolean, got int 1"),
        ('encrypt_data = "true"', "encrypt_data", "expected a boolean, got 'true'"),
        ('max_ttl_s = "10"', "max_ttl_s", "expected a number of seconds, got '10'"),
        ("max_ttl_s = false", "max_ttl_s", "expected a number of seconds, got boolean"),
        ("pool_size_bytes = 1.5", "pool_size_bytes", "expected an integer or a size string"),
        ("pool_size_bytes = false", "pool_size_bytes", "expected an integer or a size"),
        ("node_id = 7", "node_id", "expected a string, got int 7"),
        ("log_level = {a = 1}", "log_level", "expected a string, got table"),
    ],
)
def test_wrong_type_in_file(tmp_path: Path, sock: str, line: str, key: str, reason: str) -> None:
    path = write(tmp_path / "kvd.toml", line + "\n")
    message = config_error(config_file=path, env={"KVD_SOCKET_PATH": sock})
    assert message.startswith(f"{key}: {reason}")
    assert message.endswith(f"(from file {path})")


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("KVD_POOL_SIZE_BYTES", "-5", "pool_size_bytes: must be >= 0, got -5"),
        ("KVD_POOL_SIZE_BYTES", "lots", "pool_size_bytes: expected a size"),
        ("KVD_MAX_MESSAGE_BYTES", "1KiB", "max_message_bytes: must be >= 4096, got 1024"),
        ("KVD_HTTP_PORT", "abc", "http_port: expected an integer, got 'abc'"),
        ("KVD_HTTP_PORT", "65536", "http_port: must be a port in 0..65535, got 65536"),
        ("KVD_PEER_PORT", "-1", "peer_port: must be a port in 0..65535, got -1"),
        ("KVD_PEER_PORT", "1.0", "peer_port: expected an integer"),
        ("KVD_LOG_LEVEL", "verbose", "log_level: must be one of debug, info, warning, error"),
        ("KVD_DRAIN_GRACE_S", "-1", "drain_grace_s: must be >= 0, got -1.0"),
        ("KVD_MAX_TTL_S", "0", "max_ttl_s: must be > 0, got 0.0"),
        ("KVD_MAX_WAIT_S", "soon", "max_wait_s: expected a number of seconds, got 'soon'"),
        ("KVD_PUT_TTL_S", "nan", "put_ttl_s: expected a finite"),
        ("KVD_MAX_TTL_S", "inf", "max_ttl_s: expected a finite"),
        ("KVD_NODE_ID", "", "node_id: must not be empty"),
        ("KVD_NODE_ID", "a b", "node_id: must not contain whitespace"),
        ("KVD_PEER_HOST", " ", "peer_host: must not be empty"),
    ],
)
def test_bad_env_values(sock: str, var: str, value: str, expected: str) -> None:
    message = config_error(env={var: value, "KVD_SOCKET_PATH": sock})
    assert message.startswith(expected)
    assert message.endswith(f"(from env {var})")


def test_bad_value_from_file_and_flag(tmp_path: Path, sock: str) -> None:
    path = write(tmp_path / "kvd.toml", "pool_size_bytes = -5\n")
    message = config_error(config_file=path, env={"KVD_SOCKET_PATH": sock})
    assert message == f"pool_size_bytes: must be >= 0, got -5 (from file {path})"

    message = config_error(env={"KVD_SOCKET_PATH": sock}, overrides={"http_port": "abc"})
    assert message == "http_port: expected an integer, got 'abc' (from flag --http-port)"

    message = config_error(env={"KVD_SOCKET_PATH": sock}, overrides={"log_level": "loud"})
    assert message.startswith("log_level: must be one of")
    assert message.endswith("(from flag --log-level)")


def test_invalid_toml(tmp_path: Path, sock: str) -> None:
    path = write(tmp_path / "kvd.toml", "http_port = \n[[[\n")
    message = config_error(config_file=path, env={"KVD_SOCKET_PATH": sock})
    assert message.startswith(f"config file '{path}': invalid TOML:")


def test_non_utf8_file(tmp_path: Path, sock: str) -> None:
    path = tmp_path / "kvd.toml"
    path.write_bytes(b'node_id = "\xff"\n')
    message = config_error(config_file=str(path), env={"KVD_SOCKET_PATH": sock})
    assert message.startswith(f"config file '{path}': ")


def test_missing_file(tmp_path: Path, sock: str) -> None:
    path = str(tmp_path / "nope.toml")
    message = config_error(config_file=path, env={"KVD_SOCKET_PATH": sock})
    assert message == f"config file '{path}': cannot read: No such file or directory"

    message = config_error(env={"KVD_CONFIG": path, "KVD_SOCKET_PATH": sock})
    assert message.startswith(f"config file '{path}' (from env KVD_CONFIG): cannot read")


def test_config_file_is_a_directory(tmp_path: Path, sock: str) -> None:
    message = config_error(config_file=str(tmp_path), env={"KVD_SOCKET_PATH": sock})
    assert message.startswith(f"config file '{tmp_path}': cannot read")


def test_errors_are_kvd_errors_with_config_code(sock: str) -> None:
    with pytest.raises(KvdError) as info:
        load(sock, env={"KVD_HTTP_PORT": "x"})
    assert info.value.code == "config"
    assert not info.value.retriable


# --------------------------------------------------------------------------- socket path


def test_socket_dir_parent_is_a_regular_file(tmp_path: Path) -> None:
    blocker = write(tmp_path / "blocker", "")
    message = config_error(env={"KVD_SOCKET_PATH": f"{blocker}/sub/kvd.sock"})
    assert message == (
        f"socket_path: '{blocker}' exists and is not a directory (from env KVD_SOCKET_PATH)"
    )


def test_socket_path_is_a_directory(tmp_path: Path) -> None:
    message = config_error(env={}, overrides={"socket_path": str(tmp_path)})
    assert message == f"socket_path: '{tmp_path}' is a directory (from flag --socket-path)"


def test_socket_path_is_a_regular_file(tmp_path: Path) -> None:
    path = write(tmp_path / "kvd.sock", "")
    message = config_error(env={"KVD_SOCKET_PATH": path})
    assert message.startswith(f"socket_path: '{path}' exists and is not a socket")


def test_existing_socket_is_accepted(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        assert load_config(env={"KVD_SOCKET_PATH": path}).socket_path == path


def test_socket_path_too_long(tmp_path: Path) -> None:
    path = "/tmp/" + "x" * MAX_SOCKET_PATH_BYTES + "/kvd.sock"
    message = config_error(env={"KVD_SOCKET_PATH": path})
    assert message.startswith("socket_path: path ")
    assert f"over the {MAX_SOCKET_PATH_BYTES}-byte limit" in message
    assert message.endswith("(from env KVD_SOCKET_PATH)")
    # a too-long default (from a long XDG_RUNTIME_DIR) is reported as such
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    message = config_error(env={"XDG_RUNTIME_DIR": str(deep)})
    assert message.startswith("socket_path: path ")
    assert message.endswith("(from default)")


def _deny_writes_to(monkeypatch: pytest.MonkeyPatch, denied: Path) -> None:
    real_access = os.access

    def fake_access(path: object, mode: int, **kwargs: object) -> bool:
        if str(path) == str(denied) and mode & os.W_OK:
            return False
        return real_access(path, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", fake_access)
    monkeypatch.setattr(os, "supports_effective_ids", {fake_access})


def test_socket_dir_not_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # os.access ignores permission bits for root, so deny through the check itself.
    _deny_writes_to(monkeypatch, tmp_path)
    message = config_error(env={"KVD_SOCKET_PATH": str(tmp_path / "kvd.sock")})
    assert message == (
        f"socket_path: directory '{tmp_path}' is not writable (from env KVD_SOCKET_PATH)"
    )
    message = config_error(env={"KVD_SOCKET_PATH": str(tmp_path / "a" / "b" / "kvd.sock")})
    assert message.startswith(
        f"socket_path: cannot create directory '{tmp_path / 'a' / 'b'}': '{tmp_path}' is not "
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_socket_dir_not_writable_real_permissions(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        message = config_error(env={"KVD_SOCKET_PATH": str(locked / "kvd.sock")})
        assert message.startswith(f"socket_path: directory '{locked}' is not writable")
    finally:
        locked.chmod(0o700)


def test_check_paths_false_and_check_socket_path(tmp_path: Path) -> None:
    blocker = write(tmp_path / "blocker", "")
    path = f"{blocker}/kvd.sock"
    cfg = load_config(env={"KVD_SOCKET_PATH": path}, check_paths=False)
    assert cfg.socket_path == path
    with pytest.raises(ConfigError, match=r"^socket_path: .* exists and is not a directory$"):
        check_socket_path(cfg)
    check_socket_path(dataclasses.replace(cfg, socket_path=str(tmp_path / "ok.sock")))


def test_nothing_is_created(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "kvd.sock"
    assert load_config(env={"KVD_SOCKET_PATH": str(target)}).socket_path == str(target)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- argparse


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd")
    add_config_arguments(parser)
    return parser


def test_argparse_flags(tmp_path: Path, sock: str) -> None:
    path = write(tmp_path / "kvd.toml", "http_port = 1001\nencrypt_data = false\n")
    args = make_parser().parse_args(
        [
            "--config",
            path,
            "--socket-path",
            sock,
            "--pool-size-bytes",
            "512MiB",
            "--encrypt-data",
            "yes",
            "--max-wait-s",
            "12.5",
        ]
    )
    cfg = config_from_args(args, env={"KVD_HTTP_PORT": "1002", "KVD_PEER_PORT": "2002"})
    assert cfg.socket_path == sock
    assert cfg.pool_size_bytes == 512 * MiB
    assert cfg.encrypt_data is True
    assert cfg.max_wait_s == 12.5
    assert cfg.http_port == 1002  # env over file, no flag
    assert cfg.peer_port == 2002


def test_argparse_defaults_are_none(sock: str) -> None:
    args = make_parser().parse_args([])
    assert args.config is None
    assert all(getattr(args, f.name) is None for f in dataclasses.fields(Config))
    cfg = config_from_args(args, env={"KVD_SOCKET_PATH": sock})
    assert cfg == load_config(env={"KVD_SOCKET_PATH": sock})


def test_argparse_every_operator_setting_has_a_flag() -> None:
    help_text = make_parser().format_help()
    for name in OPERATOR_SETTINGS:
        assert "--" + name.replace("_", "-") in help_text
        assert "KVD_" + name.upper() in help_text


def test_argparse_errors_name_the_flag(tmp_path: Path, sock: str) -> None:
    args = make_parser().parse_args(["--http-port", "abc", "--socket-path", sock])
    with pytest.raises(ConfigError) as info:
        config_from_args(args, env={})
    assert str(info.value) == "http_port: expected an integer, got 'abc' (from flag --http-port)"

    missing = str(tmp_path / "missing.toml")
    args = make_parser().parse_args(["--config", missing, "--socket-path", sock])
    with pytest.raises(ConfigError) as info:
        config_from_args(args, env={})
    assert str(info.value).startswith(f"config file '{missing}' (from flag --config): cannot")


# --------------------------------------------------------------------------- development settings

# The settings that are tuning, not an operator's decision (chunk sizes, code-path
# switches): pinned here, so that moving one across is a decision in a diff.
DEVELOPMENT = {
    "tcp_chunk_bytes", "nccl_chunk_bytes", "nccl_warm_up", "nccl_eager",
    "nccl_blocking_calls", "pool_min_block_bytes", "pool_prefault",
}
# A valid value for each, other than its default: as KVD_DEV text, and as it is parsed.
DEV_VALUES: dict[str, tuple[str, object]] = {
    "tcp_chunk_bytes": ("1MiB", MiB), "nccl_chunk_bytes": ("256MiB", 256 * MiB),
    "nccl_warm_up": ("OFF", "off"), "nccl_eager": ("false", False),
    "nccl_blocking_calls": ("0", False), "pool_min_block_bytes": ("64KiB", 64 * 1024),
    "pool_prefault": ("off", False),
}
# Gone with their second code path, or not settings at all: no key of any kind.
NOT_SETTINGS = ("nccl_inline", "busy_poll", "busy_poll_window_s", "timeline_dir")


def test_the_development_settings_are_these() -> None:
    assert DEVELOPMENT_SETTINGS == DEVELOPMENT
    assert set(DEV_VALUES) == DEVELOPMENT
    assert {f.name for f in dataclasses.fields(Config)} == OPERATOR_SETTINGS | DEVELOPMENT_SETTINGS
    assert not OPERATOR_SETTINGS & DEVELOPMENT_SETTINGS


def serve_parser() -> argparse.ArgumentParser:
    """`kvd serve`'s own parser, as the command builds it."""
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = commands.choices["serve"]
    return parser


def test_serve_help_shows_each_operator_setting_with_what_it_allows() -> None:
    """Every operator setting has a flag whose help is one line: what it sets, then
    [allowed values; default; env variable]."""
    helps = {a.dest: a.help for a in serve_parser()._actions if a.help != argparse.SUPPRESS}
    assert set(helps) == OPERATOR_SETTINGS | {"help", "config", "check"}
    for name in OPERATOR_SETTINGS:
        text = helps[name]
        assert text is not None and "\n" not in text
        found = re.fullmatch(rf"(\S.*\S) \[(\S[^;]*); default ([^;]+); env KVD_{name.upper()}\]",
                             text)
        assert found, (name, text)
        what, allowed, _default = found.groups()
        assert len(what.split()) >= 3 and len(allowed.split()) >= 1, (name, text)


def test_serve_help_names_no_development_setting() -> None:
    result = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "--help"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    listed = set(re.findall(r"^  (?:-h, )?(--[a-z-]+)", result.stdout, re.MULTILINE))
    assert listed == {"--help", "--config", "--check"} | {"--" + n.replace("_", "-")
                                                for n in OPERATOR_SETTINGS}
    for name in DEVELOPMENT:
        for spelling in (name, name.replace("_", "-"), f"KVD_{name.upper()}"):
            assert spelling not in result.stdout


def toml_literal(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f'"{value}"' if isinstance(value, str) else repr(value)


@pytest.mark.parametrize("name", sorted(DEVELOPMENT))
def test_a_development_setting_is_refused_from_file_env_and_flag(
        tmp_path: Path, sock: str, name: str) -> None:
    """Named in the config file, as KVD_<KEY> or as a flag, with a value it would accept:
    refused, with a one-line pointer to KVD_DEV."""
    text, value = DEV_VALUES[name]
    pointer = f"is a development setting, not an operator one: for a measurement set " \
              f"KVD_DEV={name}=VALUE"
    path = write(tmp_path / "kvd.toml", f"{name} = {toml_literal(value)}\n")
    message = config_error(config_file=path, env={"KVD_SOCKET_PATH": sock})
    assert message.startswith(f"'{name}' (from file {path}) {pointer}"), message
    message = config_error(env={"KVD_SOCKET_PATH": sock, f"KVD_{name.upper()}": text})
    assert message.startswith(f"'{name}' (from env KVD_{name.upper()}) {pointer}"), message
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError) as info:
        config_from_args(serve_parser().parse_args([flag, text]), env={"KVD_SOCKET_PATH": sock})
    assert str(info.value).startswith(f"'{name}' (from flag {flag}) {pointer}")
    assert "\n" not in str(info.value)


def test_kvd_serve_refuses_a_development_flag_with_the_pointer(sock: str) -> None:
    """The command itself: exit 2 and one line, before any daemon starts."""
    result = subprocess.run(
        [sys.executable, "-m", "kvd.cli", "serve", "--socket-path", sock, "--nccl-eager",
         "false"], capture_output=True, text=True, timeout=60, cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVD_")})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("kvd: config error: 'nccl_eager' (from flag --nccl-eager) is a "
                             "development setting, not an operator one: for a measurement set "
                             "KVD_DEV=nccl_eager=VALUE (docs/architecture.md, development "
                             "settings)\n")


def test_kvd_dev_sets_every_development_setting(sock: str) -> None:
    defaults = load(sock)
    assert development_overrides(defaults) == {}
    items = ", ".join(f" {name} = {text} " for name, (text, _) in DEV_VALUES.items())
    cfg = load(sock, env={"KVD_DEV": items + ","})  # spaces around items and a trailing comma
    assert {name: getattr(cfg, name) for name in DEVELOPMENT} == \
        {name: value for name, (_, value) in DEV_VALUES.items()}
    assert development_overrides(cfg) == {name: value for name, (_, value) in DEV_VALUES.items()}
    assert dataclasses.replace(cfg, **{n: getattr(defaults, n) for n in DEVELOPMENT}) == defaults
    # nothing else moved, and an empty KVD_DEV is no setting
    assert load(sock, env={"KVD_DEV": ""}) == defaults
    assert load(sock, env={"KVD_DEV": "nccl_eager=off"}) == \
        dataclasses.replace(defaults, nccl_eager=False)


@pytest.mark.parametrize(("text", "expected"), [
    ("nccl_eager=maybe", "nccl_eager: expected a boolean (true/false, 1/0, yes/no, on/off), "
                         "got 'maybe' (from env KVD_DEV)"),
    ("nccl_warm_up=sometimes", "nccl_warm_up: must be one of off, matching, all, got "
                               "'sometimes' (from env KVD_DEV)"),
    ("timeline_dir=/tmp/m", "'timeline_dir' (from env KVD_DEV) is gone: set "
                            "KVD_TIMELINE_DIR=DIR in the daemon's environment (kvd/timeline.py)"),
    ("nccl_inline=off", "'nccl_inline' (from env KVD_DEV) is gone: NCCL jobs run on their "
                        "channel's worker thread only"),
    ("tcp_chunk_bytes=4KiB", "tcp_chunk_bytes: must be >= 65536, got 4096 (from env KVD_DEV)"),
    ("nccl_chunk_bytes=lots", "nccl_chunk_bytes: expected a size such as 4096, '64KiB', "
                              "'1.5GiB' or '2GB', got 'lots' (from env KVD_DEV)"),
    ("pool_min_block_bytes=96", "pool_min_block_bytes: must be a power of two, got 96 "
                                "(from env KVD_DEV)"),
    ("pool_min_block_bytes=32", "pool_min_block_bytes: must be >= 64, got 32 (from env KVD_DEV)"),
    ("nccl_eager", "KVD_DEV: expected key=value items separated by commas, got 'nccl_eager'"),
    ("=on", "KVD_DEV: expected key=value items separated by commas, got '=on'"),
    ("nccl_egaer=off", "unknown development setting 'nccl_egaer' (from env KVD_DEV); did you "
                       "mean 'nccl_eager'?"),
    ("nccl_eager=on,nccl_eager=off", "'nccl_eager' is set twice (from env KVD_DEV)"),
    ("x=1", "unknown development setting 'x' (from env KVD_DEV); there are tcp_chunk_bytes, "
            "nccl_chunk_bytes, nccl_warm_up, nccl_eager, nccl_blocking_calls, "
            "pool_min_block_bytes, pool_prefault"),
    ("pool_size_bytes=2GiB", "'pool_size_bytes' (from env KVD_DEV) is an operator setting: set "
                             "it with KVD_POOL_SIZE_BYTES, --pool-size-bytes or the config file"),
])
def test_kvd_dev_refuses_bad_items_in_one_line(sock: str, text: str, expected: str) -> None:
    assert config_error(env={"KVD_SOCKET_PATH": sock, "KVD_DEV": text}) == expected


def test_development_settings_reach_a_daemon_through_kvd_dev(sock_dir: str,
                                                               tmp_path: Path) -> None:
    """A `kvd serve` given KVD_DEV runs with its settings and says so in its log; one given
    KVD_TIMELINE_DIR (no setting: kvd/timeline.py reads it) writes its marks there at exit."""
    marks = tmp_path / "marks"
    d = ProcessDaemon(sock_dir, env={"KVD_DEV": "tcp_chunk_bytes=1MiB",
                                     "KVD_TIMELINE_DIR": str(marks)})
    try:
        d.wait_ready()
        with KvdClient(d.socket_path, timeout_s=10) as client:
            client.ping()
    finally:
        code = d.stop()
    assert code == 0, d.log()
    assert "development settings (KVD_DEV): tcp_chunk_bytes=1048576" in d.log()
    assert [p.name for p in marks.iterdir()] == [f"{d.proc.pid}.json"]


@pytest.mark.parametrize("name", NOT_SETTINGS)
def test_settled_knobs_and_the_timeline_are_no_setting_at_all(sock: str, name: str) -> None:
    """No Config attribute, flag or KVD_<KEY> variable; KVD_TIMELINE_DIR alone is let
    through the check for misspelt KVD_* variables (kvd/timeline.py reads it)."""
    assert name not in {f.name for f in dataclasses.fields(Config)}
    assert "--" + name.replace("_", "-") not in serve_parser().format_help()
    var = f"KVD_{name.upper()}"
    if name == "timeline_dir":
        assert load(sock, env={var: "/tmp/marks"}) == load(sock)
    else:
        assert config_error(env={"KVD_SOCKET_PATH": sock, var: "1"}).startswith(
            f"{var} (from env) is gone: ")


# --------------------------------------------------------------------------- the operator's docs


def settings_named(text: str) -> list[str]:
    """The development settings ``text`` names (not a stats field such as
    ``peer.links[].nccl_blocking_calls``, which is not a setting)."""
    return sorted(name for name in DEVELOPMENT if re.search(rf"(?<![.\w]){name}\b", text))


def test_operations_md_holds_the_settings_table_and_no_development_setting() -> None:
    """docs/operations.md's table is the one made from Config (regenerate it with
    ``python -c "from kvd.config import operator_settings_markdown as t; print(t())"``)."""
    text = (REPO / "docs" / "operations.md").read_text()
    assert operator_settings_markdown() in text
    assert settings_named(text) == []


def test_readme_configuration_and_sample_config_name_operator_settings_only() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    sample = (REPO / "systemd" / "kvd.toml").read_text()
    for text in (section, sample):
        assert settings_named(text) == []
    keys = set(re.findall(r"^#? ?([a-z_]+) = ", sample, re.MULTILINE))
    assert keys and keys <= OPERATOR_SETTINGS, keys - OPERATOR_SETTINGS
    cfg = load_config(config_file=str(REPO / "systemd" / "kvd.toml"), env={},
                      check_paths=False)
    assert cfg.socket_path == "/run/kvd/kvd.sock"
    assert development_overrides(cfg) == {}
