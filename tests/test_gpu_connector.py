"""The vLLM connector's data path (``KvMover``) with CUDA KV tensors laid out as vLLM 0.32
lays them out (one allocation, a strided view per layer, blocks on dim 0), between two
daemons, one per GPU, over NCCL: lend + pull, a local prefix hit (through GPU staging), and
push. Skipped without a GPU and nccl4py (with one, both daemons share it:
tests/gpu_nodes.py); vLLM itself is not needed (its engine wheel does not fit the GPU
machine)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

import kvd
from kvd.integrations.kv_mover import KvMover, LoadOrder, Polled, SendOrder
from kvd.integrations.kv_ranks import heads_of, lender_of, lends, reads
from kvd.transport.nccl import nccl_available
from tests.gpu_nodes import Node, node_gpus, start_node, stop_node

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and nccl_available()), reason="needs a GPU and nccl4py")]
GPU_A, GPU_B = node_gpus()

NUM_BLOCKS, LAYERS = 256, 32
PAGE = (8, 16, 256)  # kv heads, block size, 2 * head size (bf16): 64 KiB per block per layer


def vllm_like_kv(device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    whole = torch.randn((LAYERS, NUM_BLOCKS, *PAGE), generator=gen, device=device)
    whole = whole.to(torch.bfloat16)
    return [whole[i] for i in range(LAYERS)]


@contextlib.contextmanager
def movers() -> Iterator[tuple[Node, KvMover, Node, KvMover]]:
    a = start_node(GPU_A)
    b = start_node(GPU_B)
    clients = [kvd.KvdClient(a.sock, name="prefill"), kvd.KvdClient(b.sock, name="decode")]
    try:
        for c in clients:
            c.connect()
        p = KvMover(clients[0], vllm_like_kv(f"cuda:{GPU_A}", 1), NUM_BLOCKS, staging_blocks=64)
        d = KvMover(clients[1], vllm_like_kv(f"cuda:{GPU_B}", 2), NUM_BLOCKS, staging_blocks=64)
        assert p.direct and d.direct
        yield a, p, b, d
        p.close()
        d.close()
    finally:
        for node in (b, a):
            assert stop_node(node) == 0


def until(movers_: list[KvMover], done: object, timeout_s: float = 30) -> Polled:
    seen = Polled()
    deadline = time.monotonic() + timeout_s
    while not done(seen):  # type: ignore[operator]
        assert time.monotonic() < deadline, seen
        for m in movers_:
            got = m.poll()
            seen.released |= got.released
            seen.loaded |= got.loaded
            seen.failed.update(got.failed)
        time.sleep(0.0005)
    return seen


def same(p: KvMover, p_ids: list[int], d: KvMover, d_ids: list[int]) -> bool:
    torch.cuda.synchronize(GPU_A)
    torch.cuda.synchronize(GPU_B)
    return all(torch.equal(dl[d_ids].cpu(), pl[p_ids].cpu())
               for pl, dl in zip(p.layers, d.layers, strict=True))


def test_connector_data_path_over_nccl() -> None:
    with movers() as (a, p, b, d):
        rng = torch.Generator().manual_seed(0)
        src = torch.randperm(NUM_BLOCKS - 1, generator=rng)[:64].add(1).tolist()
        dst = torch.randperm(NUM_BLOCKS - 1, generator=rng)[:64].add(1).tolist()
        timings = []
        for i in range(4):
            key = f"req-{i}"
            t0 = time.perf_counter()
            p.send(SendOrder(key, key, src, lease_s=30))
            d.load(LoadOrder(key, key, a.address, len(src), 0, dst, timeout_s=30))
            seen = until([p, d], lambda s, k=key: k in s.loaded and k in s.released)
            timings.append(time.perf_counter() - t0)
            assert not seen.failed
        assert same(p, src, d, dst)
        nbytes = len(src) * p.block_bytes
        print(f"\nconnector data path, lend+pull of 64 blocks x {LAYERS} layers "
              f"({nbytes / 2**20:.0f} MiB) GPU{GPU_A} -> GPU{GPU_B}: "
              + ", ".join(f"{t * 1e3:.1f} ms" for t in timings)
              + f"; best {nbytes / min(timings) / 1e9:.1f} GB/s")

        # A local prefix hit on decode: only blocks 8.. of the key, through GPU staging.
        p.send(SendOrder("hit", "hit", src[:16], lease_s=30))
        d.load(LoadOrder("hit", "hit", a.address, 16, 8, [200 + i for i in range(8)],
                         timeout_s=30))
        until([p, d], lambda s: "hit" in s.loaded)
        assert same(p, src[8:16], d, [200 + i for i in range(8)])

        # Push: decode waits on its own daemon; prefill puts to it.
        d.load(LoadOrder("push", "push", None, 8, 0, [240 + i for i in range(8)], 30))
        p.send(SendOrder("push", "push", src[:8], lease_s=30, push_to=b.address))
        until([p, d], lambda s: "push" in s.loaded and "push" in s.released)
        assert same(p, src[:8], d, [240 + i for i in range(8)])
        assert p.stats.send_failures == 0 and d.stats.load_failures == 0


def rank_kv(device: str, heads: int, seed: int) -> list[torch.Tensor]:
    """One rank's share of the heads (8 in all; 1: an MLA latent cache), vLLM's layout."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (LAYERS, NUM_BLOCKS, heads, *PAGE[1:]) if heads else (LAYERS, NUM_BLOCKS, 16, 576)
    whole = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
    return [whole[i] for i in range(LAYERS)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"), [(2, 1, 8), (1, 2, 8),
                                                                 (1, 2, 1)])
def test_mixed_tensor_parallel_over_nccl(prefill_tp: int, decode_tp: int, heads: int) -> None:
    """Prefill and decode ranks of other counts (a mover per rank, as the connector orders
    it: kv_ranks): each decode rank reads its heads of the lending prefill ranks' blocks,
    a part of each block into a part of its own, in place, past a 4-block prefix it has
    cached. One head: MLA, the one lender read whole by both decode ranks."""
    a, b = start_node(GPU_A), start_node(GPU_B)
    made: list[kvd.KvdClient] = []
    prefill: list[KvMover] = []
    decode: list[KvMover] = []
    try:
        for node, gpu, tp, seed, side in ((a, GPU_A, prefill_tp, 10, prefill),
                                          (b, GPU_B, decode_tp, 20, decode)):
            for r in range(tp):
                client = kvd.KvdClient(node.sock, name=f"rank-{seed}-{r}")
                client.connect()
                made.append(client)
                kv = rank_kv(f"cuda:{gpu}", heads // tp if heads > 1 else 0, seed + r)
                side.append(KvMover(client, kv, NUM_BLOCKS, staging_blocks=8))
        src, dst = list(range(10, 42)), list(range(100, 132))
        for r, mover in enumerate(prefill):
            order = SendOrder("tp", f"tp#tp{r}", src, lease_s=30)
            (mover.send if lends(r, prefill_tp, heads) else mover.skip)(order)
        for r, mover in enumerate(decode):
            taken = reads(r, decode_tp, prefill_tp, heads)
            for read in taken:
                mover.load(LoadOrder("tp", f"tp#tp{read.rank}", a.address, len(src), 4,
                                     dst[4:], timeout_s=30, parts=len(taken), part=read.part,
                                     readers=read.readers, into=read.into))
        seen = until([*prefill, *decode], lambda s: "tp" in s.loaded and "tp" in s.released)
        assert not seen.failed
        torch.cuda.synchronize()
        for r, mover in enumerate(decode):
            first, count = heads_of(r, decode_tp, heads)
            for layer in range(LAYERS):
                got = mover.layers[layer][dst[4:]]
                if heads == 1:
                    assert torch.equal(got, prefill[0].layers[layer][src[4:]])
                    continue
                for h in range(first, first + count):
                    lender = lender_of(h, prefill_tp, heads)
                    theirs = h - heads_of(lender, prefill_tp, heads)[0]
                    assert torch.equal(got[:, h - first],
                                       prefill[lender].layers[layer][src[4:], theirs])
        for client in made:
            assert client.stats()["keys"] == 0
    finally:
        for mover in (*prefill, *decode):
            mover.close()
        for node in (b, a):
            assert stop_node(node) == 0
