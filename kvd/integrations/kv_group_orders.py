"""A request's orders for each KV cache group: what prefill sends and decode loads.

The connector's scheduler side builds these from vLLM's block lists (one per group,
``kv_groups``) and hands them to its workers. A full-attention group moves as a model
with one group always did: every block, in parts of ``part_blocks`` in the push flow
(``kv_parts``), decode skipping the blocks it has cached. A sliding-window group and a
state group move under one key each, when the request has finished: the blocks still in
the window, or the one block that holds the state. With one full-attention group these
are exactly the orders of a connector before groups (the same keys: no ``#g``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvd.errors import BadRequest
from kvd.integrations.kv_groups import FULL, SLIDING, Group, blocks_to_send, group_key, load_of
from kvd.integrations.kv_orders import DiscardOrder, LoadOrder, SendOrder
from kvd.integrations.kv_parts import blocks_for, part_key, part_ranges

Keys = list[list[tuple[str, int, int]]]  # per group: (key, first block, end) of each part


def keys_of(groups: Sequence[Group], key: str, tokens: int, part_blocks: int) -> Keys:
    """Per group, the keys a request of ``tokens`` tokens moves under, with the blocks
    each holds (a state group's one block is counted as the last)."""
    n = blocks_for(tokens, groups[0].block_size)
    out: Keys = []
    for g, group in enumerate(groups):
        gkey = group_key(key, g, len(groups))
        if group.kind == FULL:
            ranges = part_ranges(n, part_blocks)
            out.append([(part_key(gkey, j, len(ranges)), lo, hi)
                        for j, (lo, hi) in enumerate(ranges)])
        elif group.kind == SLIDING:
            out.append([(gkey, group.first_block(tokens), n)])
        else:
            out.append([(gkey, n - 1, n)])
    return out


@dataclass(frozen=True)
class Sending:
    """What prefill sends of one request: under ``key``, ``tokens`` tokens, to
    ``push_to`` (None: lent for a pull), in parts of ``part_blocks`` (0: one)."""

    req_id: str
    key: str
    tokens: int
    lease_s: float
    push_to: str | None = None
    part_blocks: int = 0


def finished_sends(groups: Sequence[Group], s: Sending, ids: Sequence[Sequence[int]],
                   sent: int = 0) -> list[SendOrder]:
    """The sends of a finished request (``ids``: its block list in each group), but the
    first ``sent`` parts of full-attention groups, which went while it ran.
    ``BadRequest`` when a group no longer holds a block it would send."""
    orders: list[SendOrder] = []
    n = blocks_for(s.tokens, groups[0].block_size)
    for g, (group, parts) in enumerate(zip(groups, keys_of(groups, s.key, s.tokens,
                                                           s.part_blocks), strict=True)):
        if group.kind != FULL:
            orders.append(SendOrder(s.req_id, parts[0][0], blocks_to_send(group, ids[g],
                                                                          s.tokens),
                                    s.lease_s, push_to=s.push_to, group=g))
            continue
        if len(ids[g]) < n:
            raise BadRequest(f"group {g} has {len(ids[g])} blocks for {n}")
        for j in range(sent, len(parts)):
            part, lo, hi = parts[j]
            orders.append(SendOrder(s.req_id, part, list(ids[g][lo:hi]), s.lease_s,
                                    push_to=s.push_to, final=j == len(parts) - 1, group=g))
    return orders


def written_sends(groups: Sequence[Group], s: Sending, written: int, sent: int,
                  ids: Callable[[], Sequence[Sequence[int]]]) -> tuple[list[SendOrder], int]:
    """Push flow, a request still being prefilled: the parts of its full-attention groups
    whose blocks its first ``written`` tokens have filled, from part ``sent`` on, but
    never the last (it goes when the request finishes), and how many parts have gone
    then. Staged: the engine may reuse a running request's blocks before a send ends.
    (Other groups go when it finishes.)"""
    orders: list[SendOrder] = []
    block_size = groups[0].block_size
    ranges = part_ranges(blocks_for(s.tokens, block_size), s.part_blocks)
    got: Sequence[Sequence[int]] | None = None
    while sent < len(ranges) - 1:
        lo, hi = ranges[sent]
        if written < hi * block_size:
            break
        got = got if got is not None else ids()
        for g, group in enumerate(groups):
            if group.kind == FULL:
                orders.append(SendOrder(
                    s.req_id, part_key(group_key(s.key, g, len(groups)), sent, len(ranges)),
                    list(got[g][lo:hi]), s.lease_s, push_to=s.push_to, final=False,
                    stage=True, group=g))
        sent += 1
    return orders, sent


@dataclass(frozen=True)
class Loading:
    """What decode loads of one request: ``key`` from ``source`` (None: pushed here),
    ``tokens`` tokens, in parts of ``part_blocks`` (as prefill sent them); its first
    ``first`` blocks are cached here."""

    req_id: str
    key: str
    source: str | None
    tokens: int
    first: int
    timeout_s: float
    part_blocks: int = 0
    their_tp: int = 0
    sender: str | None = None  # pushed: the daemon that pushes it, when known


def discards(groups: Sequence[Group], keys: Keys, req_id: str, sender: str | None = None,
             their_tp: int = 0) -> list[DiscardOrder]:
    """Pushed keys of request ``req_id`` that decode releases (``keys``, per group: the
    parts it will not load), pushed by ``sender`` when known."""
    return [DiscardOrder(req_id, key, sender, their_tp=their_tp, group=g)
            for g in range(len(groups)) for key, _, _ in keys[g]]


def refused_loads(groups: Sequence[Group], ld: Loading, ids: Sequence[Sequence[int]],
                  why: str) -> list[LoadOrder]:
    """A load refused before it starts: one order per group, failed at once by the
    worker (its blocks are reported invalid where vLLM takes block ids)."""
    n = blocks_for(ld.tokens, groups[0].block_size)
    return [LoadOrder(ld.req_id, group_key(ld.key, g, len(groups)), ld.source, n, ld.first,
                      list(ids[g][ld.first:n]) if group.kind == FULL else [], ld.timeout_s,
                      refusal=why, group=g)
            for g, group in enumerate(groups)]


def loads(groups: Sequence[Group], ld: Loading, ids: Sequence[Sequence[int]],
          ) -> tuple[list[LoadOrder], list[DiscardOrder]]:
    """The loads of a request (``ids``: its block list in each group), and the pushed
    parts it releases (full-attention parts wholly inside the local prefix hit, and the
    cached blocks of the one that straddles the hit, at prefill's daemon when known).
    ``BadRequest`` when a group has not allocated a block it would load into."""
    orders: list[LoadOrder] = []
    dropped: Keys = []
    heads: list[DiscardOrder] = []
    for g, (group, parts) in enumerate(zip(groups, keys_of(groups, ld.key, ld.tokens,
                                                           ld.part_blocks), strict=True)):
        if group.kind != FULL:
            load = load_of(group, ids[g], ld.tokens, ld.first)
            orders.append(LoadOrder(ld.req_id, parts[0][0], ld.source, load.remote_blocks,
                                    load.skip, load.block_ids, ld.timeout_s,
                                    their_tp=ld.their_tp, group=g, sender=ld.sender))
            dropped.append([])
            continue
        dropped.append([p for p in parts if p[2] <= ld.first])
        wanted = [p for p in parts if p[2] > ld.first]
        for key, lo, hi in wanted:
            into = list(ids[g][max(lo, ld.first):hi])
            if len(into) != hi - max(lo, ld.first):
                raise BadRequest(f"group {g} has {len(ids[g])} blocks for {hi}")
            orders.append(LoadOrder(ld.req_id, key, ld.source, hi - lo, max(ld.first - lo, 0),
                                    into, ld.timeout_s, parts=len(wanted),
                                    their_tp=ld.their_tp, group=g, sender=ld.sender))
            if lo < ld.first and ld.sender is not None:
                # The part that holds the first block not cached here: prefill's daemon
                # is told to send only its blocks from there on.
                heads.append(DiscardOrder(ld.req_id, key, ld.sender, their_tp=ld.their_tp,
                                          group=g, skip=ld.first - lo))
    if ld.source is not None:
        return orders, []
    return orders, discards(groups, dropped, ld.req_id, ld.sender, ld.their_tp) + heads
