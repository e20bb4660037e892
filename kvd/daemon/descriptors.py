"""The file descriptors the daemon's clients may make it hold.

A process at its open-file limit fails every ``accept``, ``socket`` and ``open``; some
libraries do not survive that (libzmq's IPC listener aborts the process on ``EMFILE``).
So what clients open or hand over never takes the daemon to its limit: each client
descriptor is counted here, and the next connection or handoff past ``capacity`` is
refused with a counted error. A ``reserve`` below the limit stays for the daemon's own
work: peers and their data connections, NCCL, logs, the HTTP port.

What a client costs: ``PER_LIFELINE`` while its lifeline is open (the connection, the
descriptor of its DEALER's endpoint, and the ROUTER's connection to it inside ZeroMQ),
and ``PER_SEGMENT`` for each shared-memory segment its session holds (the descriptor
handed over, and the one its region's mapping keeps).
"""

from __future__ import annotations

import resource

PER_LIFELINE = 3
PER_SEGMENT = 2
# Kept for the daemon's own descriptors: a quarter of the limit, and at least this many.
MIN_RESERVE = 512


class DescriptorBudget:
    """Descriptors clients hold, against what they may (``capacity``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reserve = max(MIN_RESERVE, limit // 4)
        self.capacity = max(0, limit - self.reserve)
        self.held = 0

    @classmethod
    def from_limit(cls) -> DescriptorBudget:
        """A budget under the process's soft limit on open files, as it is now."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls(soft if soft != resource.RLIM_INFINITY else 1 << 20)

    def take(self, n: int) -> bool:
        """Count ``n`` more, if they fit."""
        if self.held + n > self.capacity:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n
        assert self.held >= 0, "descriptors given back that were never taken"

    def refusal(self) -> str:
        """Why the next is refused, for the client."""
        return (f"the daemon holds as many client descriptors as it may ({self.capacity} of "
                f"its open-file limit {self.limit}); close other clients, or raise the "
                "daemon's LimitNOFILE")
