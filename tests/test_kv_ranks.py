"""Which prefill ranks lend, and what each decode rank reads of them (kv_ranks), checked
head by head for every pairing of tensor-parallel sizes a model's KV heads allow: each
decode rank gets exactly its heads, in its own order, and every lend is read whole, as
many times as its readers say (or its blocks would stay lent until the lease ends)."""

from __future__ import annotations

import collections

import msgspec
import pytest

from kvd.errors import BadRequest
from kvd.integrations.kv_ranks import heads_of, lends, reads
from kvd.integrations.vllm_compat import Compat
from kvd.protocol import Part

SIZES = (1, 2, 4, 8)


def held(rank: int, tp: int, heads: int) -> list[int]:
    first, count = heads_of(rank, tp, heads)
    return list(range(first, first + count))


@pytest.mark.parametrize("heads", [1, 2, 4, 8])  # 1: also an MLA latent cache
@pytest.mark.parametrize("prefill_tp", SIZES)
@pytest.mark.parametrize("decode_tp", SIZES)
def test_each_decode_rank_gets_its_heads_and_every_lend_is_read_whole(
        heads: int, prefill_tp: int, decode_tp: int) -> None:
    lenders = [r for r in range(prefill_tp) if lends(r, prefill_tp, heads)]
    # every head is lent by exactly one rank
    assert sorted(h for r in lenders for h in held(r, prefill_tp, heads)) == list(range(heads))
    reads_of: dict[tuple[int, Part], int] = collections.Counter()
    said: dict[tuple[int, int], int] = {}  # (lender, cut): the readers the reads say
    for rank in range(decode_tp):
        mine = held(rank, decode_tp, heads)
        slots: list[int | None] = [None] * len(mine)
        for read in reads(rank, decode_tp, prefill_tp, heads):
            assert read.rank in lenders
            theirs = held(read.rank, prefill_tp, heads)
            size = len(theirs) // read.part.count
            taken = theirs[read.part.index * size:(read.part.index + 1) * size]
            assert len(mine) // read.into.count == len(taken)
            start = read.into.index * len(taken)
            assert slots[start:start + len(taken)] == [None] * len(taken)
            slots[start:start + len(taken)] = taken
            reads_of[read.rank, read.part] += 1
            assert said.setdefault((read.rank, read.part.count), read.readers) == read.readers
        assert slots == mine  # its heads, each once, where its own blocks hold them
    for (lender, count), readers in said.items():
        for index in range(count):
            assert reads_of[lender, Part(index, count)] == readers
    assert {lender for lender, _ in said} == set(lenders)


def test_pairings_that_do_not_split_are_refused() -> None:
    with pytest.raises(BadRequest, match="neither divides"):
        reads(0, 2, 3, 6)
    with pytest.raises(BadRequest, match="do not split evenly"):
        reads(0, 4, 1, 6)


def compat(**changes: object) -> Compat:
    base = Compat(model="m", architecture="LlamaForCausalLM", num_layers=2, num_kv_heads=4,
                  head_size=64, use_mla=False, dtype="bfloat16", cache_dtype="auto",
                  block_size=16, tensor_parallel_size=1, pipeline_parallel_size=1,
                  kvd_protocol=14, connector=2)
    return msgspec.structs.replace(base, **changes)


def test_tensor_parallel_sizes_may_differ_where_they_divide() -> None:
    ours = compat(tensor_parallel_size=2)
    assert ours.refusal(compat(tensor_parallel_size=4)) == ""
    assert ours.refusal(compat(tensor_parallel_size=1)) == ""
    assert "neither divides" in ours.refusal(compat(tensor_parallel_size=3))
    assert ours.refusal(compat(tensor_parallel_size=8)) == ""  # two ranks hold each head
    six = compat(num_kv_heads=6)  # (vLLM starts no engine that splits heads unevenly)
    assert "do not split evenly" in six.refusal(compat(num_kv_heads=6, tensor_parallel_size=4))
    mla = compat(use_mla=True, num_kv_heads=1, tensor_parallel_size=8)
    assert mla.refusal(compat(use_mla=True, num_kv_heads=1, tensor_parallel_size=2)) == ""
    assert ours.refusal(compat(tensor_parallel_size=4, cache_dtype="fp8")) == (
        "cache_dtype: prefill 'fp8', this engine 'auto'")
