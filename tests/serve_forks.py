"""`kvd serve` for the tests, forked from a process that has imported the daemon already.

Each `python -m kvd.cli serve` spends 2-4 s of a 2-core machine's CPU importing torch
before it does anything; the suite starts about a hundred of them. This process imports
what `kvd serve` imports once, then forks one child per daemon a test asks for. The child
is `kvd serve` from there on: the same ``kvd.cli.main`` with the test's arguments,
environment, log file and open-files limit, on its own sockets. Only the import is shared.
The tests that check how the command itself starts (`test_cli.py`, `test_process.py`,
`test_startup.py`) run `python -m kvd.cli serve` as a user does.

The fork is safe because this process never starts a thread: importing torch and the
daemon's modules starts none, and a child runs only after the fork.

The test process talks to it over its stdin and stdout, a JSON line each way:
``{"spawn": {...}}`` answers ``{"pid": N}``; ``{"reap": N}`` (sent once the child has
ended) answers ``{"code": C}`` as `subprocess` gives it (``-signal`` for a signal). Its
stdin closing ends it. ``Forked`` is the test side's handle on a child, with the part of
`subprocess.Popen`'s surface the tests use.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import traceback
from typing import IO, Any


def _child(spawn: dict[str, Any]) -> None:
    """In the forked child: becomes `kvd serve` with the asked-for surroundings; never
    returns."""
    code = 1
    try:
        log = os.open(spawn["log"], os.O_WRONLY | os.O_APPEND)  # made empty by the asker
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # (0 and 1 were the control pipe: this child must not hold them)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(spawn["cwd"])
        os.environ.clear()
        os.environ.update(spawn["env"])
        if spawn["open_files"] is not None:
            limit = spawn["open_files"]
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from kvd.cli import main

        sys.argv = ["kvd", *spawn["argv"]]
        code = main(spawn["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_requests() -> None:
    # The imports every child shares (kvd.cli: the module each runs)
    import kvd.cli
    import kvd.daemon.service  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C goes to the tests, which stop us
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        ask = json.loads(line)
        if "spawn" in ask:
            pid = os.fork()
            if pid == 0:
                _child(ask["spawn"])
            answer: dict[str, int] = {"pid": pid}
        else:
            _, status = os.waitpid(ask["reap"], 0)
            answer = {"code": -os.WTERMSIG(status) if os.WIFSIGNALED(status)
                      else os.WEXITSTATUS(status)}
        out.write(json.dumps(answer) + "\n")
        out.flush()


class Forks:
    """The test side: starts the forking process at its first use; one request at a
    time (the tests' threads share it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The forking process's pid (not a daemon: its children are)."""
        return None if self._proc is None else self._proc.pid

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise AssertionError("the process forking `kvd serve` was closed: its "
                                     "children's ends can no longer be read")
            if self._proc is None:
                root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                self._proc = subprocess.Popen([sys.executable, "-m", "tests.serve_forks"],
                                              cwd=root, text=True, stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE)
                self._read(self._proc.stdout)
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            return self._read(self._proc.stdout)

    def _read(self, stream: IO[str] | None) -> dict[str, Any]:
        assert stream is not None and self._proc is not None
        line = stream.readline()
        if not line:
            raise AssertionError(f"the process forking `kvd serve` ended "
                                 f"({self._proc.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def spawn(self, argv: list[str], env: dict[str, str], log: str,
              open_files: int | None) -> Forked:
        with open(log, "wb"):  # there (empty) from now on, as with Popen(stdout=file)
            pass
        pid = self._ask({"spawn": {"argv": argv, "env": env, "log": log, "cwd": os.getcwd(),
                                   "open_files": open_files}})["pid"]
        return Forked(self, pid)

    def reap(self, pid: int) -> int:
        code: int = self._ask({"reap": pid})["code"]
        return code

    def close(self) -> None:
        """Ends the forking process (its children are the tests' to stop first)."""
        with self._lock:
            self._closed = True
            if self._proc is not None:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(30)


class Forked:
    """A forked `kvd serve`, seen like a `subprocess.Popen`: ``pid``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``. Its end is seen through a
    pidfd; its exit code comes from the forking process, which alone can reap it (until
    then the pid stays its own: no signal reaches another process)."""

    def __init__(self, forks: Forks, pid: int) -> None:
        self._forks = forks
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        return self._ended(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"kvd serve (pid {self.pid})", timeout or 0)
        return code

    def _ended(self, timeout: float | None) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], timeout)[0]:
            self.returncode = self._forks.reap(self.pid)
            os.close(self._pidfd)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    _serve_requests()
