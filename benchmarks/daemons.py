"""What the benchmarks share: stopping a `kvd serve` subprocess they started."""

from __future__ import annotations

import signal
import subprocess
import sys


def stop_daemon(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        print("warning: kvd daemon did not stop in 30s; killing it", file=sys.stderr)
        proc.kill()
        proc.wait(5)
        return
    if code != 0:
        print(f"warning: kvd daemon exited with code {code}", file=sys.stderr)
