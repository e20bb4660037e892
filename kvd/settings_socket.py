"""The local socket's path: its default, and whether a daemon may listen there
(:func:`socket_dir_problem` has the rules, and why)."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping

from kvd.settings_values import Check, InvalidValue

# sun_path is 108 bytes with the NUL. Keep a margin.
MAX_SOCKET_PATH_BYTES = 100


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


def _absolute_socket_path(value: str) -> str:
    """Make the path absolute (daemon and clients may run in different directories) and
    check that it fits in a Unix socket address."""
    path = os.path.abspath(value)
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise InvalidValue(
            f"path {path!r} is {size} bytes, over the {MAX_SOCKET_PATH_BYTES}-byte limit "
            "for a Unix socket"
        )
    return path


SOCKET_PATH = Check(f"a path of at most {MAX_SOCKET_PATH_BYTES} bytes", _absolute_socket_path,
                    whole=True, metavar="PATH")


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


def _writable_dir(path: str) -> bool:
    if os.access in os.supports_effective_ids:
        return os.access(path, os.W_OK | os.X_OK, effective_ids=True)
    return os.access(path, os.W_OK | os.X_OK)  # pragma: no cover


def socket_path_problem(path: str) -> str | None:
    """Why a daemon could not bind ``path`` (None: it could): its directory exists, is
    writable and no other user can replace the socket in it (:func:`socket_dir_problem`),
    or it can be created (the nearest existing ancestor is a writable directory). Creates
    nothing."""
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
