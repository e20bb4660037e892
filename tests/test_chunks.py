"""The chunk plan NCCL transfers use, and gathering / scattering chunks through staging,
on CPU tensors: both ends cut the same bytes at the same places, and blocks in any order
arrive where they belong."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch

from kvd.memory.regions import IdArray, LayoutEntry
from kvd.protocol import DType
from kvd.transport.chunks import BlockSet, plan_chunks

KIB = 1024


def ids_of(ids: list[int]) -> IdArray:
    return np.array(ids, dtype=np.int64)


def layout_of(tensors: list[torch.Tensor]) -> tuple[LayoutEntry, ...]:
    return tuple(LayoutEntry(t[0].numel() * t.element_size(), cast(DType, str(
        t.dtype).removeprefix("torch."))) for t in tensors)


def test_plan_covers_every_byte_once_and_never_splits_a_block() -> None:
    layout = (LayoutEntry(32 * KIB, "bfloat16"), LayoutEntry(48 * KIB, "uint8"))
    chunks = plan_chunks(layout, 10, 100 * KIB)
    assert sum(c.nbytes for c in chunks) == 10 * 80 * KIB
    seen: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks:
        assert c.nbytes <= 100 * KIB
        offset = 0
        for seg in c.segments:
            assert seg.offset == offset and seg.nbytes == (seg.stop - seg.start) * (
                layout[seg.tensor].bytes_per_block)
            offset += seg.nbytes
            seen[seg.tensor].extend(range(seg.start, seg.stop))
        assert offset == c.nbytes
    assert seen == {0: list(range(10)), 1: list(range(10))}


def test_a_block_larger_than_a_chunk_travels_alone() -> None:
    chunks = plan_chunks((LayoutEntry(3 * KIB, "uint8"),), 4, 2 * KIB)
    assert [c.nbytes for c in chunks] == [3 * KIB] * 4
    with pytest.raises(ValueError):
        plan_chunks((LayoutEntry(3 * KIB, "uint8"),), 4, 0)


@pytest.mark.parametrize("chunk_kib", [8, 40, 1024])
def test_blocks_through_staging_arrive_byte_exact(chunk_kib: int) -> None:
    gen = torch.Generator().manual_seed(7)
    src = [torch.randint(-100, 100, (32, 4, 512), generator=gen).to(torch.bfloat16),
           torch.randint(0, 255, (32, 3000), generator=gen, dtype=torch.uint8)]
    dst = [torch.zeros_like(t) for t in src]
    src_ids = [5, 6, 7, 8, 1, 30, 2, 3]  # one run, then scattered
    dst_ids = [0, 1, 2, 3, 20, 21, 9, 31]
    sender, receiver = BlockSet(src, ids_of(src_ids)), BlockSet(dst, ids_of(dst_ids))
    chunks = plan_chunks(layout_of(src), len(src_ids), chunk_kib * KIB)
    staging = torch.empty(max(c.nbytes for c in chunks), dtype=torch.uint8)
    for chunk in chunks:
        receiver.store(chunk, sender.load(chunk, staging))
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[dst_ids], s[src_ids])
        untouched = [i for i in range(32) if i not in dst_ids]
        assert torch.count_nonzero(d[untouched].float()) == 0


def test_packed_buffers_and_direct_chunks() -> None:
    src = [torch.arange(16 * 256, dtype=torch.int32).view(16, 256)]
    layout = layout_of(src)
    buf = torch.zeros(16 * 1024 + 64, dtype=torch.uint8)
    packed = BlockSet.packed(buf, layout, 16)
    chunks = plan_chunks(layout, 16, 4 * KIB)
    source = BlockSet(src, ids_of(list(range(16))))
    staging = torch.empty(4 * KIB, dtype=torch.uint8)
    for chunk in chunks:
        direct = source.direct(chunk, torch.device("cpu"))
        assert direct is not None  # consecutive blocks of a contiguous tensor: no copy
        assert direct.data_ptr() == src[0][chunk.segments[0].start].data_ptr()
        packed.store(chunk, source.load(chunk, staging))
    assert torch.equal(buf[: 16 * 1024].view(torch.int32).view(16, 256), src[0])
    assert BlockSet(src, ids_of([0, 2])).direct(plan_chunks(layout, 2, 8 * KIB)[0],
                                        torch.device("cpu")) is None
    # Ends one run apart, a break inside: not a run. Then each half of [4..7, 0..3] is.
    whole = plan_chunks(layout, 4, 16 * KIB)[0]
    assert BlockSet(src, ids_of([0, 2, 1, 3])).direct(whole, torch.device("cpu")) is None
    halves = BlockSet(src, ids_of([4, 5, 6, 7, 0, 1, 2, 3]))
    for chunk, first in zip(plan_chunks(layout, 8, 4 * KIB), (4, 0), strict=True):
        direct = halves.direct(chunk, torch.device("cpu"))
        assert direct is not None and direct.data_ptr() == src[0][first].data_ptr()
        assert torch.equal(direct, src[0][first : first + 4].reshape(-1).view(torch.uint8))
    # Rows of a wider tensor (not contiguous): one block is a run of memory, two are not.
    rows = [torch.arange(16 * 512, dtype=torch.int32).view(16, 512)[:, :256]]
    one, two = plan_chunks(layout, 1, KIB)[0], plan_chunks(layout, 2, 8 * KIB)[0]
    found = BlockSet(rows, ids_of([5])).direct(one, torch.device("cpu"))
    assert found is not None and torch.equal(found, rows[0][5].view(torch.uint8))
    assert BlockSet(rows, ids_of([5, 6])).direct(two, torch.device("cpu")) is None


@pytest.mark.parametrize("n", [8, 200])  # short segments checked in Python, long by numpy
def test_runs_are_found_in_short_and_long_segments(n: int) -> None:
    src = [torch.zeros(2 * n, 64, dtype=torch.uint8)]
    chunks = plan_chunks(layout_of(src), 2 * n, n * 64)  # n blocks per chunk
    cpu = torch.device("cpu")
    ids = list(range(n, 2 * n)) + list(range(n))  # two runs, one per chunk
    blocks = BlockSet(src, ids_of(ids))
    found = blocks.direct_chunks(chunks, cpu)
    assert [d.data_ptr() if d is not None else None for d in found] == [
        src[0][n].data_ptr(), src[0][0].data_ptr()]
    assert blocks.direct_chunks(chunks, cpu) is found  # remembered per plan
    broken = ids.copy()  # the same ends, a swap inside each chunk: no run
    broken[1], broken[2], broken[n + 1], broken[n + 2] = ids[2], ids[1], ids[n + 2], ids[n + 1]
    assert BlockSet(src, ids_of(broken)).direct_chunks(chunks, cpu) == [None, None]
    whole = plan_chunks(layout_of(src), 2 * n, 2 * n * 64)
    assert BlockSet(src, ids_of(list(range(2 * n)))).direct_chunks(whole, cpu)[0] is not None


@pytest.mark.parametrize("mixed", [False, True])
def test_block_map_describes_every_block_piece_in_wire_order(mixed: bool) -> None:
    # The rows the one-launch GPU copy reads, built here from CPU tensors. The kernel finds
    # piece i of the wire order (tensor t, block position p, piece j) at
    #   address[t] + ids[p] * stride[t] + j * piece[t]   in the blocks, and
    #   n * before[t] + (p * k + j) * piece[t]            in the packed bytes;
    # this is that arithmetic in Python, against every piece's true place.
    from kvd.transport.gpu_copy import PIECE_BYTES, BlockMap

    tensors = [torch.empty(8, 2 * PIECE_BYTES, dtype=torch.uint8),  # two pieces per block
               torch.empty(8, 3, 1000, dtype=torch.int16)]  # 6000 bytes, one piece
    if not mixed:
        tensors = [tensors[0], torch.empty(16, 2 * PIECE_BYTES, dtype=torch.uint8)[::2]]
    ids = [5, 0, 7]
    found = BlockMap(tensors, ids_of(ids), torch.device("cpu"))
    k = 1 if mixed else 2  # blocks that do not split alike are not split at all
    assert found.k == k and found.pieces() == len(tensors) * len(ids) * k
    rows = found.rows.tolist()
    count = len(tensors)
    assert len(rows) == 4 * count and found.ids.tolist() == ids
    address, stride, before, piece = (rows[r * count : (r + 1) * count] for r in range(4))
    n = len(ids)
    expected, got = [], []
    wire = 0
    for t, tensor in enumerate(tensors):
        block = tensor[0].numel() * tensor.element_size()
        for p, i in enumerate(ids):
            for j in range(k):
                expected.append((tensor[i].data_ptr() + j * block // k, wire, block // k))
                wire += block // k
                got.append((address[t] + ids[p] * stride[t] + j * piece[t],
                            n * before[t] + (p * k + j) * piece[t], piece[t]))
    assert got == expected
    # The rows are the region's, made once; a transfer brings only its ids.
    again = BlockMap(tensors, ids_of([1, 2]), torch.device("cpu"))
    assert again.rows is found.rows and again.ids.tolist() == [1, 2]
    assert found.piece_range(1, 1, 3) == ((len(ids) + 1) * k, (len(ids) + 3) * k)


def test_tensor_facts_are_cached_per_list_and_dropped_with_its_tensors() -> None:
    # What the maps read of a region's tensors is found once per region, not per transfer.
    import gc

    from kvd.transport import gpu_copy

    tensors = [torch.empty(4, 64, dtype=torch.uint8), torch.empty(4, 8, dtype=torch.int64)]
    first = gpu_copy._facts_of(tensors)
    assert gpu_copy._facts_of(tensors) is first  # a hit compares by identity, not by value
    assert gpu_copy._facts_of(list(tensors)) is first  # same tensors, another list
    assert not gpu_copy.describable(tensors, torch.device("cpu"))  # host memory
    second = torch.empty(4, 8, dtype=torch.int64)
    other = gpu_copy._facts_of([tensors[0], second])
    assert other is not first and other.geometry[1] != first.geometry[1]
    assert gpu_copy._facts_of([tensors[0], second]) is other  # it took first's place
    assert gpu_copy._facts_of(tensors) is not first
    entries = len(gpu_copy._facts)
    del tensors, first, other, second
    gc.collect()
    assert len(gpu_copy._facts) == entries - 1  # gone with its first tensor


def test_block_views_are_the_blocks_bytes_in_wire_order() -> None:
    # What a socket sends from (or receives into): every requested block of tensor 0, then
    # of tensor 1, ...; adjacent blocks in one view; strided and non-contiguous blocks too.
    from kvd.transport.views import block_views

    tensors = [(torch.arange(64 * 256, dtype=torch.int32) + i).view(64, 256) for i in range(3)]
    tensors.append(torch.arange(64 * 8 * 2, dtype=torch.int16).view(64, 8, 2)[:, :, 0])
    tensors.append(torch.arange(128 * 4, dtype=torch.int64).view(128, 4)[::2])
    ids = [3, 4, 5, 9, 0, 1, 63]
    views = block_views(tensors, ids)
    expected = b"".join(t[i].contiguous().numpy().tobytes() for t in tensors for i in ids)
    assert b"".join(bytes(v) for v in views) == expected
    # runs 3-5, 9, 0-1, 63 of each contiguous tensor; 8 two-byte pieces per block of the
    # non-contiguous one; one view per block of the strided one (its blocks are not adjacent)
    assert len(views) == 3 * 4 + 7 * 8 + 7
    views[0][:4] = b"\x01\x02\x03\x04"  # the views are the tensor's memory
    assert tensors[0][3, 0].item() == int.from_bytes(b"\x01\x02\x03\x04", "little")
