"""What a request moves under which key, without the engine's types: its KV cache groups,
the blocks each moves, the parts they are cut in, and the orders for them.

vLLM's hybrid KV cache manager gives each kind of layer a group of its own, with a block
list per request: full attention (a block for each ``block_size`` tokens), sliding-window
attention (the same positions, but blocks that no later token attends to are freed and
replaced by the *null block*), and recurrent state (Mamba, GDN: one block holds the state
after the tokens computed so far; the rest of its list is null placeholders, and
speculative scratch slots at its end). All groups take their blocks from one pool, so a
block id means a block of one group's layers only.

Both ends compute what moves from the same numbers (the groups, the tokens moved, the
block size), so that decode knows each key's blocks without being told:

- full attention: every block of the request, from ``first`` on (the ones decode has
  cached locally do not cross the wire), in parts of ``part_blocks`` in the push flow;
- sliding window: the blocks from the first one that the next token still attends to;
- state: the one block that holds the state. A state holds every token it has seen, so
  it cannot be shortened the way a KV cache is: prefill computes all but the prompt's last
  token (``backoff``) and decode computes that one on the state it loaded. A sliding
  window does the same (see ``backoff``).

Each group moves under its own key (``group_key``: ``key#g<index>`` when there is more
than one group), each part under its own (``part_key``: ``#p<index>``); with one
full-attention group these are the keys of a connector before groups. A sliding-window or
state group moves when the request has finished. Prefill refuses to send a block that it
no longer holds (a null block), and decode refuses to load into one: neither happens when
both ends follow the rules above, and a load that cannot be made fails at once (vLLM's
failure policy applies).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvd.errors import BadRequest
from kvd.integrations.kv_orders import DiscardOrder, LoadOrder, SendOrder

# vLLM's null block (``BlockPool.null_block``: the first block of the pool, never handed
# out): the placeholder for a position whose block was freed or was never allocated.
NULL_BLOCK = 0

FULL, SLIDING, STATE = "full", "sliding", "state"
KINDS = (FULL, SLIDING, STATE)


@dataclass(frozen=True)
class Group:
    """One KV cache group, as the connector moves it."""

    kind: str  # FULL, SLIDING or STATE
    block_size: int  # tokens per block
    window: int = 0  # SLIDING: the tokens a token attends to, itself included
    scratch_blocks: int = 0  # STATE: speculative slots at the end of its block list

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.block_size < 1:
            raise BadRequest(f"bad KV cache group {self}")
        if (self.kind == SLIDING) != (self.window > 0):
            raise BadRequest(f"a sliding-window group needs its window, and only it: {self}")

    @property
    def name(self) -> str:
        """What both ends of a pair must agree on (``kvd_compat``)."""
        return f"{SLIDING}:{self.window}" if self.kind == SLIDING else self.kind

    def first_block(self, tokens: int) -> int:
        """The first of a request's blocks this group still holds once ``tokens`` are
        computed: before it, blocks only earlier tokens attend to (vLLM frees them)."""
        if self.kind != SLIDING:
            return 0
        return max(0, tokens - self.window + 1) // self.block_size


def group_key(key: str, index: int, count: int) -> str:
    """The key group ``index`` of ``count`` moves under."""
    return key if count == 1 else f"{key}#g{index}"


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) if tokens > 0 else 0


def part_ranges(num_blocks: int, part_blocks: int) -> list[tuple[int, int]]:
    """How a request of ``num_blocks`` is cut into parts of ``part_blocks`` (0: one part)."""
    if part_blocks <= 0 or num_blocks <= part_blocks:
        return [(0, num_blocks)]
    return [(lo, min(lo + part_blocks, num_blocks)) for lo in range(0, num_blocks, part_blocks)]


def part_key(key: str, index: int, count: int) -> str:
    return key if count == 1 else f"{key}#p{index}"


def backoff(groups: Sequence[Group]) -> int:
    """How many of the prompt's last tokens decode computes itself, prefill leaving them
    out: none for full attention alone (decode loads the whole prompt and recomputes its
    last token, rewriting the same KV); one with a recurrent state (the state handed over
    must be the one before that token) or a sliding window. vLLM keeps a window's blocks
    from token ``T - window + 1`` on once ``T`` tokens are computed, on both sides, but a
    decode handed all ``T`` tokens recomputes token ``T - 1``, which attends from token
    ``T - window``: where that token ends a block (``T - window + 1`` a multiple of the
    block size), its block is gone on both sides and the recomputed token reads the null
    block (seen: other tokens than one engine's). Handed ``T - 1`` tokens, decode keeps
    that block, and so does prefill, having computed ``T - 1``."""
    return 1 if any(g.kind in (STATE, SLIDING) for g in groups) else 0


def state_block(group: Group, ids: Sequence[int]) -> int:
    """The block of a state group's list that holds the state: the last one before the
    speculative scratch slots."""
    if not ids:
        raise BadRequest("a state group without a block")
    scratch = min(group.scratch_blocks, len(ids) - 1)
    block = ids[len(ids) - 1 - scratch]
    if block == NULL_BLOCK:
        raise BadRequest("the state group's block is the null block")
    return block


def blocks_to_send(group: Group, ids: Sequence[int], tokens: int) -> list[int]:
    """Prefill: the blocks of a request of ``tokens`` tokens that group ``group`` sends,
    from its block list ``ids``."""
    if group.kind == STATE:
        return [state_block(group, ids)]
    n = blocks_for(tokens, group.block_size)
    lo = group.first_block(tokens)
    sent = list(ids[lo:n])
    if len(sent) != n - lo or NULL_BLOCK in sent:
        raise BadRequest(f"{group.name} group: blocks {lo}..{n - 1} of {tokens} tokens are "
                         f"not all held ({list(ids)})")
    return sent


@dataclass(frozen=True)
class Load:
    """What decode loads of one group: the key holds ``remote_blocks`` blocks; its blocks
    from ``skip`` on go into ``block_ids``."""

    remote_blocks: int
    skip: int
    block_ids: list[int]


def load_of(group: Group, ids: Sequence[int], tokens: int, first: int) -> Load:
    """Decode: what group ``group`` loads of a request of ``tokens`` tokens into its block
    list ``ids``, when its first ``first`` blocks are cached here already."""
    if group.kind == STATE:  # a state is whole: loaded whatever is cached
        return Load(1, 0, [state_block(group, ids)])
    n = blocks_for(tokens, group.block_size)
    lo = group.first_block(tokens)
    start = max(first, lo)
    into = list(ids[start:n])
    if len(into) != n - start or NULL_BLOCK in into:
        raise BadRequest(f"{group.name} group: blocks {start}..{n - 1} of {tokens} tokens "
                         f"are not all allocated here ({list(ids)})")
    return Load(n - lo, start - lo, into)


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
