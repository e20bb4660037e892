"""The ``kvd`` command as an operator meets it: each command's own help, no abbreviated
options, errors as JSON under --json, the bench's progress bar only on a terminal and its
size checked against the peer first, keygen's directory, paths and JSON, and client
commands that ignore the daemon's settings in the environment.

Every command runs as ``python -m kvd.cli`` (the ``kvd`` entry point's ``main``) in a
subprocess; daemons are real ``kvd serve`` processes."""

from __future__ import annotations

import datetime
import io
import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth
from prometheus_client.parser import text_string_to_metric_families

from kvd import KvdClient
from kvd import __version__ as kvd_version
from kvd.bench import Progress
from kvd.config import OPERATOR_SETTINGS
from tests.conftest import ProcessDaemon, start_daemons, wait_until

CLIENT_COMMANDS = ("ping", "stats", "status", "peers", "drain", "reload", "bench")
CLIENT_OPTIONS = {"--help", "--socket-path", "--config", "--timeout", "--json"}
OWN_OPTIONS = {"drain": {"--grace"}, "bench": {"--to", "--size", "--blocks", "--repeat"}}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env.update(extra)
    return env


def kvd(*args: str, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The command's result, its output decoded as it was written (text mode would turn a
    carriage return into a newline)."""
    result = subprocess.run([sys.executable, "-m", "kvd.cli", *args], capture_output=True,
                            timeout=timeout, env=env or clean_env())
    return subprocess.CompletedProcess(result.args, result.returncode,
                                       result.stdout.decode(), result.stderr.decode())


def options_listed(help_text: str) -> set[str]:
    return set(re.findall(r"^  (?:-h, )?(--[a-z-]+)", help_text, re.MULTILINE))


def json_error(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The one JSON error object a failed --json command printed (and nothing else)."""
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout + result.stderr
    error: dict[str, str] = json.loads(lines[0])["error"]
    assert set(error) == {"code", "message"} and error["message"], error
    return error


@pytest.fixture(scope="module")
def two_daemons() -> Iterator[list[ProcessDaemon]]:
    """Daemons a and b (64 MiB host pools), a linked to nothing yet."""
    root = tempfile.mkdtemp(prefix="kvd-c-", dir="/tmp")
    daemons = start_daemons(root, "a", "b")
    try:
        yield daemons
    finally:
        codes = [d.stop() for d in daemons]
        shutil.rmtree(root, ignore_errors=True)
    assert codes == [0, 0], [d.log() for d in daemons]


# --------------------------------------------------------------------------- help


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_a_client_command_shows_only_its_own_options(command: str) -> None:
    result = kvd(command, "--help")
    assert result.returncode == 0, result.stderr
    assert options_listed(result.stdout) == CLIENT_OPTIONS | OWN_OPTIONS.get(command, set())
    assert "--pool-size-bytes" not in result.stdout and "KVD_POOL" not in result.stdout


def test_serve_help_gives_each_setting_a_value_name_a_description_and_a_default() -> None:
    result = kvd("serve", "--help")
    assert result.returncode == 0, result.stderr
    flags = {"--" + name.replace("_", "-") for name in OPERATOR_SETTINGS}
    assert options_listed(result.stdout) == flags | {"--help", "--config", "--check"}
    usage = result.stdout.split("\n\n", 1)[0]
    for bare in ("STRING", "INTEGER", "BOOLEAN"):  # types, not what a value is
        assert bare not in result.stdout, bare
    assert "--log-level debug|info|warning|error" in usage
    assert "--http-port PORT" in usage and "--encrypt-data true|false" in usage
    text = " ".join(result.stdout.split())
    for name in OPERATOR_SETTINGS:
        entry = re.search(rf"--{name.replace('_', '-')} \S+ (.+?) \[([^\]]+); default "
                          rf"([^;]+); env KVD_{name.upper()}\]", text)
        assert entry, name
        what, allowed, default = entry.groups()
        assert len(what.split()) >= 3 and allowed.strip(), name
        assert default.strip() and default.strip() not in ("empty", '""', "''"), name


def test_keygen_and_demo_help() -> None:
    result = kvd("keygen", "--help")
    assert result.returncode == 0 and "/etc/kvd" in result.stdout
    assert options_listed(result.stdout) == {"--help", "--dir", "--name", "--json"}
    result = kvd("demo", "--help")
    assert options_listed(result.stdout) == {"--help", "--blocks", "--block-kib", "--layers"}


# --------------------------------------------------------------------------- no abbreviations


@pytest.mark.parametrize(("args", "meant"), [
    (["serve", "--pool-size", "1GiB"], "--pool-size-bytes"),
    (["serve", "--pool-size=1GiB"], "--pool-size-bytes"),
    (["ping", "--sock", "/tmp/x.sock"], "--socket-path"),
    (["bench", "--to", "h:1", "--rep", "2"], "--repeat"),
    (["status", "--jsn"], "--json"),
])
def test_an_abbreviated_option_is_an_error_naming_the_real_one(
        args: list[str], meant: str, tmp_path: Path) -> None:
    if args[0] == "serve":
        args = [*args, "--socket-path", str(tmp_path / "s.sock")]
    result = kvd(*args, timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvd {args[0]}: error: unrecognized option") and meant in last
    assert not (tmp_path / "s.sock").exists()


# --------------------------------------------------------------------------- JSON errors


@pytest.mark.parametrize("command", [["status"], ["peers"], ["drain"], ["stats"], ["ping"],
                                     ["bench", "--to", "127.0.0.1:1"]])
def test_json_errors_from_each_client_command(command: list[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "none.sock")
    result = kvd(*command, "--socket-path", missing, "--timeout", "2", "--json", timeout=30)
    assert result.returncode == 1 and result.stderr == ""
    error = json_error(result)
    assert error["code"] == "daemon_unavailable" and missing in error["message"]
    plain = kvd(*command, "--socket-path", missing, "--timeout", "2", timeout=30)
    assert plain.returncode == 1 and plain.stdout == ""
    assert plain.stderr.startswith("kvd: daemon_unavailable: ") and missing in plain.stderr


def test_json_usage_and_config_errors_keep_their_exit_code() -> None:
    result = kvd("bench", "--to", "h:1", "--size", "-5", "--json")
    assert result.returncode == 2 and result.stderr == ""
    error = json_error(result)
    assert error["code"] == "usage" and "--size" in error["message"]
    result = kvd("ping", "--json", "--socket-path", "")
    assert result.returncode == 2 and json_error(result)["code"] == "config"
    result = kvd("serve", "--pool-size", "1GiB", "--json")
    assert result.returncode == 2 and "--pool-size-bytes" in json_error(result)["message"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--size", "-5"], "argument --size: must be >= 0, got -5"),
    (["--size", "lots"], "argument --size: expected a size"),
    (["--size", "0"], "argument --size: must be a size > 0"),
    (["--blocks", "0"], "argument --blocks: must be an integer >= 1"),
    (["--repeat", "0"], "argument --repeat: must be an integer >= 1"),
    (["--timeout", "-1"], "argument --timeout: must be a number of seconds > 0"),
])
def test_bench_names_the_option_it_refuses(args: list[str], needle: str) -> None:
    result = kvd("bench", "--to", "h:1", *args)
    assert result.returncode == 2 and needle in result.stderr, result.stderr


# --------------------------------------------------------------------------- bench


def test_bench_without_a_terminal_draws_no_bar(two_daemons: list[ProcessDaemon]) -> None:
    a, b = two_daemons
    result = kvd("bench", "--socket-path", a.socket_path, "--to", b.peer_address(),
                 "--size", "4MiB", "--blocks", "4", "--repeat", "2")
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout + result.stderr and "ETA" not in result.stderr
    assert "bytes intact" in result.stdout


def test_bench_on_a_terminal_draws_a_bar_with_an_eta(two_daemons: list[ProcessDaemon]) -> None:
    a, b = two_daemons
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd.cli", "bench", "--socket-path", a.socket_path, "--to",
         b.peer_address(), "--size", "4MiB", "--blocks", "4", "--repeat", "3"],
        stdin=slave, stdout=slave, stderr=slave, env=clean_env())
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        code = proc.wait(30)
    text = out.decode(errors="replace")
    assert code == 0, text
    assert re.search(r"\r\[#+\] 6/6 transfers, [\d.]+s, ETA 0\.0s", text), text
    assert "\r[" in text and "ETA" in text and "bytes intact" in text


def test_the_bar_moves_within_a_step_and_leaves_no_line_for_an_error() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar = Progress(4, stream=Terminal(), interval_s=60, width=20)
    start = bar._started
    assert bar.frame(start + 1) == "[....................] 0/4 transfers, 1.0s, ETA ?"
    bar._done, bar._step_started = 1, start + 2.0  # one step took 2 s
    halfway = bar.frame(start + 3.0)  # halfway through the second
    assert halfway == "[#######.............] 1/4 transfers, 3.0s, ETA 5.0s", halfway
    screen = Terminal()
    with pytest.raises(RuntimeError), Progress(2, stream=screen, interval_s=0.01):
        time.sleep(0.05)
        raise RuntimeError("the peer went away")
    assert "\r[" in screen.getvalue() and screen.getvalue().endswith("\r\x1b[2K")
    assert Progress(2, stream=io.StringIO()).enabled is False


def test_bench_refuses_at_once_a_size_the_peer_pool_cannot_hold(
        two_daemons: list[ProcessDaemon]) -> None:
    """b's host pool is 64 MiB: 128 MiB cannot be put there, and bench says so before it
    makes its regions (a's daemon sees none registered)."""
    a, b = two_daemons
    result = kvd("bench", "--socket-path", a.socket_path, "--to", b.peer_address(),
                 "--size", "128MiB", "--blocks", "4", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    error = json_error(result)
    assert error["code"] == "bad_request", error
    assert "--size 128MiB does not fit in the host pool of" in error["message"]
    assert "(64MiB)" in error["message"]


def test_bench_to_a_peer_that_does_not_answer_fails_before_its_set_up(
        two_daemons: list[ProcessDaemon]) -> None:
    a, _ = two_daemons
    t0 = time.monotonic()
    result = kvd("bench", "--socket-path", a.socket_path, "--to", "127.0.0.1:1",
                 "--size", "1GiB", "--json")
    assert result.returncode == 1 and json_error(result)["code"] == "peer_unreachable"
    assert time.monotonic() - t0 < 30


# --------------------------------------------------------------------------- the daemon's facts


def test_status_says_the_daemons_version_and_uptime_and_metrics_its_process(
        two_daemons: list[ProcessDaemon]) -> None:
    """What redis INFO and node_exporter tell: the version, since when it runs, and the
    process's memory, CPU and descriptors (prometheus_client's process collector)."""
    a, _ = two_daemons
    result = kvd("status", "--socket-path", a.socket_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == f"version             kvd {kvd_version}", result.stdout
    assert re.fullmatch(r"up                  (\d+[dhm] \d+[hms]|\d+s), since "
                        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \w+", lines[2]), result.stdout
    st = json.loads(kvd("status", "--socket-path", a.socket_path, "--json").stdout)
    assert st["version"] == kvd_version and st["started_at"] == st["epoch"] / 1e9
    assert st["uptime_s"] > 0
    with urllib.request.urlopen(f"http://{st['http']}/v1/status", timeout=10) as r:
        assert json.loads(r.read())["version"] == kvd_version
    with urllib.request.urlopen(f"http://{st['http']}/metrics", timeout=10) as r:
        names = {f.name for f in text_string_to_metric_families(r.read().decode())}
    assert {"process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds",
            "process_max_fds", "process_start_time_seconds"} <= names, names


def test_the_clis_sessions_are_logged_at_debug_level_an_engines_at_info(
        two_daemons: list[ProcessDaemon]) -> None:
    """`watch kvd status` leaves nothing in an info-level journal; a real client's session
    is still told when it comes and goes."""
    a, _ = two_daemons
    for command in ("status", "ping", "stats", "peers"):
        assert kvd(command, "--socket-path", a.socket_path).returncode == 0
    with KvdClient(a.socket_path, name="engine") as client:
        client.ping()
    connected = wait_until(lambda: re.search(
        r" INFO kvd\.daemon\.local_server: client connected session=(\d+) "
        rf"pid={os.getpid()} name=engine\n", a.log()))
    log = wait_until(lambda: f"client gone session={connected[1]} " in a.log() and a.log())
    assert f" INFO kvd.daemon.local_server: client gone session={connected[1]} " \
           f"pid={os.getpid()} reason=client said bye\n" in log
    assert "kvd-cli" not in log, log


# --------------------------------------------------------------------------- serve --check


def test_serve_check_prints_each_setting_and_where_it_came_from(tmp_path: Path) -> None:
    """Like `nginx -t`: the effective settings, as config-file lines, and their sources."""
    toml = tmp_path / "kvd.toml"
    toml.write_text('node_id = "gpu-01"\npool_size_bytes = "2GiB"\npeers = "10.0.0.2:14579"\n')
    result = kvd("serve", "--config", str(toml), "--peer-port", "1", "--socket-path",
                 "/run/kvd/kvd.sock", "--check", env=clean_env(KVD_HTTP_PORT="9500"))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"""\
socket_path = "/run/kvd/kvd.sock"  # flag --socket-path
node_id = "gpu-01"  # file {toml}
peer_host = "127.0.0.1"  # default
peer_port = 1  # flag --peer-port
data_port = 14580  # default
advertise_host = ""  # default
peers = "10.0.0.2:14579"  # file {toml}
http_host = "127.0.0.1"  # default
http_port = 9500  # env KVD_HTTP_PORT
curve_secret_key_file = ""  # default
curve_allowed_keys_file = ""  # default
encrypt_data = true  # default
allow_unauthenticated_peers = false  # default
pool_size_bytes = "2GiB"  # file {toml}
nccl = true  # default
gpu_staging_bytes = "1GiB"  # default
nccl_channel_memory_bytes = "2GiB"  # default
max_message_bytes = "1MiB"  # default
max_ttl_s = 86400.0  # default
put_ttl_s = 300.0  # default
max_wait_s = 3600.0  # default
max_peer_links = 1024  # default
max_waiting_pulls = 4096  # default
heartbeat_interval_s = 1.0  # default
peer_grace_s = 3.0  # default
peer_connect_timeout_s = 5.0  # default
peer_data_idle_s = 60.0  # default
nccl_init_timeout_s = 30.0  # default
drain_grace_s = 30.0  # default
log_level = "info"  # default
"""
    # What it prints is a config file kvd takes, to the same settings.
    again = tmp_path / "again.toml"
    again.write_text(result.stdout)
    assert kvd("serve", "--config", str(again), "--check").stdout == \
        re.sub(r"  # .*", f"  # file {again}", result.stdout)


@pytest.mark.parametrize(("args", "message"), [
    (["--pool-size-bytes", "lots"], "pool_size_bytes: expected a size"),
    (["--peer-host", "10.1.1.1"], "peer_host: 10.1.1.1 is not a loopback address and no "
                                  "CurveZMQ keys are set"),
])
def test_serve_check_refuses_what_serve_would(args: list[str], message: str) -> None:
    result = kvd("serve", *args, "--check")
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.startswith(f"kvd: config error: {message}")
    assert result.stderr.count("\n") == 1, result.stderr


# --------------------------------------------------------------------------- keygen


def test_keygen_prints_absolute_paths_and_json(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "kvd.cli", "keygen", "--dir", "keys",
                             "--name", "n1"], capture_output=True, text=True, timeout=30,
                            cwd=tmp_path, env=clean_env())
    assert result.returncode == 0, result.stderr
    secret = tmp_path / "keys" / "n1.key_secret"
    assert f"secret key: {secret} (mode 0600)" in result.stdout
    assert f'curve_secret_key_file = "{secret}"' in result.stdout
    result = kvd("keygen", "--dir", str(tmp_path / "k2"), "--name", "n2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["secret_key_file"] == str(tmp_path / "k2" / "n2.key_secret")
    assert report["public_key_file"] == str(tmp_path / "k2" / "n2.key")
    assert report["allow_list_line"] == f"{report['public_key']} HOST:PORT"
    assert (tmp_path / "k2" / "n2.key").read_text().count(report["public_key"]) == 1


def test_keygen_refuses_to_overwrite_and_says_how_to_proceed(tmp_path: Path) -> None:
    assert kvd("keygen", "--dir", str(tmp_path), "--name", "n").returncode == 0
    before = (tmp_path / "n.key_secret").read_bytes()
    result = kvd("keygen", "--dir", str(tmp_path), "--name", "n")
    assert result.returncode == 2 and result.stdout == ""
    assert "config error" not in result.stderr
    assert result.stderr.startswith(f"kvd: keygen: {tmp_path / 'n.key'} and "
                                    f"{tmp_path / 'n.key_secret'} exist: not overwriting")
    assert "remove n.key and n.key_secret first" in result.stderr
    result = kvd("keygen", "--dir", str(tmp_path), "--name", "n", "--json")
    assert result.returncode == 2 and json_error(result)["code"] == "key_exists"
    assert (tmp_path / "n.key_secret").read_bytes() == before


def test_keygen_makes_its_directory_0750_and_files_with_kvds_own_header(
        tmp_path: Path) -> None:
    keys = tmp_path / "etc" / "kvd"
    result = kvd("keygen", "--dir", str(keys), "--name", "node", "--json")
    assert result.returncode == 0, result.stderr
    public = json.loads(result.stdout)["public_key"]
    assert oct(keys.stat().st_mode)[-3:] == "750"  # (docs/operations.md: root:kvd 0750)
    assert oct((keys / "node.key_secret").stat().st_mode)[-3:] == "600"
    today = datetime.date.today()
    assert (keys / "node.key").read_text() == (
        f"#   kvd public key, made by kvd keygen on {today}: its line on the allow-list "
        "(curve_allowed_keys_file) is '<public-key> HOST:PORT'\n\n"
        f'metadata\ncurve\n    public-key = "{public}"\n')
    secret = (keys / "node.key_secret").read_text()
    assert secret.startswith(f"#   kvd secret key, made by kvd keygen on {today}: the "
                             "curve_secret_key_file of one daemon, readable by its user "
                             "alone\n\nmetadata\ncurve\n")
    assert zmq.auth.load_certificate(keys / "node.key_secret")[0] == public.encode()
    assert "pyzmq" not in secret and "home directory" not in (keys / "node.key").read_text()


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".", ""])
def test_keygen_names_stay_in_their_directory(tmp_path: Path, name: str) -> None:
    keys = tmp_path / "keys"
    result = kvd("keygen", "--dir", str(keys), "--name", name)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("usage: kvd keygen [-h] [--dir DIR] [--name NAME] [--json]\n"
                             "kvd keygen: error: argument --name: must be a file name, with no "
                             f"/, in --dir, got {name}\n")
    assert list(tmp_path.iterdir()) == []


def keygen_with_default_dir(default_dir: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvd keygen`` without --dir, its default directory moved to ``default_dir`` (the
    real one, /etc/kvd, is not the tests' to write)."""
    code = ("import sys, kvd.cli as cli; cli.DEFAULT_KEY_DIR = sys.argv[1]; "
            "sys.exit(cli.main(sys.argv[2:]))")
    return subprocess.run([sys.executable, "-c", code, default_dir, "keygen", *args],
                          capture_output=True, text=True, timeout=30, env=clean_env())


def test_keygen_writes_to_its_default_directory_when_it_may(tmp_path: Path) -> None:
    target = tmp_path / "etc-kvd"  # missing, in a writable directory: made
    result = keygen_with_default_dir(str(target), "--name", "node", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["secret_key_file"] == str(target / "node.key_secret")
    assert oct((target / "node.key_secret").stat().st_mode)[-3:] == "600"


def test_keygen_without_a_usable_default_directory_requires_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "kvd"  # cannot be made: its parent is a file
    result = keygen_with_default_dir(str(target))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"kvd: keygen: the default key directory {target} does not "
                             f"exist and cannot be created ({blocker} is not writable): run as "
                             f"a user who may write there (root), or give --dir DIR\n")
    result = keygen_with_default_dir(str(target), "--json")
    assert result.returncode == 2 and json_error(result)["code"] == "usage"


# --------------------------------------------------------------------------- the environment


def test_client_commands_ignore_the_daemons_settings_in_the_environment(
        two_daemons: list[ProcessDaemon], tmp_path: Path) -> None:
    a, _ = two_daemons
    stray = {"KVD_FOO": "1", "KVD_POOL_SIZE_BYTES": "lots", "KVD_DEV": "nonsense"}
    for command in ("ping", "stats", "status", "peers"):
        result = kvd(command, "--socket-path", a.socket_path, env=clean_env(**stray))
        assert result.returncode == 0, (command, result.stderr)
    # the socket path alone is read: from KVD_SOCKET_PATH, or the config file's socket_path
    result = kvd("ping", "--json", env=clean_env(**stray, KVD_SOCKET_PATH=a.socket_path))
    assert result.returncode == 0 and json.loads(result.stdout)["node_id"] == "a"
    toml = tmp_path / "kvd.toml"
    toml.write_text(f'socket_path = "{a.socket_path}"\npool_size_bytes = "lots"\nbogus = 1\n')
    result = kvd("ping", "--json", env=clean_env(**stray, KVD_CONFIG=str(toml)))
    assert result.returncode == 0, result.stdout + result.stderr
    result = kvd("ping", "--json", "--config", str(toml), env=clean_env(**stray))
    assert result.returncode == 0, result.stdout + result.stderr
    # and the flag wins over both
    result = kvd("ping", "--socket-path", str(tmp_path / "none.sock"), "--json",
                 env=clean_env(KVD_SOCKET_PATH=a.socket_path, KVD_CONFIG=str(toml)))
    assert result.returncode == 1 and "none.sock" in json_error(result)["message"]


@pytest.mark.parametrize(("var", "message"), [
    ("KVD_POOL_SIZ", "kvd: config error: unknown variable KVD_POOL_SIZ (from env); did you "
                     "mean KVD_POOL_SIZE_BYTES?\n"),
    ("KVD_POOL", "kvd: config error: unknown variable KVD_POOL (from env); did you mean "
                 "KVD_POOL_SIZE_BYTES?\n"),
    ("KVD_HTTP", "kvd: config error: unknown variable KVD_HTTP (from env); did you mean "
                 "KVD_HTTP_HOST or KVD_HTTP_PORT?\n"),
])
def test_serve_refuses_a_misspelt_setting_with_the_closest_real_names(
        var: str, message: str, tmp_path: Path) -> None:
    result = kvd("serve", "--socket-path", str(tmp_path / "s.sock"), env=clean_env(**{var: "1"}),
                 timeout=30)
    assert result.returncode == 2 and result.stderr == message


def test_serve_ignores_another_programs_kvd_variables_and_says_so(sock_dir: str) -> None:
    """A ``KVD_*`` variable like no setting is not a typo of one: the daemon starts, and
    says once, at warning level, that it ignores it."""
    stray = {"KVD_VLLM_VENV": "/opt/venv", "KVD_FOO": "1"}
    d = ProcessDaemon(sock_dir, env=stray)
    try:
        d.wait_ready()
        log = d.log()
    finally:
        assert d.stop() == 0, d.log()
    for var in sorted(stray):
        assert log.count(f" WARNING kvd.config: ignoring {var} (from env): not a kvd "
                         "setting\n") == 1, log


def test_the_projects_own_scripts_use_no_kvd_variable() -> None:
    """The daemon's prefix is the daemon's: a script's variable left in the environment of
    `kvd serve` would be read as a setting."""
    root = Path(__file__).parent.parent
    for script in [*root.glob(".ci/*"), *root.glob("benchmarks/*.sh")]:
        named = set(re.findall(r"\bKVD_[A-Z_]+", script.read_text()))
        assert named <= {"KVD_SOCKET_PATH", "KVD_CONFIG", "KVD_DEV"}, (script, named)


def test_demo_runs_with_a_stray_variable_in_the_environment() -> None:
    result = kvd("demo", "--blocks", "8", "--layers", "1", env=clean_env(KVD_FOO="1"),
                 timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bytes checked" in result.stdout
