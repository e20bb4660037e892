"""One NCCL transfer job, and the shape of its work: what a channel runs and what it waits for.

A job (``NcclJob``) is one transfer's send or receive on an ``NcclChannel``
(``transport.nccl_channel``), with its deadline and the future its owner awaits. Its
work is a generator of steps (``transport.nccl_streams``): between two yields it issues
work on the GPU, and each yield says what to wait for before the next step — ``SETTLE``
(the last NCCL call accepted), or, last, a ``LastStep`` whose event fires when the bytes
are there. This module holds those shared shapes, so that the channel (whose worker
thread runs the steps) and the streams (which make them) depend on it and not on each
other.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvd.errors import PeerUnreachable
from kvd.memory.regions import Layout
from kvd.transport.chunks import BlockSet

SETTLE = object()  # a step waits for the last NCCL call to be accepted
# A job's steps: each yields what to wait for (SETTLE, an event, or LastStep, last); the
# generator's value is the bytes moved.
Steps = Generator[Any, None, int]


@dataclass(eq=False)
class NcclJob:
    transfer_id: int
    blocks: BlockSet | None  # None: a receive nobody wants any more (bytes dropped)
    layout: Layout
    num_blocks: int
    deadline: float  # time.monotonic()
    nbytes: int = 0
    chunk_bytes: int = 0  # as the ACCEPT said (both ends must cut the bytes alike)
    ready_events: list[Any] = field(default_factory=list)  # sender: clients' writes first
    future: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)
    started_at: float = 0.0
    abandoned: bool = False  # receiver: drop the bytes instead of storing them


@dataclass(frozen=True)
class LastStep:
    """A job's last step: all its work is queued, ``event`` fires when its bytes are there
    (sent, or stored in their blocks)."""

    event: Any


def time_left(job: NcclJob, channel: str) -> float:
    """Seconds until ``job``'s deadline; ``PeerUnreachable`` once it has passed."""
    left = job.deadline - time.monotonic()
    if left <= 0:
        raise PeerUnreachable(f"transfer {job.transfer_id} on {channel} ran out of time")
    return left


def finish_steps(steps: Steps) -> int:
    """The bytes of a job whose last event fired (its steps end after ``LastStep``)."""
    try:
        steps.send(None)
    except StopIteration as stop:
        return int(stop.value)
    raise AssertionError("a job's steps went on after its last")


def only_direct(direct: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """Every chunk's memory, when each goes straight from (or into) it; else None."""
    bufs = [d for d in direct if d is not None]
    return bufs if bufs and len(bufs) == len(direct) else None
