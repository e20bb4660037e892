"""A hybrid model's KV cache groups on the GPU data path (a ``KvMover`` of two groups): a
full-attention group and a recurrent-state group laid over one CUDA allocation, as vLLM
0.32 lays them (layer ``l`` of every group at ``l * layer_stride``, so a state block is
the first bytes of the same page as an attention block), each group registered by its own
client (two registrations of the same memory), moved between two daemons over NCCL:
lend + pull, then push. Skipped without a GPU and nccl4py (with one, both daemons share
it: tests/gpu_nodes.py); vLLM itself is not needed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

import kvd
from kvd.integrations.kv_mover import KvMover, LoadOrder, Polled, SendOrder
from kvd.transport.nccl import nccl_available
from tests.gpu_nodes import Node, node_gpus, start_node, stop_node

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and nccl_available()), reason="needs a GPU and nccl4py")]
GPU_A, GPU_B = node_gpus()

NUM_BLOCKS, LAYERS = 128, 8
HEADS, BLOCK, CONTENT = 8, 16, 256  # a page: heads x tokens x (K, V) of 128 bf16: 64 KiB
PAGE_BYTES = HEADS * BLOCK * CONTENT * 2
STATE_BYTES = 40 * 1024  # a Mamba/GDN state: less than a page, padded to it


def hybrid_kv(device: str, seed: int) -> list[list[torch.Tensor]]:
    """One allocation; per group, its layers' views: full attention [B, H, N, C] bf16,
    the state [B, 1, 1, bytes] int8 (as vLLM views a Mamba layer)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(-128, 128, (LAYERS * NUM_BLOCKS * PAGE_BYTES,), dtype=torch.int8,
                        generator=gen, device=device)
    stride = NUM_BLOCKS * PAGE_BYTES
    full = [raw[i * stride:(i + 1) * stride].view(torch.bfloat16)
            .view(NUM_BLOCKS, HEADS, BLOCK, CONTENT) for i in range(LAYERS)]
    state = [torch.as_strided(raw, (NUM_BLOCKS, 1, 1, STATE_BYTES), (PAGE_BYTES, 0, 0, 1),
                              i * stride) for i in range(LAYERS)]
    return [full, state]


@contextlib.contextmanager
def engines() -> Iterator[tuple[Node, KvMover, Node, KvMover]]:
    a, b = start_node(GPU_A), start_node(GPU_B)
    clients: list[kvd.KvdClient] = []
    sides: list[KvMover] = []
    try:
        for node, gpu, seed in ((a, GPU_A, 1), (b, GPU_B, 2)):
            kv = hybrid_kv(f"cuda:{gpu}", seed)
            made = [kvd.KvdClient(node.sock, name=f"engine-{seed}-g{g}") for g in (0, 1)]
            clients += made
            for client in made:
                client.connect()
            sides.append(KvMover(made[0], kv[0], NUM_BLOCKS, staging_blocks=8,
                                 more_groups=[(made[1], kv[1])]))
            assert sides[-1].direct
        yield a, sides[0], b, sides[1]
    finally:
        for side in sides:
            side.close()
        for client in clients[2 * len(sides):]:
            client.close()
        for node in (b, a):
            assert stop_node(node) == 0


def until(sides: list[KvMover], done: object, timeout_s: float = 30) -> Polled:
    seen = Polled()
    deadline = time.monotonic() + timeout_s
    while not done(seen):  # type: ignore[operator]
        assert time.monotonic() < deadline, seen
        for side in sides:
            got = side.poll()
            seen.released |= got.released
            seen.loaded |= got.loaded
            seen.failed.update(got.failed)
        time.sleep(0.0005)
    return seen


def pages(side: KvMover, group: int, ids: list[int]) -> list[torch.Tensor]:
    torch.cuda.synchronize()
    return [layer[ids].contiguous().view(torch.int8).cpu() for layer in
            side.groups[group].layers]


def test_groups_over_one_allocation_over_nccl() -> None:
    """Full attention 32 blocks and the state's 1 block of each of two requests, pulled
    then pushed: every byte of each group's blocks arrives, decode's other blocks (the
    page the state shares with an attention block included) stay as they were."""
    with engines() as (a, p, b, d):
        src = [[*range(10, 42)], [50]]
        for flow, dst in (("pull", [[*range(60, 92)], [100]]),
                          ("push", [[*range(101, 127), 1, 2, 3, 4, 5, 6], [127]])):
            push_to = b.address if flow == "push" else None
            source = None if flow == "push" else a.address
            untouched = pages(d, 0, dst[1])  # the attention page under the state block
            for g in (0, 1):
                d.load(LoadOrder(flow, f"{flow}#g{g}", source, len(src[g]), 0, dst[g], 30,
                                 group=g))
                p.send(SendOrder(flow, f"{flow}#g{g}", src[g], 30, push_to=push_to, group=g))
            seen = until([p, d], lambda s, k=flow: k in s.loaded and k in s.released)
            assert not seen.failed
            for g in (0, 1):
                assert all(torch.equal(x, y) for x, y in zip(
                    pages(p, g, src[g]), pages(d, g, dst[g]), strict=True)), (flow, g)
            # The state wrote its bytes only: the rest of that page is decode's own.
            for before, now in zip(untouched, pages(d, 0, dst[1]), strict=True):
                assert torch.equal(before.flatten()[STATE_BYTES:], now.flatten()[STATE_BYTES:])
        moved = 2 * LAYERS * (32 * PAGE_BYTES + STATE_BYTES)
        assert d.stats.loads == 2 and d.stats.load_failures == 0
        assert d.stats.bytes_received == moved
