"""A hybrid model's KV cache groups without vLLM: which blocks each group moves
(``kv_groups``), and the data path of several groups (``KvMover`` with ``more_groups``):
tensors of a full-attention group and of a recurrent-state group laid over one
allocation, as vLLM lays them, moved between two `kvd serve` daemons group by group,
bytes checked; a request heard of once, whatever its groups did."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

from kvd import KvdClient
from kvd.errors import BadRequest
from kvd.integrations import kv_groups as orders
from kvd.integrations.kv_groups import (
    FULL,
    NULL_BLOCK,
    SLIDING,
    STATE,
    Group,
    Load,
    backoff,
    blocks_to_send,
    group_key,
    load_of,
)
from kvd.integrations.kv_mover import DiscardOrder, KvMover, LoadOrder, Polled, SendOrder
from tests.conftest import ProcessDaemon, start_daemons

FULL16, SLIDING40, STATE16 = Group(FULL, 16), Group(SLIDING, 16, window=40), Group(STATE, 16)


def test_a_sliding_window_keeps_the_blocks_the_next_token_attends_to() -> None:
    # 100 tokens, window 40: the next token (index 100) attends to 61..100; token 61 is
    # in block 3 (48..63): blocks 0..2 are freed by vLLM (null), 3..6 move.
    assert SLIDING40.first_block(100) == 3 and SLIDING40.first_block(39) == 0
    ids = [NULL_BLOCK] * 3 + [11, 12, 13, 14]
    assert blocks_to_send(SLIDING40, ids, 100) == [11, 12, 13, 14]
    assert blocks_to_send(FULL16, [1, 2, 3, 4, 5, 6, 7], 100) == [1, 2, 3, 4, 5, 6, 7]
    # Decode with its first 4 blocks cached: of the key's 4 blocks, the first is skipped.
    assert load_of(SLIDING40, [0, 0, 0, 21, 22, 23, 24], 100, 4) == Load(4, 1, [22, 23, 24])
    assert load_of(SLIDING40, [0, 0, 0, 21, 22, 23, 24], 100, 0) == Load(4, 0, [21, 22, 23,
                                                                              24])
    with pytest.raises(BadRequest, match="not all held"):  # a block prefill freed already
        blocks_to_send(SLIDING40, [0, 0, 0, 0, 12, 13, 14], 100)
    with pytest.raises(BadRequest, match="not all allocated here"):
        load_of(FULL16, [0, 22, 23], 40, 0)


def test_a_state_moves_its_one_block() -> None:
    # vLLM's list for a state group: null placeholders, then the block of the state, then
    # speculative scratch slots.
    assert blocks_to_send(STATE16, [0, 0, 9], 40) == [9]
    assert blocks_to_send(Group(STATE, 16, scratch_blocks=2), [0, 9, 30, 31], 40) == [9]
    assert load_of(STATE16, [0, 0, 0, 5], 60, 3) == Load(1, 0, [5])  # cached or not
    with pytest.raises(BadRequest, match="null block"):
        blocks_to_send(STATE16, [0, 0], 40)
    assert backoff([FULL16]) == 0
    assert backoff([FULL16, SLIDING40]) == backoff([STATE16, FULL16]) == 1
    assert group_key("k", 1, 2) == "k#g1" and group_key("k", 0, 1) == "k"


def test_one_full_group_gives_the_orders_of_before_groups() -> None:
    """A model that is not hybrid: the keys and orders a connector without groups made
    (no ``#g``), whole or in parts."""
    send = orders.Sending("r", "k", 70, 30.0, push_to="h:1", part_blocks=2)
    assert orders.finished_sends([FULL16], send, [[1, 2, 3, 4, 5]], sent=1) == [
        SendOrder("r", "k#p1", [3, 4], 30.0, push_to="h:1", final=False),
        SendOrder("r", "k#p2", [5], 30.0, push_to="h:1")]
    pull = orders.Loading("r", "k", "src:1", 70, first=2, timeout_s=5.0)
    assert orders.loads([FULL16], pull, [[7, 8, 9, 10, 11]]) == (
        [LoadOrder("r", "k", "src:1", 5, 2, [9, 10, 11], 5.0)], [])
    push = orders.Loading("r", "k", None, 70, first=2, timeout_s=5.0, part_blocks=2)
    assert orders.loads([FULL16], push, [[7, 8, 9, 10, 11]]) == (
        [LoadOrder("r", "k#p1", None, 2, 0, [9, 10], 5.0, parts=2),
         LoadOrder("r", "k#p2", None, 1, 0, [11], 5.0, parts=2)],
        [DiscardOrder("r", "k#p0")])


def test_each_group_of_a_hybrid_request() -> None:
    groups = [SLIDING40, STATE16, FULL16]
    ids = [[0, 0, 0, 11, 12, 13, 14], [0, 0, 0, 0, 0, 0, 20], [1, 2, 3, 4, 5, 6, 7]]
    send = orders.Sending("r", "k", 100, 30.0, push_to="h:1", part_blocks=4)
    # While it runs, only the full-attention group's parts go (staged); the rest at the end.
    early, sent = orders.written_sends(groups, send, 64, 0, lambda: ids)
    assert sent == 1 and early == [SendOrder("r", "k#g2#p0", [1, 2, 3, 4], 30.0, push_to="h:1",
                                             final=False, stage=True, group=2)]
    assert orders.finished_sends(groups, send, ids, sent) == [
        SendOrder("r", "k#g0", [11, 12, 13, 14], 30.0, push_to="h:1", group=0),
        SendOrder("r", "k#g1", [20], 30.0, push_to="h:1", group=1),
        SendOrder("r", "k#g2#p1", [5, 6, 7], 30.0, push_to="h:1", group=2)]
    with pytest.raises(BadRequest, match="sliding:40 group"):
        orders.finished_sends(groups, send, [[0] * 7, *ids[1:]], 0)
    # Decode, pushed to, its first 5 blocks cached: the full group's first part is
    # released; the sliding group loads blocks 5..6 of its key's 3..6.
    load = orders.Loading("r", "k", None, 100, first=5, timeout_s=5.0, part_blocks=4)
    mine = [[0, 0, 0, 31, 32, 33, 34], [0, 0, 0, 0, 0, 0, 40], [41, 42, 43, 44, 45, 46, 47]]
    assert orders.loads(groups, load, mine) == (
        [LoadOrder("r", "k#g0", None, 4, 2, [33, 34], 5.0, group=0),
         LoadOrder("r", "k#g1", None, 1, 0, [40], 5.0, group=1),
         LoadOrder("r", "k#g2#p1", None, 3, 1, [46, 47], 5.0, group=2)],
        [DiscardOrder("r", "k#g2#p0", group=2)])
    refused = orders.refused_loads(groups, load, mine, "no")
    assert [(o.key, o.refusal, o.group) for o in refused] == [
        ("k#g0", "no", 0), ("k#g1", "no", 1), ("k#g2", "no", 2)]


# ---------------------------------------------------------------- the data path

NUM_BLOCKS = 16
PAGE_BYTES = 2 * 4 * 16 * 4  # full attention: 2 heads x 4 tokens x 16 (K and V) x fp32
STATE_BYTES = 320  # a state: fewer bytes than a page, laid in the same page (padded)
LAYERS = 2


def hybrid_kv(seed: int) -> list[list[torch.Tensor]]:
    """vLLM's layout of a hybrid model: one allocation; layer ``l`` of every group starts at
    ``l * layer_stride``, so a full-attention layer and a state layer are views of the
    same bytes (a block id belongs to one group at a time). Per group, its layers."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 127, (LAYERS * NUM_BLOCKS * PAGE_BYTES,), dtype=torch.int8,
                        generator=gen)
    layer_stride = NUM_BLOCKS * PAGE_BYTES
    full = [raw[i * layer_stride:(i + 1) * layer_stride].view(torch.float32)
            .view(NUM_BLOCKS, 2, 4, 16) for i in range(LAYERS)]
    state = [torch.as_strided(raw, (NUM_BLOCKS, 1, 1, STATE_BYTES), (PAGE_BYTES, 0, 0, 1),
                              i * layer_stride) for i in range(LAYERS)]
    return [full, state]


class Engine:
    """One engine's groups on its daemon: one mover, a client per group."""

    def __init__(self, proc: ProcessDaemon, name: str, seed: int) -> None:
        self.kv = hybrid_kv(seed)
        clients = [KvdClient(proc.socket_path, name=f"{name}-g{g}") for g in (0, 1)]
        try:
            for client in clients:
                client.connect()
            self.movers = KvMover(clients[0], self.kv[0], NUM_BLOCKS, staging_blocks=8,
                                  more_groups=[(clients[1], self.kv[1])])
        except BaseException:
            for client in clients:
                client.close()
            raise
        self.address = clients[0].stats()["peer"]["address"]
        self.seen = Polled()

    def poll(self) -> Polled:
        got = self.movers.poll()
        for name in ("released", "loaded", "refused"):
            getattr(self.seen, name).update(getattr(got, name))
        self.seen.failed.update(got.failed)
        self.seen.causes.update(got.causes)
        return got

    def block(self, group: int, i: int) -> list[torch.Tensor]:
        """Block ``i`` of a group's layers, as bytes (random bytes as floats hold NaNs)."""
        return [layer[i].clone().view(torch.int8) for layer in self.kv[group]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    procs = start_daemons(str(tmp_path_factory.mktemp("groups")), "prefill", "decode")
    made: list[Engine] = []
    try:
        for proc, name, seed in zip(procs, ("prefill", "decode"), (1, 2), strict=True):
            made.append(Engine(proc, name, seed))
        yield made[0], made[1]
    finally:
        with contextlib.ExitStack() as stack:  # each closes whatever the others raised
            for proc in procs:
                stack.callback(proc.stop)
            for engine in made:
                stack.callback(engine.movers.close)
    assert [proc.stop() for proc in procs] == [0, 0], [proc.log() for proc in procs]


def drive(*engines: Engine, until: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():  # type: ignore[operator]
        assert time.monotonic() < deadline, [e.seen for e in engines]
        for engine in engines:
            engine.poll()
        time.sleep(0.002)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("flow", ["pull", "push"])
def test_groups_move_over_one_allocation(engines: tuple[Engine, Engine], flow: str) -> None:
    """A full-attention group (blocks 3, 5, 6) and a state group (block 9) of one request,
    their layers over the same bytes, moved into decode's blocks 10..12 and 13: each
    group's blocks arrive whole, nothing else of decode's changes, the request is
    released and loaded once."""
    p, d = engines
    want = [{i: p.block(0, i) for i in (3, 5, 6)}, {9: p.block(1, 9)}]
    untouched = [d.block(0, 14), d.block(1, 15)]
    push_to = d.address if flow == "push" else None
    source = None if flow == "push" else p.address
    rid, before = f"r-{flow}", (d.movers.stats.loads, d.movers.stats.bytes_received,
                                p.movers.stats.sends, p.movers.stats.bytes_sent)
    for g, ids in enumerate(([3, 5, 6], [9])):
        p.movers.send(SendOrder(rid, f"{rid}#g{g}", ids, 10.0, push_to=push_to, group=g))
    for g, ids in enumerate(([10, 11, 12], [13])):
        d.movers.load(LoadOrder(rid, f"{rid}#g{g}", source, len(ids), 0, ids, 10.0, group=g))
    drive(p, d, until=lambda: rid in d.seen.loaded and rid in p.seen.released)
    assert [same(d.block(0, b), want[0][a]) for a, b in ((3, 10), (5, 11), (6, 12))] == [
        True] * 3
    assert same(d.block(1, 13), want[1][9])
    assert same(d.block(0, 14), untouched[0]) and same(d.block(1, 15), untouched[1])
    stats = d.movers.stats
    moved = LAYERS * (3 * PAGE_BYTES + STATE_BYTES)
    assert (stats.loads - before[0], stats.bytes_received - before[1]) == (1, moved)
    assert [n for _, n in stats.take_samples()["load_samples"]] == [moved]  # the request's
    drive(p, d, until=lambda: p.movers.stats.sends == before[2] + 2)  # (lent: once pulled)
    assert p.movers.stats.bytes_sent - before[3] == moved


def test_a_request_fails_once_every_group_has_ended(engines: tuple[Engine, Engine]) -> None:
    """Prefill sends only its full-attention group: decode's state group waits for its key
    until its timeout. The request is heard of once, failed, with that group's cause,
    only when both groups have ended (none writes into its blocks any more)."""
    p, d = engines
    loads, failures = d.movers.stats.loads, d.movers.stats.load_failures
    p.movers.send(SendOrder("f", "f#g0", [1, 2], 10.0, group=0))
    d.movers.load(LoadOrder("f", "f#g0", p.address, 2, 0, [3, 4], 10.0, group=0))
    d.movers.load(LoadOrder("f", "f#g1", p.address, 1, 0, [5], 1.0, group=1))
    received = d.movers.stats.bytes_received
    drive(p, d, until=lambda: d.movers.stats.bytes_received > received)  # group 0's came
    assert "f" not in d.seen.loaded and "f" not in d.seen.failed  # group 1 still waits
    drive(p, d, until=lambda: "f" in d.seen.failed)
    assert d.seen.causes["f"].startswith("group 1: key 'f#g1'") and "f" not in d.seen.loaded
    assert (d.movers.stats.loads - loads, d.movers.stats.load_failures - failures) == (0, 1)
    # Refused: every group fails at once, said once (loads_refused counts the request).
    d.movers.load(LoadOrder("q", "x#g0", p.address, 1, 0, [6], 10.0, refusal="no", group=0))
    d.movers.load(LoadOrder("q", "x#g1", p.address, 1, 0, [7], 10.0, refusal="no", group=1))
    assert "q" in d.poll().refused and d.movers.stats.loads_refused == 1
