"""Which daemon owns a socket path, and which socket files are whose.

A socket path belongs to one daemon at a time: the one that holds an exclusive ``flock``
on ``<socket_path>.lock``, taken first thing at start and dropped by the kernel when the
process ends, however it ends. A second `kvd serve` on the path, or two started at once,
cannot both have it: the loser is refused before it allocates anything, and removes
nothing. Only the owner clears a socket file a dead daemon left; and at exit a daemon
removes only the files it bound itself (same device and inode), never one that took their
place.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from dataclasses import dataclass

from kvd.errors import ConfigError

log = logging.getLogger(__name__)


def lock_path(socket_path: str) -> str:
    return socket_path + ".lock"


def starting_path(socket_path: str) -> str:
    """``<pid> <step>`` while the daemon that holds the path starts (``PathClaim.say``);
    no file once it serves. Readable by clients, unlike the lock, which one could hold."""
    return socket_path + ".starting"


def daemon_starting(socket_path: str) -> str | None:
    """What a client is told while the daemon of ``socket_path`` starts; None when none
    does (no file, or its process is gone)."""
    try:
        with open(starting_path(socket_path)) as f:
            pid_text, _, step = f.read().partition(" ")
        os.kill(int(pid_text), 0)
    except PermissionError:  # (a process of another user's: there)
        pass
    except (OSError, ValueError):
        return None
    return f"a kvd daemon is starting at {socket_path} (pid {pid_text}): {step.strip()}"


class PathClaim:
    """This process's hold on a socket path (see the module's docstring)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._fd: int | None = None

    def take(self) -> None:
        """Hold the path, or ``ConfigError`` when another daemon does."""
        path = lock_path(self.socket_path)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError as exc:
                raise ConfigError(f"socket_path: cannot open the lock file {path}: "
                                  f"{exc.strerror or exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(f"socket_path: another daemon is serving "
                                  f"{self.socket_path}") from None
            # The owner before us removes the file as it exits: a lock on a file no longer
            # at the path holds nothing, so take the one that is there now.
            try:
                same = _identity(os.stat(path)) == _identity(os.fstat(fd))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return
            os.close(fd)

    def say(self, step: str) -> None:
        """Tell clients where the start-up stands (any thread); '' once it serves."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if not step:
                os.unlink(starting_path(self.socket_path))
                return
            path = starting_path(self.socket_path)
            fd = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                         0o644)
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {step}\n")
            os.replace(path + ".new", path)  # (a reader sees the old line or the new)

    def release(self) -> None:
        """Let the path go (after the sockets are closed and removed)."""
        self.say("")
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):  # removed while we hold it: nobody else has it
            if _identity(os.stat(lock_path(self.socket_path))) == _identity(os.fstat(fd)):
                os.unlink(lock_path(self.socket_path))
        os.close(fd)


@dataclass(frozen=True)
class BoundFile:
    """A socket file this process bound: the path, and the file that was there then."""

    path: str
    dev: int
    ino: int


def bind_unix(sock: socket.socket, path: str) -> BoundFile:
    """Bind ``sock`` at ``path``, first removing a socket file left there (the caller owns
    the path: its ``PathClaim``, or a live daemon's socket that answered)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock.bind(path)
    return BoundFile(path, *_identity(os.lstat(path)))


def remove_bound(bound: BoundFile | None) -> None:
    """Remove the socket file ``bound``, if it is still the one at its path."""
    if bound is None:
        return
    try:
        now = _identity(os.lstat(bound.path))
    except FileNotFoundError:
        return
    if now != (bound.dev, bound.ino):
        log.warning("not removing %s: another socket took its place", bound.path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(bound.path)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
