"""Whose sockets are whose: a daemon removes only what it bound, a second one on a live
socket path is refused and takes nothing away, and no daemon listens in a directory that
another user can change. And the test fixtures leave no daemon behind, whatever fails."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvd import KvdClient, shared_zeros
from kvd.client import default_socket_path
from kvd.config import load_config
from kvd.errors import ConfigError
from tests.conftest import (
    READY_TIMEOUT_S,
    ProcessDaemon,
    leaked_daemons,
    start_daemons,
    wait_until,
)
from tests.test_process import fill_random, run_cli

OTHER_UID = 64990  # a user that is not this one (numeric: no account needed)
SERVE_FLAGS = ("--pool-size-bytes", "64MiB", "--peer-port", "0", "--data-port", "0",
               "--http-port", "0")

needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to give a directory to another user")


def files_at(path: str) -> dict[str, tuple[int, int]]:
    """The socket files at ``path``, by name: (device, inode)."""
    found = {}
    for name in (path,):
        if os.path.lexists(name):
            st = os.lstat(name)
            found[os.path.basename(name)] = (st.st_dev, st.st_ino)
    return found


def serves(path: str) -> None:
    """A client reaches the daemon at ``path`` on both its sockets: a ping, and a CPU
    region handed over the segment socket whose bytes go into the pool and back."""
    with KvdClient(path, timeout_s=10) as c:
        assert c.ping() > 0
        src, dst = fill_random((4, 4096), 5), shared_zeros((4, 4096), torch.uint8)
        r_src, r_dst = c.register("src", [src]), c.register("dst", [dst])
        c.offload("k", r_src, [0, 1, 2, 3])
        c.get("k", r_dst, [3, 2, 1, 0], timeout_s=10)
        assert torch.equal(dst, src.flip(0))
        c.delete("k")


# --------------------------------------------------------------------------- one path, one daemon


def test_a_second_serve_on_a_live_socket_is_refused_and_removes_nothing(
        process_daemon: ProcessDaemon) -> None:
    """A `kvd serve` run by hand on a node's live socket path exits 2 saying why, and the
    running daemon keeps both its sockets: clients still reach it, and hand it segments."""
    path = process_daemon.socket_path
    before = files_at(path)
    assert set(before) == {"kvd.sock"}
    result = run_cli("serve", "--socket-path", path, *SERVE_FLAGS, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"another daemon is serving {path}" in result.stderr
    assert files_at(path) == before  # the same files: neither removed nor replaced
    serves(path)
    # Refused at once, before it took a port or the pool: its one line says so (after the
    # start-up steps that ran: config read, imports).
    said = [line for line in result.stderr.strip().splitlines() if " kvd.startup: " not in line]
    assert len(said) == 1 and "pool" not in result.stderr, result.stderr


def test_two_daemons_started_at_once_one_serves_and_a_restart_takes_over(
        sock_dir: str) -> None:
    """Started together on one path, one daemon serves and the other is refused without
    touching it; once the first is killed (SIGKILL: nothing cleaned up), a new daemon
    takes the path over, and at its exit removes what it bound."""
    path = os.path.join(sock_dir, "kvd.sock")
    dirs = [os.path.join(sock_dir, name) for name in ("a", "b", "c")]
    for directory in dirs:
        os.makedirs(directory)
    pair = [ProcessDaemon(directory, socket_path=path) for directory in dirs[:2]]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while all(d.proc.poll() is None for d in pair):
            assert time.monotonic() < deadline, "neither daemon was refused"
            time.sleep(0.02)
        loser = next(d for d in pair if d.proc.poll() is not None)
        winner = next(d for d in pair if d is not loser)
        assert loser.proc.returncode == 2, loser.log()
        assert f"another daemon is serving {path}" in loser.log()
        winner.wait_ready()
        serves(path)
        winner.proc.kill()
        winner.proc.wait(30)
    finally:
        for d in pair:
            d.stop()
    assert set(files_at(path)) == {"kvd.sock"}  # left by the killed one
    restarted = ProcessDaemon(dirs[2], socket_path=path)
    try:
        restarted.wait_ready()
        serves(path)
    finally:
        assert restarted.stop() == 0, restarted.log()
    assert sorted(os.listdir(sock_dir)) == ["a", "b", "c"]  # its sockets and lock, gone


# --------------------------------------------------------------------------- socket directories


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temporary directory of this test's own as the one the default socket path
    falls back to (no XDG_RUNTIME_DIR, no KVD_SOCKET_PATH)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("KVD_SOCKET_PATH", raising=False)
    yield tmp_path


@needs_root
def test_a_fallback_socket_dir_that_another_user_can_change_is_refused(
        private_tmp: Path) -> None:
    """``kvd-<uid>`` in the temporary directory can be made by anyone, first. The daemon
    refuses it unless it is a real directory of its own user that no one else can write,
    saying why; so does a client that would look for the daemon there."""
    fallback = private_tmp / f"kvd-{os.getuid()}"
    fallback.mkdir()

    def refused() -> str:
        with pytest.raises(ConfigError) as daemon_side:
            load_config(env={})
        with pytest.raises(ConfigError) as client_side:
            default_socket_path()
        with pytest.raises(ConfigError):
            KvdClient()
        assert str(fallback) in str(client_side.value)
        message = str(daemon_side.value)
        assert message.startswith("socket_path: ") and message.endswith("(from default)")
        return message

    os.chown(fallback, OTHER_UID, OTHER_UID)
    fallback.chmod(0o777)
    assert f"belongs to uid {OTHER_UID}, not to this daemon's user" in refused()
    fallback.chmod(0o700)  # its owner can open it up again at any time
    assert f"belongs to uid {OTHER_UID}" in refused()
    os.chown(fallback, os.getuid(), os.getgid())
    fallback.chmod(0o777)
    assert "is writable by other users (mode 0777)" in refused()
    fallback.chmod(0o770)
    assert "is writable by other users (mode 0770)" in refused()
    fallback.rmdir()
    own = private_tmp / "elsewhere"
    own.mkdir(mode=0o700)
    fallback.symlink_to(own)
    assert "is not a directory" in refused()
    fallback.unlink()
    fallback.mkdir(mode=0o750)
    path = load_config(env={}).socket_path
    assert path == str(fallback / "kvd.sock") == default_socket_path()


@needs_root
def test_serve_refuses_a_fallback_dir_of_another_user_and_makes_its_own(
        sock_dir: str, private_tmp: Path) -> None:
    """`kvd serve` without a socket path, and without XDG_RUNTIME_DIR: a ``kvd-<uid>``
    left in the temporary directory by another user stops it at once (exit 2), with
    nothing created in it. Without one it makes a private one, where a client with the
    same environment finds it."""
    env = {"TMPDIR": str(private_tmp), "XDG_RUNTIME_DIR": ""}
    fallback = private_tmp / f"kvd-{os.getuid()}"
    fallback.mkdir()
    os.chown(fallback, OTHER_UID, OTHER_UID)
    fallback.chmod(0o777)
    path = str(fallback / "kvd.sock")
    d = ProcessDaemon(sock_dir, env=env, socket_path=path, socket_flag=False)
    try:
        code = d.proc.wait(READY_TIMEOUT_S)
    finally:
        d.stop()
    assert code == 2, d.log()
    assert f"belongs to uid {OTHER_UID}" in d.log() and "(from default)" in d.log()
    assert os.listdir(fallback) == []
    fallback.rmdir()
    d = ProcessDaemon(sock_dir, env=env, socket_path=path, socket_flag=False)
    try:
        d.wait_ready()
        st = fallback.stat()
        assert st.st_uid == os.geteuid() and st.st_mode & 0o022 == 0, oct(st.st_mode)
        assert default_socket_path() == path
        with KvdClient() as c:
            assert c.ping() > 0
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize(("layout", "problem"), [
    pytest.param("other-owner", f"directory '{{d}}' belongs to uid {OTHER_UID}, neither this "
                 "daemon's", marks=needs_root, id="other-owner-refused"),
    pytest.param("world-writable", "directory '{d}' is writable by every user (mode 0777)",
                 id="world-writable-refused"),
    pytest.param("sticky-world-writable", "directory '{d}' is writable by every user (mode "
                 "1777)", id="sticky-world-writable-refused"),
    pytest.param("above-of-other-owner", f"(above the socket's) belongs to uid {OTHER_UID}",
                 marks=needs_root, id="above-of-other-owner-refused"),
    pytest.param("above-world-writable", "directory '{a}' (above the socket's) is writable "
                 "by every", id="above-world-writable-refused"),
    # An operator's choice: the daemon's group may write.
    pytest.param("group-writable", None, id="group-writable-accepted"),
    # As /tmp: others cannot move what is not theirs.
    pytest.param("above-sticky", None, id="above-sticky-accepted"),
])
def test_an_operators_socket_dir_that_another_user_can_change_is_refused(
        tmp_path: Path, layout: str, problem: str | None) -> None:
    above = tmp_path / "above"
    above.mkdir(mode=0o755)
    directory = above / "run"
    directory.mkdir(mode=0o750)
    mode, above_mode = {
        "world-writable": (0o777, 0o755), "sticky-world-writable": (0o1777, 0o755),
        "above-world-writable": (0o750, 0o777), "group-writable": (0o770, 0o755),
        "above-sticky": (0o750, 0o1777),
    }.get(layout, (0o750, 0o755))
    directory.chmod(mode)
    above.chmod(above_mode)
    if layout == "other-owner":
        os.chown(directory, OTHER_UID, OTHER_UID)
    if layout == "above-of-other-owner":
        os.chown(above, OTHER_UID, OTHER_UID)
    env = {"KVD_SOCKET_PATH": str(directory / "kvd.sock")}
    if problem is None:
        assert load_config(env=env).socket_path == env["KVD_SOCKET_PATH"]
        return
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    assert problem.format(d=directory, a=above) in str(err.value)
    assert str(err.value).endswith("(from env KVD_SOCKET_PATH)")


# --------------------------------------------------------------------------- no daemon left behind


def test_a_daemon_not_ready_in_time_is_killed(sock_dir: str) -> None:
    d = ProcessDaemon(sock_dir)
    try:
        # The net sees it (once its command line is there: just after exec it may not be).
        wait_until(lambda: d.proc.pid in [pid for pid, _ in leaked_daemons()])
        with pytest.raises(AssertionError, match=r"not ready in 0\.01s"):
            d.wait_ready(timeout_s=0.01)  # not even a forked daemon is ready that fast
        assert d.proc.poll() is not None  # killed, and reaped
        assert d.proc.pid not in [pid for pid, _ in leaked_daemons()]
    finally:
        d.stop()


def test_start_daemons_stops_all_when_one_fails(sock_dir: str) -> None:
    """The first daemon becomes ready, the second cannot start (a node id with a space):
    the first is stopped too, and the error is the second one's."""
    before = leaked_daemons()
    with pytest.raises(AssertionError, match="node_id"):
        start_daemons(sock_dir, "good", "bad name")
    assert leaked_daemons() == before
