"""What an engine asks its ``KvMover`` to do, and what the mover reports back.

Orders (send, load, discard, renew, release) go in from the engine's step loop; ``Polled``
comes out of each ``poll``; ``MoverStats`` counts what moved. They are plain data, apart
from the mover that acts on them, so that a connector's scheduler side (which builds
orders but moves no bytes) imports them without the data path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd.protocol import WHOLE, Part


@dataclass
class SendOrder:
    """Send blocks ``block_ids`` of request ``req_id`` under ``key``: lent for one pull
    (``push_to`` None) or put to the daemon at ``push_to``; given up after ``lease_s``.

    A request may be sent in parts (one order each, one key each): it is released once its
    ``final`` order has come and every part is done with the engine's blocks. ``stage``:
    copy the blocks to staging first even when they could be read in place (a part sent
    while the request still runs: the engine may reuse its blocks before the send ends)."""

    req_id: str
    key: str
    block_ids: list[int]
    lease_s: float
    push_to: str | None = None
    final: bool = True
    stage: bool = False
    group: int = 0  # the KV cache group whose blocks these are (kv_groups)


@dataclass
class LoadOrder:
    """Bring ``key`` (``remote_blocks`` blocks) into this engine: its blocks from
    ``first`` on go into ``block_ids`` (the ones before are cached here already, and do
    not cross the wire). From daemon ``source`` (pull), or, with ``source`` None, pushed
    to this daemon. With tensor parallelism of other sizes on the two sides
    (``kv_ranks``): ``part`` of each of the key's blocks goes into part ``into`` of each
    of ``block_ids``, and ``readers`` ranks read each part of the key."""

    req_id: str
    key: str
    source: str | None
    remote_blocks: int
    first: int
    block_ids: list[int]
    timeout_s: float
    parts: int = 1  # how many orders (keys) the request is loaded from; all come together
    # Not '': the load is refused before it starts (prefill's KV does not fit this engine,
    # said once by the scheduler): it fails at once, and vLLM's failure policy applies.
    refusal: str = ""
    part: Part = WHOLE
    readers: int = 1
    into: Part = WHOLE
    their_tp: int = 0  # prefill's tensor-parallel size, when told (0: not told)
    # Pushed (``source`` None): the daemon that pushes it, when known. The load fails at
    # once if that daemon cannot be reached or goes while the key has not come.
    sender: str | None = None
    group: int = 0  # the KV cache group whose blocks these are (kv_groups)


@dataclass
class DiscardOrder:
    """Request ``req_id`` will not load ``key``, pushed (or still to be) to this daemon by
    ``sender`` (None: not known), a part of a prompt that this engine has cached itself:
    the key is released at this daemon (dropped if it is here, refused if it comes) and at
    the sender (its put then sends nothing).

    ``skip`` (not 0): only the key's first ``skip`` blocks are cached here, and the
    request loads the rest: they are released at the sender alone, whose put then sends
    only the others (what comes here whole, if it was sent already, is loaded anyway)."""

    req_id: str
    key: str
    sender: str | None = None
    their_tp: int = 0
    group: int = 0
    skip: int = 0


@dataclass
class RenewOrder:
    """Request ``req_id`` still means to load ``key``, lent at daemon ``source``: keep it
    there ``ttl_s`` more (the request waits in the engine's queue)."""

    req_id: str
    key: str
    source: str
    ttl_s: float
    their_tp: int = 0  # as in LoadOrder: which of prefill's keys this rank reads
    group: int = 0  # as in LoadOrder


@dataclass
class ReleaseOrder:
    """Request ``req_id`` will not load ``key``, lent at daemon ``source`` (it was aborted,
    or is computed here): the lender is told to free it now."""

    req_id: str
    key: str
    source: str
    their_tp: int = 0
    group: int = 0
    skip: int = 0  # not 0: only the key's first blocks (a DiscardOrder's ``skip``)


@dataclass
class Polled:
    released: set[str] = field(default_factory=set)  # sends: the engine may free the blocks
    loaded: set[str] = field(default_factory=set)  # loads that completed
    failed: dict[str, list[int]] = field(default_factory=dict)  # loads that failed: blocks
    causes: dict[str, str] = field(default_factory=dict)  # why each of those failed
    refused: set[str] = field(default_factory=set)  # failed ones that were refused: said
    aborted: set[str] = field(default_factory=set)  # failed ones released first (aborted)
    nbytes: dict[str, int] = field(default_factory=dict)  # loaded ones: the bytes they took


@dataclass
class MoverStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    sends: int = 0
    sends_unread: int = 0  # lent, and nobody pulled them before the lease ended
    sends_released: int = 0  # released by decode (aborted, or cached there): lent unread, or
    # pushed without a byte
    # Bytes of keys sent that did not cross the wire as decode had them cached or would not
    # load them: the released sends', and the cached blocks of a part it loaded the rest of.
    bytes_unsent: int = 0
    send_failures: int = 0
    loads: int = 0
    load_failures: int = 0
    load_seconds: float = 0.0  # summed over completed loads
    pull_retries: int = 0  # pulls that found no key yet (not lent yet) and went again
    parts_dropped: int = 0  # pushed parts this engine had cached: released
    loads_refused: int = 0  # refused: prefill's KV did not fit this engine (kvd_compat)
    loads_gone: int = 0  # found their key gone at prefill (its lease ended, or released)
    leases_renewed: int = 0  # renewals of prefill's lease that its daemon took
    leases_released: int = 0  # keys released at prefill (aborted, not loaded, failed)
    # Samples since the last report (taken by ``take_samples``), for histograms: each
    # request loaded, and each key sent, as [seconds, bytes].
    load_samples: list[list[float]] = field(default_factory=list)
    send_samples: list[list[float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, int | float]:
        """The counters (cumulative)."""
        return {k: v for k, v in self.__dict__.items() if not isinstance(v, list)}

    def take_samples(self) -> dict[str, list[list[float]]]:
        """The samples since the last call."""
        taken = {"load_samples": self.load_samples, "send_samples": self.send_samples}
        self.load_samples, self.send_samples = [], []
        return taken
