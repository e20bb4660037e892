"""Which tensor-parallel ranks of prefill lend a request's KV, and what each rank of decode
reads of whom, when the two engines split their KV heads over different numbers of ranks.

vLLM splits a model's ``heads`` KV heads evenly over ``tp`` ranks when there are at least
as many heads as ranks, and gives each rank one head, each head held by ``tp / heads``
ranks, when there are fewer. An MLA model's latent cache is the same on every rank: one
"head" that all ranks hold. The KV layout the connector asks vLLM for keeps a block's heads
outermost, so that a run of a rank's heads is one equal byte range of each block: a
``Part`` of it, which the daemon reads and writes in place.

Prefill: of the ranks that hold the same heads, only the first lends them (``lends``).
Decode: each rank reads each of its heads once, grouped by the prefill rank that lends
them (``reads``): a part of that rank's blocks into a part of its own, and says how many
decode ranks read each part, so that the lend is done once all of them have. Both ends
compute this alike from the same numbers: prefill's and decode's TP sizes, the heads in
all, whether the model is MLA.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.errors import BadRequest
from kvd.protocol import Part


def heads_of(rank: int, tp: int, heads: int) -> tuple[int, int]:
    """The first KV head rank ``rank`` of ``tp`` holds, and how many it holds."""
    if heads >= tp:
        return rank * heads // tp, heads // tp
    return rank * heads // tp, 1


def lender_of(head: int, tp: int, heads: int) -> int:
    """The rank of ``tp`` that lends head ``head``: the first that holds it."""
    return head * tp // heads if heads < tp else head // (heads // tp)


def check_pair(tp: int, their_tp: int, heads: int) -> None:
    """``BadRequest`` unless decode's ``tp`` ranks can read prefill's ``their_tp``: one size
    divides the other, and both split the ``heads`` KV heads evenly."""
    if max(tp, their_tp) % max(1, min(tp, their_tp)):
        raise BadRequest("neither divides the other")
    for size, who in ((their_tp, "prefill"), (tp, "decode")):
        if size < 1 or heads < 1 or (heads % size and size % heads):
            raise BadRequest(f"{who}: {heads} KV heads do not split evenly over "
                             f"tensor_parallel_size={size}")


def lends(rank: int, tp: int, heads: int) -> bool:
    """Whether prefill's rank ``rank`` lends its KV (others hold the same heads)."""
    return lender_of(heads_of(rank, tp, heads)[0], tp, heads) == rank


@dataclass(frozen=True)
class Read:
    """One pull of a decode rank: ``part`` of the blocks that prefill's rank ``rank``
    lends, into part ``into`` of its own; ``readers`` decode ranks read that part."""

    rank: int
    part: Part
    readers: int
    into: Part


def reads(rank: int, tp: int, their_tp: int, heads: int) -> list[Read]:
    """What decode's rank ``rank`` of ``tp`` reads of prefill's ``their_tp`` ranks."""
    check_pair(tp, their_tp, heads)
    first, count = heads_of(rank, tp, heads)
    readers = max(1, tp // heads)  # decode ranks that hold each head
    out: list[Read] = []
    head = first
    while head < first + count:
        lender = lender_of(head, their_tp, heads)
        lent_first, lent_count = heads_of(lender, their_tp, heads)
        group = min(count, lent_count)  # heads taken from this lender in one read
        out.append(Read(lender, Part((head - lent_first) // group, lent_count // group),
                        readers, Part((head - first) // group, count // group)))
        head += group
    return out
