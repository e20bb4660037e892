"""What the daemon accepts as a client's shared-memory segment (client/shm.py makes them).

A segment is a file descriptor a client handed over (daemon/lifelines.py): it must be
a non-empty regular file sealed against shrinking. The seal is what makes mapping it
safe: a mapping of a file that is truncated under it faults (SIGBUS) on the next touch,
and the daemon touches client memory from its own threads, so one truncating client
would take the daemon, and every other client, down with it.
"""

from __future__ import annotations

import fcntl
import os
import stat

from kvd.errors import BadRequest


def check_segment(fd: int) -> int:
    """The segment's size; BadRequest unless it is a non-empty regular file sealed against
    shrinking (only memfds can be sealed)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        raise BadRequest("a segment must be a non-empty regular file (kvd.shared_empty)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a file that can carry seals at all
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise BadRequest("a segment must be a memfd sealed against shrinking "
                         "(kvd.shared_empty makes them)")
    return st.st_size
