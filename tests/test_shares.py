"""Shares of a key: a pull takes a part of each block (a tensor-parallel rank's heads), from
a block on (what the reader has not cached), for a number of readers, into a part of its
own blocks. Real daemons, real bytes over TCP and within one daemon."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import kvd
from kvd import KvdClient, Part, Region, Share, Transfer, shared_empty, shared_zeros
from tests.conftest import wait_until
from tests.test_peers import Nodes

HEADS, TOKENS, WIDTH, LAYERS, BLOCKS = 4, 4, 8, 2, 8  # a block: [heads, tokens, 2 x head]


@pytest.fixture
def nodes(sock_dir: str) -> Iterator[Nodes]:
    started = Nodes(sock_dir)
    yield started
    started.stop_all()


def kv(heads: int, seed: int | None = None) -> list[torch.Tensor]:
    """One engine's KV: a tensor per layer, [blocks, heads, tokens, 2 x head], float32."""
    layers = []
    for i in range(LAYERS):
        t = shared_empty((BLOCKS, heads, TOKENS, WIDTH), torch.float32)
        if seed is None:
            t.zero_()
        else:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + i)))
        layers.append(t)
    return layers


def lend(client: KvdClient, key: str, region: Region, blocks: list[int]) -> Transfer:
    """A lend for 30 s, once the daemon holds the key (its reply comes only when it ends,
    and a pull that comes first, without a wait, finds no key)."""
    keys = client.stats()["keys"]
    lent = client.lend(key, region, blocks, ttl_s=30)
    wait_until(lambda: client.stats()["keys"] == keys + 1)
    return lent


def block_bytes(heads: int) -> int:
    return LAYERS * heads * TOKENS * WIDTH * 4


def test_two_ranks_into_one_and_one_into_two(nodes: Nodes) -> None:
    a, b = nodes(2)
    # prefill TP=2 on a: each rank half the heads; decode TP=1 on b takes both halves
    ranks = [kv(HEADS // 2, seed=10 * r) for r in range(2)]
    with KvdClient(a.proc.socket_path) as rank1:
        lenders = [a.client, rank1]
        regions = [c.register("kv", t) for c, t in zip(lenders, ranks, strict=True)]
        lends = [lend(c, f"req#tp{r}", regions[r], [5, 2, 7])
                 for r, c in enumerate(lenders)]
        whole = kv(HEADS)
        r_whole = b.client.register("kv", whole)
        for r in range(2):
            assert b.client.pull(f"req#tp{r}", a.address, r_whole, [0, 1, 2], timeout_s=10,
                                 into=Part(r, 2)) == 3 * block_bytes(HEADS // 2)
        for lent in lends:
            assert lent.wait(10) == 3 * block_bytes(HEADS // 2)
        for layer in range(LAYERS):
            for r in range(2):
                got = whole[layer][[0, 1, 2], r * 2:(r + 1) * 2]
                assert torch.equal(got, ranks[r][layer][[5, 2, 7]])

        # prefill TP=1 on b lends whole blocks; decode TP=2 on a: each rank its heads
        lent = lend(b.client, "back", r_whole, [0, 1, 2])
        halves = [kv(HEADS // 2) for _ in range(2)]
        r_halves = [c.register("half", t) for c, t in zip(lenders, halves, strict=True)]
        assert lenders[0].pull("back", b.address, r_halves[0], [3, 4, 5], timeout_s=10,
                               share=Share(Part(0, 2))) == 3 * block_bytes(HEADS // 2)
        assert not lent.done()  # half of it is still to be read
        lenders[1].pull("back", b.address, r_halves[1], [3, 4, 5], timeout_s=10,
                        share=Share(Part(1, 2)))
        assert lent.wait(10) == 3 * block_bytes(HEADS)
        for layer in range(LAYERS):
            for r in range(2):
                assert torch.equal(halves[r][layer][3:6], ranks[r][layer][[5, 2, 7]])
        with pytest.raises(kvd.KeyGone):
            lenders[0].pull("back", b.address, r_halves[0], [3, 4, 5], timeout_s=5,
                            share=Share(Part(0, 2)))


def test_readers_skip_and_reads_within_one_daemon(nodes: Nodes) -> None:
    (a,) = nodes(1)
    src = kv(HEADS, seed=3)
    r_src = a.client.register("kv", src)
    with KvdClient(a.proc.socket_path) as other:
        dsts = [kv(HEADS), kv(HEADS)]
        readers = [a.client, other]
        r_dsts = [c.register("dst", t) for c, t in zip(readers, dsts, strict=True)]
        # a latent cache every rank holds: two readers of all of it, the first skipping
        # the two blocks it has cached
        pulls = [readers[1].start_pull("mla", a.address, r_dsts[1], [0, 1, 2, 3],
                                       timeout_s=10, wait_for_key_s=5,
                                       share=Share(readers=2))]
        lent = lend(a.client, "mla", r_src, [4, 5, 6, 7])
        assert readers[0].pull("mla", a.address, r_dsts[0], [6, 7], timeout_s=10,
                               share=Share(skip=2, readers=2)) == 2 * block_bytes(HEADS)
        assert pulls[0].wait(10) == 4 * block_bytes(HEADS)
        assert lent.wait(10) == 6 * block_bytes(HEADS)
        for layer in range(LAYERS):
            assert torch.equal(dsts[1][layer][0:4], src[layer][4:8])
            assert torch.equal(dsts[0][layer][6:8], src[layer][6:8])
            assert not dsts[0][layer][0:6].any()

        # a key put here (in the pool) read in parts, each into a part of the blocks
        a.client.put("stored", r_src, [1, 3], to=None).wait(10)
        for r in (1, 0):
            readers[r].pull("stored", a.address, r_dsts[r], [0, 1], timeout_s=5,
                            share=Share(Part(r, 2)), into=Part(r, 2))
        assert a.client.stats()["keys"] == 0
        for layer in range(LAYERS):
            for r in (0, 1):
                half = slice(r * HEADS // 2, (r + 1) * HEADS // 2)
                assert torch.equal(dsts[r][layer][0:2, half], src[layer][[1, 3], half])


def test_shares_that_do_not_fit_are_refused_and_nothing_is_taken(nodes: Nodes) -> None:
    a, b = nodes(2)
    src, dst = kv(HEADS, seed=5), kv(HEADS)
    r_src, r_dst = a.client.register("kv", src), b.client.register("kv", dst)
    lent = lend(a.client, "k", r_src, [0, 1])
    for share, into, error in [
        (Share(Part(0, 2)), Part(), kvd.LayoutMismatch),  # half a block into a whole one
        (Share(), Part(1, 2), kvd.LayoutMismatch),
        (Share(Part(0, 3)), Part(0, 3), kvd.BadRequest),  # 128 floats do not cut in 3
        (Share(skip=2), Part(), kvd.BadRequest),  # skips all it holds
        (Share(skip=1), Part(), kvd.BadRequest),  # one block, two given
    ]:
        with pytest.raises(error):
            b.client.pull("k", a.address, r_dst, [0, 1], timeout_s=5, share=share, into=into)
    with pytest.raises(ValueError, match="part 2 of 2"):
        Part(2, 2)
    assert not lent.done()  # none of those took a read
    b.client.pull("k", a.address, r_dst, [2, 3], timeout_s=5)
    assert lent.wait(10) == 2 * block_bytes(HEADS)

    # Blocks that are not one run each (K and V apart, blocks on dim 1) cannot be cut.
    apart = shared_empty((2, BLOCKS, 64), torch.float32)
    r_apart = a.client.register("apart", [apart], block_dim=1)
    halves = [(c, c.register("half", [shared_zeros((BLOCKS, 64), torch.float32)]))
              for c in (b.client, a.client)]  # served to a peer, and within its daemon
    lent = lend(a.client, "apart", r_apart, [0])
    for client, region in halves:
        with pytest.raises(kvd.BadRequest, match="cannot be cut into 2 parts"):
            client.pull("apart", a.address, region, [0], timeout_s=5, share=Share(Part(1, 2)))
    assert not lent.done()
    whole = b.client.register("whole", [shared_zeros((2, BLOCKS, 64), torch.float32)],
                              block_dim=1)
    assert b.client.pull("apart", a.address, whole, [3], timeout_s=5) == 512
    assert lent.wait(10) == 512
