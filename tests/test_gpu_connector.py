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
