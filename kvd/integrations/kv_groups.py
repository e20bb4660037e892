"""A hybrid model's KV cache groups: which of a request's blocks each group moves, under
which key, without the engine's types.

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
  cached locally do not cross the wire);
- sliding window: the blocks from the first one that the next token still attends to;
- state: the one block that holds the state. A state holds every token it has seen, so
  it cannot be shortened the way a KV cache is: prefill computes all but the prompt's last
  token (``backoff``) and decode computes that one on the state it loaded. A sliding
  window does the same (see ``backoff``).

Each group moves under its own key (``group_key``: ``key#g<index>`` when there is more
than one group). Prefill refuses to send a block that it no longer holds (a null block),
and decode refuses to load into one: neither happens when both ends follow the rules
above, and a load that cannot be made fails at once (vLLM's failure policy applies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvd.errors import BadRequest

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
    n = -(-tokens // group.block_size)
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
    n = -(-tokens // group.block_size)
    lo = group.first_block(tokens)
    start = max(first, lo)
    into = list(ids[start:n])
    if len(into) != n - start or NULL_BLOCK in into:
        raise BadRequest(f"{group.name} group: blocks {start}..{n - 1} of {tokens} tokens "
                         f"are not all allocated here ({list(ids)})")
    return Load(n - lo, start - lo, into)
